"""Forms of a Llama model's linear layers side by side, in raw JAX: what decides the layout XLA gives the
residual stream on a TPU.

    python -m benchmarks.linear_layouts [--shapes 8x1024,1x1024] [--json FILE] [--layers 4] [--tiny]

Each row runs the 1.1B model's embedding lookup, `--layers` whole layers (RMSNorm, q/k/v projections, rotary
embeddings, splash attention, output projection, SwiGLU MLP, residual adds, each op rounded to bfloat16 as
PyTorch rounds it) and the vocabulary projection at each of `--shapes` (batch x tokens, by default 8x1024), with
every linear layer in one form:

- `flattened`: the input flattened to (tokens, features), a float32 product rounded to bfloat16: the program
  the compiled forward gave Transformers' `nn.Linear` (`view`, `mm`, `view`) before 2026-12-06;
- `in_shape`: the same product contracted in the input's own (batch, tokens, features) shape;
- `bfloat16_product`: in the input's shape, the product asked for in bfloat16 (XLA's default, torchax's
  form), which rounds where XLA chooses.

Besides each row's time, the layout of the residual stream: how many of the program's (tokens, hidden) arrays
XLA lays out token-minor. Where `in_shape` and `bfloat16_product` change places between shapes is where
`hf_tpu.ops.products._BFLOAT16_PRODUCT_ROWS` belongs (on the v5e the whole model's forward was faster with float32
products at 1x1024 and with bfloat16 ones at 8x1024, 2026-12-06). Elsewhere (or with `--tiny`) the model's
dims are tiny and the kernel runs in interpret mode: a check that the script works, not a measurement.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time

from benchmarks import raw_forms


def _forms():
    """name -> linear(x [..., in], w [out, in]) -> [..., out] in bfloat16."""
    import jax.numpy as jnp
    from jax import lax

    def product(x, w, dtype, precision=lax.Precision.HIGHEST):  # hf-tpu's precision: PyTorch's default "highest"
        return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=dtype)

    def flattened(x, w):
        return product(x.reshape(-1, x.shape[-1]), w, jnp.float32).astype(jnp.bfloat16).reshape(*x.shape[:-1], -1)

    def in_shape(x, w):
        return product(x, w, jnp.float32).astype(jnp.bfloat16)

    def bfloat16_product(x, w):
        return product(x, w, jnp.bfloat16, lax.Precision.DEFAULT)

    return dict(flattened=flattened, in_shape=in_shape, bfloat16_product=bfloat16_product)


def main(argv=None):
    args = raw_forms.parse(argv, __doc__, "layers", iters=10, shapes="8x1024")
    import jax

    tiny = args.tiny or jax.devices()[0].platform != "tpu"
    results = [dict(shape=[batch, length], rows=_rows(args, batch, length, tiny))
               for batch, length in args.shapes or ([(1, 128)] if tiny else [(8, 1024)])]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(layers=args.layers, tiny=tiny, shapes=results), f, indent=1)


def _rows(args, batch: int, length: int, tiny: bool) -> list:
    """Every form's row at `batch` x `length`, printed as a table."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from hf_tpu.kernels.flash_attention import flash_attention

    heads, kv_heads, head_dim, hidden, intermediate, vocab = (
        (4, 2, 64, 256, 512, 1000) if tiny else (32, 8, 64, 2048, 8192, 32000))

    def up(x):
        return x.astype(jnp.float32)

    def down(x):
        return x.astype(jnp.bfloat16)

    def norm(x, weight):
        x = up(x)
        return down(up(weight) * up(down(x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6))))

    def rope(projection, n, cos, sin):
        q = lax.optimization_barrier(projection.reshape(batch, length, n, head_dim).transpose(0, 2, 1, 3))
        low, high = q[..., :head_dim // 2], q[..., head_dim // 2:]
        rotated = jnp.concatenate([down(-up(high)), low], -1)
        return down(up(down(up(q) * cos)) + up(down(up(rotated) * sin)))

    def model(linear, ids, table, layers, final, head, cos, sin):
        x = table[ids]
        for n1, wq, wk, wv, wo, n2, wg, wu, wd in layers:
            h = norm(x, n1)
            q, k = rope(linear(h, wq), heads, cos, sin), rope(linear(h, wk), kv_heads, cos, sin)
            v = linear(h, wv).reshape(batch, length, kv_heads, head_dim).transpose(0, 2, 1, 3)
            out = flash_attention(q, k, v, scale=head_dim ** -0.5, is_causal=True)
            x = down(up(x) + up(linear(out.transpose(0, 2, 1, 3).reshape(batch, length, heads * head_dim), wo)))
            h = norm(x, n2)
            act = down(up(down(jax.nn.silu(up(linear(h, wg))))) * up(linear(h, wu)))
            x = down(up(x) + up(linear(act, wd)))
        return linear(norm(x, final), head)

    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16 * args.layers + 4))

    def weight(*shape):
        return jax.random.normal(next(keys), shape, jnp.bfloat16) * 0.02

    ones = jnp.ones(hidden, jnp.bfloat16)
    layers = [(ones, weight(heads * head_dim, hidden), weight(kv_heads * head_dim, hidden),
               weight(kv_heads * head_dim, hidden), weight(hidden, heads * head_dim), ones,
               weight(intermediate, hidden), weight(intermediate, hidden), weight(hidden, intermediate))
              for _ in range(args.layers)]
    ids = jax.random.randint(next(keys), (batch, length), 0, vocab)
    cos, sin = raw_forms.rotary_cos_sin(length, head_dim)
    inputs = (ids, weight(vocab, hidden), layers, ones, weight(vocab, hidden), cos, sin)
    token_minor = re.compile(rf"bf16\[{batch * length},{hidden}\]\{{0,1|bf16\[{batch},{length},{hidden}\]\{{1,2,0")

    compiled, extra = {}, {}
    for name, linear in _forms().items():
        start = time.perf_counter()
        compiled[name] = jax.jit(lambda *a, linear=linear: model(linear, *a)).lower(*inputs).compile()
        extra[name] = dict(compile_s=time.perf_counter() - start,
                           token_minor=len(token_minor.findall(compiled[name].as_text() or "")))
    rows = raw_forms.time_forms({name: functools.partial(program, *inputs) for name, program in compiled.items()},
                                args.iters)
    rows = [{**row, **extra[row["form"]]} for row in rows]

    base = rows[0]["ms"]
    print(f"{args.layers} layers and the vocabulary projection at {batch}x{length} on {jax.devices()[0].device_kind}"
          f"{' (tiny, interpret mode: not a measurement)' if tiny else ''}")
    print(f"{'form':18s} {'ms':>9s} {'vs flattened':>12s} {'compile s':>9s} {'token-minor arrays':>18s} "
          f"{'max |out - flattened|':>21s}")
    for row in rows:
        print(f"{row['form']:18s} {row['ms']:9.3f} {row['ms'] / base:11.2f}x {row['compile_s']:9.1f} "
              f"{row['token_minor']:18d} {row['max_diff']:21.3g}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
