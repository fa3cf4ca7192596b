"""The core's layers, checked from its source: module-level imports between `hf_tpu`'s own modules form
no cycle (docs/design/architecture.md). Importing `hf_tpu.a.b` runs `hf_tpu/a/__init__.py` first, so
that is an import of the package too, except for the module's own packages, which are already being
imported when it runs; the root package, which imports every layer, is left out."""

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "hf_tpu"


def _module_name(path: Path) -> str:
    parts = ("hf_tpu",) + path.relative_to(CORE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level(tree):
    """Import statements that run when the module is imported (not those inside functions)."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            pending += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                        *[n for h in getattr(node, "handlers", []) for n in h.body]]


def _import_graph() -> dict:
    modules = {_module_name(p): p for p in CORE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _module_level(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            else:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
                named = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in named:
                parts = target.split(".")
                for i in range(2, len(parts) + 1):  # each package on the way runs its __init__
                    prefix = ".".join(parts[:i])
                    # a module's own packages are being imported already when it runs
                    if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                        targets.add(prefix)
        graph[name] = targets
    return graph


def _cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_core_has_no_import_cycle():
    graph = {name: targets - {"hf_tpu"} for name, targets in _import_graph().items() if name != "hf_tpu"}
    assert len(graph) > 40 and graph["hf_tpu.dispatch.run"], "the graph was not read"
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
