"""The Pallas kernels against the XLA lowerings they replace, side by side, in raw JAX.

    python -m benchmarks.kernels_on_chip [--json FILE] [--block 512] [--tiling 128,512,512] [--tiny]

On a TPU: Llama-1.1B attention shapes (32 query / 8 key-value heads, head_dim 64, bfloat16, causal) at
batch 1 and 8 and 1024 and 4096 tokens, the forward (and forward plus backward) of

- `xla_full`: SDPA's fused-op lowering (`hf_tpu.ops.attention._attention`: the whole score matrix in
  float32, keys repeated per query head as a model's `repeat_kv` does),
- `xla_scan`: hf_tpu's own op's lowering (`_blocked_attention`, a scan over 512-key blocks),
- `pallas`: the splash attention kernel (`hf_tpu.kernels.flash_attention`);
- `pallas_keys`: the same kernel given a padding mask that hides no key (its hidden-keys form, splash's key
  segment ids), which the compiled forward at 8x1024 ran 7% faster with than without (v5e, 2026-12-05);

decode attention (one query against a 4096-slot cache, half filled) through the scan and through JAX's
`paged_attention` kernel (cache already in its page layout: the kernel's best case); and Qwen3-MoE-like
grouped products (128 experts, top-8, hidden 2048, expert width 768) through megablox `gmm` and
`lax.ragged_dot`. Every case runs in its own try/except, so one failure prints its error and the rest run.

Elsewhere (or with `--tiny`) the same cases run with tiny shapes, the Pallas kernels in interpret mode:
a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON ('-' for stdout)")
    parser.add_argument("--block", type=int, default=None, help="attention kernel block (HF_TPU_KERNEL_BLOCK)")
    parser.add_argument("--tiling", default=None, help="gmm tiles as rows,k,n (default: the kernel module's)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the default off a TPU)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per case")
    return parser.parse_args(argv)


def _time(fn, *args, iters):
    """Median milliseconds per call of the jitted `fn` after one warm-up (which compiles)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def _attention_cases(tiny):
    if tiny:
        return [dict(batch=1, heads=4, kv_heads=2, length=256, head_dim=64)]
    return [dict(batch=b, heads=32, kv_heads=8, length=n, head_dim=64) for b in (1, 8) for n in (1024, 4096)]


def _attention_rows(tiny, block, iters):
    import jax
    import jax.numpy as jnp

    from hf_tpu.kernels import flash_attention as kernel
    from hf_tpu.ops import attention as lowering

    rows = []
    for case in _attention_cases(tiny):
        b, h, kvh, n, d = case["batch"], case["heads"], case["kv_heads"], case["length"], case["head_dim"]
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (b, h, n, d), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, kvh, n, d), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, kvh, n, d), jnp.bfloat16)
        scale = d ** -0.5

        def xla_full(q, k, v):
            groups = h // kvh
            k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
            f32 = jnp.float32  # as the lowering's `_opmath` upcasts
            out, _ = lowering._attention(q.astype(f32), k.astype(f32), v.astype(f32), None, True, scale)
            return out.astype(q.dtype)

        def xla_scan(q, k, v):
            out, _ = lowering._blocked_attention(q, k, v, None, scale, True, 0, 0.0)
            return lowering._heads_first(out).astype(q.dtype)

        def pallas(q, k, v):
            return kernel.flash_attention(q, k, v, scale=scale, is_causal=True, block=block)

        every_key = jnp.ones((b, 1, 1, n), jnp.bool_)

        def pallas_keys(q, k, v):
            # the same attention through the kernel's hidden-keys form (a padding mask, every key seen: splash's
            # key segment ids), which a compiled forward ran while Transformers' causal mask was still passed
            return kernel.flash_attention(q, k, v, every_key, scale=scale, is_causal=True, block=block)

        forms = (xla_full, xla_scan, pallas, pallas_keys)
        for label, fns in (("forward", forms), ("fwd+bwd", forms)):
            times = {}
            for fn in fns:
                try:
                    if label == "forward":
                        timed = jax.jit(fn)
                    elif fn in (pallas, pallas_keys):  # the kernel's backward, as hf_tpu's backward lowerings call it
                        mask = every_key if fn is pallas_keys else None
                        timed = jax.jit(lambda q, k, v, mask=mask: kernel.gradients(
                            jnp.ones_like(q), q, k, v, mask, scale=scale, is_causal=True, block=block))
                    else:
                        timed = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1](jnp.ones_like(q)))
                    times[fn.__name__] = _time(timed, q, k, v, iters=iters)
                except Exception as e:  # noqa: BLE001 - report and go on to the next case
                    times[fn.__name__] = None
                    print(f"attention {label} {fn.__name__} b={b} n={n}: {type(e).__name__}: {e}", file=sys.stderr)
                    traceback.print_exc(limit=3)
            rows.append(dict(kernel="attention", case=f"{label} b{b} n{n} h{h}/{kvh} d{d}", **times))
    return rows


