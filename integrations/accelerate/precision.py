"""Mixed precision on `tpu` under Accelerate.

`Accelerator(mixed_precision="fp16")` refused every device outside a fixed list ("fp16 mixed precision
requires a device in ('xpu', 'cuda', ...)"), and its GradScaler comes from a fixed list as well. On
`tpu` it now autocasts to float16 and scales the loss with `torch.amp.GradScaler("tpu")` (the scaler's
unscale and inf checks run on tpu). `"bf16"` needs no scaler; Accelerate already autocasts in one
process, and `MULTI_TPU` (data_parallel.py) gets the same bfloat16 autocast (Accelerate lists the
distributed types that autocast to bfloat16, and the default autocast dtype of a new device is float16).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

import torch

from hf_tpu.wrapping import wrap_once

from .data_parallel import MULTI_TPU, wrap_everywhere


def install(module) -> None:
    if module.__name__ == "accelerate.accelerator":
        wrap_once(module.Accelerator, "__init__", _allow_fp16)
        wrap_everywhere(sys.modules["accelerate.utils.modeling"], "get_mixed_precision_context_manager",
                        _bfloat16_for_multi_tpu)


def _bound_for_tpu(arguments: dict) -> bool:
    """Whether an Accelerator built with these arguments lands on `tpu`, decided before it exists (asking
    torch.accelerator whether a chip is available would create JAX's backends, which a multi-process run
    must join first)."""
    from accelerate.utils import parse_flag_from_env

    if arguments.get("cpu") or parse_flag_from_env("ACCELERATE_USE_CPU"):
        return False
    wanted = os.environ.get("ACCELERATE_TORCH_DEVICE")
    if wanted is not None:
        return torch.device(wanted).type == "tpu"
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "tpu"


def _allow_fp16(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        from accelerate.state import AcceleratorState

        bound = signature.bind(self, *args, **kwargs)
        wanted = bound.arguments.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        if str(wanted).lower() != "fp16" or not _bound_for_tpu(bound.arguments):
            return original(self, *args, **kwargs)
        # Accelerate's own setup, without its fp16 check; then fp16 as Accelerate sets it up on CUDA
        shared = AcceleratorState._shared_state
        if shared.get("_mixed_precision") == "fp16":
            shared["_mixed_precision"] = "no"
        bound.arguments["mixed_precision"] = "no"
        original(*bound.args, **bound.kwargs)
        self.state._mixed_precision = "fp16"
        if self.device.type == "tpu":
            self.native_amp = True
            scaler_kwargs = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
            self.scaler = torch.amp.GradScaler("tpu", **scaler_kwargs)

    return __init__


def _bfloat16_for_multi_tpu(original):
    @functools.wraps(original)
    def get_mixed_precision_context_manager(native_amp=False, autocast_kwargs=None):
        from accelerate.state import AcceleratorState

        state = AcceleratorState()
        if native_amp and state.distributed_type == MULTI_TPU and state.mixed_precision == "bf16":
            kwargs = {} if autocast_kwargs is None else autocast_kwargs.to_kwargs()
            return torch.autocast(device_type=state.device.type, dtype=torch.bfloat16, **kwargs)
        return original(native_amp, autocast_kwargs)

    return get_mixed_precision_context_manager
