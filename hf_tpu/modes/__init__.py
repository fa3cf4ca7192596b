"""Execution modes: how a dispatched op's program runs.

Every op reaches its mode as a `Program` (a pure function of its operands' arrays) and the arrays
themselves; the mode decides when and how that function runs. Strict eager runs it at once through
`jax.jit`; launch-blocking also waits for the result so an error surfaces at the user's line;
defer-and-fuse records it and runs the pending ops as one program at the next sync point
(`modes/deferred.py`). Each mode object says what it is by `mode.kind`, a `ModeKind` member
(`modes/kinds.py`); a `torch.compile` trace is one more kind (`hf_tpu.compile`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import traceback

import jax
import torch

from .. import counters, platform
from ..memory import buffer, donation
from ..memory.out_of_memory import raise_out_of_memory  # noqa: F401  (modes.raise_out_of_memory)
from . import device_errors
from .deferred import Deferred
from .kinds import EagerMode, ModeKind
from .scalars import on_device

_counters = counters.counters
log = logging.getLogger("hf_tpu.compile")


class _Eager:
    """Each op compiled once per key and launched at once."""

    def __init__(self, mode: EagerMode, blocking: bool):
        self.mode = mode
        self.kind = ModeKind[mode.name]
        self.counter_key = self.kind.value  # its key in the per-mode metrics
        self.blocking = blocking

    def _compiled(self, program, donating: bool, scalars, rng):
        fn, overwritten = program.fn, program.overwritten

        def traced(donated, kept, scalars, rng):
            _counters["compiles"] += 1
            _counters["compiles_by_mode"][self.counter_key] += 1
            return fn(donation.join(overwritten, donated, kept), scalars, rng)

        if donating:
            program.jitted_donating = jax.jit(traced, donate_argnums=(0,))
            return program.jitted_donating
        if not scalars and rng is None:
            # arrays in as arguments, no pytree for jit's dispatch to walk: 1-1.5 us less per op; one array out
            # where there is one. (A program's number of scalars and its use of a key are in its key: fixed per
            # program.)
            program.arrays_only_call = True
            if len(program.result_layouts) == 1:
                program.jitted = jax.jit(lambda *arrays: traced((), list(arrays), (), None)[0])
                if program.single_result_spec is not None and not program.overwritten \
                        and not program.large_result_bytes:
                    # (a large result is checked against the device's free memory in Python first)
                    program.direct_launch = (program.jitted, *program.single_result_spec)
            else:  # several results, or one and the record of errors a checked op returns (`Program.index_check`)
                program.jitted = jax.jit(lambda *arrays: traced((), list(arrays), (), None))
                program.returns_list = True
        else:
            program.jitted = jax.jit(lambda arrays, scalars, rng: traced((), arrays, scalars, rng))
        return program.jitted

    def execute(self, program, key, arrays, scalars, rng, device_index):
        overwritten = program.overwritten
        donating = bool(overwritten) and _donatable(overwritten, arrays)
        jitted = program.jitted_donating if donating else program.jitted
        if jitted is None:
            jitted = self._compiled(program, donating, scalars, rng)
        else:
            _counters["compile_cache_hits"] += 1
            _counters["compile_cache_hits_by_mode"][self.counter_key] += 1
        scalars = on_device(scalars, device_index)
        try:
            if donating:
                out = jitted(*donation.split(arrays, overwritten), scalars, rng)
            elif program.arrays_only_call:
                if arrays:
                    out = jitted(*arrays)
                else:
                    with jax.default_device(platform.jax_device(device_index)):
                        out = jitted()
                if not program.returns_list:
                    out = (out,)
            elif arrays:
                out = jitted(arrays, scalars, rng)
            else:
                with jax.default_device(platform.jax_device(device_index)):
                    out = jitted(arrays, scalars, rng)
            if self.blocking:
                jax.block_until_ready(out)
        except jax.errors.JaxRuntimeError as e:
            raise_out_of_memory(e, device_index, f"an op ({program.name})")
            raise
        return out

    def sync(self, reason: str) -> None:
        """Nothing is pending in an eager mode."""


def _donatable(overwritten: tuple, arrays: list) -> bool:
    """Whether an in-place op may give XLA the arrays it overwrites, so the result takes their memory
    (an optimizer step rewrites every parameter and moment; without donation each op allocates them
    anew): each must be a device array that only the overwritten buffer holds and that the op reads
    once."""
    if not overwritten:
        return False
    for i in overwritten:
        array = arrays[i]
        if not isinstance(array, jax.Array) or buffer.allocator.holders(array) != 1:
            return False
    reads = collections.Counter(map(id, arrays))
    return all(reads[id(arrays[i])] == 1 for i in overwritten)


def log_sync(reason: str) -> None:
    """With HF_TPU_LOG_COMPILES=1, say where the user's code forced a sync and why."""
    from hf_tpu import settings

    if not settings.get("HF_TPU_LOG_COMPILES"):
        return
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(part in frame.filename for part in ("/torch/", "/hf_tpu/", "/jax/")):
            log.warning("hf_tpu: sync (%s) at %s:%d", reason, frame.filename, frame.lineno)
            return
    log.warning("hf_tpu: sync (%s)", reason)


