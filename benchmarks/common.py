"""Shared helpers for the benchmark scripts: timing, tiny models, and table printing."""

from __future__ import annotations

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
