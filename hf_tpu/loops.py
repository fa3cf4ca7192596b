"""`hf_tpu.while_loop`: a loop whose every iteration runs on the device, in one program.

A Python loop over device ops (a decoding loop: one forward and a few small ops per token) costs a
launch, and often a host read for its stopping test, per iteration. `while_loop(cond_fn, body_fn,
carried_inputs)` has the signature of `torch._higher_order_ops.while_loop`; on `tpu` it compiles
one iteration (`body_fn`, then `cond_fn` on its results) and runs the iterations inside one XLA while
loop, with no host read between them: traced straight from Python (`hf_tpu.direct`) where the caller
names the loop's `state`, else with `torch.compile(backend="tpu")` (`hf_tpu.compile.looping`). Unlike
the higher-order op, `body_fn` may also update tensors in place (a static KV cache): such tensors are
carried through the loop and hold their final values afterwards, as after the Python loop. Anything
the device loop cannot take (a graph break, a tensor that needs gradients, a CPU tensor) runs as the
Python loop `while cond_fn(*carried): carried = body_fn(*carried)`, which defines the result in every
case.

The device loop runs in chunks of iterations (`hf_tpu.loop_chunks`), so that Ctrl-C stops a long loop.
This module is the layer above both ways of compiling the step, and imports each at the first loop
that takes it (`import hf_tpu` loads neither).
"""

from __future__ import annotations

import logging
import types

import torch

from .loop_chunks import NotLoopable

log = logging.getLogger("hf_tpu.loops")


def _step(cond_fn, body_fn, *carried):
    new = body_fn(*carried)
    # a tensor returned unchanged (or a view of one) would not be an output of the graph: the loop needs
    # one new value per carried tensor; XLA drops the copy
    new = tuple(t.clone() for t in (new if isinstance(new, (tuple, list)) else (new,)))
    return (*new, cond_fn(*new))


# one compiled step per loop site (the code of its body and condition): each has its own Dynamo cache,
# which recompiles for each model, shape or captured constant the site meets
_compiled_steps: dict = {}
_RECOMPILE_LIMIT = 64


def _compiled(cond_fn, body_fn):
    site = (getattr(body_fn, "__code__", body_fn), getattr(cond_fn, "__code__", cond_fn))
    if site not in _compiled_steps:
        code = _step.__code__.replace(co_name=f"_step_{len(_compiled_steps)}")
        step = types.FunctionType(code, _step.__globals__, code.co_name)
        _compiled_steps[site] = torch.compile(step, backend="tpu", fullgraph=True, dynamic=False)
    return _compiled_steps[site]


def _on_device(carried: tuple) -> bool:
    return bool(carried) and all(
        isinstance(t, torch.Tensor) and t.device.type == "tpu" and not (t.requires_grad and torch.is_grad_enabled())
        for t in carried)


def while_loop(cond_fn, body_fn, carried_inputs, state=None, *, run: bool = True):
    """Run `carried = body_fn(*carried)` while `cond_fn(*carried)` is true; return `carried` (a tuple).

    `cond_fn` returns a one-element bool tensor; `body_fn` returns tensors of the same shapes and
    dtypes as `carried_inputs`. No gradient flows through the loop.

    With `state` (the objects `hf_tpu.jit` takes as state: modules, tensors, a KV cache), the step is traced
    straight from Python (`hf_tpu.direct`), without Dynamo: the state's tensors, and those the two
    functions' closures hold, are the loop's inputs, and those written in place are carried through it.
    Where that trace cannot be made, the loop compiles its step with `torch.compile` as without `state`.

    `run=False` (with `state`) runs nothing and returns None: it traces the step now and compiles the loop on
    a thread of its own, so that other work (tracing and compiling another program) proceeds meanwhile. A
    later call with the same functions, state and carried shapes and dtypes (their values may differ) runs
    that program, once its compile has ended.
    """
    carried = tuple(carried_inputs)
    if not run:
        if _on_device(carried) and state is not None:
            from . import direct

            try:
                with torch.no_grad():
                    direct.while_loop(cond_fn, body_fn, carried, state, run=False)
            except NotLoopable as e:  # the call that runs the loop finds its own way
                log.info("hf_tpu: while_loop compiles nothing ahead (%s)", e)
        return None
    if _on_device(carried) and state is not None:
        from . import direct

        try:
            with torch.no_grad():
                return direct.while_loop(cond_fn, body_fn, carried, state)
        except NotLoopable as e:
            log.warning("hf_tpu: while_loop compiles its step with torch.compile instead (%s)", e)
    if _on_device(carried):
        import torch._dynamo.exc as dynamo_errors

        from .compile import looping

        keep_going = cond_fn(*carried)
        try:
            with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT), \
                    looping(carried, keep_going) as request:
                outputs = _compiled(cond_fn, body_fn)(cond_fn, body_fn, *carried)
            if request.taken:  # the step's graph ran the whole loop
                return tuple(outputs[:-1])
            # no graph: the step has no tensor op, so running it once had no effect but its results
            if not bool(keep_going):
                return carried
            carried = tuple(outputs[:-1])
        # raised before any iteration ran
        except (NotLoopable, dynamo_errors.TorchDynamoException, dynamo_errors.FailOnRecompileLimitHit) as e:
            log.info("hf_tpu: while_loop runs its iterations from Python (%s: %s)", type(e).__name__, e)
    while bool(cond_fn(*carried)):
        new = body_fn(*carried)
        carried = tuple(new) if isinstance(new, (tuple, list)) else (new,)
    return carried
