"""Causal prefill attention in Pallas in nine layouts, against splash attention: is a kernel of our own faster?

    python -m benchmarks.attention_layouts [--lengths 1024,4096] [--json FILE]

hf-tpu's prefill attention is JAX's splash kernel (`hf_tpu.kernels.flash_attention`). At the 1.1B Llama's
shapes (32 query / 8 key-value heads, head_dim 64, bfloat16) it runs 1x1024's causal products at about a
fifth of the chip's matrix rate, and it is the one cost of the compiled forward that is not the chip's
(docs/design/compiled-forward-on-tpu.md). This script holds a forward kernel written here, with the choices
splash makes differently as switches, and times each form against splash in one run (16 chained calls,
as a 16-layer forward makes, median of 20 calls of the program):

- `transposed`: scores held (keys, queries), `k @ q.T`, so the softmax's max and sum reduce along sublanes
  and the running statistics of 128 queries fill one register row; False holds (queries, keys) as splash.
  The transposed form gives the output transposed, `v.T @ p`; `values_transposed` hands it `v.T` from XLA
  (a plain product) instead of a product over the values' first axis, and `output_transposed` writes
  (head_dim, queries) for XLA to turn back instead of turning each head's block in the kernel.
- `stacked`: the query heads that share a key/value head side by side in one product (wide products, one
  read of each key block); False loops over them within the step. `heads_per_step` below the group size
  splits them over the grid instead.
- `base2`: log2(e) folded into the queries' scale and `exp2` for `exp`.
- The probabilities enter the values' product in bfloat16, one pass of the matrix unit (splash casts the
  values to float32 instead); a causal block of queries runs its key chunks below the diagonal unmasked,
  those on it masked, those above not at all.
- `block_q`, `block_kv`: the query block of a grid step and the key chunk of its loop.

splash runs as hf-tpu calls it (512-blocks) and with smaller compute chunks (`block_kv_compute`). Each row
states the largest difference from the float32 reference. Off a TPU the shapes are tiny and every kernel
runs in Pallas interpret mode: a check that the script and its kernels work, not a measurement.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# a finite stand-in for -inf, as splash's: exp(mask - max) is exactly 0 once any key is seen
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = 1.4426950408889634

TRANSPOSED_BY_XLA = dict(values_transposed=True, output_transposed=True)
LAYOUTS = {
    "transposed, stacked": dict(),
    "transposed, stacked, v.T and out.T by XLA": TRANSPOSED_BY_XLA,
    "transposed, stacked, v.T and out.T by XLA, exp2": dict(TRANSPOSED_BY_XLA, base2=True),
    "transposed, stacked, v.T and out.T by XLA, exp2, key chunks 128": dict(TRANSPOSED_BY_XLA, base2=True,
                                                                            block_kv=128),
    "transposed, stacked, query blocks 512": dict(block_q=512),
    "transposed, heads looped in the step, v.T and out.T by XLA, exp2": dict(TRANSPOSED_BY_XLA, base2=True,
                                                                             stacked=False),
    "transposed, one head a grid step": dict(heads_per_step=1),
    "queries by keys (splash's), stacked, exp2": dict(transposed=False, base2=True),
    "queries by keys (splash's), stacked, exp2, key chunks 512": dict(transposed=False, base2=True, block_kv=512),
}
# splash's (block_q, block_kv, block_kv_compute); hf-tpu's own call is the first
SPLASH_BLOCKS = [(512, 512, 512), (512, 512, 256), (1024, 1024, 256)]


def _kernel(q_ref, k_ref, v_ref, o_ref, *, block_q, block_kv, heads, scale, transposed, stacked, base2,
            values_transposed, output_transposed):
    head_dim = q_ref.shape[-1]
    first_query = pl.program_id(2) * block_q
    last_chunk = (first_query + block_q - 1) // block_kv + 1  # chunks [0, last_chunk) hold keys these queries see
    unmasked = (first_query + 1) // block_kv  # chunks [0, unmasked) every query sees whole
    power = jnp.exp2 if base2 else jnp.exp
    tiles = [tuple(range(heads))] if stacked else [(head,) for head in range(heads)]
    width = len(tiles[0]) * block_q
    keys_axis = 0 if transposed else 1
    shape = (block_kv, width) if transposed else (width, block_kv)
    # key position minus query position within a chunk, less (start - first_query); computed once
    relative = (jax.lax.broadcasted_iota(jnp.int32, shape, keys_axis)
                - jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, shape, 1 - keys_axis), block_q))

    for tile in tiles:
        queries = q_ref[0, tile[0]:tile[-1] + 1].reshape(width, head_dim)
        queries = (queries.astype(jnp.float32) * (scale * (LOG2E if base2 else 1.0))).astype(q_ref.dtype)

        def step(chunk, carry, masked, queries=queries):
            running_max, running_sum, acc = carry
            start = pl.multiple_of(chunk * block_kv, block_kv)
            keys = k_ref[0, 0, pl.ds(start, block_kv), :]
            pair = (keys, queries) if transposed else (queries, keys)
            scores = jax.lax.dot_general(*pair, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            if masked:
                scores = jnp.where(relative <= first_query - start, scores, MASK_VALUE)
            new_max = jnp.maximum(running_max, scores.max(axis=keys_axis, keepdims=True))
            probs = power(scores - new_max)
            rescale = power(running_max - new_max)
            running_sum = rescale * running_sum + probs.sum(axis=keys_axis, keepdims=True)
            probs = probs.astype(v_ref.dtype)
            if values_transposed:
                product = jnp.dot(v_ref[0, 0, :, pl.ds(start, block_kv)], probs, preferred_element_type=jnp.float32)
            else:
                values = v_ref[0, 0, pl.ds(start, block_kv), :]
                pair, contracted = ((values, probs), 0) if transposed else ((probs, values), 1)
                product = jax.lax.dot_general(*pair, (((contracted,), (0,)), ((), ())),
                                              preferred_element_type=jnp.float32)
            return new_max, running_sum, rescale * acc + product

        stats = (1, width) if transposed else (width, 1)
        carry = (jnp.full(stats, MASK_VALUE, jnp.float32), jnp.zeros(stats, jnp.float32),
                 jnp.zeros((head_dim, width) if transposed else (width, head_dim), jnp.float32))
        carry = jax.lax.fori_loop(0, unmasked, functools.partial(step, masked=False), carry)
        _, running_sum, acc = jax.lax.fori_loop(unmasked, last_chunk, functools.partial(step, masked=True), carry)
        out = acc / running_sum  # (head_dim, width) transposed, else (width, head_dim)
        for i, head in enumerate(tile):
            part = slice(i * block_q, (i + 1) * block_q)
            if not transposed:
                o_ref[0, head] = out[part].astype(o_ref.dtype)
            else:
                o_ref[0, head] = (out[:, part] if output_transposed else out[:, part].T).astype(o_ref.dtype)


def causal_attention(query, key, value, *, block_q=256, block_kv=256, transposed=True, stacked=True,
                     heads_per_step=None, base2=False, values_transposed=False, output_transposed=False,
                     interpret=False):
    """Causal attention of (batch, heads, length, head_dim) bfloat16 queries over (batch, kv_heads, length,
    head_dim) keys and values, scaled by head_dim ** -0.5, in the layout the switches choose."""
    batch, num_heads, length, head_dim = query.shape
    groups = num_heads // key.shape[1]
    heads = heads_per_step or groups
    values_transposed &= transposed
    output_transposed &= transposed
    if values_transposed:
        value = jnp.swapaxes(value, 2, 3)
    value_block = (1, 1, head_dim, length) if values_transposed else (1, 1, length, head_dim)
    out_shape, out_block = query.shape, (1, heads, block_q, head_dim)
    if output_transposed:
        out_shape, out_block = (batch, num_heads, head_dim, length), (1, heads, head_dim, block_q)

    def kv_index(b, h, i):
        return (b, h * heads // groups, 0, 0)

    kernel = functools.partial(_kernel, block_q=block_q, block_kv=block_kv, heads=heads, scale=head_dim ** -0.5,
                               transposed=transposed, stacked=stacked, base2=base2,
                               values_transposed=values_transposed, output_transposed=output_transposed)
    out = pl.pallas_call(
        kernel,
        grid=(batch, num_heads // heads, length // block_q),
        in_specs=[pl.BlockSpec((1, heads, block_q, head_dim), lambda b, h, i: (b, h, i, 0)),
                  pl.BlockSpec((1, 1, length, head_dim), kv_index),
                  pl.BlockSpec(value_block, kv_index)],
        out_specs=pl.BlockSpec(out_block, (lambda b, h, i: (b, h, 0, i)) if output_transposed
                               else (lambda b, h, i: (b, h, i, 0))),
        out_shape=jax.ShapeDtypeStruct(out_shape, query.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(query, key, value)
    return jnp.swapaxes(out, 2, 3) if output_transposed else out


def splash_attention(query, key, value, *, blocks, interpret=False):
    """The same attention through splash with (block_q, block_kv, block_kv_compute) `blocks`."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    heads, length = query.shape[1], query.shape[2]
    block_q, block_kv, compute = blocks
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([splash.CausalMask((length, length))] * heads),
        block_sizes=splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=compute),
        head_shards=1, q_seq_shards=1, interpret=interpret)
    scaled = (query.astype(jnp.float32) * query.shape[-1] ** -0.5).astype(query.dtype)
    return jax.vmap(kernel)(scaled, key, value)


