"""A decoder's loop over its layers as one scanned loop in a traced training step (`hf_tpu.scan_layers`).

Transformers' decoders run `hidden_states = decoder_layer(hidden_states, ...)` for each of their layers. Once a
model's layers are checkpointed (`gradient_checkpointing_enable()`, the Trainer's `gradient_checkpointing=True`),
`arrange(model)` gives each decoder whose `forward` runs exactly that loop (checked on its source: the loop's body
is that one assignment, and its arguments do not name the layer) a layer list that, iterated inside `hf_tpu.jit`'s
trace with gradients on, yields one callable for the whole stack instead of its layers: the loop's body then runs
once, and `hf_tpu.scan_layers` runs the layers as one XLA loop whose backward recomputes each layer, which is what
the checkpoint of each layer did. The first step's compile then covers one layer's forward and backward, not every
layer's (the 1.1B Llama's 16 layers). Everywhere else (eager execution, `torch.compile`, a layer list met outside
the loop, a call with a KV cache or with hooks on the layers) the list iterates over its layers as before.

The layers must be alike but for what the scan may take from the first layer for all: their index where it reaches
only a cache, and the record a PEFT adapter layer keeps of its making (its own name among the keyword arguments it was
made with), which PEFT never reads: a LoRA model's decoder scans as the plain model's does, its frozen weights stacked
beside the adapters, which alone take gradients.

`HF_TPU_SCAN_LAYERS` (or `configure(scan_layers=...)`): `checkpointed` (as above; the default off a TPU), `always`
(also a traced call without gradients or a KV cache, `use_cache=False`: the compile of a model's forward shrinks
likewise, and each call copies the layers' parameters into the stacked arrays the loop reads, which on the v5e made
the 1.1B's 1x128 forward 4x slower), `first-calls` (the default on a TPU: a `torch.compile`d model's forward without
gradients or a KV cache runs scanned only while its unrolled program compiles: the first call waits for the scanned
program's compile, the unrolled one, traced at a later call, then serves; `quick_form`), `off`. The setting is read
when a call is traced: a program traced before a change keeps its form.
"""

from __future__ import annotations

import ast
import contextvars
import functools
import inspect
import logging
import sys
import textwrap
import types
import weakref

import torch

import hf_tpu

from .settings import settings

log = logging.getLogger("hf_tpu.transformers")

# keyword arguments through which a decoder layer reads or writes a KV cache: its layers then differ by their index
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def arrange(model: torch.nn.Module) -> None:
    """Gives every decoder in `model` whose forward runs the plain loop over `self.layers` a `ScannableLayers` list
    (the same modules, the same state dict)."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if type(layers) is torch.nn.ModuleList and len(layers) > 1 and _plain_loop(type(module)):
            layers.__class__ = ScannableLayers


def _wrap_set_gradient_checkpointing(original):
    @functools.wraps(original)
    def _set_gradient_checkpointing(self, enable: bool = True, *args, **kwargs):
        result = original(self, enable, *args, **kwargs)
        if enable:
            arrange(self)
        return result

    return _set_gradient_checkpointing


@functools.cache
def _plain_loop(cls: type) -> bool:
    """Whether `cls.forward` runs `for layer in self.layers[...]: hidden = layer(hidden, <arguments>)` once, with
    nothing else in the loop's body and no argument that names the layer."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    loops = [node for node in ast.walk(tree) if isinstance(node, ast.For) and _over_self_layers(node.iter)]
    return len(loops) == 1 and _plain_body(loops[0])


def _over_self_layers(node) -> bool:
    if isinstance(node, ast.Subscript):
        node = node.value
    return (isinstance(node, ast.Attribute) and node.attr == "layers" and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _plain_body(loop: ast.For) -> bool:
    if not (isinstance(loop.target, ast.Name) and len(loop.body) == 1 and not loop.orelse):
        return False
    layer, (statement,) = loop.target.id, loop.body
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name) and isinstance(statement.value, ast.Call)):
        return False
    call, hidden = statement.value, statement.targets[0].id
    if not (isinstance(call.func, ast.Name) and call.func.id == layer and len(call.args) == 1
            and isinstance(call.args[0], ast.Name) and call.args[0].id == hidden):
        return False
    return not any(isinstance(node, ast.Name) and node.id == layer
                   for keyword in call.keywords for node in ast.walk(keyword.value))


