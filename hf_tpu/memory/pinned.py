"""Pinned host memory while `tpu` is the accelerator: `pin_memory=True` in the factories,
`Tensor.pin_memory()` and `Tensor.is_pinned()`.

PyTorch allocates pinned memory through the current accelerator's C++ hooks
(`PrivateUse1HooksInterface::getPinnedMemoryAllocator`, asked by the CPU allocator whenever
`pin_memory=True`), and torch 2.13's hooks for a backend written in Python
(`torch._C._acc.PrivateUse1Hooks`) expose neither that nor `isPinnedPtr`: with `tpu` the accelerator
every `torch.empty(n, pin_memory=True)` raised NotImplementedError (on a machine without CUDA and
without hf-tpu it raises RuntimeError). Providing them needs a C++ extension built against one
PyTorch's headers, which docs/design/native-hot-path.md rules out.

Page-locked memory gains nothing here: JAX copies a host array to the device itself
(`buffer.from_host`), which is as fast from ordinary memory. So host memory pinned for `tpu` is memory
from PyTorch's CPU allocator that hf-tpu records as pinned: the factories that take `pin_memory`
allocate without it and record the new storage, `Tensor.pin_memory()` copies once into a recorded
storage (and returns a tensor already pinned unchanged, as PyTorch does), and `Tensor.is_pinned()`
answers from the record, which forgets a storage when PyTorch frees it. The factories are wrapped in
Python, which costs 0.3-0.8 us per call (measured on `torch.zeros(4)`, 1.8-2.5 us unwrapped). On a
machine with CUDA, PyTorch's CUDA allocator pins, as it does without hf-tpu. The wrappers are hidden from
Dynamo's frame hook (`hf_tpu.dynamo_frames`): CPU code compiled with `torch.compile` compiles to the same
graphs as without hf-tpu (where a graph calls `torch.ones_like`, the wrapper stands in the builtin's place).
"""

from __future__ import annotations

import functools
import weakref

import torch

from ..dynamo_frames import hide_from_dynamo

# data pointer of a pinned storage -> the finalizer that forgets it when PyTorch frees the storage
_pinned: dict[int, weakref.finalize] = {}

# the factories of `torch` and the methods of `torch.Tensor` that take `pin_memory`, but `torch.tensor`:
# Dynamo handles that one itself, and wrapped it changed the graphs of Transformers' generation (wrong
# tokens); `torch.tensor(data).pin_memory()` pins
_FACTORIES = ("arange", "empty", "empty_like", "empty_permuted", "empty_strided", "eye", "full", "full_like",
              "linspace", "logspace", "ones", "ones_like", "rand", "rand_like", "randint", "randint_like", "randn",
              "randn_like", "randperm", "scalar_tensor", "zeros", "zeros_like")
_TENSOR_FACTORIES = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros")


def _cuda_pins() -> bool:
    """PyTorch's CPU allocator asks CUDA for pinned memory before any other accelerator."""
    return torch.cuda.is_available()


def _record(tensor: torch.Tensor) -> torch.Tensor:
    storage = tensor.untyped_storage()
    address = storage.data_ptr()
    if address and address not in _pinned:
        # PyTorch keeps a storage's Python object alive as long as the storage, so the finalizer runs
        # when the memory is freed, before the address can be handed out again
        _pinned[address] = weakref.finalize(storage, _pinned.pop, address, None)
    return tensor


_PYTHON_DISPATCH = torch._C.DispatchKey.Python


def is_pinned(tensor: torch.Tensor, device=None) -> bool:
    """Whether `tensor`'s memory was pinned through `pin_memory=True` or `Tensor.pin_memory()`. A tensor of
    Python dispatch (a fake tensor while `torch.compile` traces, a subclass) has no memory of its own to look
    up: PyTorch's dispatch answers for it."""
    if tensor.device.type != "cpu" or _cuda_pins() or torch._C._dispatch_keys(tensor).has(_PYTHON_DISPATCH):
        return _base_is_pinned(tensor) if device is None else _base_is_pinned(tensor, device)
    return tensor.untyped_storage().data_ptr() in _pinned


def _pinning(factory):
    @functools.wraps(factory)
    def pinning_factory(*args, pin_memory=False, **kwargs):
        if not pin_memory:
            return factory(*args, **kwargs)
        if _cuda_pins():
            return factory(*args, pin_memory=True, **kwargs)
        result = factory(*args, **kwargs)
        if result.device.type != "cpu" or result.layout != torch.strided:
            raise RuntimeError("Only dense CPU tensors can be pinned")
        return _record(result)

    return pinning_factory


def _pin_memory(self, device=None):
    """`Tensor.pin_memory()` pins for the current accelerator; for `tpu` it copies once into memory
    recorded as pinned, keeping the strides (PyTorch's `empty_like` for a dense tensor)."""
    if _cuda_pins() or self.device.type != "cpu":
        return _base_pin_memory(self) if device is None else _base_pin_memory(self, device)
    if is_pinned(self):
        return self
    return _record(torch.empty_like(self).copy_(self))


_base_is_pinned = torch.Tensor.is_pinned
_base_pin_memory = torch.Tensor.pin_memory


def install() -> None:
    for name in _FACTORIES:
        factory = _pinning(getattr(torch, name))
        setattr(torch, name, factory)
        # TorchScript compiles `torch.<name>` as the ATen op only when it knows the function
        torch.jit._builtins._register_builtin(factory, f"aten::{name}")
    for name in _TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _pinning(getattr(torch.Tensor, name)))
    torch.Tensor.pin_memory = _pin_memory
    torch.Tensor.is_pinned = is_pinned
    # run as the builtins in whose place they are, not traced by Dynamo as functions of their own
    hide_from_dynamo(torch.empty.__code__, _pin_memory.__code__, is_pinned.__code__, recursive=False)
    hide_from_dynamo(_cuda_pins.__code__, _record.__code__)
