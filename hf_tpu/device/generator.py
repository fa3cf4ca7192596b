"""`torch.Generator("tpu")`. PyTorch makes a PrivateUse1 generator through C++ hooks a Python backend cannot
register, so `torch.Generator` becomes a class that makes `tpu` ones itself: an `rng.TpuGenerator`, PyTorch's
CPU generator underneath reporting `device` as `tpu:N` (Diffusers then draws latents on `tpu`, as for a CUDA
generator). Other devices get PyTorch's own generator. See docs/design/tpu-generator.md."""

from __future__ import annotations

import torch

from ..device_state import current, rng
from ..dynamo_frames import hide_from_dynamo


class _AnyGenerator(type(torch._C.Generator)):  # PyTorch's metaclass for opaque objects
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch._C.Generator)

    def __subclasscheck__(cls, subclass) -> bool:
        return issubclass(subclass, torch._C.Generator)


class Generator(torch._C.Generator, metaclass=_AnyGenerator):
    """`torch.Generator(device="cpu")`, which also makes generators for `tpu`."""

    def __new__(cls, device="cpu"):
        device = torch.device(device)
        if device.type == "tpu":
            return rng.TpuGenerator(torch.device("tpu", current.current_index_for(device)))
        if cls is Generator:
            return torch._C.Generator(device)
        return super().__new__(cls, device)  # a user's subclass of torch.Generator


def install() -> None:
    if torch.Generator is torch._C.Generator:
        torch.Generator = Generator
    # run as PyTorch's own do under torch.compile, not traced by Dynamo as functions of their own
    hide_from_dynamo(Generator.__new__.__code__, _AnyGenerator.__instancecheck__.__code__,
                     _AnyGenerator.__subclasscheck__.__code__)
