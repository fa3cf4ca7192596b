"""The layers, checked from the source against their drawing in docs/design/architecture.md ("The layers,
bottom up"): every module of the core, the adapters and the command line stands in one layer of the drawing;
a module imports only modules of its own layer or below, and an adapter only the core's public contract; the
imports made when a module is imported form no cycle.

An import is read from the source (`ast`). Importing `hf_tpu.a.b` runs `hf_tpu/a/__init__.py` first, so that
is an import of the package too, except for the module's own packages, which are already being imported when
it runs; the root package `hf_tpu`, which every module's import runs first, counts as no import."""

import ast
import itertools
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPOSITORY / "docs" / "design" / "architecture.md"
# folder -> the package it ships as (pyproject.toml's package-dir)
PACKAGES = {"hf_tpu": "hf_tpu", "integrations": "hf_tpu.integrations", "model_patches": "hf_tpu.model_patches",
            "cli": "hf_tpu.cli"}
ADAPTERS = ("hf_tpu.integrations", "hf_tpu.model_patches", "hf_tpu.cli")
# what an adapter may import of the core (architecture.md: torch.tpu, torch.accelerator and `hf_tpu`'s
# public functions need no import of a core module; `compiled_modules` holds the registries an adapter fills)
PUBLIC_CONTRACT = {"hf_tpu.settings", "hf_tpu.distributed", "hf_tpu.compiled_modules", "hf_tpu.wrapping"}

# (importer, imported): the imports against the drawing's order known today. None: no import may go up.
KNOWN_UPWARD_IMPORTS = set()


def _modules() -> dict:
    """Module name -> its file, for every Python module of the four folders."""
    modules = {}
    for folder, package in PACKAGES.items():
        root = REPOSITORY / folder
        for path in root.rglob("*.py"):
            parts = (package,) + path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


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


def _anywhere(tree):
    """Every import statement, those inside functions too."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _import_graph(statements=_module_level) -> dict:
    """Module name -> the modules of the four folders its `statements` import."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in statements(ast.parse(path.read_text())):
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


def documented_layers(text: str) -> list:
    """The layers of the drawing, bottom up, each a list of module names. Under `hf_tpu/`, a line indented by
    two spaces is a layer of the core; a line at the margin is a layer of its own (a whole adapter folder).
    The names are the files (`x.py`) and folders (`x/`) a line starts with; deeper lines describe a folder's
    files, and far-indented ones continue a description."""
    drawing = text.split("## The layers, bottom up", 1)[1].split("```")[1]
    layers, folder = [], None
    for line in drawing.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        names = list(itertools.takewhile(lambda word: word.endswith((".py", "/")), line.split()))
        if not names or indent not in (0, 2):
            continue
        if indent == 0:
            folder = names[0].rstrip("/")
            if folder != "hf_tpu":
                layers.append([PACKAGES[folder]])
            continue
        assert folder == "hf_tpu", f"an indented layer outside the core: {line!r}"
        layers.append([_core_module(name) for name in names])
    return layers


def _core_module(name: str) -> str:
    """`x.py` or `x/` of the drawing's core as a module name (`__init__.py`: the root package)."""
    stem = name.removesuffix(".py").removesuffix("/")
    return "hf_tpu" if stem == "__init__" else f"hf_tpu.{stem}"


def _layer_of(module: str, layers: list) -> int | None:
    """The index of the layer that holds `module` (a package holds its modules; the root package only its
    `__init__.py`), or None where the drawing names none."""
    for index, layer in enumerate(layers):
        for name in layer:
            if module == name or (name != "hf_tpu" and module.startswith(name + ".")):
                return index
    return None


def _upward_imports(graph: dict, layers: list) -> set:
    """(importer, imported) where the imported module stands in a higher layer (modules the drawing omits
    are left to `test_every_module_stands_in_one_layer_of_the_drawing`)."""
    layer = {module: _layer_of(module, layers) for module in {*graph, *itertools.chain(*graph.values())}}
    return {(importer, imported) for importer, targets in graph.items() for imported in targets
            if None not in (layer[importer], layer[imported]) and layer[imported] > layer[importer]}


def test_every_module_stands_in_one_layer_of_the_drawing():
    layers = documented_layers(ARCHITECTURE.read_text())
    named = [name for layer in layers for name in layer]
    modules = _modules()
    assert len(named) == len(set(named)), "a name stands twice in the drawing"
    assert [name for name in named if name not in modules] == [], "the drawing names what the tree lacks"
    assert [module for module in modules if _layer_of(module, layers) is None] == [], "modules the drawing omits"


def test_each_module_imports_only_its_own_layer_or_below():
    """Imports inside functions count: a layer reached from a function is a layer above all the same."""
    layers = documented_layers(ARCHITECTURE.read_text())
    graph = _import_graph(_anywhere)
    assert len(graph) > 60 and graph["hf_tpu.dispatch.run"], "the graph was not read"
    upward = _upward_imports(graph, layers)
    assert sorted(upward - KNOWN_UPWARD_IMPORTS) == [], "imports against the order of docs/design/architecture.md"
    assert sorted(KNOWN_UPWARD_IMPORTS - upward) == [], "a known exception is gone: take it out of the list"


def test_the_adapters_import_only_the_cores_public_contract():
    graph = _import_graph(_anywhere)
    reached = {(adapter, imported) for adapter, targets in graph.items() if adapter.startswith(ADAPTERS)
               for imported in targets if not imported.startswith(ADAPTERS) and imported not in PUBLIC_CONTRACT}
    assert sorted(reached) == []


def test_no_import_cycle():
    graph = {name: targets for name, targets in _import_graph().items() if name != "hf_tpu"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


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


def test_the_checks_find_what_they_look_for():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    drawing = ("## The layers, bottom up\n\n```\nhf_tpu/      the core\n  low.py  side.py     bottom\n"
               "    inner.py       a file of a folder\n  high/        top\n                 its description, "
               "continued.py\n  __init__.py  the root\nmodel_patches/  patches\ncli/   commands\n```\n")
    layers = documented_layers(drawing)
    assert layers == [["hf_tpu.low", "hf_tpu.side"], ["hf_tpu.high"], ["hf_tpu"], ["hf_tpu.model_patches"],
                      ["hf_tpu.cli"]]
    assert _layer_of("hf_tpu.high.deep", layers) == 1 and _layer_of("hf_tpu.other", layers) is None
    graph = {"hf_tpu.low": {"hf_tpu.side"}, "hf_tpu.side": {"hf_tpu.high.deep"}, "hf_tpu.high.deep": {"hf_tpu.low"},
             "hf_tpu.cli.x": {"hf_tpu.model_patches"}}
    assert _upward_imports(graph, layers) == {("hf_tpu.side", "hf_tpu.high.deep")}
