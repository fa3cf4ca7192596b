"""`torch.accelerator` functions that reach a device through C++ hooks a Python backend cannot
provide (synchronize, memory statistics, capability, the current device and stream). While `tpu` is
the accelerator they are answered by `torch.tpu`; for any other accelerator PyTorch's own function
runs unchanged.
"""

from __future__ import annotations

import functools

import torch

from .. import device as tpu
from ..dynamo_frames import hide_from_dynamo


def _device_arg(device):
    if device is None:
        return None
    if isinstance(device, int):
        return device
    return torch.device(device).index


_ROUTES = {
    "synchronize": lambda d=None: tpu.synchronize(_device_arg(d)),
    "empty_cache": lambda: tpu.empty_cache(),
    "empty_host_cache": lambda: None,
    "memory_stats": lambda d=None: tpu.memory_stats(_device_arg(d)),
    "memory_allocated": lambda d=None: tpu.memory_allocated(_device_arg(d)),
    "max_memory_allocated": lambda d=None: tpu.max_memory_allocated(_device_arg(d)),
    "memory_reserved": lambda d=None: tpu.memory_reserved(_device_arg(d)),
    "max_memory_reserved": lambda d=None: tpu.max_memory_reserved(_device_arg(d)),
    "reset_accumulated_memory_stats": lambda d=None: None,
    "reset_peak_memory_stats": lambda d=None: tpu.reset_peak_memory_stats(_device_arg(d)),
    "get_memory_info": lambda d=None: tpu.mem_get_info(_device_arg(d)),
    "get_device_capability": lambda d=None: {"supported_dtypes": tpu.supported_dtypes()},
    # a Python backend's device guard cannot hold a current device: `torch.tpu` holds it
    "current_device_index": lambda: tpu.current_device(),
    "current_device_idx": lambda: tpu.current_device(),
    "set_device_index": lambda d: tpu.set_device(d),
    "set_device_idx": lambda d: tpu.set_device(d),
    # one stream per device (`torch.tpu.Stream`): the device's, as the `torch.Stream` PyTorch returns
    "current_stream": lambda d=None: torch.Stream(stream_id=0, device_index=tpu._index(d), device_type=_PRIVATEUSE1),
    "set_stream": lambda stream: tpu.set_device(stream.device_index),
}
_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)


def _tpu_is_the_accelerator() -> bool:
    accel = torch.accelerator.current_accelerator()
    return accel is not None and accel.type == "tpu"


class _DeviceIndex(torch.accelerator.device_index):
    """`with torch.accelerator.device_index(i):` switching `torch.tpu`'s current device."""

    def __enter__(self) -> None:
        if not _tpu_is_the_accelerator():
            return super().__enter__()
        if self.idx is not None:
            self.prev_idx = tpu.current_device()
            tpu.set_device(self.idx)

    def __exit__(self, *exc_info) -> None:
        if not _tpu_is_the_accelerator():
            return super().__exit__(*exc_info)
        if self.idx is not None:
            tpu.set_device(self.prev_idx)


def _routed(name, original):
    route = _ROUTES[name]

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if _tpu_is_the_accelerator():
            return route(*args, **kwargs)
        return original(*args, **kwargs)

    wrapper._hf_tpu_original = original  # the marker of a function hf-tpu put in PyTorch's place
    return wrapper


def install() -> None:
    for name in _ROUTES:
        original = getattr(torch.accelerator, name, None)
        if original is None or hasattr(original, "_hf_tpu_original"):
            continue
        setattr(torch.accelerator, name, _routed(name, original))
    if not issubclass(torch.accelerator.device_index, _DeviceIndex):
        torch.accelerator.device_index = _DeviceIndex
    # Dynamo asks for the current stream while it compiles: it must not try to compile our answer
    routed = [getattr(torch.accelerator, name) for name in _ROUTES if hasattr(torch.accelerator, name)]
    hide_from_dynamo(*{wrapper.__code__ for wrapper in routed}, _DeviceIndex.__enter__.__code__,
                     _DeviceIndex.__exit__.__code__)