def _chained(attention, calls):
    def program(query, key, value):
        for _ in range(calls):
            query = attention(query, key, value)
        return query

    return jax.jit(program)


def measure(length, heads, kv_heads, calls, iters, tiny):
    """Rows (name, ms for `calls` chained calls, largest difference from the reference) at one length."""
    from benchmarks.common import timeit
    from hf_tpu.kernels import flash_attention

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    query, key, value = (jax.random.normal(k, (1, n, length, 64), jnp.float32).astype(jnp.bfloat16)
                         for k, n in zip(keys, (heads, kv_heads, kv_heads)))
    reference = flash_attention.reference(query, key, value, scale=0.125, is_causal=True).astype(jnp.float32)
    forms = {f"splash {b[0]}/{b[1]}/{b[2]}": functools.partial(splash_attention, blocks=b, interpret=tiny)
             for b in ([(128, 128, 128)] if tiny else SPLASH_BLOCKS)}
    for name, switches in LAYOUTS.items():
        if tiny:  # blocks no longer than the tiny length
            switches = {k: (min(v, 128) if k.startswith("block") else v) for k, v in switches.items()}
            switches = dict({"block_q": 128, "block_kv": 128}, **switches)
        forms[name] = functools.partial(causal_attention, interpret=tiny, **switches)
    rows = []
    for name, attention in forms.items():
        with jax.enable_x64(False):  # splash's index maps expect JAX's 32-bit default
            program = _chained(attention, calls)
            ms = timeit(lambda: jax.block_until_ready(program(query, key, value)), warmup=1, iters=iters) * 1e3
            error = float(jnp.max(jnp.abs(jax.jit(attention)(query, key, value).astype(jnp.float32) - reference)))
        rows.append((name, ms, error))
        print(f"  {length}: {name}: {ms:.3f} ms, largest difference {error:.4f}", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    import hf_tpu  # noqa: F401 - JAX's configuration as hf_tpu runs it
    from benchmarks.common import table

    tiny = jax.default_backend() != "tpu"
    heads, kv_heads, calls, iters = (4, 2, 2, 1) if tiny else (32, 8, 16, 20)
    lengths = [256] if tiny else [int(n) for n in args.lengths.split(",")]
    out, printed = [], []
    for length in lengths:
        rows = measure(length, heads, kv_heads, calls, iters, tiny)
        base = rows[0][1]
        out += [dict(length=length, form=name, ms=ms, largest_difference=error) for name, ms, error in rows]
        printed += [(length, name, f"{ms:.3f}", f"{base / ms:.2f}x", f"{error:.4f}") for name, ms, error in rows]
    print(f"\nbackend {jax.default_backend()}, causal attention, {heads}/{kv_heads} heads, head_dim 64, bfloat16, "
          f"{calls} chained calls{' (tiny shapes, kernels interpreted)' if tiny else ''}")
    print(table(["length", "form", "ms", "speed / first splash row", "largest difference"], printed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
