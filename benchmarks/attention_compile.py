"""What one attention call costs XLA's compile: the splash kernel against plain XLA attention, 1 and 16 calls.

    python -m benchmarks.attention_compile [--json FILE]

A program holding one causal attention call (Llama-1.1B shapes: 32 query / 8 key-value heads, head_dim 64,
1024 tokens, bfloat16) and one chaining 16 of them, as a 16-layer model's forward does, at batch 1 and 8:
the seconds `jax.jit(...).lower()` and `.compile()` take, and the best of 5 calls per attention. `kernel` is
`hf_tpu.kernels.flash_attention` (splash attention, compiled by Mosaic); `xla` a grouped-query attention
over the whole score matrix that XLA fuses (no key repeat, float32 scores). It answers whether the kernels'
Mosaic compiles explain why XLA's compile of hf-tpu's compiled forward takes longer than torchax's.

Off a TPU the shapes are tiny and the kernel runs in Pallas interpret mode: a check that the script
works, not a measurement.
"""

from __future__ import annotations

import argparse


def _xla_attention(q, k, v):
    import jax
    import jax.numpy as jnp

    batch, heads, length, head_dim = q.shape
    groups = heads // k.shape[1]
    grouped = q.reshape(batch, k.shape[1], groups, length, head_dim)
    scores = jnp.einsum("bhgqd,bhkd->bhgqk", grouped, k, preferred_element_type=jnp.float32) / head_dim ** 0.5
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(q.dtype)
    out = jnp.einsum("bhgqk,bhkd->bhgqd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(batch, heads, length, head_dim)


def _kernel_attention(q, k, v):
    from hf_tpu.kernels import flash_attention

    return flash_attention.flash_attention(q, k, v, scale=q.shape[-1] ** -0.5, is_causal=True)


def _chain(attention, calls: int):
    def program(q, k, v):
        for _ in range(calls):
            q = attention(q, k, v) + q
        return q

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
    heads, kv_heads, length = (4, 2, 128) if tiny else (32, 8, 1024)
    rows = {}
    for batch in (1, 8):
        q = jnp.ones((batch, heads, length, 64), jnp.bfloat16)
        kv = jnp.ones((batch, kv_heads, length, 64), jnp.bfloat16)
        for name, attention in (("kernel", _kernel_attention), ("xla", _xla_attention)):
            for calls in (1, 16):
                row = compile_timings(jax.jit(_chain(attention, calls)), (q, kv, kv))
                rows[f"b{batch} {name} x{calls}"] = dict(row, ms=row["ms"] / calls)
    report_compile_timings(f"backend {jax.default_backend()}, causal attention {heads}/{kv_heads} heads, {length} "
                           f"tokens{' (tiny shapes, kernel interpreted)' if tiny else ''}", "program", "attention",
                           rows, args.json)


if __name__ == "__main__":
    main()
