"""What writing new keys and values into a static KV cache costs XLA: a scatter against a dynamic-update-slice.

    python -m benchmarks.cache_write [--json FILE]

Transformers' `StaticLayer.update` writes each layer's new keys and values with `index_copy_` at the positions
`arange(length) + cumulative_length`, which hf-tpu lowers as XLA does any indexed write: a scatter
(`cache.at[:, :, positions].set(new, mode="drop")`). The positions are contiguous, so one
`lax.dynamic_update_slice` at the first of them writes the same values. Each program here writes all 32
caches of the 1.1B Llama of `benchmarks.chip` (16 layers, keys and values, 8 heads x 64, bfloat16; the caches
donated, as `generate()` donates them), at a traced offset, and is timed both ways: a prefill's write (the
whole prompt) and a decode step's (one position). It answers whether the scatters explain why `generate()`'s
prefill compiles longer than the same forward without a cache (`docs/design/compile-latency.md`), and what
they cost per call.

Off a TPU the shapes are small: a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse

LAYERS, KV_HEADS, HEAD_DIM = 16, 8, 64


def _scatter(cache, new, start):
    import jax.numpy as jnp

    positions = jnp.arange(new.shape[2]) + start
    return cache.at[:, :, positions].set(new, mode="drop")


def _update_slice(cache, new, start):
    from jax import lax

    return lax.dynamic_update_slice_in_dim(cache, new, start, axis=2)


def _writes(write):
    """A program writing `new` into every cache at `start`; returns the caches and a value that reads them
    (so that the writes are not dead)."""
    def program(caches, new, start):
        caches = [write(cache, new, start) for cache in caches]
        return caches, sum(cache[:, :, :1].astype("float32").sum() for cache in caches)

    return program


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    import jax
    import jax.numpy as jnp

    import hf_tpu  # noqa: F401 - JAX's configuration as hf_tpu runs it
    from benchmarks.common import compile_timings, report_compile_timings

    tiny = jax.default_backend() != "tpu"
    layers = 2 if tiny else LAYERS
    # (what, batch, cache length, positions written)
    cases = [("prefill", 1, 256, 128), ("decode", 1, 256, 1), ("decode", 64, 256, 1)]
    if not tiny:
        cases.insert(1, ("prefill", 1, 4096 + 256, 4096))
    rows = {}
    for what, batch, cache_length, written in cases:
        for name, write in (("scatter", _scatter), ("dynamic_update_slice", _update_slice)):
            shape = (batch, KV_HEADS, cache_length, HEAD_DIM)
            caches = [jnp.zeros(shape, jnp.bfloat16) for _ in range(2 * layers)]
            new = jnp.ones((batch, KV_HEADS, written, HEAD_DIM), jnp.bfloat16)
            rows[f"{what} b{batch} {written}/{cache_length} {name}"] = compile_timings(
                jax.jit(_writes(write), donate_argnums=(0,)), (caches, new, jnp.int32(0)),
                feed=lambda result, args: (result[0], *args[1:]))  # the donated caches come back
    report_compile_timings(f"backend {jax.default_backend()}, {2 * layers} caches of (batch, {KV_HEADS}, length, "
                           f"{HEAD_DIM}) bfloat16{' (small shapes)' if tiny else ''}",
                           "program (positions written / cache length)", "call", rows, args.json)


if __name__ == "__main__":
    main()
