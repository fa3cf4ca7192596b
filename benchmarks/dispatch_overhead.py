"""Strict-eager dispatch overhead: microseconds per op on tpu against PyTorch on CPU and raw jax.jit.

Each figure is the best of 15 loops of 200 ops (the median is printed beside it). The three columns'
loops alternate (cpu, raw jit, tpu, cpu, ...): this shared 2-core machine changes speed by up to 2x from
one second to the next, and alternating lets every column see the same phases.

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


def per_op_us(*fns) -> list:
    """(best, median) microseconds per op of each function, their 15 timed loops alternating."""
    for fn in fns:
        for _ in range(2):
            _block(_loop(fn))
    times = [[] for _ in fns]
    for _ in range(15):
        for fn, samples in zip(fns, times):
            start = time.perf_counter()
            _block(_loop(fn))
            samples.append((time.perf_counter() - start) / N * 1e6)
    return [(min(samples), statistics.median(samples)) for samples in times]


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
        ja, jb = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
        jitted = jax.jit(jop)
        ta, tb = a.to("tpu"), b.to("tpu")
        with torch.tpu.use_eager_mode("DEFER_NEVER"):
            cpu, raw, tpu = per_op_us(lambda: op(a, b), lambda: jitted(ja, jb), lambda: op(ta, tb))
        cells = [f"{best:.1f} ({median:.1f})" for best, median in (cpu, raw, tpu)]
        rows.append([name, *cells, f"{tpu[0] / raw[0]:.2f}x", f"{tpu[0] / cpu[0]:.1f}x"])
    print(table(["op", "torch cpu us (median)", "raw jax.jit us (median)", "tpu strict us (median)", "tpu/jax",
                 "tpu/cpu"], rows))


if __name__ == "__main__":
    main()