class ScannableLayers(torch.nn.ModuleList):
    """A decoder's layers; iterated inside a traced step that scans them (see the module's docstring), one callable
    that runs them all."""

    def __iter__(self):
        layers = list(self._modules.values())
        if _scanned_here(layers):
            return iter((_LayerStack(layers),))
        return iter(layers)


def _scanned_here(layers: list) -> bool:
    if settings.scan_layers == "off" or torch.compiler.is_dynamo_compiling() or not torch.compiler.is_compiling():
        return False
    return settings.scan_layers == "always" or _quick_form_tracing.get() or _checkpointed(layers)


# set while `quick_form`'s function runs: the layers it meets are scanned
_quick_form_tracing = contextvars.ContextVar("hf_tpu_quick_form_tracing", default=False)


def quick_form(module: torch.nn.Module, args: tuple, kwargs: dict):
    """`HF_TPU_SCAN_LAYERS=first-calls`: for a compiled call of a model holding scannable layers, without gradients
    and without a KV cache (`use_cache=False`), its forward with the layers scanned (`hf_tpu.compiled_modules.
    QUICK_FORMS`): XLA compiles one layer where the unrolled program has them all (the 1.1B Llama's 1x1024 forward on
    the v5e: 10.8 s against 15.6 s), and each call copies the layers' weights into stacked arrays (23.5 ms a call
    against 17.2 ms). None where the copy would take more than half of the device's free memory."""
    if settings.scan_layers != "first-calls" or torch.is_grad_enabled() and module.training:
        return None
    config = getattr(module, "config", None)
    use_cache = kwargs.get("use_cache", getattr(config, "use_cache", False))
    if use_cache or any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS):
        return None
    stacked = _stacked_bytes.get(module)
    if stacked is None:
        parameters = [p for m in module.modules() if isinstance(m, ScannableLayers) for p in m.parameters()]
        on_tpu = bool(parameters) and parameters[0].device.type == "tpu"
        stacked = _stacked_bytes[module] = (sum(p.numel() * p.element_size() for p in parameters) if on_tpu else 0,
                                            parameters[0].device if on_tpu else None)
    size, device = stacked
    if not size or 2 * size > torch.tpu.mem_get_info(device)[0]:
        return None
    return types.MethodType(_scanned_forward, module)  # keyed as the module's own forward is: its code and the module


# per model: the bytes of its scannable layers' parameters (their stacked copy) and their device, found once (a
# model's own attribute would be keyed by the compiled call)
_stacked_bytes = weakref.WeakKeyDictionary()


def _scanned_forward(module: torch.nn.Module, *args, **kwargs):
    token = _quick_form_tracing.set(True)
    try:
        return module.forward(*args, **kwargs)
    finally:
        _quick_form_tracing.reset(token)


def install() -> None:
    """Add `quick_form` to the core's quick forms (once)."""
    from hf_tpu import compiled_modules

    if quick_form not in compiled_modules.QUICK_FORMS:
        compiled_modules.QUICK_FORMS.append(quick_form)


def _checkpointed(layers: list) -> bool:
    """Whether each layer's call checkpoints it (`GradientCheckpointingLayer`'s condition)."""
    return torch.is_grad_enabled() and all(
        getattr(layer, "gradient_checkpointing", False) and layer.training for layer in layers)


class _LayerStack:
    """The loop's one `decoder_layer`: every layer, scanned where `hf_tpu.scan_layers` can."""

    def __init__(self, layers: list):
        self.layers = layers

    def __call__(self, hidden_states, *args, **kwargs):
        if _checkpointed(self.layers) and not getattr(self.layers[0], "_can_checkpoint_with_cache", False):
            # what each layer's checkpoint does to its arguments: a checkpointed layer neither reads nor writes a
            # cache (Transformers says so once, from the model's forward)
            kwargs = {name: None if name in _CACHE_ARGUMENTS else False if name == "use_cache" else value
                      for name, value in kwargs.items()}
        if any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS):
            for layer in self.layers:
                hidden_states = layer(hidden_states, *args, **kwargs)
            return hidden_states
        return hf_tpu.scan_layers(self.layers, hidden_states, args, kwargs, body_forward=_layer_forward,
                                  differing=_differing(self.layers[0]), hooks_inert=_hooks_inert(self.layers))


def _differing(layer: torch.nn.Module) -> tuple:
    """The plain attributes the layers may differ in: the scan runs the first layer's code for all, which is right for
    the index only where it reaches nothing but a cache (and no cache is passed), and for the record of how a PEFT
    adapter layer was made (`_peft_record_unread`)."""
    classes = {type(m) for m in layer.modules()}
    differing = ("layer_idx",) if all(map(_index_only_for_caches, classes)) else ()
    holders = {type(m) for m in layer.modules() if _PEFT_RECORD in vars(m)}
    if holders and all(map(_peft_record_unread, holders)):
        differing += (_PEFT_RECORD,)
    return differing


