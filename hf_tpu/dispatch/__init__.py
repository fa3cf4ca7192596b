"""The one entry point from PyTorch's dispatcher into the lowerings.

Every `tpu` kernel, and the PrivateUse1 fallback, is the C entry `_entry.entry(signature, ...)`: it
binds the call to the op's schema and launches strict eager's common calls itself; every other call
continues in `run.run_bound`, which builds a key from what decides the compiled code (op, static
arguments, shapes, dtypes and view layouts of the tensors, Python types of the scalars), and runs
the cached program for that key through the current execution mode.

One concern a module, in the order a call meets them:

    registry.py      the lowerings and handlers the ops register (`hf_tpu.ops` fills it)
    signatures.py     what dispatch knows of one op (`Signature`, `signature(op)`)
    _entry.c         the C entry: binding a call, strict eager's common case, a compiled graph's inputs
    call.py          one call analysed: operands, scalars, key
    write_checks.py  PyTorch's checks of the tensors an op writes
    program.py       building the program of a key
    run.py           running a bound call through the current mode
    fallback.py      ops with no lowering: decompositions, the CPU fallback
    registration.py  registering the kernels with PyTorch, binding the C entry
    index_checks.py  out-of-range index checks

What `hf_tpu.ops`, `hf_tpu.modes` and `hf_tpu.compile` use of dispatch is re-exported here.
"""

from __future__ import annotations

from .call import device_mismatch
from .fallback import cpu_fallback, cpu_fallback_enabled, run_unlowered, unsupported
from .registration import register_kernels
from .registry import (LOWERINGS, Lowering, Promote, backend_choice, floating_kernel, handler,  # noqa: F401
                       lowering, reuse_cpu_kernel)
from .run import run_bound, run_lowered
from .signatures import Signature, signature

__all__ = ["Signature", "signature", "run_bound", "run_lowered", "run_unlowered", "cpu_fallback",
           "cpu_fallback_enabled", "unsupported", "device_mismatch", "register_kernels",
           "LOWERINGS", "Lowering", "Promote", "lowering", "floating_kernel", "handler", "reuse_cpu_kernel",
           "backend_choice"]
