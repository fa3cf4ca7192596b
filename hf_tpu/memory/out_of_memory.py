"""XLA's out-of-memory error in PyTorch's terms."""

from __future__ import annotations

import torch

from .. import platform
from . import buffer


def raise_out_of_memory(error, device_index: int, what: str) -> None:
    """XLA's RESOURCE_EXHAUSTED becomes `torch.OutOfMemoryError`, with the sizes involved; any other
    error is left to the caller to re-raise."""
    if "RESOURCE_EXHAUSTED" not in str(error) and "Out of memory" not in str(error):
        return
    free, total = platform.memory_info(device_index)
    raise torch.OutOfMemoryError(
        f"tpu:{device_index} ran out of memory running {what}. Live tpu tensors hold "
        f"{buffer.allocator.allocated.get(device_index, 0) / 2**30:.2f} GiB of {total / 2**30:.2f} GiB "
        f"({free / 2**30:.2f} GiB free). XLA said: {str(error).splitlines()[0]}"
    ) from None