def _decode_rows(tiny, iters):
    """One query per sequence against a (batch, kv_heads, 4096, head_dim) static cache, half filled."""
    import jax
    import jax.numpy as jnp

    from hf_tpu.ops import attention as lowering

    rows = []
    cases = [(1, 4, 2, 256, 64)] if tiny else [(1, 32, 8, 4096, 64), (8, 32, 8, 4096, 64)]
    for b, h, kvh, max_len, d in cases:
        keys = jax.random.split(jax.random.key(1), 3)
        q = jax.random.normal(keys[0], (b, h, 1, d), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, kvh, max_len, d), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, kvh, max_len, d), jnp.bfloat16)
        lengths = jnp.full((b,), max_len // 2, jnp.int32)
        mask = (jnp.arange(max_len)[None, :] < lengths[:, None])[:, None, None, :]
        times = {}

        def xla_scan(q, k, v, mask):
            out, _ = lowering._blocked_attention(q, k, v, mask, d ** -0.5, False, 0, 0.0)
            return lowering._heads_first(out).astype(q.dtype)

        try:
            times["xla_scan"] = _time(jax.jit(xla_scan), q, k, v, mask, iters=iters)
        except Exception as e:  # noqa: BLE001
            times["xla_scan"] = None
            print(f"decode xla_scan b={b}: {type(e).__name__}: {e}", file=sys.stderr)
        try:
            if jax.default_backend() != "tpu":
                raise RuntimeError("paged_attention has no interpret mode: it runs on a TPU only")
            from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

            page = 128
            pages = max_len // page
            # (kv_heads, batch * pages, page, head_dim): the layout the kernel reads, made outside the timing
            k_pages = k.transpose(1, 0, 2, 3).reshape(kvh, b * pages, page, d)
            v_pages = v.transpose(1, 0, 2, 3).reshape(kvh, b * pages, page, d)
            page_indices = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)

            def paged(q, k_pages, v_pages, lengths, page_indices):
                with jax.enable_x64(False):
                    return paged_attention(q[:, :, 0] * jnp.asarray(d ** -0.5, q.dtype), k_pages, v_pages, lengths,
                                           page_indices, pages_per_compute_block=8)

            times["pallas_paged"] = _time(jax.jit(paged), q, k_pages, v_pages, lengths, page_indices, iters=iters)
        except Exception as e:  # noqa: BLE001
            times["pallas_paged"] = None
            print(f"decode pallas_paged b={b}: {type(e).__name__}: {e}", file=sys.stderr)
        rows.append(dict(kernel="decode attention", case=f"b{b} cache{max_len} (half full) h{h}/{kvh} d{d}", **times))
    return rows


