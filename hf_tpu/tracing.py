"""What a trace of `tpu` ops into one program needs, shared by `torch.compile`'s backend (`hf_tpu.compile`) and
`hf_tpu.jit` (`hf_tpu.direct`): the execution mode inside a trace (`Tracing`: ops run on tracers, random ops draw
from a key input, a host read makes the trace fail), what a failed trace raises (`UNTRACEABLE`), and what a
traced program's call does around its launch: donation of the arrays it overwrites, the random stream moved on and
the device's checks made after it, XLA's out-of-memory error in PyTorch's terms."""

from __future__ import annotations

import contextlib

import jax
import torch

from . import counters, modes
from .device_state import rng
from .memory import buffer

_counters = counters.counters


class Tracing:
    """The execution mode inside a trace: programs run on tracers, randomness comes from an input."""

    kind = modes.ModeKind.TRACE

    def __init__(self, rng_base):
        self.mode = None
        self.rng_base = rng_base
        self.draws = 0  # random ops traced so far: the i-th takes the i-th offset from rng_base
        self.checks = []  # (tensor, raise_if_bad) of each `modes.check_on_device` in the graph
        self.index_record = None  # the trace's record of out-of-range indices, once an op checks one (`device_errors`)
        self.replayed = None  # (saved key data, draws since) while `run_with_rng_state` replays an op
        self.latest = None  # the results of the op traced last (`hf_tpu.remat` orders a recomputation after it)
        self.widened = {}  # id of a traced array that widens another (bfloat16 -> float32) -> (it, the narrower array)

    def note_widening(self, wide, narrow) -> None:
        """`wide` (a traced array) is `narrow` cast to a wider floating dtype, exactly: a value the forward saves
        for the backward is kept as `narrow` (`hf_tpu.remat.saved_values_materialized`)."""
        self.widened[id(wide)] = (wide, narrow)

    def narrower(self, wide):
        """The array `wide` was widened from (`note_widening`), or None."""
        entry = self.widened.get(id(wide))
        return entry[1] if entry is not None and entry[0] is wide else None

    def random_key(self, generator):
        if generator is not None:
            raise Untraceable("a random op draws from its own torch.Generator")
        if self.replayed is not None:  # inside `run_with_rng_state`: the recomputed op's own draws
            state, n = self.replayed
            self.replayed = (state, n + 1)
            return rng.offset_key(state, n)
        key = rng.offset_key(self.rng_base, self.draws)
        self.draws += 1
        return key

    def next_key(self):
        """The key the next random op will take (`run_and_save_rng_state` saves it)."""
        return rng.offset_key(self.rng_base, self.draws)

    def rng_state(self, index: int) -> torch.Tensor:
        """`torch.tpu.get_rng_state()` inside the trace: the device's state as the next random op of the program
        will find it (the call's state, as many offsets on as the trace has drawn)."""
        return rng.get_state(index, ahead=self.draws)

    def set_rng_state(self, state: torch.Tensor, index: int) -> None:
        """`torch.tpu.set_rng_state(state)` inside the trace, to a state `rng_state` gave: the program's next random
        op draws from it (`torch.utils.checkpoint` replays a forward's draws this way)."""
        seed, offset = rng.state_values(state)
        call_seed, call_offset = rng.state_values(rng.get_state(index))
        if seed != call_seed or offset < call_offset:
            raise Untraceable("it sets the tpu random state to one the traced call did not reach")
        self.draws = offset - call_offset

    def execute(self, program, key, arrays, scalars, rng, device_index):
        self.latest = program.nested(arrays, scalars, rng)
        return self.latest

    def sync(self, reason: str) -> None:
        raise Untraceable(reason)


class Untraceable(Exception):
    """A trace that cannot be made: a host read, a random op with a generator of its own, an effect the program
    cannot replay."""


# what a trace that cannot be made raises: a host read or an unreplayable effect (`Untraceable`), an op
# without a lowering, a tracer where a concrete value is needed
UNTRACEABLE = (Untraceable, NotImplementedError, jax.errors.JAXTypeError, TypeError)


def count_trace() -> None:
    """One more program traced by `torch.compile` or `hf_tpu.jit` (`hf_tpu.metrics()["compiles"]`)."""
    _counters["compiles"] += 1
    _counters["compiles_by_mode"]["COMPILE"] += 1


def count_launch(arguments) -> None:
    """One more traced program launched (`hf_tpu.jit`, the direct trace, a device loop's chunk) with these argument
    arrays (`hf_tpu.metrics()["programs_launched"]` and `["argument_bytes"]`)."""
    _counters["programs_launched"] += 1
    _counters["argument_bytes"] += sum(a.nbytes for a in arguments)


def finish_call(device_index: int, draws: int, checks: list, checked: list) -> None:
    """After a traced program ran: the device's random stream moves past the offsets its random ops took,
    and the values it checks (a linalg `info`, an assert's condition; `checks` holds each one's dtype and
    `raise_if_bad`) are checked as eager ops check them."""
    rng.advance(device_index, draws)
    for (dtype, raise_if_bad), array in zip(checks, checked):
        modes.check_on_device(buffer.new_tensor(array.shape, dtype, device_index, array), raise_if_bad)


@contextlib.contextmanager
def launching(device_index: int, what: str):
    """XLA's out-of-memory error of a traced program, as `torch.OutOfMemoryError` naming `what` ran."""
    try:
        yield
    except modes.LAUNCH_ERRORS as e:
        modes.raise_out_of_memory(e, device_index, what)
        raise


def donatable(arrays) -> bool:
    """Whether arrays a program overwrites can be donated: each held by its own buffer only (a donated array
    is gone after the call), and none passed twice."""
    return bool(arrays) and all(buffer.allocator.holders(a) == 1 for a in arrays) \
        and len({id(a) for a in arrays}) == len(arrays)
