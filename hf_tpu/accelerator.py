"""`torch.accelerator` functions that reach a device through C++ hooks a Python backend cannot
provide (synchronize, memory statistics, capability). While `tpu` is the accelerator they are
answered by `torch.tpu`; for any other accelerator PyTorch's own function runs unchanged.
"""

from __future__ import annotations

import functools

import torch

from . import device as tpu


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
}


def _routed(name, original):
    route = _ROUTES[name]

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        accel = torch.accelerator.current_accelerator()
        if accel is not None and accel.type == "tpu":
            return route(*args, **kwargs)
        return original(*args, **kwargs)

    wrapper.__hf_tpu_original__ = original
    return wrapper


def install() -> None:
    for name in _ROUTES:
        original = getattr(torch.accelerator, name, None)
        if original is None or hasattr(original, "__hf_tpu_original__"):
            continue
        setattr(torch.accelerator, name, _routed(name, original))
