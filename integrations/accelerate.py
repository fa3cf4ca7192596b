"""Accelerate on `tpu`: `Accelerator()`, and with it the Trainer, trains on `tpu` once hf_tpu is imported.

Accelerate picks its device from a list of backends it knows (CUDA, MPS, XPU, ...), and without one
of them it picks the CPU. The Trainer already put its inputs on `tpu` (Transformers asks
`torch.accelerator`), so `accelerator.prepare(model)` moved the model back to the CPU and the first
forward failed on the two devices. Here, a single process whose accelerator is `tpu` gets
`tpu:<current>`, as one with CUDA gets `cuda`; `cpu=True` (`use_cpu=True`) and
`ACCELERATE_TORCH_DEVICE` still decide first, as before.
"""

from __future__ import annotations

import torch


def _tpu_is_the_accelerator() -> bool:
    accel = torch.accelerator.current_accelerator()
    return accel is not None and accel.type == "tpu" and torch.accelerator.is_available()


def install(state_module) -> None:
    state = state_module.PartialState
    original = state.default_device
    if getattr(original.fget, "_hf_tpu", False):
        return

    def default_device(self) -> torch.device:
        if _tpu_is_the_accelerator():
            return torch.device("tpu", torch.accelerator.current_device_index())
        return original.fget(self)

    default_device.__doc__ = original.__doc__
    patched = property(default_device)
    patched.fget._hf_tpu = True
    state.default_device = patched
