"""Users' own kernels: a function registered for an op, per platform, in place of its lowering.

A kernel is a JAX function (typically a `pl.pallas_call`) written against the op's schema exactly as a
lowering is (`hf_tpu.dispatch.registry`): tensors arrive as `jax.Array`s, other arguments as PyTorch
passed them, and it returns arrays in the order of the schema's returns. It runs for the calls that its
`applies` accepts (shapes and dtypes; None: every call), on the platforms in `platforms` (with
`HF_TPU_KERNELS=pallas`, on every platform; with `xla`, never); every other call keeps the op's lowering.
Several kernels may be registered for one op: the newest that takes a call wins.

An op without a lowering of its own (a `torch.library` custom op, say a model's fused layer) needs a
`reference`, a JAX function computing the same thing, which becomes its lowering on the other platforms.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..dispatch import registry as dispatch_registry
from ..dispatch.program import PROGRAMS
from ..dispatch.signatures import signature
from . import selection

# what `register` accepts as a name: the ops whose lowerings the core's attention and MoE paths call
NAMED_OPS = {
    "flash_attention": lambda: torch.ops.hf_tpu.flash_attention.default,
    "scaled_dot_product_attention": lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    "grouped_mm": lambda: torch.ops.aten._grouped_mm.default,
}


@dataclasses.dataclass(frozen=True, eq=False)
class Registration:
    """One registered kernel; `remove()` takes it back out."""

    op: torch._ops.OpOverload
    kernel: Callable
    platforms: tuple
    applies: Callable | None
    chooser: Callable = dataclasses.field(repr=False, default=None)

    def remove(self) -> None:
        choosers = dispatch_registry.KERNEL_CHOICES.get(self.op, [])
        if self.chooser in choosers:
            choosers.remove(self.chooser)
            _REGISTRATIONS.remove(self)
        _forget_programs()


_REGISTRATIONS: list[Registration] = []  # newest first


def _resolve(target) -> torch._ops.OpOverload:
    if isinstance(target, str):
        if target not in NAMED_OPS:
            raise ValueError(f"no op is named {target!r} here; names: {', '.join(NAMED_OPS)} (or pass an op)")
        return NAMED_OPS[target]()
    if isinstance(target, torch._ops.OpOverloadPacket):
        if "default" not in target.overloads():
            raise ValueError(f"{target} has no default overload: pass one of {target.overloads()}")
        return target.default
    if isinstance(target, torch._ops.OpOverload):
        return target
    raise TypeError(f"register() takes an op (torch.ops.ns.name[.overload]) or a name, not {type(target).__name__}")


def _forget_programs() -> None:
    """Programs compiled before a registration traced the old choice: build them again on next use."""
    PROGRAMS.clear()


def register(target, kernel: Callable, *, platforms=("tpu",), applies: Callable | None = None,
             reference: Callable | None = None) -> Registration:
    """Run `kernel` in place of the lowering of `target` (an op, or a name in `NAMED_OPS`) on `platforms`
    for the calls `applies(*args, **kwargs)` accepts. Register before the op's first call: programs of
    `torch.compile` and of deferred graphs already built keep the choice they traced (strict eager's are
    rebuilt). Returns a `Registration` whose `remove()` undoes it."""
    op = _resolve(target)
    if isinstance(platforms, str):
        platforms = (platforms,)
    if op not in dispatch_registry.LOWERINGS:
        if reference is None:
            raise ValueError(
                f"{op} has no lowering of its own: pass reference=, a JAX function computing the same thing, "
                "for the platforms the kernel is not registered for"
            )
        # its result shapes and dtypes come from tracing the reference (a custom op may have no fake kernel)
        dispatch_registry.lowering(op, own_shapes=True)(reference)
        signature.cache_clear()  # a call before this registration cached a signature without the lowering

    def chooser(args, kwargs):
        if not selection.pallas_enabled(platforms):
            return None
        if applies is not None and not applies(*args, **kwargs):
            return None
        return kernel

    dispatch_registry.KERNEL_CHOICES.setdefault(op, []).insert(0, chooser)
    _forget_programs()
    registration = Registration(op, kernel, tuple(platforms), applies, chooser)
    _REGISTRATIONS.insert(0, registration)
    return registration


def registered(target=None) -> list[Registration]:
    """The kernels registered (for `target`, an op or a name, when given), newest first."""
    op = None if target is None else _resolve(target)
    return [r for r in _REGISTRATIONS if op is None or r.op == op]
