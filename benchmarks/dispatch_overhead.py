"""Strict-eager dispatch overhead: microseconds per op on tpu against PyTorch on CPU and raw jax.jit.

Each figure is the best of 15 loops of 200 ops (the median is printed beside it). The three columns'
loops alternate (cpu, raw jit, tpu, cpu, ...): this shared 2-core machine changes speed by up to 2x from
one second to the next, and alternating lets every column see the same phases.

Run: python -m benchmarks.dispatch_overhead   (tpu strict eager should stay within 3x raw JAX dispatch)
     python -m benchmarks.dispatch_overhead --budget   (where a strict and a deferred add's time goes:
     docs/design/deferred-speedup-ceiling.md)
     python -m benchmarks.dispatch_overhead --numbers   (what Python numbers as jitted arguments cost, raw
     JAX: the reason hf_tpu/modes/scalars.py passes them as device arrays)
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import hf_tpu
from benchmarks.common import table
from hf_tpu import dispatch
from hf_tpu.dispatch import call as calls
from hf_tpu.dispatch.program import PROGRAMS
from hf_tpu.memory import buffer

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
        # raw jax.jit is given the number as a Python float, as a call site would; tpu keeps it on the device
        ("multiply by a number 1x1024", (1, 1024), lambda a, b: a * 0.37, lambda a, b: a * 0.37),
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


def _alternating_best_us(parts, calls: int = 2000, rounds: int = 9) -> list:
    """Best microseconds per op of each (function, ops per call), their rounds taking turns so that
    every part sees the machine's same phases."""
    for fn, _ in parts:
        for _ in range(100):
            fn()
    best = [float("inf")] * len(parts)
    for _ in range(rounds):
        for i, (fn, ops) in enumerate(parts):
            n = max(calls // ops, 20)
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / (n * ops) * 1e6)
    return best


def _launch_inside_op_us(a, b, calls: int = 2000, rounds: int = 9) -> float:
    """Best microseconds per op that strict eager's launch (the program's jitted call, made by the C
    entry for a common call) takes inside a loop of `a + b`: what deferring an op saves. On a busy
    cache it costs more than in its own hot loop."""
    a + b  # the add's program exists
    programs = [p for p in PROGRAMS.values() if p.direct_launch is not None]
    spent = [0]

    def timed(launch):
        def launch_timed(*arrays):
            start = time.perf_counter_ns()
            try:
                return launch(*arrays)
            finally:
                spent[0] += time.perf_counter_ns() - start
        return launch_timed

    originals = [p.direct_launch for p in programs]
    best = float("inf")
    for p in programs:
        p.direct_launch = (timed(p.direct_launch[0]), *p.direct_launch[1:])
    try:
        for _ in range(rounds):
            spent[0] = 0
            for _ in range(calls):
                a + b
            best = min(best, spent[0] / calls / 1e3)
    finally:
        for p, direct in zip(programs, originals):
            p.direct_launch = direct
    return best


def budget():
    """The parts of one strict `a + b` (1x1024), each timed alone in a hot loop, the launch timed inside
    the op, and the deferred add."""
    a, b = torch.randn(1, 1024), torch.randn(1, 1024)
    ta, tb = a.to("tpu"), b.to("tpu")
    ja, jb = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
    jitted = jax.jit(lambda x, y: x + y)
    noop = torch.library.Library("hf_tpu_bench", "DEF")
    noop.define("noop(Tensor a, Tensor b) -> Tensor")
    noop.impl("noop", lambda x, y: x, "PrivateUse1")
    sig, values = dispatch.signature(torch.ops.aten.add.Tensor), [ta, tb, 1]
    array = buffer.buffer_of(ta).array

    def deferred_add():  # 50 adds recorded, then one flush: the per-op figure includes the flush's share
        with torch.tpu.use_eager_mode("DEFER_AND_FUSE"):
            for _ in range(50):
                ta + tb
            torch.tpu.synchronize()

    parts = [
        ("PyTorch on CPU, the whole a + b", lambda: a + b, 1),
        ("PyTorch's dispatcher into a Python kernel and back", lambda: torch.ops.hf_tpu_bench.noop(ta, tb), 1),
        ("analysing the call (C: dispatch.call._analyse_common)",
         lambda: calls._analyse_common(sig.kinds, sig.defaults, sig.default_keys, values, sig.ident, "highest"), 1),
        ("making and releasing the result tensor",
         lambda: buffer.allocator.new_tensor((1, 1024), torch.float32, 0, array), 1),
        ("the launch: raw jax.jit", lambda: jitted(ja, jb), 1),
        ("tpu strict eager, the whole a + b", lambda: ta + tb, 1),
        ("tpu defer-and-fuse, the whole a + b (50 recorded, one flush)", deferred_add, 50),
    ]
    with torch.tpu.use_eager_mode("DEFER_NEVER"):
        us = _alternating_best_us([(fn, ops) for _, fn, ops in parts])
        launch = _launch_inside_op_us(ta, tb)
    rows = [[name, f"{t:.1f}"] for (name, _, _), t in zip(parts, us)]
    rows.insert(5, ["the launch, timed inside strict a + b", f"{launch:.1f}"])
    print(table(["part", "us per op (best)"], rows))
    strict, deferred = us[5], us[6]
    print(f"strict eager less its launch: {strict - launch:.1f} us, so removing the launch alone would make an op "
          f"{strict / (strict - launch):.2f}x faster; defer-and-fuse is {strict / deferred:.2f}x faster than strict "
          "eager (free recording aside, its other parts also run warmer without launches between them)")


def numbers(count: int = 141) -> None:
    """Milliseconds of one jitted call given `count` Python numbers (AdamW's fused step on the modes benchmark's
    tiny Llama passes 141), against the same values packed in two NumPy arrays and as device arrays."""
    arrays = [jnp.full((64, 64), float(i)) for i in range(8)]
    values = [i * 0.5 for i in range(count)]

    @jax.jit
    def take(arrays, values):
        total = arrays[0]
        for v in values:
            total = total + v
        return total

    @jax.jit
    def take_packed(arrays, packed):
        return arrays[0] + packed.sum()

    on_device = [jax.device_put(v) for v in values]
    cases = [("Python numbers", lambda: take(arrays, values)),
             ("one NumPy array", lambda: take_packed(arrays, np.asarray(values))),
             ("device arrays", lambda: take(arrays, on_device))]
    rows = []
    for name, call in cases:
        for _ in range(3):
            call().block_until_ready()
        best = min(_timed_calls(call) for _ in range(7))
        rows.append([name, f"{best * 1e3:.3f}"])
    print(f"backend {jax.default_backend()}, one jitted call with {count} numbers")
    print(table(["numbers given as", "ms per call"], rows))


def _timed_calls(call, calls: int = 20) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = call()
    out.block_until_ready()
    return (time.perf_counter() - start) / calls


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", action="store_true", help="time the parts of one add instead")
    parser.add_argument("--numbers", action="store_true", help="time Python numbers as jitted arguments instead")
    args = parser.parse_args()
    budget() if args.budget else numbers() if args.numbers else main()
