"""Attention masks that a compiled graph computes from constants alone, replaced by the pattern they spell.

Under `torch.compile` a model's causal mask is often built inside the graph from `arange`s and comparisons
(Transformers does so whenever it cannot tell, while tracing, that the mask is plain causal: a forward without
a cache checks its position ids for packed sequences, and a traced tensor cannot answer). The graph then hands
attention a materialised (batch, 1, query, key) mask that depends on no input. An attention op given a mask
must read it and cannot skip the blocks it hides; on a TPU the flash kernel's masked path compiles several
kernel variants per layer and reads the mask from memory on every call, where the causal path computes it
from block positions. Evaluating such a mask once, when the graph compiles, tells which pattern it is: every
key visible (the mask is dropped), causal (`is_causal`), or causal within a sliding window (for hf_tpu's own
op, which takes a window). Anything else is left as it is, so the rewrite never changes a result.

A function traced straight from Python (`hf_tpu.jit`, and `torch.compile` of a module through it) has no graph
to rewrite: there `KnownValues`, a torch function mode active during the trace, keeps the CPU value of every
tensor computed from constants alone (factories such as `arange`, and ops on such tensors), computed with
PyTorch on the host beside the traced op, and hands an attention call whose mask has a known value the pattern
instead. The program still computes the mask, which nothing then reads and XLA drops; the index checks of its
ops (Transformers' mask functions index position ids) are decided on the host from the known indices, so that no
check keeps the mask's ops in the program (`hf_tpu.dispatch.index_checks.in_range_on_host`).
"""

from __future__ import annotations

import operator

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.operator_schemas import normalize_function

from .dispatch import index_checks

aten = torch.ops.aten

# a mask is evaluated only if all the values computing it take at most this many bytes (the mask of an 8 x
# 4096 x 4096 forward and its intermediates take about 0.6 GB), so that compiling stays quick and small
MOST_BYTES = 2 << 30


def _attention_ops() -> dict:
    """Each attention op whose mask may be recognised -> whether it takes a sliding window. SDPA aligns its
    causal pattern to the first keys and hf_tpu's op to the last: masks are recognised only where the query
    and key lengths agree, and the two alignments with them."""
    ops = {aten._scaled_dot_product_flash_attention_for_cpu.default: False}
    import hf_tpu.ops.attention  # noqa: F401  (defines hf_tpu::flash_attention)

    ops[torch.ops.hf_tpu.flash_attention.default] = True
    return ops


def recognise_constant_masks(gm: torch.fx.GraphModule) -> int:
    """Rewrites the graph's attention calls whose mask is a constant causal, sliding-window or all-visible
    pattern; returns how many it rewrote."""
    ops = _attention_ops()
    patterns = {}  # mask node -> its pattern (or None), once for the layers that share it
    rewritten = 0
    for node in list(gm.graph.nodes):
        takes_window = ops.get(node.target) if node.op == "call_function" else None
        if takes_window is None:
            continue
        arguments = _arguments(node)
        mask = arguments.get("attn_mask")
        if not isinstance(mask, torch.fx.Node) or arguments.get("is_causal") or arguments.get("sliding_window"):
            continue
        query, key = arguments["query"].meta.get("val"), arguments["key"].meta.get("val")
        if query is None or key is None:
            continue
        # None where the lengths are symbolic (dynamic shapes, a copy `with_sizes` made): the evaluated mask
        # tells them then; comparing symbolic ones would add a guard after Dynamo's were made
        length = query.shape[-2] if type(query.shape[-2]) is int and type(key.shape[-2]) is int else None
        if length is not None and length != key.shape[-2]:
            continue
        if mask not in patterns:
            with unset_fake_temporarily():  # real values, though AOT autograd compiles under fake tensors
                patterns[mask] = _pattern(gm, mask, length)
        pattern = patterns[mask]
        if pattern is None or (pattern[1] and not takes_window):
            continue
        is_causal, window = pattern
        arguments.update(attn_mask=None, is_causal=is_causal)
        if window:
            arguments["sliding_window"] = window
        _set_arguments(node, arguments)
        rewritten += 1
    if rewritten:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return rewritten


