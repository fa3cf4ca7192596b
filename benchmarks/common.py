"""Shared helpers for the benchmark scripts: timing, tiny models, and table printing."""

from __future__ import annotations

import collections
import functools
import statistics
import time

import torch


def timeit(fn, warmup: int = 3, iters: int = 20, clock=time.perf_counter) -> float:
    """Median seconds per call of `fn` after warm-up (fn must sync what it measures). `clock`: wall time by default;
    `time.process_time` counts the CPU time of the process's threads, which other processes sharing the machine
    change less."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def timeit_alternating(fns, warmup: int = 1, iters: int = 20, per_turn: int = 3, clock=time.perf_counter) -> list:
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
                start = clock()
                fn()
                samples.append(clock() - start)
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


def compile_timings(jitted, args: tuple, feed=None, calls: int = 5) -> dict:
    """{"trace": seconds of trace and lowering, "compile": seconds of XLA's compile, "ms": the best of `calls`
    calls after a first} of the jitted JAX function on `args`. `feed(result, args)` gives each next call's
    arguments (a program that donates its inputs takes back its outputs); by default the same. XLA compiles
    with the disk cache off (`HF_TPU_CACHE_DIR`): a second run would time a load from it instead."""
    import jax

    start = time.perf_counter()
    lowered = jitted.lower(*args)
    lowered_at = time.perf_counter()
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        compiled = lowered.compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    compiled_at = time.perf_counter()
    times = []
    for _ in range(calls + 1):
        call_start = time.perf_counter()
        result = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - call_start)
        if feed is not None:
            args = feed(result, args)
    return dict(trace=lowered_at - start, compile=compiled_at - lowered_at, ms=min(times[1:]) * 1e3)


def report_compile_timings(title: str, program: str, per: str, rows: dict, json_path: str | None) -> None:
    """Print `compile_timings` rows ({name: row}) under `title`, and write them to `json_path` if given."""
    import json

    print(title)
    print(table([program, "trace + lowering s", "XLA compile s", f"ms per {per}"],
                [[name, f"{r['trace']:.2f}", f"{r['compile']:.2f}", f"{r['ms']:.3f}"] for name, r in rows.items()]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f)


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