def _gmm_rows(tiny, tiling, iters):
    import jax
    import jax.numpy as jnp

    from hf_tpu.kernels import grouped_matmul as kernel
    from hf_tpu.ops import products

    rows = []
    if tiny:
        cases = [(16, 2, 8, 128, 128)]
    else:  # tokens, top-k, experts, hidden, expert width: decode at batch 64 and a 2048-token prefill
        cases = [(64, 8, 128, 2048, 768), (2048, 8, 128, 2048, 768)]
    for tokens, top_k, experts, hidden, width in cases:
        m = tokens * top_k
        rng = np.random.default_rng(0)
        choices = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
        sizes = jnp.asarray(np.bincount(choices.ravel(), minlength=experts), jnp.int32)
        keys = jax.random.split(jax.random.key(2), 3)
        x = jax.random.normal(keys[0], (m, hidden), jnp.bfloat16)
        gate_up = jax.random.normal(keys[1], (experts, hidden, 2 * width), jnp.bfloat16) * 0.02
        down = jax.random.normal(keys[2], (experts, width, hidden), jnp.bfloat16) * 0.02
        for name, w, lhs in (("gate_up", gate_up, x), ("down", down, x[:, :width])):
            def ragged(lhs, w, sizes):
                return products._ragged_dot(lhs, w, sizes, 0, [0], ((1,), (1,))).astype(lhs.dtype)

            def megablox(lhs, w, sizes):
                return kernel.gmm(lhs, w, sizes, tiling=tiling)

            times = {}
            for fn in (ragged, megablox):
                try:
                    times[fn.__name__] = _time(jax.jit(fn), lhs, w, sizes, iters=iters)
                except Exception as e:  # noqa: BLE001
                    times[fn.__name__] = None
                    print(f"gmm {name} {fn.__name__} m={m}: {type(e).__name__}: {e}", file=sys.stderr)
                    traceback.print_exc(limit=3)
            rows.append(dict(kernel="grouped matmul", case=f"{name} {tokens}tok x top{top_k} -> {experts} experts "
                                                           f"({lhs.shape[1]}x{w.shape[2]})", **times))
    return rows


def _ratio(row, baseline, candidate):
    if row.get(baseline) and row.get(candidate):
        return f"{row[baseline] / row[candidate]:.2f}x"
    return "-"


def _fmt(ms):
    return "failed" if ms is None else f"{ms:.3f}"


def main(argv=None) -> int:
    args = _parse(argv)
    if args.block:
        os.environ["HF_TPU_KERNEL_BLOCK"] = str(args.block)
    import jax

    import hf_tpu  # noqa: F401 - JAX's configuration (x64) as hf_tpu runs it
    from benchmarks.common import table

    on_tpu = jax.default_backend() == "tpu"
    tiny = args.tiny or not on_tpu
    iters = args.iters or (2 if tiny else 20)
    tiling = tuple(int(t) for t in args.tiling.split(",")) if args.tiling else None
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}, "
          f"{'tiny shapes, Pallas in interpret mode' if tiny else 'full shapes'}; median ms of {iters} calls")

    rows = _attention_rows(tiny, args.block, iters) + _decode_rows(tiny, iters) + _gmm_rows(tiny, tiling, iters)

    attention = [r for r in rows if r["kernel"] == "attention"]
    print()
    print(table(["attention (bf16, causal)", "xla_full", "xla_scan", "pallas", "pallas_keys", "full/pallas",
                 "scan/pallas", "keys/pallas"],
                [[r["case"], _fmt(r["xla_full"]), _fmt(r["xla_scan"]), _fmt(r["pallas"]), _fmt(r["pallas_keys"]),
                  _ratio(r, "xla_full", "pallas"), _ratio(r, "xla_scan", "pallas"), _ratio(r, "pallas_keys", "pallas")]
                 for r in attention]))
    decode = [r for r in rows if r["kernel"] == "decode attention"]
    print()
    print(table(["decode attention (bf16)", "xla_scan", "pallas_paged", "scan/paged"],
                [[r["case"], _fmt(r["xla_scan"]), _fmt(r["pallas_paged"]), _ratio(r, "xla_scan", "pallas_paged")]
                 for r in decode]))
    grouped = [r for r in rows if r["kernel"] == "grouped matmul"]
    print()
    print(table(["grouped matmul (bf16)", "ragged_dot", "megablox", "ragged/megablox"],
                [[r["case"], _fmt(r["ragged"]), _fmt(r["megablox"]), _ratio(r, "ragged", "megablox")]
                 for r in grouped]))
    print("\nratios above 1 mean the Pallas kernel is faster")
    if args.json:
        text = json.dumps(dict(backend=jax.default_backend(), tiny=tiny, block=args.block, tiling=tiling, rows=rows),
                          indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
