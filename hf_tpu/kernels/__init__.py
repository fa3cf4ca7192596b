"""Pallas kernels: device code that the lowerings call on a TPU, and users' own kernels.

One module a kernel, each with its reference computation beside it:

    selection.py        when a kernel runs: the platform and `HF_TPU_KERNELS` (auto | xla | pallas)
    flash_attention.py  prefill attention (JAX's splash attention): GQA, causal and sliding-window
                        patterns that skip hidden blocks, soft-cap, boolean masks; forward and backward
    grouped_matmul.py   MoE grouped products (JAX's megablox gmm and tgmm) behind `aten::_grouped_mm`
    int4_matmul.py      decode and prefill products with packed int4 weights behind `hf_tpu::int4_linear`: the bytes
                        unpacked in VMEM into both nibbles' products (ours: no library kernel reads this layout)
    registry.py         `register`: a user's kernel for an op, per platform

The lowerings in `hf_tpu.ops` ask a kernel's `unsupported(...)` when a program is traced and call the
kernel when it returns None and `selection.pallas_enabled()`; every other call keeps the XLA lowering,
which is also what runs off a TPU. Decode attention (one query against a static cache) stays on the XLA
lowering; docs/design/pallas-kernels.md says why, and what each kernel covers.

A user's kernel for an op (`register`), in the style of a layer mapped to a kernel per device::

    import hf_tpu.kernels

    def gelu_tanh_kernel(x):            # a JAX function, e.g. a pl.pallas_call; lowering's signature
        ...

    hf_tpu.kernels.register(torch.ops.aten.gelu.default, gelu_tanh_kernel, platforms=("tpu",),
                            applies=lambda x, approximate="none": approximate == "tanh")

`examples/pallas_kernel.py` registers a fused RMSNorm this way for a custom op and runs it.
"""

from __future__ import annotations

from .registry import NAMED_OPS, Registration, register, registered
from .selection import interpret, mode, pallas_enabled

__all__ = ["register", "registered", "Registration", "NAMED_OPS", "interpret", "mode", "pallas_enabled"]
