"""The current tpu device: the index every call without an explicit one uses (`torch.tpu.set_device`,
`torch.tpu.device(...)`). PyTorch's Python backend hooks expose no device switching, so it is kept here."""

from __future__ import annotations

import torch

from .. import platform

_current_device = [0]


def current_device_index() -> int:
    return _current_device[0]


def set_current_device_index(index: int) -> None:
    _current_device[0] = index


def current_index_for(device: torch.device) -> int:
    index = device.index if device.index is not None else _current_device[0]
    platform.jax_device(index)  # raises a clear error for a chip that does not exist
    return index
