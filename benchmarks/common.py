"""Shared helpers for the benchmark scripts: timing, tiny models, and table printing."""

from __future__ import annotations

import collections
import functools
import statistics
import time

import torch


def timeit(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median seconds per call of `fn` after warm-up (fn must sync what it measures)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timeit_alternating(fns, warmup: int = 1, iters: int = 20, per_turn: int = 3) -> list:
    """Median seconds per call of each function (each must sync what it measures), the functions taking
    turns of `per_turn` timed calls. This machine's speed drifts over seconds; taking turns gives every
    function the same drift, so the ratios hold where separately timed medians can be 1.5x apart. Each
    turn starts with an untimed call: PyTorch's OpenMP threads spin for a while after their work and
    would slow the next function's first call."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    while len(times[0]) < iters:
        for fn, samples in zip(fns, times):
            fn()
            for _ in range(min(per_turn, iters - len(samples))):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


@functools.cache
def jax_compile_phases() -> dict:
    """{jitted function's name: {phase: seconds}} of every compile from the first call of this on, as JAX times
    its phases: "trace" (Python to jaxpr), "lowering" (to MLIR) and "XLA" (the backend's compile)."""
    from jax._src import monitoring

    phases = collections.defaultdict(lambda: collections.defaultdict(float))
    names = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lowering",
             "backend_compile_duration": "XLA"}

    def on_duration(event, seconds, **kwargs):
        phase = names.get(event.rsplit("/", 1)[-1])
        if phase is not None:
            name = kwargs.get("fun_name", "?")
            phases[name.removeprefix("jit(").removesuffix(")")][phase] += seconds

    monitoring.register_event_duration_secs_listener(on_duration)
    return phases


def static_compiled(model):
    """`torch.compile(model, backend="tpu")` with one program per input shape (`dynamic=False`), as
    `generate()`'s prefill has one per prompt length: the reference forward of time-to-first-token rows. With
    PyTorch's default, the second prompt length is captured again symbolically (about 40 s of Dynamo on the
    v5e's host)."""
    import torch

    return torch.compile(model, backend="tpu", dynamic=False)


def tiny_llama(layers: int = 4, hidden: int = 256, vocab: int = 1000):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=vocab,
                         max_position_embeddings=512)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def table(headers, rows) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(r, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])
