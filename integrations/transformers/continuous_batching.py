"""Continuous batching (`generate_batch`, `init_continuous_batching`) on `tpu`: the paged KV cache sized
from the tpu's memory.

Transformers sizes the paged cache from `get_device_and_memory_breakdown()`, which knows CUDA, XPU and
MPS and otherwise reports the host's RAM, less the process's resident size. For a model on `tpu` the
cache and its attention masks then asked the device for 90% of the host's RAM: a chip's memory
is a fraction of that, and on the virtual TPU (the CPU platform) the allocation ran the host out of
memory and the process was killed. While a cache for a `tpu` device is built, the breakdown is the
tpu's (`torch.tpu.mem_get_info`, the numbers CUDA's branch reads). Where the tpu's memory is the
host's (the CPU platform), the default share of the free memory is `HOST_MEMORY_SHARE` instead of an
accelerator's 90%: with a budget of 2.26 GiB (20% of the free memory) the process's resident size
peaked at 7.8 GB, 3.5 times the budget (the masks and the copies XLA makes while writing into them), so
15% keeps the process as far from the host's limit as Transformers' 60% keeps a CPU model.
An explicit `max_memory_percent` or `num_blocks` is kept.
"""

from __future__ import annotations

import contextvars
import functools

import torch

# the device of the paged cache being built, which Transformers' breakdown is not told
_device_being_sized: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar(
    "hf_tpu_paged_cache_device", default=None)


HOST_MEMORY_SHARE = 0.15


def _memory_is_the_hosts(device: torch.device) -> bool:
    return torch.tpu.get_device_properties(device).platform == "cpu"


def _wrap_paged_cache_init(original):
    @functools.wraps(original)
    def __init__(self, config, continuous_batching_config, device, *args, **kwargs):
        token = _device_being_sized.set(torch.device(device))
        try:
            original(self, config, continuous_batching_config, device, *args, **kwargs)
        finally:
            _device_being_sized.reset(token)

    return __init__


def _wrap_memory_breakdown(original):
    @functools.wraps(original)
    def get_device_and_memory_breakdown():
        """(device, total, reserved, allocated) bytes, as Transformers' CUDA branch computes them."""
        device = _device_being_sized.get()
        if device is None or device.type != "tpu":
            return original()
        free, total = torch.tpu.mem_get_info(device)
        return device, total, torch.tpu.memory_reserved(device), total - free

    return get_device_and_memory_breakdown


def _wrap_resolve_max_memory_percent(original):
    @functools.wraps(original)
    def resolve_max_memory_percent(cb_config, has_logit_processors, device=None):
        if (cb_config.max_memory_percent is None and device is not None and torch.device(device).type == "tpu"
                and _memory_is_the_hosts(device)):
            cb_config.max_memory_percent = HOST_MEMORY_SHARE
        return original(cb_config, has_logit_processors, device)

    return resolve_max_memory_percent