_MODES = {
    EagerMode.DEFER_NEVER: _Eager(EagerMode.DEFER_NEVER, blocking=False),
    EagerMode.DEFER_AND_FUSE: Deferred(EagerMode.DEFER_AND_FUSE),
    EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING: _Eager(EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING, blocking=True),
}


def default_mode() -> EagerMode:
    """The mode at start: `HF_TPU_EAGER_MODE`, or where it is unset, strict eager; launch-blocking when
    several processes share the CPU platform's simulated chips. There, with several programs holding gloo
    collectives in flight at once, 2-process training loops hung now and then in their second backward;
    with launches that block (one program in flight per process) they ran to the end
    (docs/design/accelerate-launch.md)."""
    from hf_tpu import settings

    joined = jax.distributed.is_initialized()  # asked first: the other two start JAX's backends
    if settings.source("HF_TPU_EAGER_MODE") == "default" and joined and jax.process_count() > 1 \
            and platform.name() == "cpu":
        return EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    return EagerMode[settings.get("HF_TPU_EAGER_MODE")]


_current = [_MODES[default_mode()]]


def current():
    return _current[0]


def current_cell() -> list:
    """The one-element list holding the current mode object: what the C entry and the dispatch hot
    path read (`cell[0]`) without a call."""
    return _current


def mode_for(mode: EagerMode):
    """The mode object that runs `mode`."""
    return _MODES[mode]


def replace_current(mode):
    """Make `mode` (a mode object: a trace's, in `hf_tpu.compile`) current without syncing the one it
    replaces; returns that one, to be put back the same way."""
    previous = _current[0]
    _current[0] = mode
    return previous


def set_eager_mode(mode) -> None:
    mode = EagerMode(mode.value if isinstance(mode, EagerMode) else str(mode).upper())
    _current[0].sync("eager mode change")
    _current[0] = _MODES[mode]


def get_eager_mode() -> EagerMode:
    return _current[0].mode


@contextlib.contextmanager
def eager_mode(mode):
    """Run a block in another execution mode (pending work is flushed on entry and exit)."""
    previous = get_eager_mode()
    set_eager_mode(mode)
    try:
        yield
    finally:
        set_eager_mode(previous)


def host_read(reason: str, at_the_call: bool = False) -> None:
    """A value is about to be read on the host: say where (with HF_TPU_LOG_COMPILES=1), compute the
    pending work, count the sync in `host_syncs`, and report what the device found wrong meanwhile.
    `at_the_call`: an op checks its own values at its call (`device_errors.check_at_each_op`)."""
    log_sync(reason)
    _current[0].sync(reason)
    _counters["host_syncs"] += 1
    report_device_checks(at_the_call)


# Checks on device values (`torch.linalg`'s LAPACK `info`, `torch._assert_async`): (value, raise_if_bad).
_pending_checks: list = []


def check_on_device(value: torch.Tensor, raise_if_bad) -> None:
    """Call `raise_if_bad` on `value`'s host copy (it raises PyTorch's error if the value says so) at
    the next host read or `torch.tpu.synchronize()`, as CUDA reports device-side asserts, so the op
    itself never waits for the device. Under launch-blocking mode it runs at once, so the error points
    at the user's line. Inside a `torch.compile` trace the value becomes an output of the compiled
    program, checked in the same way after each call of it. A traced program's record of out-of-range
    indices joins its device's record (`device_errors`)."""
    mode = _current[0]
    if mode.kind is ModeKind.TRACE:
        mode.checks.append((value, raise_if_bad))
    elif isinstance(raise_if_bad, device_errors.TraceSites):
        merge_index_record(buffer.array_of(value), buffer.buffer_of(value).device_index, raise_if_bad)
    elif mode.kind is ModeKind.DEFER_NEVER_AND_LAUNCH_BLOCKING:
        host_read("a check on a device value")
        raise_if_bad(buffer.host_copy(value))
    else:
        _pending_checks.append((value, raise_if_bad))


def merge_index_record(found, device_index: int, sites) -> None:
    """A traced program's record of out-of-range indices (an array, after a call) joins its device's; checked at
    once where each op checks its indices at its call (`device_errors.check_at_each_op`)."""
    device_errors.merge(found, device_index, sites)
    if device_errors.check_at_each_op(_current[0]):
        host_read("a traced program's index checks")


def report_device_checks(at_the_call: bool = False) -> None:
    """Run the pending checks (after a sync: their values are computed); the first failing one raises."""
    device_errors.report(at_the_call)
    while _pending_checks:
        checks = _pending_checks[:]
        _pending_checks.clear()
        for value, raise_if_bad in checks:
            raise_if_bad(buffer.host_copy(value))


def flush(reason: str) -> None:
    """Compute all deferred work now, without reading anything back (`host_read` counts the reads)."""
    _current[0].sync(reason)


buffer.flush = flush
