"""Out of memory in PyTorch's terms: `torch.OutOfMemoryError` with the sizes involved, raised once at
the call that asks for the memory.

Two places meet it. An allocation the dispatch layer makes itself (`torch.empty`, `empty_strided`,
`new_empty`, a factory such as `zeros` or `randn`), and an op's result of a large share of its device's
memory (`is_large`: `a @ b` of 256 GiB), are checked before anything is made or launched
(`check_allocation`): more bytes than the device has left is refused at once, so no tensor claims
memory it could never have. (An op's launch returns before XLA allocates its result: a result that did
not fit was an error at its next read, and until it died every allocation check counted its bytes.) A
program XLA fails to run for want of memory (strict eager's launch, a deferred flush, a compiled graph)
has its error turned into the same exception (`raise_out_of_memory`); nothing of the failed program is
kept, so the device stays usable.
"""

from __future__ import annotations

import functools

import torch

from .. import platform
from . import buffer

# How XLA says it ran out of memory: RESOURCE_EXHAUSTED at run time, and at compile time on a TPU an
# INTERNAL error that says "Ran out of memory in memory space hbm".
_MARKERS = ("resource_exhausted", "out of memory", "resource exhausted")


def is_out_of_memory(error) -> bool:
    """Whether an error XLA raised says that it ran out of memory."""
    text = str(error).lower()
    return any(marker in text for marker in _MARKERS)


@functools.cache
def capacity(device_index: int) -> int:
    """The bytes device `device_index` holds in all: what JAX reports as its limit
    (`platform.memory_info`); on the CPU platform, where JAX reports none, the host's physical memory.
    0 where nothing is known, which turns the allocation check off."""
    try:
        return int(platform.memory_info(device_index)[1])
    except Exception:
        return 0


# An op's new tensors of at least 1/LARGE_SHARE of their device's memory are checked against what the device
# has left before each launch; smaller ones are not, so that a model's ops pay nothing for it (the decision
# is made once per program: its results' sizes are fixed by its key). Such programs run through the Python
# path, whose launch costs tens of microseconds more than the C entry's: at 1/16 of a v5e's 16 GiB that is
# under 2% of the time the chip takes to write 1 GiB.
LARGE_SHARE = 16


def is_large(nbytes: int, device_index: int) -> bool:
    """Whether `nbytes` of an op's results are worth checking against the device's free memory before it
    launches (see `LARGE_SHARE`); never where the capacity is unknown."""
    total = capacity(device_index)
    return bool(total) and nbytes * LARGE_SHARE >= total


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def check_allocation(nbytes: int, device_index: int, what) -> None:
    """Raise `torch.OutOfMemoryError` before making a tensor of `nbytes` on `tpu:device_index` when
    those bytes exceed what the device has left: its capacity (`capacity`) less the bytes live tpu
    tensors hold (`torch.tpu.memory_allocated`). Nothing is checked where the capacity is unknown.
    `what` (the call, for the message) is a string or a function that makes it, called only to raise."""
    total = capacity(device_index)
    if not total:
        return
    held = buffer.allocator.allocated.get(device_index, 0)
    if nbytes <= total - held:
        return
    if callable(what):
        what = what()
    raise torch.OutOfMemoryError(
        f"tpu:{device_index} is out of memory: {what} asks for {_gib(nbytes)} ({nbytes} bytes); the device "
        f"holds {_gib(total)} in all, of which live tpu tensors hold {_gib(held)} "
        f"({_gib(max(total - held, 0))} free)."
    )


def check_results(nbytes: int, device_index: int, may_be_split: bool, what) -> None:
    """`check_allocation` of a program's results before its launch. Where they may be split over the chips (an
    operand is sharded: XLA lays the results out), only the least a chip can hold of them, their share of
    every chip, is checked: a check must never refuse results that may fit."""
    split = len(platform.global_devices()) if may_be_split else 1
    check_allocation(nbytes // split, device_index,
                     lambda: what() + (f", split over {split} chips at best," if split > 1 else ""))


def raise_out_of_memory(error, device_index: int, what: str) -> None:
    """XLA's out-of-memory error (`is_out_of_memory`) becomes `torch.OutOfMemoryError`, with the sizes
    involved, raised without XLA's error chained to it; any other error is left to the caller to
    re-raise."""
    if not is_out_of_memory(error):
        return
    try:
        free, total = platform.memory_info(device_index)
    except Exception:
        free = total = 0
    raise torch.OutOfMemoryError(
        f"tpu:{device_index} ran out of memory running {what}. Live tpu tensors hold "
        f"{buffer.allocator.allocated.get(device_index, 0) / 2**30:.2f} GiB of {total / 2**30:.2f} GiB "
        f"({free / 2**30:.2f} GiB free). XLA said: {str(error).strip().splitlines()[0]}"
    ) from None