def with_sizes(gm: torch.fx.GraphModule, sizes: dict) -> torch.fx.GraphModule | None:
    """A copy of a graph traced with dynamic shapes, its size inputs (placeholder position -> int) written in
    as the numbers one call gives them, with the masks recognised that those sizes make constant; None where
    the copy recognises none (the graph itself then serves these sizes as it is)."""
    if not any(node.op == "call_function" and node.target in _attention_ops() for node in gm.graph.nodes):
        return None
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    placeholders = graph.find_nodes(op="placeholder")
    for position, value in sizes.items():
        size = placeholders[position]
        for user in list(size.users):
            written = lambda a: value if a is size else a  # noqa: E731
            user.args = torch.fx.node.map_aggregate(user.args, written)
            user.kwargs = torch.fx.node.map_aggregate(user.kwargs, written)
    specialized = torch.fx.GraphModule(gm, graph)
    return specialized if recognise_constant_masks(specialized) else None


def _arguments(node: torch.fx.Node) -> dict:
    """The call's arguments by their schema names."""
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    return dict(normalized.kwargs)


def _set_arguments(node: torch.fx.Node, arguments: dict) -> None:
    """Writes the arguments back, positionally where the schema takes them so."""
    schema = node.target._schema
    node.args = tuple(arguments[a.name] for a in schema.arguments if not a.kwarg_only and a.name in arguments)
    node.kwargs = {a.name: arguments[a.name] for a in schema.arguments if a.kwarg_only and a.name in arguments}


def _pattern(gm: torch.fx.GraphModule, mask: torch.fx.Node, length: int | None) -> tuple | None:
    """(is_causal, sliding window or 0) of a constant mask over as many keys as queries (`length` of each, or
    None: read off the mask, whose lengths other than 1 are the attention's), or None where it is not
    constant or not one of these patterns."""
    return _pattern_of(_evaluate(gm, mask), length)


def _pattern_of(value: torch.Tensor | None, length: int | None) -> tuple | None:
    """`_pattern` of a mask's value (None: not known)."""
    if value is None or value.dim() < 2 or value.dim() > 4:
        return None
    if length is None:
        length = value.shape[-1]
        if length == 1 or value.shape[-2] != length:
            return None
    if tuple(value.shape[-2:]) not in ((length, length), (1, length), (length, 1), (1, 1)):
        return None
    visible = _visible(value)
    if visible is None:
        return None
    visible = visible.expand(*visible.shape[:-2], length, length)
    if bool(visible.all()):
        return False, 0
    query = torch.arange(length)[:, None]
    key = torch.arange(length)[None, :]
    causal = key <= query
    if not bool((visible <= causal).all()):
        return None
    # the window is the most keys a query sees: the last query's count, if the mask is a window at all
    window = int(visible[..., -1, :].sum(-1).max())
    if window < 1:
        return None
    expected = causal & (query - key < window) if window < length else causal
    return (True, window if window < length else 0) if bool((visible == expected).all()) else None


def _visible(value: torch.Tensor) -> torch.Tensor | None:
    """Which pairs a mask lets attend: a boolean mask's True entries, an additive mask's zeros where every other
    entry hides its key altogether (-inf or the dtype's lowest value, as Transformers writes it)."""
    if value.dtype == torch.bool:
        return value
    if not value.dtype.is_floating_point:
        return None
    visible = value == 0
    hidden = (value == -torch.inf) | (value == torch.finfo(value.dtype).min)
    return visible if bool((visible | hidden).all()) else None


def _evaluate(gm: torch.fx.GraphModule, output: torch.fx.Node) -> torch.Tensor | None:
    """The node's value computed on the CPU, if it depends on no input and on no random op; else None."""
    order, seen, stack = [], set(), [output]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if not _constant_op(node):
            return None
        order.append(node)
        stack.extend(node.all_input_nodes)
    order.sort(key=_position(gm))
    # sizes the graph records (symbolic ones, under dynamic shapes, count as they are computed)
    if sum(_bytes(node.meta.get("val")) for node in order) > MOST_BYTES:
        return None
    values, computed = {}, 0
    on_cpu = lambda a: values[a] if isinstance(a, torch.fx.Node) else _cpu_device(a)  # noqa: E731
    with torch.no_grad():
        for node in order:
            if node.op == "get_attr":
                values[node] = _cpu_device(getattr(gm, node.target))
            else:
                args = torch.fx.node.map_aggregate(node.args, on_cpu)
                kwargs = torch.fx.node.map_aggregate(node.kwargs, on_cpu)
                values[node] = node.target(*args, **kwargs)
            computed += _bytes(values[node])
            if computed > MOST_BYTES:
                return None
    result = values[output]
    return result if isinstance(result, torch.Tensor) else None


