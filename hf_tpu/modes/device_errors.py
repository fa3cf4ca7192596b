"""Errors an op's own program finds in its values (an index out of range), raised at the next host read.

PyTorch's CPU kernels raise for an out-of-range index; XLA clamps a gather and drops a scatter's write, silently.
Checking on the host would need the indices there, a sync per op. Instead the program of each checked op
(`dispatch/index_checks.py`) computes, beside its results, whether an index is out of range, and writes it into its
device's *record*: three int64s (site, value, detail), zero while nothing is wrong, else the first error found
since the last report: where it came from (an id in `_sites`: the op, the user's line that called it, the error
it stands for), the offending value and a detail its message needs (a dim, a position). The record is one more
input and output of each checked program: no launch, no sync, 24 bytes per device, folded on the device, so a
loop that never reads anything back keeps one record, not one per op. At the next host read (`modes.host_read`:
`.item()`, `.cpu()`, `print`) or `torch.tpu.synchronize()`, where the device has finished anyway, the host reads
the record of each device a checked op ran on since (`report`) and raises the first error, as CUDA reports a
device-side assert at its next synchronization; the record then starts again from zero.

A traced program (`torch.compile`, `hf_tpu.jit`, a `hf_tpu.while_loop` step) folds a record of its own, starting
from zero, in which its checked ops are numbered 1, 2, ... in the order traced (`TraceSites`): the program does not
depend on the order in which the process met its sites, so it is the same program in every process (the disk
cache finds it). The record is one of the values the program checks (`modes.check_on_device`); after each call it
is folded into the device's record (`merge`), its numbers renamed to sites. A device loop carries its step's
record through its iterations (`fold_loop_step`).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import typing

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import platform, settings
from ..memory import buffer, host_transfers, placement, tensor_views
from .kinds import ModeKind

Lazy = buffer.Lazy

# the record's layout: (site, value, detail)
SHAPE, DTYPE = (3,), jnp.int64


class Site(typing.NamedTuple):
    """What an error found on the device stands for."""

    op: str  # as PyTorch's errors name ops: `aten::index_select`
    error: typing.Callable  # (value, detail) -> the exception PyTorch's CPU kernel raises
    where: str  # the user's line that called the op: `train.py:12 in step`

    def exception(self, value: int, detail: int, at_the_call: bool) -> Exception:
        """The CPU's exception; raised later than the call, it names the op and where it was called."""
        error = self.error(value, detail)
        if not at_the_call:
            error.args = (f"{error.args[0]} ({self.op} called at {self.where}; found by the tpu device and raised "
                          "at the next host read)",)
        return error


_sites: list = [None]  # a site's id is its position; 0 is no error
_site_ids: dict = {}  # (error, code, line) -> id, for eager ops' sites
_site_arrays: dict = {}  # (id, device index) -> the id as an array on that device, which programs take


# --- Where an op was called: the innermost Python frame outside torch, JAX and hf_tpu (its code and line are
# read at the call; its file and function named once per site). Inside a `torch.compile` graph that frame is
# FX's generated code, whose node knows the user's line it was traced from.

_LIBRARY = ("/torch/", "/hf_tpu/", "/jax/", "/jaxlib/")
_library_files: dict = {}  # file name -> whether it is library code
_FX_CODE = "<eval_with_key"
_TRACED_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _is_library(filename: str) -> bool:
    known = _library_files.get(filename)
    if known is None:
        known = _library_files[filename] = any(part in filename for part in _LIBRARY)
    return known


