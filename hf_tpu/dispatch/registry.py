"""The one table from ATen operator to JAX lowering.

A lowering is a pure function written against the ATen schema: tensor arguments arrive as
`jax.Array`s (already read through their views), `Scalar` arguments as traced scalars (so a new
value never recompiles), a `Generator?` argument as a JAX PRNG key, everything else as the Python
value PyTorch passed. It returns arrays in the order of the schema's returns. Output dtypes and
shapes come from PyTorch's own meta kernels and are enforced after the lowering, so a lowering only
has to get the values right.

Only functional overloads are written; their in-place (`add_`) and `out=` (`add.out`) variants are
derived by dispatch (`signatures.functional_counterpart`), once, for every lowering.

Ops whose output shapes depend on the data (`nonzero`, `masked_select`, `unique`) have no meta
kernel; their lowerings cannot be traced, so dispatch runs them on concrete arrays (a sync point)
and takes the results as they are: such a lowering must return PyTorch's exact dtypes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Promote

from ..dtypes import scalar_type_name

__all__ = ["Lowering", "LOWERINGS", "lowering", "floating_kernel", "HANDLERS", "handler", "CPU_VIEW_KERNELS",
           "reuse_cpu_kernel", "BACKEND_CHOICES", "backend_choice", "KERNEL_CHOICES", "lowering_function", "Promote"]


@dataclasses.dataclass(frozen=True)
class Lowering:
    fn: Callable
    # PyTorch's elementwise type promotion applied to the tensor and Scalar arguments before the
    # lowering runs (computation dtype, e.g. float32 for bfloat16 inputs); None: inputs as they are.
    promote: Promote | None = None
    # names of Scalar arguments the lowering needs as Python values (e.g. to choose a code path)
    static: frozenset = frozenset()
    # result shapes and dtypes from tracing the lowering, not PyTorch's meta kernel: for the few ops
    # whose meta kernel rejects what tpu supports (it copies a CUDA-only restriction)
    own_shapes: bool = False
    # per Scalar argument name, values compiled into the program when the call passes one of them
    # (others stay traced): common constants a lowering computes faster as special cases, e.g. x ** 2
    static_values: tuple = ()  # ((name, frozenset of values), ...)
    # names of matrix arguments that may arrive as `buffer.Transposed` (a whole buffer viewed with its
    # last two dims swapped) for the lowering to contract directly instead of reading a transposed copy
    transposed: frozenset = frozenset()
    # names of matrix arguments that may arrive as `buffer.Flattened` (a whole contiguous buffer of 3 or more
    # dims viewed with its leading dims flattened, a linear layer's input) for the lowering to contract in the
    # buffer's own shape
    flattened: frozenset = frozenset()
    # names of `float` arguments passed traced, like Scalars, where they would be Python values:
    # hyperparameters that change every step (an optimizer's learning rate under a schedule); an
    # overload where the name is a Tensor (`tensor_lr`) gets it as an array anyway
    traced: frozenset = frozenset()
    # raises PyTorch's error for argument values its CPU kernel rejects and its meta kernel lets through
    # (an integer tensor to a negative integer power): called with the call's values, in schema order,
    # before every call, since a traced Scalar's value is not part of the compiled program
    check: Callable | None = None
    # raises PyTorch's error for argument dtypes or Python number types its CPU kernel rejects (a bool
    # tensor subtracted): called with the call's values when its program is built, since these types
    # are part of the call's key; an op with only this check keeps the C entry's fast path
    type_check: Callable | None = None


LOWERINGS: dict[torch._ops.OpOverload, Lowering] = {}


def floating_kernel(kernel: str | Callable, complex: bool = False):
    """The `type_check` of an op whose CPU kernel is compiled for floating dtypes only (ATen's
    `AT_DISPATCH_FLOATING_TYPES_AND2(Half, BFloat16, ...)`: softmax, the normalisations, most activations and
    losses): PyTorch's NotImplementedError, naming the CPU kernel, for an integer, bool or complex input, which
    the op's meta kernel lets through and JAX would compute (`cross_entropy` of Long logits). `kernel` is the
    CPU kernel's name, or a function of the call's values giving it where it depends on them; `complex`: the
    kernel takes complex dtypes too (`AT_DISPATCH_FLOATING_AND_COMPLEX_TYPES...`)."""
    def check(values):
        if not (values[0].is_floating_point() or (complex and values[0].is_complex())):
            name = kernel(values) if callable(kernel) else kernel
            raise NotImplementedError(f'"{name}" not implemented for {scalar_type_name(values[0].dtype)!r}')

    return check


def _overloads(op):
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def lowering(*ops, promote: Promote | None = None, static=(), own_shapes: bool = False, transposed=(),
             flattened=(), static_values=None, traced=(), check=None, type_check=None):
    """Register `fn` as the lowering of each op (an OpOverload, or a packet meaning its functional
    overloads)."""

    def register(fn):
        entry = Lowering(fn, promote, frozenset(static), own_shapes,
                         tuple((name, frozenset(values)) for name, values in (static_values or {}).items()),
                         frozenset(transposed), frozenset(flattened), frozenset(traced), check, type_check)
        for op in ops:
            for overload in _overloads(op):
                if isinstance(op, torch._ops.OpOverloadPacket) and overload._schema.is_mutable:
                    continue
                if overload in LOWERINGS:
                    raise ValueError(f"{overload} has two lowerings")
                LOWERINGS[overload] = entry
        return fn

    return register


# Ops that manage storage rather than compute values (allocation, views, transfers, host reads), and
# the few that choose at call time how to compute: a handler, a Python function taking the bound call
# `(signature, values)` instead of arrays, runs in place of a lowering. Such an op still has the C entry
# as its dispatcher kernel; its handlers are the few places that touch buffers directly.
HANDLERS: dict[torch._ops.OpOverload, Callable] = {}


def handler(*ops):
    def register(fn):
        for op in ops:
            for overload in _overloads(op):
                HANDLERS[overload] = fn
        return fn

    return register


# View ops whose CPU kernel only computes sizes and strides over the tensor's own storage: on tpu that
# very kernel runs, registered as a direct redispatch with nothing in Python between PyTorch's
# dispatcher and it (a third of a decoding step's ops are views).
CPU_VIEW_KERNELS: set = set()


def reuse_cpu_kernel(*ops):
    CPU_VIEW_KERNELS.update(ops)


# CompositeImplicitAutograd ops for which PyTorch picks a fused kernel per device in C++ (a DispatchStub
# a Python backend cannot extend), leaving tpu on the unfused math decomposition: on tpu this choice
# runs instead, above autograd, and calls an op with a lowering and a derivative of its own.
BACKEND_CHOICES: dict[torch._ops.OpOverload, Callable] = {}


def backend_choice(op):
    def register(fn):
        BACKEND_CHOICES[op] = fn
        return fn

    return register


# Device code registered in place of a lowering for some calls (`hf_tpu.kernels.register`): per functional
# op, choosers `(args, kwargs) -> function or None`, newest first. A chooser sees the call's arrays while
# its program is traced (shapes and dtypes, not values) and returns the function to lower it with, or
# None to leave the call to the next chooser and finally to the lowering.
KERNEL_CHOICES: dict[torch._ops.OpOverload, list[Callable]] = {}


def lowering_function(op, low: Lowering, args, kwargs) -> Callable:
    """The function that lowers this call of `op`: a registered kernel that takes it, else the lowering."""
    for choose in KERNEL_CHOICES.get(op, ()):
        chosen = choose(args, kwargs)
        if chosen is not None:
            return chosen
    return low.fn
