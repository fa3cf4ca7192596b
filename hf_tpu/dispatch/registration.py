"""Registration with PyTorch's dispatcher, and the binding of the C entry.

Every op with a lowering (and the in-place and out= variants derived from it) or a handler gets the
C entry bound to its signature as its tpu kernel (`dispatcher_kernel`); the view ops that only compute
sizes and strides get PyTorch's CPU kernel; every other op reaches the same entry through the
PrivateUse1 fallback. The C entry is handed the Python objects it uses by name (`_entry.configure`),
which checks each one once, here, at import.
"""

from __future__ import annotations

import functools

import torch
from jax._src.array import ArrayImpl

from .. import counters, modes
from ..dynamo_frames import hide_from_dynamo
from ..memory import buffer
from . import _entry
from .call import LIVE, Operand, matmul_precision
from .program import PROGRAMS, Program
from .registry import BACKEND_CHOICES, CPU_VIEW_KERNELS, HANDLERS, LOWERINGS
from .run import allocate, run_bound
from .signatures import (ENTRY_FIELDS, OPT_TENSOR, SCALAR, STATIC, TENSOR, Signature, functional_counterpart,
                        hashable, signature)

_libraries: list = []


def _is_composite_implicit(op) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _derived_variants(functional):
    """The in-place and out= overloads that compute through `functional` (in its own namespace: aten, or
    hf_tpu's custom ops)."""
    name = functional._schema.name.split("::")[1]
    for packet_name in (name, name + "_"):
        packet = getattr(getattr(torch.ops, functional.namespace), packet_name, None)
        if packet is None:
            continue
        for overload_name in packet.overloads():
            overload = getattr(packet, overload_name)
            if overload._schema.is_mutable and functional_counterpart(overload) == functional:
                sig = signature(overload)
                if sig.written is None and not set(sig.mutated) <= set(sig.returns_mutated):
                    continue  # writes that cannot be matched to results: left to the fallback
                yield overload


def dispatcher_kernel(sig: Signature):
    """The op's kernel on the tpu key: the C entry, bound to the signature and what it reads of it."""
    return functools.partial(_entry.entry, sig, sig.entry_fields)


_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _cpu_view_kernel(op):
    # a partial of the C++ redispatch: no Python frame between PyTorch's dispatcher and its CPU kernel
    return functools.partial(op._handle.redispatch_boxed, _CPU)


def _fallback(op, *args, **kwargs):
    sig = signature(op)
    return _entry.entry(sig, sig.entry_fields, *args, **kwargs)


def register_kernels() -> None:
    """Register a tpu kernel for every op with a lowering (and its derived variants) or a handler,
    PyTorch's CPU kernel for the view ops that only compute sizes and strides, and the backend
    choices of composite ops; everything else reaches the same entry point through the PrivateUse1
    fallback."""
    ops = set(HANDLERS)
    for functional in LOWERINGS:
        if not _is_composite_implicit(functional):
            ops.add(functional)
        ops.update(_derived_variants(functional))
    libraries = {}  # namespace -> Library: aten, and hf_tpu's own custom ops
    for op in sorted(ops, key=str):
        if op in LOWERINGS and op not in HANDLERS and _is_composite_implicit(op):
            continue
        namespace = op.namespace
        if namespace not in libraries:
            libraries[namespace] = torch.library.Library(namespace, "IMPL")
        libraries[namespace].impl(op, dispatcher_kernel(signature(op)), "PrivateUse1")
    for op in CPU_VIEW_KERNELS:
        if op.namespace not in libraries:
            libraries[op.namespace] = torch.library.Library(op.namespace, "IMPL")
        libraries[op.namespace].impl(op, _cpu_view_kernel(op), "PrivateUse1")
    for op, choice in BACKEND_CHOICES.items():
        if op.namespace not in libraries:
            libraries[op.namespace] = torch.library.Library(op.namespace, "IMPL")
        for key in ("AutogradPrivateUse1", "PrivateUse1"):  # the latter where autograd is off (inference_mode)
            libraries[op.namespace].impl(op, choice, key)
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_fallback, "PrivateUse1")
    _libraries.extend([*libraries.values(), fallback])
    # Dynamo would try to trace these kernels (and fail on their buffer bookkeeping) when code that runs
    # eagerly under torch.compile calls an op: skipped, and everything they call (the C entry has no frame)
    hide_from_dynamo(run_bound.__code__, _fallback.__code__)


_STRICT = modes.mode_for(modes.EagerMode.DEFER_NEVER)
# Everything the C entry uses, by name; `_entry.configure` checks each one (and every attribute it reads
# by name on tensors, buffers, programs and signatures) and raises, naming it, if one is missing.
BINDINGS = dict(
    tensor_type=torch.Tensor,
    operand_type=Operand,
    buffer_type=buffer.Buffer,
    program_type=Program,
    signature_type=Signature,
    entry_fields=ENTRY_FIELDS,
    kinds={"TENSOR": TENSOR, "OPT_TENSOR": OPT_TENSOR, "SCALAR": SCALAR, "STATIC": STATIC},
    live=LIVE,
    hashable=hashable,
    programs=PROGRAMS,
    current_mode=modes.current_cell(),
    strict_mode=_STRICT,
    strict_counter_key=_STRICT.counter_key,
    buffer_module=buffer,
    counters=counters.counters,
    allocate=allocate,
    run_bound=run_bound,
    matmul_precision=matmul_precision,
    array_type=ArrayImpl,
)
_entry.configure(**BINDINGS)
