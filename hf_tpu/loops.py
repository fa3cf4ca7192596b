"""`hf_tpu.while_loop`: a loop whose every iteration runs on the device, in one program.

A Python loop over device ops (a decoding loop: one forward and a few small ops per token) costs a
launch, and often a host read for its stopping test, per iteration. `while_loop(cond_fn, body_fn,
carried_inputs)` has the signature of `torch._higher_order_ops.while_loop`; on `tpu` it compiles
one iteration (`body_fn`, then `cond_fn` on its results) with `torch.compile(backend="tpu")` and runs
the iterations inside one XLA while loop, with no host read between them. Unlike the higher-order op,
`body_fn` may also update tensors in place (a static KV cache): such tensors are carried through the
loop and hold their final values afterwards, as after the Python loop. Anything the device loop
cannot take (a graph break, a tensor that needs gradients, a CPU tensor) runs as the Python loop
`while cond_fn(*carried): carried = body_fn(*carried)`, which defines the result in every case.

The device loop runs in chunks of iterations (`ChunkSizes`), each one XLA program the host launches
after the previous one, so that Ctrl-C stops a long loop within about `CHUNK_SECONDS` twice: a program
once launched runs to its end, and Python handles a signal only between two host operations.
"""

from __future__ import annotations

import collections
import logging
import time
import types

import jax
import numpy as np
import torch

log = logging.getLogger("hf_tpu.loops")


class NotLoopable(Exception):
    """Raised by a compiled graph asked to loop that cannot (the loop then runs in Python)."""


class LoopRequest:
    """What the compiled step needs to run as a loop: the carried tensors (to find among the graph's
    inputs) and `cond_fn` of them (whether the first iteration runs)."""

    def __init__(self, carried: tuple, keep_going: torch.Tensor):
        self.carried = carried
        self.keep_going = keep_going


# Ctrl-C waits for the chunk running and the one queued behind it: two chunks of about this long
CHUNK_SECONDS = 0.2


class ChunkSizes:
    """How many iterations each chunk of a device loop runs: a few first, then as many as take about
    `CHUNK_SECONDS`, measured from the chunks before (an iteration's time is not known before it runs).

    A chunk costs a launch, and a read of the loop's condition that overlaps the next chunk (which is
    queued before the read): tens of microseconds against `CHUNK_SECONDS`, so under 0.1% of the loop.
    """

    FIRST = 8
    GROWTH = 8  # the most a chunk grows over the one before, so one slow measurement cannot run away

    def __init__(self, seconds: float = CHUNK_SECONDS):
        self.seconds = seconds
        self.steps = self.FIRST
        self.launched = 0
        self._since = time.perf_counter()

    def start(self) -> None:
        """The first chunk is running (its launch compiled the loop, which is not an iteration's time)."""
        self._since = time.perf_counter()

    def finished(self, steps: int) -> None:
        """A chunk of `steps` iterations ended now (its condition was read): size the next one."""
        now = time.perf_counter()
        per_step = max((now - self._since) / steps, 1e-7)
        self._since = now
        self.steps = max(1, min(int(self.seconds / per_step), self.steps * self.GROWTH))


def run_in_chunks(launch, state: tuple, started, interrupted) -> tuple:
    """Run a device loop as chunks of iterations until one ends it; return its last state.

    `launch(state, steps)` launches one chunk of at most `steps` iterations from `state`, (overwritten
    arrays, carried arrays, whether to go on), plus the iteration count, which starts at 0, and returns
    the state after it without waiting for it. The next chunk is queued before a chunk's condition is read,
    so the device never waits for the host. `started()` runs once the first chunk is launched (its launch
    traced and compiled the loop); on Ctrl-C, `interrupted(state)` gets the state of the last chunk
    launched before the interrupt is raised again."""
    # Every chunk is one program only if each chunk's inputs are placed as the first's: a chunk's results
    # are committed to their device, so the first chunk's arrays are too (an array made without a device
    # named is not, and JAX keys a second compile by that).
    state = first_chunk(*state)[:-1]
    chunks = ChunkSizes()
    queued = collections.deque()  # (condition, iterations) of the chunks launched and not yet read
    iterations = 0
    try:
        while True:
            state = launch(state, np.uint32(chunks.steps))
            # The next chunk starts from the count the host keeps, a NumPy value as the first chunk's (the
            # chunk's own count is a device array, placed otherwise). The two agree whenever the next chunk
            # runs an iteration: this one then ran all of its own.
            iterations += chunks.steps
            state = (*state[:-1], np.uint32(iterations))
            if chunks.launched == 0:
                chunks.start()  # the first launch compiled the loop: its chunks are timed from here
                started()
            chunks.launched += 1
            queued.append((state[2], chunks.steps))
            if len(queued) < 2:
                continue  # the next chunk is queued before this one's condition is read
            condition, steps = queued.popleft()
            if not np.asarray(condition).item():  # waits for that chunk: Ctrl-C is handled here
                return state  # the chunk queued behind it ran no iteration: its results are the loop's
            chunks.finished(steps)
    except KeyboardInterrupt:
        interrupted(state)
        raise


def first_chunk(overwritten, carried, keep_going) -> tuple:
    """The arguments of a loop's first chunk after its state: the state, committed, the iteration count 0 and
    the first chunk's size, as `run_in_chunks` launches it (and as a compile ahead lowers it)."""
    return (*jax.tree.map(_committed, (overwritten, carried, keep_going)), np.uint32(0),
            np.uint32(ChunkSizes.FIRST))


def _committed(value):
    if isinstance(value, jax.Array) and not value.committed:
        return jax.device_put(value, value.sharding)
    return value


# the request for the next compiled graph call; set only around the call of `_step` below
pending: list = [None]


def take_request() -> LoopRequest | None:
    request, pending[0] = pending[0], None
    return request


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
                    direct.while_loop(cond_fn, body_fn, carried, cond_fn(*carried), state, run=False)
            except NotLoopable as e:  # the call that runs the loop finds its own way
                log.info("hf_tpu: while_loop compiles nothing ahead (%s)", e)
        return None
    if _on_device(carried) and state is not None:
        from . import direct

        keep_going = cond_fn(*carried)
        try:
            with torch.no_grad():
                return direct.while_loop(cond_fn, body_fn, carried, keep_going, state)
        except NotLoopable as e:
            log.warning("hf_tpu: while_loop compiles its step with torch.compile instead (%s)", e)
    if _on_device(carried):
        import torch._dynamo.exc as dynamo_errors

        request = LoopRequest(carried, cond_fn(*carried))
        pending[0] = request
        try:
            with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
                outputs = _compiled(cond_fn, body_fn)(cond_fn, body_fn, *carried)
            if pending[0] is None:  # the step's graph ran the whole loop
                return tuple(outputs[:-1])
            # no graph: the step has no tensor op, so running it once had no effect but its results
            if not bool(request.keep_going):
                return carried
            carried = tuple(outputs[:-1])
        # raised before any iteration ran
        except (NotLoopable, dynamo_errors.TorchDynamoException, dynamo_errors.FailOnRecompileLimitHit) as e:
            log.info("hf_tpu: while_loop runs its iterations from Python (%s: %s)", type(e).__name__, e)
        finally:
            pending[0] = None
    while bool(cond_fn(*carried)):
        new = body_fn(*carried)
        carried = tuple(new) if isinstance(new, (tuple, list)) else (new,)
    return carried
