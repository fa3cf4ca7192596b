"""`hf_tpu.scan_layers`: a stack of identical layers traced once and run as one XLA loop, as MaxText scans its layers.

A model's decoder runs `hidden = layer(hidden, ...)` for each of its layers. Traced into one program by
`hf_tpu.jit` (a training step), that loop is unrolled: XLA receives, optimizes and generates code for every layer
on its own, and the first step's compile grows with the number of layers (the 1.1B Llama's checkpointed training
step: 16 layers of 357k bundles each, 55 s of the v5e's compile). Inside such a trace, `scan_layers` stacks the
layers' parameters (one array per parameter name, layers first), traces one layer's Python once as the body of a
`jax.lax.scan` over them, and makes the whole stack one autograd node whose backward is a second scan, in reverse:
for each layer it recomputes the layer's forward from the input the forward scan kept and runs PyTorch's autograd
over it (`torch.autograd.backward` onto the body's own leaf tensors), so the derivative formulas are PyTorch's, as in the unrolled program, and what
the step keeps for the backward is each layer's input, what `torch.utils.checkpoint` of each layer keeps. XLA then
compiles two loop bodies where it compiled twice as many layers.

The price is the stacking: the forward copies every layer's parameters into the stacked arrays, which the backward
reads too, and the backward's loop makes the gradients stacked, sliced back into one per layer where the optimizer's
update reads them: a few milliseconds a step for a 1B model at the v5e's 819 GB/s, and memory: the stacked copy of
the parameters lives from the forward to the end of the backward, and every layer's gradients at once after it (the
unrolled program updated the last layers while computing the first layers' gradients). For the 1.1B Llama's
checkpointed 8x1024 step that is 12.2 GiB by XLA's analysis for a v5e, against 7.9 GiB unrolled
(`benchmarks.train_memory`; the chip's peak stayed at the unrolled step's 9.4 GiB). Stacking again in the backward (behind a barrier, the forward's copy freed after the
forward) held more: 14.3 GiB, XLA keeping both copies.

Outside a trace, or where the layers are not alike (their types, parameter names, shapes, dtypes and
`requires_grad`, their submodules' plain attributes other than those the caller names in `differing`), hold
buffers or hooks, take a tensor argument that requires gradients other than `hidden`, or trace into something a
loop body cannot hold (a random draw, a device check, an in-place write to a tensor of the caller's, an output
that is not a tensor like `hidden`), the layers run one by one as the plain loop does, with the same results.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import jax
import jax.numpy as jnp
import torch
from torch.utils import _pytree as pytree

from . import modes, remat
from .memory import buffer, placement, tensor_views
from .tracing import Untraceable

log = logging.getLogger("hf_tpu.layer_scan")

_CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_MODULE_BOOKKEEPING = frozenset({"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set"})


class NotScannable(Exception):
    """What keeps a stack of layers from running as one loop; the layers then run one by one."""


def _module_call(layer, hidden, *args, **kwargs):
    return layer(hidden, *args, **kwargs)


def scan_layers(layers, hidden: torch.Tensor, args: tuple = (), kwargs: dict | None = None, *,
                body_forward=_module_call, differing: tuple = (), hooks_inert: bool = False) -> torch.Tensor:
    """`hidden = layer(hidden, *args, **kwargs)` for each layer of `layers`, in order; the last `hidden`.

    Inside `hf_tpu.jit`'s trace, identical layers run as one `jax.lax.scan` (see the module's docstring), whose
    backward recomputes each layer's forward: scan layers where that is what the caller wants (checkpointed layers,
    or no gradients at all). `body_forward(layer, hidden, *args, **kwargs)` runs one layer inside the scan (by
    default the module's call; a caller may skip a wrapper of the layer's forward that the scan makes redundant,
    such as a checkpoint); a layer with hooks is not scanned, unless the caller knows they do nothing in this call
    (`hooks_inert`: Transformers' output-capturing hooks while no output is recorded), and the scan skips them.
    `differing` names the plain attributes the layers may differ in (a layer's index, read only with a KV cache the
    caller does not pass)."""
    kwargs = {} if kwargs is None else kwargs
    layers = list(layers)
    try:
        plan = _plan(layers, hidden, args, kwargs, differing, hooks_inert)
        return _ScannedLayers.apply(plan, body_forward, args, kwargs, hidden, *plan.parameters)
    except NotScannable as e:
        if len(layers) > 1 and modes.current().kind is modes.ModeKind.TRACE:
            # the message, not the error: a log record kept (a test's capture) would keep its frames and their tracers
            log.info("hf_tpu: %d layers of %s run one by one (%s)", len(layers), type(layers[0]).__name__, str(e))
    for layer in layers:
        hidden = layer(hidden, *args, **kwargs)
    return hidden


class _Plan:
    """The layers as the scan takes them: their parameters' names, and every layer's parameters, layer by layer."""

    def __init__(self, layers: list, names: list, trained: list):
        self.layers = layers
        self.names = names  # parameter names of one layer, in `named_parameters` order
        self.trained = trained  # per name: whether it requires gradients
        self.parameters = [dict(layer.named_parameters())[name] for layer in layers for name in names]

    def per_layer(self, values: list) -> list:
        n = len(self.names)
        return [values[k * n:(k + 1) * n] for k in range(len(self.layers))]


def _plan(layers: list, hidden, args: tuple, kwargs: dict, differing: tuple, hooks_inert: bool) -> _Plan:
    if modes.current().kind is not modes.ModeKind.TRACE or torch.compiler.is_dynamo_compiling():
        raise NotScannable("not inside hf_tpu.jit's trace")
    if len(layers) < 2:
        raise NotScannable("fewer than two layers")
    if not (isinstance(hidden, torch.Tensor) and hidden.device.type == "tpu"):
        raise NotScannable("the hidden state is not a tpu tensor")
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            raise NotScannable("an argument other than the hidden state requires gradients")
    if _global_hooks():
        raise NotScannable("global module hooks are installed")
    first = dict(layers[0].named_modules())
    parameters = list(layers[0].named_parameters())
    names = [name for name, _ in parameters]
    for layer in layers:
        modules = dict(layer.named_modules())
        if modules.keys() != first.keys():
            raise NotScannable("the layers' submodules differ")
        for name, module in modules.items():
            _check_alike(first[name], module, name, differing, hooks_inert)
        own = list(layer.named_parameters())
        if [n for n, _ in own] != names or any(
                (p.shape, p.dtype, p.requires_grad, p.device) != (q.shape, q.dtype, q.requires_grad, q.device)
                for (_, p), (_, q) in zip(parameters, own)):
            raise NotScannable("the layers' parameters differ in name, shape, dtype or requires_grad")
        if any(True for _ in layer.buffers()):
            raise NotScannable("the layers hold buffers")
    if any(p.device.type != "tpu" for _, p in parameters):
        raise NotScannable("a parameter is not on tpu")
    return _Plan(layers, names, [p.requires_grad for _, p in parameters])


def _global_hooks() -> bool:
    hooks = torch.nn.modules.module
    return any(getattr(hooks, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks", "_global_forward_hooks_always_called"))


def _check_alike(first: torch.nn.Module, module: torch.nn.Module, name: str, differing: tuple,
                 hooks_inert: bool) -> None:
    if type(module) is not type(first):
        raise NotScannable(f"the layers' {name or 'modules'} are of different types")
    if module.training != first.training:
        raise NotScannable("some layers train and others do not")
    for attribute, value in vars(module).items():
        if attribute in _CALL_HOOKS:
            if value and not hooks_inert:
                raise NotScannable(f"a layer's {name or 'module'} has hooks")
            continue
        # the hooks' flags, state-dict hooks (which a forward does not run), the module's own bookkeeping
        if "hook" in attribute or attribute in _MODULE_BOOKKEEPING or attribute in differing:
            continue
        other = vars(first).get(attribute, _MISSING)
        if other is value:
            continue
        if isinstance(value, torch.Tensor) or not _equal(other, value):
            raise NotScannable(f"the layers differ in {name + '.' if name else ''}{attribute}")


_MISSING = object()


def _equal(a, b) -> bool:
    """Plain values equal; `functools.partial`s of one function with equal arguments (an activation each layer makes
    for itself) alike."""
    if type(a) is functools.partial and type(b) is functools.partial:
        return a.func is b.func and _equal(a.args, b.args) and _equal(a.keywords, b.keywords)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a plain equality is not alike
        return False


@contextlib.contextmanager
def _parameters_replaced(module: torch.nn.Module, values: dict):
    """`module`'s parameters named in `values` replaced by those tensors while the block runs."""
    saved = []
    try:
        for name, value in values.items():
            owner_name, _, attribute = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            saved.append((owner, attribute, owner._parameters[attribute]))
            owner._parameters[attribute] = value
        yield
    finally:
        for owner, attribute, parameter in reversed(saved):
            owner._parameters[attribute] = parameter


class _BodyTrace:
    """Runs one layer's Python on the scan body's tracers, and refuses what a loop body cannot hold: the trace's
    random draws, device checks and index records would be the loop's values, not the program's, and a tensor of
    the caller's written in place would hold a tracer of the body."""

    def __init__(self, plan: _Plan, body_forward, args: tuple, kwargs: dict, device_index: int):
        self.plan, self.body_forward, self.args, self.kwargs = plan, body_forward, args, kwargs
        self.device_index = device_index

    def tensor(self, array, dtype, requires_grad=False):
        return buffer.new_tensor(array.shape, dtype, self.device_index, array).requires_grad_(requires_grad)

    @contextlib.contextmanager
    def guarded(self):
        mode = modes.current()
        draws, checks, record, latest, widened = mode.draws, len(mode.checks), mode.index_record, mode.latest, \
            dict(mode.widened)
        arrays_before = {address: buf._array for address, buf in buffer.allocator.live_now().items()}
        try:
            yield
        finally:
            written = [buf for address, buf in buffer.allocator.live_now().items()
                       if address in arrays_before and buf._array is not arrays_before[address]]
            for buf in written:
                buf.array = arrays_before[buf.address]
            changed = (mode.draws != draws, len(mode.checks) != checks, mode.index_record is not record)
            del mode.checks[checks:]
            mode.draws, mode.index_record, mode.latest, mode.widened = draws, record, latest, widened
        if written:
            raise NotScannable("a layer writes a tensor of the caller's in place")
        if any(changed):
            raise NotScannable("a layer draws random numbers or checks device values")

    def run(self, hidden: torch.Tensor, values: list, grad=None) -> torch.Tensor:
        """The first layer's forward over `hidden` with its parameters replaced by `values`; with `grad`, its backward
        too, with them still replaced (a checkpoint inside the layer recomputes there, reading its parameters then).
        """
        layer = self.plan.layers[0]
        with _parameters_replaced(layer, dict(zip(self.plan.names, values))):
            out = self.body_forward(layer, hidden, *self.args, **self.kwargs)
            if not (isinstance(out, torch.Tensor) and out.shape == hidden.shape and out.dtype == hidden.dtype
                    and out.device == hidden.device):
                raise NotScannable("a layer returns something other than a tensor like its input")
            if grad is not None:
                # `backward`, not `autograd.grad`: a reentrant checkpoint inside the layer accumulates its inputs'
                # gradients into `.grad` and cannot serve `grad`; the leaves here are the body's own tensors
                torch.autograd.backward(out, grad)
        return out


def _autocast_state(device_type: str) -> dict:
    """The autocast settings the forward ran under, for the device's type and the CPU's, as `torch.utils.checkpoint`
    keeps them: the backward runs inside `loss.backward()`, outside the user's `torch.autocast`, and a layer recomputed
    without it computes in float32 what the forward computed in bfloat16 (other values, and products several times
    slower on a TPU)."""
    return {kind: dict(enabled=torch.is_autocast_enabled(kind), dtype=torch.get_autocast_dtype(kind),
                       cache_enabled=torch.is_autocast_cache_enabled()) for kind in dict.fromkeys((device_type, "cpu"))}


@contextlib.contextmanager
def _autocast_entered(state: dict):
    with contextlib.ExitStack() as stack:
        for kind, settings in state.items():
            stack.enter_context(torch.autocast(kind, **settings))
        yield


def _scan_stacking(step, carry, xs, slices: list, reverse: bool = False):
    """`jax.lax.scan(step, carry, xs, reverse=reverse)`, whose `step` returns one array per `(shape, dtype)` of
    `slices` each layer, stacked layers first, with the stacks allocated uninitialized (`jax.lax.empty`) instead of
    filled with zeros: every layer writes its own slice, so no zero is ever read. `jax.lax.scan` fills its stacks
    with zeros, and the v5e's XLA keeps that fill before a reverse loop (the backward's gradients) and, in the 0.44B
    Llama's mixed-precision step, before the forward's stack of float32 layer inputs: 2.4 GB of writes a step there
    (each MLP weight's stacked float32 gradients 0.4 GB, the layer inputs 0.8 GB), 8.9 ms by the compiler's
    estimate. Over a mesh of several chips the stacks are zeros as `jax.lax.scan`'s: an uninitialized allocation is a
    custom call whose partitioning across chips is not shown."""
    length = jax.tree.leaves(xs)[0].shape[0]
    allocate = jnp.zeros if placement.traced_over_chips(*jax.tree.leaves((carry, xs))) else jax.lax.empty

    def write_each_layer(state, inputs):
        carry, stacks = state
        x, index = inputs
        carry, ys = step(carry, x)
        return (carry, [jax.lax.dynamic_update_index_in_dim(stack, y, index, 0) for stack, y in zip(stacks, ys)]), None

    stacks = [allocate((length, *shape), dtype) for shape, dtype in slices]
    (carry, stacks), _ = jax.lax.scan(write_each_layer, (carry, stacks), (xs, jnp.arange(length, dtype=jnp.int32)),
                                      reverse=reverse)
    return carry, stacks


class _ScannedLayers(torch.autograd.Function):
    """The stack of layers as one autograd node: a forward scan that keeps each layer's input, and a reverse scan
    that recomputes each layer and takes PyTorch's gradients of it."""

    @staticmethod
    def forward(ctx, plan: _Plan, body_forward, args: tuple, kwargs: dict, hidden: torch.Tensor, *parameters):
        body = _BodyTrace(plan, body_forward, args, kwargs, hidden.device.index)
        arrays = [tensor_views.array_of(p) for p in parameters]
        stacked = [jnp.stack(column) for column in zip(*plan.per_layer(arrays))]
        dtypes = [p.dtype for p in parameters[:len(plan.names)]]

        def step(h, layer_arrays):
            out = body.run(body.tensor(h, hidden.dtype), [body.tensor(a, d) for a, d in zip(layer_arrays, dtypes)])
            return tensor_views.array_of(out), [h]

        h = tensor_views.array_of(hidden)
        with body.guarded():
            final, (inputs,) = _scan_stacking(step, h, stacked, [(h.shape, h.dtype)])
        ctx.body, ctx.stacked, ctx.inputs, ctx.dtypes = body, stacked, inputs, dtypes
        ctx.hidden_dtype = hidden.dtype
        ctx.function_modes = torch.overrides._get_current_function_mode_stack()
        ctx.autocast = _autocast_state(hidden.device.type)
        return body.tensor(final, hidden.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        body, plan, dtypes = ctx.body, ctx.body.plan, ctx.dtypes
        trained = [k for k, t in enumerate(plan.trained) if t]
        stacked, g = ctx.stacked, tensor_views.array_of(grad)

        def step(g, xs):
            layer_arrays, h = xs
            with torch.enable_grad():
                hidden = body.tensor(h, ctx.hidden_dtype, requires_grad=True)
                values = [body.tensor(a, d, requires_grad=plan.trained[k])
                          for k, (a, d) in enumerate(zip(layer_arrays, dtypes))]
                body.run(hidden, values, grad=body.tensor(g, ctx.hidden_dtype))
            wanted = [hidden, *(values[k] for k in trained)]
            grads = [jnp.zeros_like(tensor_views.array_of(w)) if w.grad is None else tensor_views.array_of(w.grad)
                     for w in wanted]
            return grads[0], grads[1:]

        # the layer recomputed under the torch function modes of the forward: the backward runs inside
        # `loss.backward()`, which PyTorch runs with the mode whose function it is taken off the stack
        try:
            with body.guarded(), remat.modes_entered(ctx.function_modes, contextlib.nullcontext()), \
                    _autocast_entered(ctx.autocast):
                g_hidden, g_stacked = _scan_stacking(step, g, (stacked, ctx.inputs),
                                                     [(stacked[k].shape[1:], stacked[k].dtype) for k in trained],
                                                     reverse=True)
        except NotScannable as e:  # the forward scanned: too late for the plain loop, the whole trace falls back
            raise Untraceable(f"the scanned layers' backward cannot be a loop body ({e})") from e
        grads_by_name = dict(zip(trained, g_stacked))
        parameter_grads = [body.tensor(grads_by_name[k][layer], dtypes[k]) if k in grads_by_name else None
                           for layer in range(len(plan.layers)) for k in range(len(plan.names))]
        return (None, None, None, None, body.tensor(g_hidden, ctx.hidden_dtype), *parameter_grads)