def _constant_op(node: torch.fx.Node) -> bool:
    """Whether the node computes the same value whenever its inputs are the same: not a random op, nor an
    uninitialized allocation (`empty` and its kin), nor one that writes its inputs."""
    if node.op == "get_attr":
        return True
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or getattr(node.target, "__module__", None) == "_operator":
        return True  # an item of a result, or arithmetic on sizes
    return (isinstance(node.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded not in node.target.tags
            and "empty" not in node.target._schema.name
            and not node.target._schema.is_mutable)


def _cpu_device(value):
    """A `tpu` device (or its name) or tensor as its CPU counterpart (the evaluation's factory calls name the
    graph's device)."""
    if isinstance(value, torch.device) and value.type != "cpu":
        return torch.device("cpu")
    if isinstance(value, str) and value.split(":")[0] == "tpu":
        return "cpu"
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.cpu()
    return value


def _position(gm: torch.fx.GraphModule):
    index = {node: k for k, node in enumerate(gm.graph.nodes)}
    return index.__getitem__


def _bytes(value) -> int:
    """The bytes of a value's tensors; 0 for a tensor of symbolic size."""
    if isinstance(value, torch.Tensor):
        numel = value.numel()
        return numel * value.element_size() if type(numel) is int else 0
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


# --- In a direct trace: values computed from constants alone, known on the host


# factories whose value depends on their arguments alone (random and uninitialized ones are not)
_FACTORIES = frozenset(("arange", "ones", "zeros", "full", "tensor", "as_tensor", "eye", "linspace", "ones_like",
                        "zeros_like", "full_like"))
# parts of the names of functions whose result is not a function of their arguments' values
_NOT_CONSTANT = ("rand", "empty", "normal", "dropout", "bernoulli", "multinomial", "uniform", "exponential",
                 "cauchy", "geometric", "poisson", "seed")
# the most bytes of a value kept on the host (a mask of 8 x 4096 x 4096 booleans takes 128 MiB)
MOST_KNOWN_BYTES = 256 << 20


class KnownValues(torch.overrides.TorchFunctionMode):
    """While a function is traced: the CPU value of each `tpu` tensor computed from constants alone, and attention
    calls whose mask has such a value run on its pattern (see the module's docstring).

    A value is kept with the tensor's version counter, which every in-place write to it or to a view of it moves:
    a value whose tensor was written since is not known, and nothing is known of an inference tensor (made under
    `torch.inference_mode()`), which keeps no version. Ops on known values are computed again on the host with
    the same function and the CPU tensors in place of the `tpu` ones; an op that fails there, or that makes a value
    over `MOST_KNOWN_BYTES`, leaves its result unknown. What is known decides the attention's pattern, and the index
    checks of ops whose indices are known (`index_checks.HOST_VALUES`), nothing else."""

    def __init__(self):
        super().__init__()
        from torch.utils.weak import WeakIdKeyDictionary

        self.values = WeakIdKeyDictionary()  # tpu tensor -> (its CPU value, its version then)
        self.attention = _attention_functions()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        takes_window = self.attention.get(func)
        if takes_window is not None:
            rewritten = self._attention_on_pattern(func, takes_window, args, kwargs)
            if rewritten is not None:
                func, args, kwargs = rewritten
        result = func(*args, **kwargs)
        self._note(func, args, kwargs, result)
        return result

    def __enter__(self):
        index_checks.HOST_VALUES.append(self.known)
        return super().__enter__()

    def __exit__(self, *exc):
        index_checks.HOST_VALUES.remove(self.known)
        return super().__exit__(*exc)

    def known(self, tensor) -> torch.Tensor | None:
        """The CPU value of a tensor (a CPU tensor's own), if known and not written since."""
        if not isinstance(tensor, torch.Tensor):
            return None
        if tensor.device.type == "cpu":
            return tensor
        entry = self.values.get(tensor)
        return entry[0] if entry is not None and entry[1] == tensor._version else None  # noted: not an inference one

    def _note(self, func, args, kwargs, result) -> None:
        """Keeps the CPU value of `func`'s result where each of its tensor arguments has one. Most ops of a trace read
        a traced tensor: the first unknown argument ends the work, before any tree is walked."""
        leaves = [result] if isinstance(result, torch.Tensor) else _tensors(result)
        if not leaves or any(r.device.type != "tpu" for r in leaves):
            return
        simple = all(isinstance(a, torch.Tensor) or type(a) in _SCALARS for a in (*args, *kwargs.values()))
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)] if simple \
            else _tensors((args, kwargs))
        host = {}
        for t in tensors:
            value = self.known(t)
            if value is None:
                return
            host[id(t)] = value
        name = getattr(func, "__name__", "")
        if (not tensors and name not in _FACTORIES) or "out" in kwargs or any(part in name for part in _NOT_CONSTANT):
            return
        if sum(r.numel() * r.element_size() for r in leaves) > MOST_KNOWN_BYTES:
            return
        on_host = lambda a: host[id(a)] if isinstance(a, torch.Tensor) else _cpu_device(a)  # noqa: E731
        try:
            with torch.no_grad():
                value = func(*torch.utils._pytree.tree_map(on_host, args),
                             **torch.utils._pytree.tree_map(on_host, kwargs))
        except Exception:  # noqa: BLE001 - whatever the host's op refuses, its result is not known
            return
        values = [value] if isinstance(value, torch.Tensor) else _tensors(value)
        if len(values) == len(leaves) and all(v.device.type == "cpu" for v in values):
            for tensor, known in zip(leaves, values):
                # an inference tensor (made under `torch.inference_mode()`) keeps no version: a write would not show
                if known.shape == tensor.shape and known.dtype == tensor.dtype and not tensor.is_inference():
                    self.values[tensor] = (known, tensor._version)

    def _attention_on_pattern(self, func, takes_window: bool, args: tuple, kwargs: dict):
        """(function, args, kwargs) of an attention call with a known constant mask, as the pattern it spells; None
        where the mask is not known, or not a pattern the call can take. SDPA on a sliding window is hf_tpu's op,
        which takes one (as SDPA on tpu computes grouped heads: `hf_tpu.ops.attention`)."""
        names = ("query", "key", "value", "attn_mask")
        arguments = dict(zip(names, args), **kwargs)
        if len(args) > len(names) or set(arguments) - set(_ATTENTION_OPTIONS[takes_window]) - set(names):
            return None
        mask = self.known(arguments.get("attn_mask"))
        query, key = arguments["query"], arguments["key"]
        if mask is None or arguments.get("is_causal") or arguments.get("sliding_window") or \
                query.shape[-2] != key.shape[-2]:
            return None
        pattern = _pattern_of(mask, query.shape[-2])
        if pattern is None:
            return None
        arguments.update(attn_mask=None, is_causal=pattern[0])
        if not pattern[1]:
            return func, (), arguments
        if takes_window:
            return func, (), dict(arguments, sliding_window=pattern[1])
        from .ops.attention import _grouped_attention_applies

        if not _grouped_attention_applies(query, key, arguments["value"], None, arguments.get("dropout_p", 0.0), True):
            return None
        return (torch.ops.hf_tpu.flash_attention, (query, key, arguments["value"]),
                dict(attn_mask=None, scale=arguments.get("scale"), is_causal=True, sliding_window=pattern[1]))


_SCALARS = frozenset((int, float, bool, type(None), torch.dtype, torch.device, str, torch.Size, torch.memory_format))


def _tensors(tree) -> list:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


# the keyword arguments each attention function takes besides query, key, value and mask, by whether it takes a
# sliding window (hf_tpu's op) or not (SDPA)
_ATTENTION_OPTIONS = {False: ("dropout_p", "is_causal", "scale", "enable_gqa"),
                      True: ("scale", "is_causal", "sliding_window", "softcap")}


def _attention_functions() -> dict:
    """Each attention function a traced call may make whose mask may be recognised -> whether it takes a window."""
    import hf_tpu.ops.attention  # noqa: F401  (defines hf_tpu::flash_attention)

    return {torch.nn.functional.scaled_dot_product_attention: False, torch.ops.hf_tpu.flash_attention: True,
            torch.ops.hf_tpu.flash_attention.default: True}
