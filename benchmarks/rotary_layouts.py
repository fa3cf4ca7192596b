"""Forms of a Llama layer's rotary embeddings before splash attention, side by side, in raw JAX.

    python -m benchmarks.rotary_layouts [--json FILE] [--layers 4] [--tiny]

Transformers' `apply_rotary_pos_emb` reads q = proj.view(b, s, h, d).transpose(1, 2) whole and as its two
halves (`rotate_half`), each op rounded to bfloat16 as PyTorch does. On a TPU the halves' layout decides how
many copies of q XLA makes before the kernel. Each row runs `--layers` layers of the 1.1B model's attention
block (q/k/v projections, rotary embeddings of q and k, splash attention, output projection) at batch 8 and
1024 tokens, with the rotary embeddings in one form:

- `hf_tpu`: q and its halves read through `hf_tpu.memory.tensor_views.read` from the projection's array, as the
  compiled forward reads them (each half sliced from the transposed array, kept whole behind an optimization
  barrier);
- `each_slice_transposed`: each half sliced from the projection and transposed on its own (the reads before
  2026-12-06);
- `transposed_unkept`: the halves sliced from the transposed q with no barrier, which XLA may fold into each
  consumer again (the reads of commit `f6f9ffd`);
- `rotated_then_transposed`: the rotary embeddings computed in the projection's own order (batch, token, head,
  dim), then transposed once: what rewriting the model's code would give;
- `bfloat16_ops`: torchax's form, the ops in bfloat16 with no explicit rounding;
- `none`: no rotary embeddings, q only transposed (the floor).

The `vs hf_tpu` column is each row's time over `hf_tpu`'s. Elsewhere (or with `--tiny`) the shapes are tiny
and the kernel runs in interpret mode: a check that the script works, not a measurement.
"""

from __future__ import annotations

import functools
import json
import sys

from benchmarks import raw_forms


def _forms(batch, length, head_dim):
    """name -> rope(projection [batch*length, heads*head_dim], heads, cos, sin) -> [batch, heads, length, head_dim]."""
    import jax.numpy as jnp
    import torch

    from hf_tpu.memory import tensor_views

    half = head_dim // 2

    def up(x):
        return x.astype(jnp.float32)

    def down(x):
        return x.astype(jnp.bfloat16)

    def rounded(q, low, high, cos, sin):
        """q * cos + cat(-high, low) * sin, each op rounded to bfloat16 as PyTorch on the CPU rounds it."""
        rotated = jnp.concatenate([down(-up(high)), low], -1)
        return down(up(down(up(q) * cos)) + up(down(up(rotated) * sin)))

    def views(heads):
        """The views `apply_rotary_pos_emb` reads of the projection's buffer: q, its upper and lower half."""
        strides = (length * heads * head_dim, head_dim, heads * head_dim, 1)
        shape, halved = (batch, heads, length, head_dim), (batch, heads, length, half)
        return (tensor_views.View(shape, strides, 0, torch.bfloat16),
                tensor_views.View(halved, strides, half, torch.bfloat16),
                tensor_views.View(halved, strides, 0, torch.bfloat16))

    def transposed(x):
        return x.transpose(0, 2, 1, 3)

    def hf_tpu(projection, heads, cos, sin):
        q, high, low = (tensor_views.read(projection, view) for view in views(heads))
        return rounded(q, low, high, cos, sin)

    def each_slice_transposed(projection, heads, cos, sin):
        base = projection.reshape(batch, length, heads, head_dim)
        return rounded(transposed(base), transposed(base[..., :half]), transposed(base[..., half:]), cos, sin)

    def transposed_unkept(projection, heads, cos, sin):
        q = transposed(projection.reshape(batch, length, heads, head_dim))
        return rounded(q, q[..., :half], q[..., half:], cos, sin)

    def rotated_then_transposed(projection, heads, cos, sin):
        base = projection.reshape(batch, length, heads, head_dim)
        return transposed(rounded(base, base[..., :half], base[..., half:], cos[:, None], sin[:, None]))

    def bfloat16_ops(projection, heads, cos, sin):
        q = transposed(projection.reshape(batch, length, heads, head_dim))
        return q * down(cos) + jnp.concatenate([-q[..., half:], q[..., :half]], -1) * down(sin)

    def none(projection, heads, cos, sin):
        return transposed(projection.reshape(batch, length, heads, head_dim))

    return dict(hf_tpu=hf_tpu, each_slice_transposed=each_slice_transposed, transposed_unkept=transposed_unkept,
                rotated_then_transposed=rotated_then_transposed, bfloat16_ops=bfloat16_ops, none=none)


def main(argv=None):
    args = raw_forms.parse(argv, __doc__, "attention blocks", iters=15)
    import jax
    import jax.numpy as jnp

    from hf_tpu.kernels.flash_attention import flash_attention

    tiny = args.tiny or jax.devices()[0].platform != "tpu"
    batch, length, heads, kv_heads, head_dim, hidden = (1, 128, 4, 2, 64, 256) if tiny else (8, 1024, 32, 8, 64, 2048)
    forms = _forms(batch, length, head_dim)

    def project(x, w):
        return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def blocks(rope, x, weights, cos, sin):
        for wq, wk, wv, wo in weights:
            q, k = rope(project(x, wq), heads, cos, sin), rope(project(x, wk), kv_heads, cos, sin)
            v = project(x, wv).reshape(batch, length, kv_heads, head_dim).transpose(0, 2, 1, 3)
            out = flash_attention(q, k, v, scale=head_dim ** -0.5, is_causal=True)
            x = x + project(out.transpose(0, 2, 1, 3).reshape(batch * length, heads * head_dim), wo)
        return x

    keys = jax.random.split(jax.random.PRNGKey(0), 4 * args.layers + 1)
    x = jax.random.normal(keys[0], (batch * length, hidden), jnp.bfloat16)
    shapes = [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden),
              (hidden, heads * head_dim)]
    weights = [tuple(jax.random.normal(keys[1 + 4 * i + j], shape, jnp.bfloat16) * 0.02 for j, shape in enumerate(shapes))
               for i in range(args.layers)]
    cos, sin = raw_forms.rotary_cos_sin(length, head_dim)
    rows = raw_forms.time_forms(
        {name: functools.partial(jax.jit(lambda x, weights, cos, sin, rope=rope: blocks(rope, x, weights, cos, sin)),
                                 x, weights, cos, sin) for name, rope in forms.items()}, args.iters)

    base = rows[0]["ms"]
    print(f"{args.layers} attention blocks at {batch}x{length} on {jax.devices()[0].device_kind}"
          f"{' (tiny, interpret mode: not a measurement)' if tiny else ''}")
    print(f"{'form':24s} {'ms':>9s} {'vs hf_tpu':>9s} {'first s':>8s} {'max |out - hf_tpu|':>18s}")
    for row in rows:
        print(f"{row['form']:24s} {row['ms']:9.3f} {row['ms'] / base:8.2f}x {row['first_s']:8.1f} {row['max_diff']:18.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=[batch, length], layers=args.layers, tiny=tiny, rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