def _caller():
    """The frame of the user's code that called the op being dispatched (or of the graph running it), or None."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_FX_CODE) or not _is_library(filename):
            return frame
        frame = frame.f_back
    return None


def _where(frame) -> str:
    if frame is None:
        return "an unknown place"
    code = frame.f_code
    if code.co_filename.startswith(_FX_CODE):
        return _traced_from(frame) or "a torch.compile graph"
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"


def _traced_from(frame) -> str | None:
    """The user's line a graph's node was traced from (its `stack_trace`), for the FX frame running it."""
    graph_module = frame.f_locals.get("self")
    lines = getattr(graph_module, "_lineno_map", None)
    if not lines:
        return None
    index = lines.get(frame.f_lineno - graph_module._prologue_start)
    node = None if index is None else next(itertools.islice(graph_module.graph.nodes, index, None), None)
    found = _TRACED_LINE.findall(node.meta.get("stack_trace") or "") if node is not None else ()
    return f"{found[-1][0]}:{found[-1][1]} in {found[-1][2]}" if found else None


def site(sig, error, device_index: int):
    """The id of the site of an eager op now dispatched (its op's signature and error, the user's line), as the
    array a program takes on `tpu:device_index` (uploaded once: `host_transfers.from_number`)."""
    frame = _caller()
    key = (error, None, 0) if frame is None else (error, frame.f_code, frame.f_lineno)
    found = _site_ids.get(key)
    if found is None:
        found = _site_ids[key] = len(_sites)
        _sites.append(Site(sig.name, error, _where(frame)))
    array = _site_arrays.get((found, device_index))
    if array is None:
        array = _site_arrays[(found, device_index)] = host_transfers.from_number(found, device_index)
        buffer.allocator.hold(array)  # held for good: a fused program may not be given it to overwrite
    return array


# --- Each device's record, between ops


class _Held:
    """Holds a device's record between ops. A deferred (DEFER_AND_FUSE) result is listed in `buffer.pending`, as
    a buffer's is, so that the flush makes it an output of the fused program and hands it back here."""

    __slots__ = ("_array", "written")

    def __init__(self):
        self._array = None
        self.written = False  # a checked op ran since the last report

    @property
    def array(self):
        return self._array

    @array.setter
    def array(self, value):
        self._array = value
        if type(value) is Lazy:
            buffer.pending.append(self)


_held: dict = {}  # device index -> _Held


def no_errors(device_index: int):
    """A fresh record of no error on `tpu:device_index` (a new array: programs may be donated theirs)."""
    return jax.device_put(np.zeros(SHAPE, np.int64), platform.jax_device(device_index))


def _on_own_chip(record, device_index: int):
    """A record a program over a mesh wrote, on `tpu:device_index` alone. A mesh over several processes (a
    multi-host run) is not addressable as a whole from one process; its record is replicated, so the copy this
    process's chip holds is all of it."""
    chip = platform.jax_device(device_index)
    if record.is_fully_addressable:
        return jax.device_put(record, chip)
    local = {shard.device: shard.data for shard in record.addressable_shards}
    return jax.device_put(local.get(chip, next(iter(local.values()))), chip)


def _current(mode, device_index: int):
    held = _held.get(device_index)
    if held is None:
        held = _held[device_index] = _Held()
    array = held._array
    if type(array) is Lazy:
        if array.concrete is not None:
            array = held._array = array.concrete
        elif getattr(mode, "graphs", {}).get(device_index) is not array.graph:
            array = None  # the flush that was to compute it failed (out of memory): what it held is lost
    elif buffer.sharded_arrays_exist and placement.is_sharded(array):
        # written by a program over a mesh (a sharded model's op): back on its own chip, so that a single-chip
        # op does not run over the mesh for it
        array = _on_own_chip(array, device_index)
    if array is None:
        array = no_errors(device_index)
    held._array = array
    return array


class TraceSites:
    """The sites of a traced program's checked ops, in the order traced: its record names the k-th by the number k.
    The `raise_if_bad` of the record's check (`modes.check_on_device`), which merges it (`merge`)."""

    def __init__(self):
        self.sites = []
        self.first = None  # the id in `_sites` of its first site, once merged

    def __repr__(self):
        return f"TraceSites({len(self.sites)} checked ops)"


class _TraceRecord(typing.NamedTuple):
    tensor: torch.Tensor  # holds the trace's record (a tracer), as a checked value of the trace
    sites: TraceSites


def operands(mode, device_index: int, sig, error) -> tuple:
    """(the site, the record) a checked op's program takes, as arrays: its site's id and its device's record, or
    inside a trace, the op's number in the trace and the trace's record."""
    if mode.kind is not ModeKind.TRACE:
        return site(sig, error, device_index), _current(mode, device_index)
    traced = mode.index_record
    if traced is None:
        tensor = buffer.new_tensor(SHAPE, torch.int64, device_index, jnp.zeros(SHAPE, DTYPE))
        traced = mode.index_record = _TraceRecord(tensor, TraceSites())
        mode.checks.append((tensor, traced.sites))
    traced.sites.sites.append(Site(sig.name, error, _where(_caller())))
    return jnp.asarray(len(traced.sites.sites), DTYPE), tensor_views.array_of(traced.tensor)


