"""Strict-eager dispatch overhead: microseconds per op on tpu against PyTorch on CPU and raw jax.jit.

Each figure is the best of 15 loops of 200 ops (the median is printed beside it): on a shared 2-core
machine other processes inflate single loops by up to 2x, the same way for every column.

Run: python -m benchmarks.dispatch_overhead   (goal: tpu strict eager at most 3x raw JAX dispatch)
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import torch

import hf_tpu  # noqa: F401
from benchmarks.common import table

N = 200


def per_op_us(fn) -> tuple:
    """(best, median) microseconds per op over 15 timed loops."""
    for _ in range(2):
        _block(_loop(fn))
    times = []
    for _ in range(15):
        start = time.perf_counter()
        _block(_loop(fn))
        times.append((time.perf_counter() - start) / N * 1e6)
    return min(times), statistics.median(times)


def _loop(fn):
    for _ in range(N):
        out = fn()
    return out


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
        cells = [f"{best:.1f} ({median:.1f})" for best, median in (cpu, raw, tpu)]
        rows.append([name, *cells, f"{tpu[0] / raw[0]:.2f}x", f"{tpu[0] / cpu[0]:.1f}x"])
    print(table(["op", "torch cpu us (median)", "raw jax.jit us (median)", "tpu strict us (median)", "tpu/jax",
                 "tpu/cpu"], rows))


if __name__ == "__main__":
    main()
