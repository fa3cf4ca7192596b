"""When a Pallas kernel runs instead of the XLA lowering: the platform, and `HF_TPU_KERNELS`.

- `auto` (default): on the platforms a kernel is written for (the TPU, for every kernel here), when the
  call meets the kernel's shape rules; the XLA lowering everywhere else.
- `xla`: never; every call takes the XLA lowering.
- `pallas`: wherever the shape rules hold, on any platform. Off a TPU, Mosaic cannot compile a TPU
  kernel, so it runs in Pallas interpret mode (`interpret=True`): a slow emulation on the CPU, there for
  tests of the kernels against the lowerings.

The choice is made when a call's program is traced, so it is compiled into the program: changing the
variable applies to programs built afterwards, not to shapes already compiled in this process.
"""

from __future__ import annotations

import functools

import jax

from .. import platform, settings


def mode() -> str:
    """`HF_TPU_KERNELS`: 'auto', 'xla' or 'pallas'."""
    return settings.get("HF_TPU_KERNELS")


def pallas_enabled(platforms=("tpu",)) -> bool:
    """Whether a Pallas kernel written for `platforms` may run now (its shape rules still apply)."""
    chosen = mode()
    return chosen == "pallas" or (chosen == "auto" and platform.name() in platforms)


def interpret() -> bool:
    """Whether Pallas kernels run in interpret mode: everywhere but a TPU, where Mosaic compiles them.
    A kernel passes this to `pl.pallas_call(..., interpret=...)` (or the library kernel's `interpret`)."""
    return platform.name() != "tpu"


def attention_block() -> int:
    """`HF_TPU_KERNEL_BLOCK`: the largest query/key block of the attention kernel (a multiple of 128, the TPU's
    lane width: `settings` checks it)."""
    return settings.get("HF_TPU_KERNEL_BLOCK")


def in_32_bit_mode(kernel):
    """Trace `kernel` with JAX's 64-bit types off. hf_tpu turns them on for PyTorch's int64 and float64,
    and the library kernels, written for JAX's default, then mix int64 and int32 in their index maps."""
    @functools.wraps(kernel)
    def traced(*args, **kwargs):
        with jax.enable_x64(False):
            return kernel(*args, **kwargs)

    return traced