# PEFT's adapter layers (`BaseTunerLayer`: LoRA's `Linear` wrapping a `q_proj`) keep the keyword arguments they were
# made with, among them the layer's own name (`target_name`, "model.layers.0.self_attn.q_proj"): the only attribute in
# which a LoRA model's layers differ
_PEFT_RECORD = "kwargs"


@functools.cache
def _peft_record_unread(cls: type) -> bool:
    """Whether `cls` is a PEFT adapter layer and no code of the files that define it and its bases reads the record
    of its making (`kwargs` of any object, or a string naming it, as `getattr` would) outside an `__init__`: PEFT 0.21
    only writes it. Code of other files is not read (PEFT 0.21 has none that reads it)."""
    if not any(klass.__name__ == "BaseTunerLayer" and klass.__module__.startswith("peft.") for klass in cls.__mro__):
        return False

    def reads_the_record(node, parents):
        read = isinstance(node, ast.Attribute) and node.attr == _PEFT_RECORD and isinstance(node.ctx, ast.Load)
        return read or (isinstance(node, ast.Constant) and node.value == _PEFT_RECORD)

    return _read_only_in_init(cls, reads_the_record, lambda klass: _source_tree(klass.__module__))


@functools.cache
def _source_tree(module_name: str):
    """The parsed source of a Python module; None where it has none."""
    try:
        return ast.parse(inspect.getsource(sys.modules[module_name]))
    except (KeyError, OSError, TypeError, SyntaxError):
        return None


def _class_tree(klass: type):
    """The parsed source of a class; None where it has none."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return None


def _read_only_in_init(cls: type, reads, tree_of) -> bool:
    """Whether no node `reads(node, parents)` finds in the source `tree_of(klass)` of `cls` and its bases (below
    PyTorch's) lies outside an `__init__`; False where a source is missing."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "builtins", "abc")):
            continue
        tree = tree_of(klass)
        if tree is None:
            return False
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        if any(reads(node, parents) and not _in_init(node, parents) for node in ast.walk(tree)):
            return False
    return True


@functools.cache
def _index_only_for_caches(cls: type) -> bool:
    """Whether every method of `cls` (and of its bases below `torch.nn.Module`) other than `__init__` reads
    `self.layer_idx` only to reach a KV cache (inside a call or subscript of something named `cache` or
    `past_key...`). A method that computes with the index (`x / (self.layer_idx + 1)`) is not the same computation
    for each layer; what `__init__` computes from it (GPT-2's attention scaled by `1 / (layer_idx + 1)`) makes
    attributes that differ, which `scan_layers` compares."""
    return _read_only_in_init(cls, lambda node, parents: isinstance(node, ast.Attribute) and node.attr == "layer_idx"
                              and not _reaches_a_cache(node, parents), _class_tree)


def _in_init(node, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef):
            return node.name == "__init__"
    return False


def _reaches_a_cache(node, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.Call, ast.Subscript)):
            target = ast.unparse(node.func if isinstance(node, ast.Call) else node.value).lower()
            if "cache" in target or "past_key" in target:
                return True
        if isinstance(node, ast.stmt):
            return False
    return False


def _hooks_inert(layers: list) -> bool:
    """Whether every hook on the layers is Transformers' output-capturing hook (which a model loaded on `tpu` has
    from the start, `install_output_capturing_hooks`) and the call records no output: each hook then returns at once.
    """
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    if _active_collector.get():
        return False
    return all(getattr(getattr(hook, "__code__", None), "co_name", "") == "output_capturing_hook"
               for layer in layers for module in layer.modules()
               for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                             module._backward_pre_hooks)
               for hook in hooks.values())


def _layer_forward(layer, hidden_states, *args, **kwargs):
    """The layer's own forward, without the checkpoint Transformers wraps it in (`GradientCheckpointingLayer`): the
    scan's backward recomputes the layer already."""
    forward = type(layer).forward
    if getattr(forward, "__code__", None) is not None and forward.__code__.co_name == "forward_with_checkpointing":
        forward = forward.__wrapped__  # `functools.wraps` gave the wrapper the forward's name: its code keeps its own
    return forward(layer, hidden_states, *args, **kwargs)
