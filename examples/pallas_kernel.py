"""A user's own Pallas kernel on `tpu`: a fused RMSNorm, registered for a custom op that a module calls.

    python examples/pallas_kernel.py

The layer calls `torch.ops.examples.rms_norm`, a PyTorch custom op with a plain CPU implementation.
`hf_tpu.kernels.register` maps it, on the TPU platform, to a Pallas kernel (one program per block of
rows: the mean of squares, the reciprocal square root and the weight in one pass over the data), with a
JAX reference that serves every other platform. On a machine without a TPU this script sets
`HF_TPU_KERNELS=pallas`, so the kernel runs in Pallas interpret mode on the CPU: the same code path,
emulated.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_TPU_KERNELS", "pallas")  # off a TPU: run the kernel in interpret mode

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

import hf_tpu  # noqa: E402,F401 - registers the tpu device
import hf_tpu.kernels  # noqa: E402


@torch.library.custom_op("examples::rms_norm", mutates_args=(), device_types="cpu")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The op the layer calls. Its implementation is registered for CPU only (`device_types`): on tpu the
    op then reaches hf_tpu's dispatch, which lowers it with the registered kernel or reference."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


ROWS_PER_BLOCK = 8  # a multiple of the TPU's 8 sublanes; the hidden size is one block wide


def rms_norm_kernel(x, weight, eps):
    """The Pallas kernel: a grid over blocks of rows, each block normalised in one pass."""
    hidden = x.shape[-1]
    flat = x.reshape(-1, hidden)
    rows = flat.shape[0]

    def body(x_ref, w_ref, o_ref):
        block = x_ref[...].astype(jnp.float32)
        scale = jax.lax.rsqrt(jnp.mean(block * block, axis=-1, keepdims=True) + eps)
        o_ref[...] = (block * scale * w_ref[...].astype(jnp.float32)).astype(o_ref.dtype)

    out = pl.pallas_call(
        body,
        grid=(pl.cdiv(rows, ROWS_PER_BLOCK),),
        in_specs=[pl.BlockSpec((ROWS_PER_BLOCK, hidden), lambda i: (i, 0)),
                  pl.BlockSpec((1, hidden), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((ROWS_PER_BLOCK, hidden), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(flat.shape, x.dtype),
        interpret=hf_tpu.kernels.interpret(),  # True off a TPU
    )(flat, weight.reshape(1, hidden))
    return out.reshape(x.shape)


def rms_norm_reference(x, weight, eps):
    """The same in plain JAX: the op's lowering on the platforms the kernel is not registered for."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * weight).astype(x.dtype)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        return torch.ops.examples.rms_norm(x, self.weight, self.eps)


def main() -> None:
    kernel_calls = []

    def counted_kernel(x, weight, eps):
        kernel_calls.append(x.shape)  # at trace time (the program's shapes and its code), not per call
        return rms_norm_kernel(x, weight, eps)

    hf_tpu.kernels.register(torch.ops.examples.rms_norm.default, counted_kernel, platforms=("tpu",),
                            applies=lambda x, weight, eps: x.shape[-1] % 128 == 0,  # lane-aligned rows only
                            reference=rms_norm_reference)

    torch.manual_seed(0)
    layer = RMSNorm(256)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 16, 256)
    expected = layer(x)  # CPU: the op's own implementation
    actual = layer.to("tpu")(x.to("tpu")).cpu()
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    print(f"HF_TPU_KERNELS={hf_tpu.kernels.mode()}, interpret={hf_tpu.kernels.interpret()}; "
          f"the kernel ran: {bool(kernel_calls)}; the tpu result matches the reference")


if __name__ == "__main__":
    main()
