"""Strict-eager dispatch overhead: microseconds per op on tpu against PyTorch on CPU and raw jax.jit.

Run: python benchmarks/dispatch_overhead.py   (goal: tpu strict eager at most 3x raw JAX dispatch)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

import hf_tpu  # noqa: F401
from benchmarks.common import table, timeit

N = 200


def per_op_us(fn) -> float:
    def loop():
        for _ in range(N):
            out = fn()
        return out

    return timeit(lambda: _block(loop()), warmup=2, iters=7) / N * 1e6


def _block(out):
    if isinstance(out, torch.Tensor) and out.device.type == "tpu":
        torch.tpu.synchronize()
    elif isinstance(out, jax.Array):
        out.block_until_ready()


def main():
    rows = []
    for name, shape, op, jop in [
        ("add 1x1024", (1, 1024), lambda a, b: a + b, lambda a, b: a + b),
        ("matmul 64x64", (64, 64), lambda a, b: a @ b, lambda a, b: a @ b),
    ]:
        a, b = torch.randn(shape), torch.randn(shape)
        cpu = per_op_us(lambda: op(a, b))
        ja, jb = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
        jitted = jax.jit(jop)
        raw = per_op_us(lambda: jitted(ja, jb))
        ta, tb = a.to("tpu"), b.to("tpu")
        with torch.tpu.use_eager_mode("DEFER_NEVER"):
            tpu = per_op_us(lambda: op(ta, tb))
        rows.append([name, f"{cpu:.1f}", f"{raw:.1f}", f"{tpu:.1f}", f"{tpu / raw:.2f}x", f"{tpu / cpu:.1f}x"])
    print(table(["op", "torch cpu us", "raw jax.jit us", "tpu strict us", "tpu/jax", "tpu/cpu"], rows))


if __name__ == "__main__":
    main()
