"""Storage-level PyTorch APIs on `tpu`: `torch.UntypedStorage(n, device="tpu")`,
and `torch.load(..., map_location="tpu")`.

PyTorch creates a device storage through the device's C++ allocator, which a Python backend cannot
register (the call would crash). Storage creation on `tpu` is answered here instead, and restored
checkpoints move their bytes with one transfer. That keeps `copy.deepcopy`, pickling, `storage.to`
and `torch.load` working.
"""

from __future__ import annotations

import re

import torch

from ..device_state import current
from ..dynamo_frames import hide_from_dynamo
from . import buffer

_LOCATION = re.compile(r"^tpu(:(\d+))?$")


def _tag(storage):
    if storage.device.type == "tpu":
        return f"tpu:{storage.device.index or 0}"
    return None


def _restore(storage, location: str):
    match = _LOCATION.match(location)
    if match is None:
        return None
    index = current.current_index_for(torch.device(location))
    if storage.device.type == "tpu" and storage.device.index == index:
        return storage
    storage = getattr(storage, "_untyped_storage", storage)  # TypedStorage -> UntypedStorage
    host = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    if host.device.type != "cpu":
        host = host.cpu()
    tpu_bytes = buffer.new_tensor(host.shape, torch.uint8, index, buffer.from_host(host, index))
    return tpu_bytes.untyped_storage()


def new_storage(nbytes: int, index: int) -> torch.UntypedStorage:
    return buffer.new_tensor((nbytes,), torch.uint8, index).untyped_storage()


_base_new = torch.UntypedStorage.__new__


def _untyped_storage_new(cls, *args, device=None, **kwargs):
    if device is not None and torch.device(device).type == "tpu":
        index = current.current_index_for(torch.device(device))
        if len(args) == 1 and isinstance(args[0], int) and not kwargs:
            return new_storage(args[0], index)
        host = _base_new(cls, *args, **kwargs)
        return _restore(host, f"tpu:{index}")
    return _base_new(cls, *args, device=device, **kwargs)


def install() -> None:
    # `storage.tpu()` and `storage.is_tpu`, as storages have `cuda()` and `is_cuda` (PyTorch's backend
    # setup makes the tensor and module methods only)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=False, for_module=False, for_packed_sequence=False, for_storage=True)
    torch.serialization.register_package(15, _tag, _restore)
    torch.UntypedStorage.__new__ = _untyped_storage_new
    hide_from_dynamo(_untyped_storage_new.__code__)  # runs as the builtin it replaces under torch.compile