def unrecorded():
    """A checked op's site and record where its indices were found in range as the program was traced
    (`index_checks.in_range_on_host`): constants, so that what its program finds is read by nothing."""
    return jnp.zeros((), DTYPE), jnp.zeros(SHAPE, DTYPE)


def keep(mode, device_index: int, record) -> None:
    """The record a checked op's program returned, in place of the one it took."""
    if mode.kind is ModeKind.TRACE:
        buffer.buffer_of(mode.index_record.tensor).array = record
        return
    held = _held[device_index]
    held.array = record
    held.written = True


def check_at_each_op(mode) -> bool:
    """Whether each checked op reports at once, at its call, at the cost of a host sync: in launch-blocking mode
    (the debug mode), or with HF_TPU_CHECK_INDICES=1. Not inside a trace, which cannot sync: a traced program
    reports after each call instead."""
    kind = mode.kind
    if kind is ModeKind.DEFER_NEVER_AND_LAUNCH_BLOCKING:
        return True
    # the variable looked up before it is parsed: every checked op asks
    return kind is not ModeKind.TRACE and _AT_EACH_OP in os.environ and settings.get(_AT_EACH_OP)


_AT_EACH_OP = "HF_TPU_CHECK_INDICES"


# --- Inside a program


def fold(record, found, site_id):
    """`record` with `found` (whether an index is out of range, the first such value, a detail) written in, at
    `site_id`, unless it holds an error already: the first one found is the one raised."""
    bad, value, detail = found
    new = jnp.stack([jnp.asarray(site_id).astype(DTYPE), value.astype(DTYPE), jnp.asarray(detail).astype(DTYPE)])
    return jnp.where((record[0] == 0) & bad, new, record)


def fold_loop_step(record, checked: list, checks: list):
    """A device loop's record after one iteration whose step checked `checked` (values) as `checks` say ((dtype,
    raise_if_bad) each): its record of out-of-range indices folded in. A step checking anything else (a linalg
    error, an assert) cannot run as a device loop: TypeError."""
    for value, (_, raise_if_bad) in zip(checked, checks):
        if not isinstance(raise_if_bad, TraceSites):
            raise TypeError("a while_loop step cannot check device values (a linalg error, an assert)")
        record = jnp.where(record[0] == 0, value, record)
    return record


def loop_sites(checks: list) -> TraceSites | None:
    """The sites of a loop step's record of out-of-range indices, among its checks, or None."""
    return next((r for _, r in checks if isinstance(r, TraceSites)), None)


def loop_can_fold(checks: list) -> bool:
    """Whether a step's checks are all a record of out-of-range indices, which a device loop carries."""
    return all(isinstance(r, TraceSites) for _, r in checks)


@jax.jit
def _merged(record, found, first):
    """`found` (numbered by a trace: 1, 2, ...) renamed from `first` on, written into `record` unless it holds an
    error already."""
    renamed = found.at[0].add(jnp.where(found[0] != 0, first - 1, 0))
    return jnp.where(record[0] != 0, record, renamed)


def merge(found, device_index: int, sites: TraceSites) -> None:
    """Fold a traced program's record (an array, after a call) into its device's; one small launch, no sync."""
    from . import current, flush

    if sites.first is None:
        sites.first = len(_sites)
        _sites.extend(sites.sites)
    held = _held.get(device_index)
    if held is not None and type(held._array) is Lazy and held._array.concrete is None:
        flush("a traced program's index checks")  # not the case after a call: it syncs first
    record = _current(current(), device_index)
    if buffer.sharded_arrays_exist and placement.is_sharded(found):  # a sharded model's program: onto the record's chip
        found = _on_own_chip(found, device_index)
    _held[device_index].array = _merged(record, found, host_transfers.from_number(sites.first, device_index))
    _held[device_index].written = True


# --- At a host read


def report(at_the_call: bool = False) -> None:
    """After a sync: raise the first error a device found since the last report, if any (its record then starts
    again from zero). `at_the_call`: the op reports at its own call (`check_at_each_op`), so its error is the CPU's
    exactly."""
    for device_index, held in _held.items():
        if not held.written:
            continue
        held.written = False
        array = held._array
        if type(array) is Lazy:
            array = array.concrete
        if array is None:
            continue
        if buffer.sharded_arrays_exist and placement.is_sharded(array):
            array = _on_own_chip(array, device_index)
        site_id, value, detail = np.asarray(array).tolist()
        if site_id:
            held._array = None
            raise _sites[site_id].exception(value, detail, at_the_call)
