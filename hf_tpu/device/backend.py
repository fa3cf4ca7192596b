"""Registering PyTorch's PrivateUse1 backend as `tpu`: its hooks and device guard, `torch.tpu`
(`hf_tpu.device`), the kernels of every op (`dispatch.register_kernels`) and each piece of PyTorch's
API that needs a tpu path (accelerator, storage, pinned host memory, autocast, generators,
`Module.to`)."""

from __future__ import annotations

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from .. import device, dispatch, ops  # noqa: F401  (`ops` fills the lowering registry)
from ..memory import pinned, storage_apis
from . import accelerator, autocast, generator, module_to


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return device.is_available()

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def register() -> None:
    if torch._C._get_privateuse1_backend_name() == "tpu":
        return  # this process already registered us (e.g. importlib.reload)
    _setup_privateuseone_for_python_backend("tpu", backend_module=device, hook=_Hooks(), device_guard=_Guard())
    dispatch.register_kernels()
    accelerator.install()
    storage_apis.install()
    pinned.install()
    autocast.install()
    generator.install()
    module_to.install()
