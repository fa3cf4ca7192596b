"""A device loop (`hf_tpu.while_loop`) run as chunks of iterations: each chunk one XLA program (`loop_chunk`) the host
launches after the previous one (`run_in_chunks`), so that Ctrl-C stops a long loop within about `CHUNK_SECONDS`
twice: a program once launched runs to its end, and Python handles a signal only between two host operations. The
chunks of a step `torch.compile` compiled (`hf_tpu.compile`) and of one traced straight from Python
(`hf_tpu.direct`) run alike."""

from __future__ import annotations

import collections
import time

import jax
import jax.numpy as jnp
import numpy as np

from .modes import device_errors


class NotLoopable(Exception):
    """Raised, before any iteration ran, by a step asked to loop that cannot (traced or compiled): the loop then
    runs another way, the Python loop last."""


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


def loop_chunk(step, overwritten_arrays, other_arrays, rng_base, slots, carried, keep_going, count, steps,
               condition=None):
    """One chunk of a device loop (`hf_tpu.while_loop`): at most `steps` iterations from iteration `count` on.

    `step(overwritten, others, key)` is one traced iteration: it returns ([the overwritten inputs' new
    values, the new carried values, whether to go on], the values it checks, how it checks them: (dtype,
    raise_if_bad) each); `slots` says where each carried value sits among `others` (None: the step does
    not read it). `carried` ends with the loop's record of out-of-range indices, which the step does not
    read: each iteration folds its own into it (`device_errors.fold_loop_step`).

    With `condition(overwritten, others, key)`, the loop's condition traced alone, the chunk computes whether to go
    on from its first state itself, and `keep_going` is None: the loop's first condition is then part of its
    program, not ops the host runs (each a program of its own) before the first chunk. After the first chunk this
    recomputes the condition the chunk before ended with."""
    limit = count + steps

    def go_on(state):
        return jnp.reshape(state[2], ()).astype(bool) & (state[3] < limit)

    def with_carried(carried):
        others = list(other_arrays)
        for slot, array in zip(slots, carried):
            if slot is not None:
                others[slot] = array
        return others

    if condition is not None:
        keep_going = condition(list(overwritten_arrays), with_carried(carried[:-1]), rng_base)

    def iteration(state):
        overwritten, (*carried, record), _, count = state
        others = with_carried(carried)
        # each iteration draws its random numbers from its own keys
        results, checked, checks = step(list(overwritten), others, rng_base.at[3].add(count))
        record = device_errors.fold_loop_step(record, checked, checks)
        k, n = len(overwritten), len(carried)
        if len(results) != k + n + 1 or any(r is None for r in results):
            raise TypeError("a while_loop step must return as many tensors as it carries")
        return results[:k], [*results[k:k + n], record], results[k + n], count + jnp.uint32(1)

    state = (list(overwritten_arrays), list(carried), keep_going, count)
    return jax.lax.while_loop(go_on, iteration, state)
