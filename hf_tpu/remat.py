"""`torch.utils.checkpoint` inside a traced program: the recomputed forward stays a recomputation.

In eager execution a checkpointed block (Transformers' `gradient_checkpointing_enable()`, a user's
`checkpoint(fn, x)`) keeps only its inputs and runs its forward again in the backward. Traced into one
program by `hf_tpu.jit` (a whole training step: forward, backward, optimizer), that second forward is the
same computation of the same arrays as the first, and XLA's common-subexpression elimination merges the
two: the program then keeps every activation alive from the forward to the backward, as if nothing were
checkpointed. `jax.checkpoint` meets the same problem and passes the recomputation's inputs through an
optimization barrier, which XLA may not look through: the recomputed values are then new values, computed
where the backward needs them. The same is done here at the two places PyTorch's checkpoint hands its saved
inputs to the recomputation: `_CheckpointFrame.get_inputs` (the non-reentrant form, Transformers' default)
and `detach_variable` (the reentrant form).

Random ops of a recomputation draw what the forward drew: inside a trace `torch.tpu.get_rng_state()` names
the trace's next draw and `set_rng_state` moves it (`hf_tpu.tracing.Tracing.rng_state`), so the
checkpoint's `fork_rng` replays the forward's draws as it does in eager execution.

Under `torch.compile` none of this runs: AOT autograd puts the recomputation in the backward graph, a
program of its own.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import torch
import torch.utils.checkpoint as torch_checkpoint

from . import modes
from .memory import buffer, tensor_views
from .wrapping import wrap_once


def behind_barrier(values):
    """`values` (a list or tuple, as the checkpoint holds its inputs) with every tpu tensor among them replaced by
    one whose array has passed, with the others', one optimization barrier; outside a trace, `values` as they
    are."""
    mode = modes.current()
    if mode.kind is not modes.ModeKind.TRACE:
        return values
    positions = [k for k, v in enumerate(values) if isinstance(v, torch.Tensor) and v.device.type == "tpu"]
    if not positions:
        return values
    # with the results of the op traced last (the backward's, which is what needs the recomputation): the
    # recomputation depends on them, so XLA cannot move it up into the forward, where it would hold its values
    # from there on as much as the forward's own would have
    arrays, _ = jax.lax.optimization_barrier(([tensor_views.array_of(values[k]) for k in positions],
                                              jax.tree_util.tree_leaves(mode.latest)[:1]))
    replaced = list(values)
    for k, array in zip(positions, arrays):
        # requiring gradients where the old did: autograd saves what an op's backward needs by that (the
        # recomputation must save what the forward did), and the reentrant form reads their `.grad`
        old = values[k]
        replaced[k] = buffer.new_tensor(array.shape, old.dtype, old.device.index, array).requires_grad_(old.requires_grad)
    return type(values)(replaced)


@contextlib.contextmanager
def saved_values_materialized(input_buffers):
    """Inside a traced step, each value the forward saves for the backward (outside a checkpointed block, whose
    own hooks keep its inputs alone) passes an optimization barrier where it is saved: the backward reads that
    one array, kept from the forward.

    Without it XLA may instead keep what the value was computed from and compute it again where the backward
    reads it. The TPU compiler did that with the residual stream of a checkpointed Llama: the final norm's saved
    float32 input was recomputed in the loss's backward from every layer's two residual addends, each kept in
    float32 from the forward, 128 MB a layer at 8192 tokens of hidden 2048, where the saved input is 64 MB in
    all. A parameter (a buffer among `input_buffers`, or a view of one: a linear layer saves its transposed
    weight) is an input of the program and is left as it is: behind a barrier, a view of it would be a copy."""
    def pack(t):
        # in the backward (a reentrant checkpoint's recomputation) a saved value is read soon after, by the same
        # backward: nothing to keep apart
        if not (isinstance(t, torch.Tensor) and t.device.type == "tpu") or torch._C._current_graph_task_id() != -1:
            return t
        buf = buffer.buffer_of(t)
        if buf in input_buffers or not isinstance(buf.value(), jax.core.Tracer):
            return t
        mode = modes.current()
        narrow = mode.narrower(buf.value()) if mode.kind is modes.ModeKind.TRACE else None
        if narrow is not None:
            # a widened value (bfloat16 logits cast to float32 for the loss) is kept as what it was widened from,
            # half the bytes, and widened again where the backward reads it, in the fusion that reads it
            (narrow,) = jax.lax.optimization_barrier((narrow,))
            array = tensor_views.array_of(t, buf, narrow.astype(buf.value().dtype))
        else:
            (array,) = jax.lax.optimization_barrier((tensor_views.array_of(t, buf),))
        return buffer.new_tensor(array.shape, t.dtype, t.device.index, array)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _wrap_get_inputs(original):
    @functools.wraps(original)
    def get_inputs(self):
        return behind_barrier(original(self))

    return get_inputs


def _wrap_detach_variable(original):
    @functools.wraps(original)
    def detach_variable(inputs):
        return behind_barrier(original(inputs))

    return detach_variable


def _wrap_without_reentrant(original):
    @functools.wraps(original)
    def generator(fn, preserve_rng_state, context_fn, *args, **kwargs):
        """The non-reentrant checkpoint, its recomputation under the torch function modes its forward met."""
        if modes.current().kind is modes.ModeKind.TRACE:
            context_fn = _recomputed_under_the_forwards_modes(context_fn)
        return original(fn, preserve_rng_state, context_fn, *args, **kwargs)

    return generator


def _recomputed_under_the_forwards_modes(context_fn):
    """`context_fn` (the checkpoint's: a forward context and a recomputation context), with the torch function
    modes of the forward entered again around the recomputation. PyTorch takes a mode off its stack while the
    mode's own function runs, and `hf_tpu.jit`'s trace runs under one (`constant_masks.KnownValues`, which gives
    attention a causal mask's pattern): a backward started inside the trace (`loss.backward()`) runs without it,
    and a recomputed attention took the mask's other path, saving other tensors than its forward, which the
    checkpoint refuses (a C++ abort inside autograd's engine)."""
    def contexts():
        forward, recompute = context_fn()
        return forward, modes_entered(torch.overrides._get_current_function_mode_stack(), recompute)

    return contexts


@contextlib.contextmanager
def modes_entered(forward_modes: list, recompute):
    with contextlib.ExitStack() as stack:
        current = torch.overrides._get_current_function_mode_stack()
        for mode in forward_modes:
            if not any(mode is m for m in current):
                stack.enter_context(mode)
        stack.enter_context(recompute)
        yield


def install() -> None:
    """Put the barrier into PyTorch's checkpoint (once)."""
    wrap_once(torch_checkpoint, "_checkpoint_without_reentrant_generator", _wrap_without_reentrant)
    wrap_once(torch_checkpoint._CheckpointFrame, "get_inputs", _wrap_get_inputs)
    wrap_once(torch_checkpoint, "detach_variable", _wrap_detach_variable)
