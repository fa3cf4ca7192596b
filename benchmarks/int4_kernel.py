"""The int4 Pallas kernel beside XLA's forms: the 1.1B Llama's 16 layers of weight products in raw JAX.

    python -m benchmarks.int4_kernel            # on the chip: the 1.1B's shapes, batch 1 and 8 (about a minute)
    python -m benchmarks.int4_kernel --tiny     # anywhere: tiny shapes, the kernel in Pallas interpret mode off a TPU
    python -m benchmarks.int4_kernel --sweep    # the kernel alone at other tile sizes and stacked-row limits
    python -m benchmarks.int4_kernel --forms "bf16,int8,int8 MXU,int8 transposed" --batches 1   # int8's forms
    python -m benchmarks.int4_kernel --forms "bf16,int8" --fused   # 4 products a layer (qkv, o, gate-up, down), not 7

Each form computes the same chain of products (attention's four projections and the MLP, no LM head) with its
weights held as: "bf16" (a product of bfloat16 weights), "int8" (int8 converted inside the product, then scaled
per row), "int4 XLA" (`hf_tpu::int4_linear`'s XLA form: two products over the packed bytes) and "int4 Pallas"
(`hf_tpu.kernels.int4_matmul`, which the op's lowering picks on a TPU). At one row XLA's TPU compiler rewrites
a product into an elementwise multiply and a reduce on the vector unit, each int8 weight converted to float32 there
(`int8`: about 75% of the HBM's bandwidth on a v5e in generate()); two more int8 forms time the alternatives:
"int8 MXU" (the rows padded to 8, so the product stays a dot on the matrix unit, which reads the int8 operand
itself), "int8 transposed" (the weight stored (in, out): the reduce runs over the sublanes, not across the
lanes) and "int8 split" (the rows as three int8 pieces of a common scale each, times the int8 weight on the int8
matrix unit: no conversion of the weight); "int8 activations" is the prefill's form of int8 activations and weights
(each row quantized, the product on the int8 matrix unit), to time at a prompt's rows (`--batches 8192`). Printed per form and batch: ms per call,
GB/s of the bytes the weights hold (what a call must read at least), and the speed against bf16's. Both int4
forms are checked against the kernel's reference on two of the products first.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

# the 1.1B Llama (TinyLlama's shape); --tiny: a shape the interpret mode runs in seconds
LLAMA_1B = dict(hidden=2048, intermediate=5632, heads=32, kv_heads=4, head_dim=64, layers=16)
TINY = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, layers=2)
FORMS = ("bf16", "int8", "int4 XLA", "int4 Pallas")
INT8_FORMS = ("int8 MXU", "int8 transposed", "int8 split", "int8 activations")


def _shapes(model: dict, fused: bool = False) -> list:
    """(out, in) of one layer's products, as PyTorch's linear layers keep them: q, k, v, o, gate, up, down; `fused`:
    q, k and v as one weight, gate and up as one (qkv, o, gate-up, down)."""
    h, d = model["hidden"], model["head_dim"]
    q, kv, intermediate = model["heads"] * d, model["kv_heads"] * d, model["intermediate"]
    if fused:
        return [(q + 2 * kv, h), (h, q), (2 * intermediate, h), (h, intermediate)]
    return [(q, h), (kv, h), (kv, h), (h, q), (intermediate, h), (intermediate, h), (h, intermediate)]


def _weights(form: str, shape: tuple, key, group: int):
    import jax
    import jax.numpy as jnp

    out_features, in_features = shape
    if form == "bf16":
        return (jax.random.normal(key, shape, jnp.bfloat16) * 0.02,)
    if form in ("int8", "int8 MXU", "int8 split", "int8 activations"):
        return (jax.random.randint(key, shape, -127, 128, jnp.int8), jnp.full((out_features, 1), 1e-3, jnp.bfloat16))
    if form == "int8 transposed":
        return (jax.random.randint(key, shape[::-1], -127, 128, jnp.int8), jnp.full((1, out_features), 1e-3,
                                                                                  jnp.bfloat16))
    groups = (in_features // group, out_features)
    scale_key, zero_key = jax.random.split(jax.random.fold_in(key, 1))
    return (jax.random.randint(key, (out_features, in_features // 2), -128, 128, jnp.int8),
            (jax.random.uniform(scale_key, groups, jnp.float32, 1e-3, 2e-3)).astype(jnp.bfloat16),
            (jax.random.normal(zero_key, groups, jnp.float32) * 1e-3).astype(jnp.bfloat16))


def _product(form: str, group: int, interpret: bool):
    import jax.numpy as jnp

    from hf_tpu.kernels.int4_matmul import int4_matmul
    from hf_tpu.ops.quantized import two_products

    def product(x, w):
        if form == "bf16":
            return x @ w[0].T
        if form == "int8":
            return (x @ w[0].T.astype(x.dtype)) * w[1][:, 0]
        if form == "int8 MXU":  # padded rows: XLA rewrites a product of one row before it drops the padding
            rows = x.shape[0]
            padded = jnp.pad(x, ((0, -rows % 8), (0, 0)))
            return (padded @ w[0].T.astype(x.dtype))[:rows] * w[1][:, 0]
        if form == "int8 transposed":
            return (x @ w[0].astype(x.dtype)) * w[1][0]
        if form == "int8 split":
            return _split_activation_product(x, *w)
        if form == "int8 activations":
            return _int8_activation_product(x, *w)
        if form == "int4 XLA":
            return two_products(x, *w, group)
        return int4_matmul(x, *w, group, interpret=interpret)

    return product


def _split_activation_product(x, qdata, scale):
    """The row as three int8 pieces (`x ~ s * (p1 + p2 / 256 + p3 / 65536)`, s the row's largest magnitude / 127)
    times the int8 weight on the int8 matrix unit, in int32: no conversion of the weight at all."""
    import jax
    import jax.numpy as jnp

    rows = x.shape[0]
    remainder = x.astype(jnp.float32)
    step = jnp.max(jnp.abs(remainder), axis=-1, keepdims=True) / 127
    step = jnp.where(step == 0, 1.0, step)
    pieces = []
    for fraction in (1.0, 1 / 256, 1 / 65536):
        piece = jnp.clip(jnp.round(remainder / (step * fraction)), -127, 127)
        pieces.append(piece.astype(jnp.int8))
        remainder = remainder - piece * (step * fraction)
    products = jax.lax.dot_general(jnp.concatenate(pieces), qdata, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.int32).astype(jnp.float32)
    y = products[:rows] + products[rows:2 * rows] / 256 + products[2 * rows:] / 65536
    return (y * step * scale[:, 0].astype(jnp.float32)).astype(x.dtype)


def _int8_activation_product(x, qdata, scale):
    """torchao's `Int8DynamicActivationInt8WeightConfig` product: each row quantized to int8 by its largest
    magnitude, times the int8 weight on the int8 matrix unit in int32, both scales applied to the result."""
    import jax
    import jax.numpy as jnp

    row_scale = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True), 1e-5) / 127
    rows = jnp.clip(jnp.round(x.astype(jnp.float32) / row_scale), -128, 127).astype(jnp.int8)
    products = jax.lax.dot_general(rows, qdata, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return (products.astype(jnp.float32) * row_scale * scale[:, 0].astype(jnp.float32)).astype(x.dtype)


def _chain(product, model: dict, fused: bool = False):
    """The layers' products in a decode step's order, each layer's output feeding the next (so none is dropped);
    `fused`: a layer's q, k and v one product and its gate and up one, their outputs sliced apart."""
    q_out, kv_out = model["heads"] * model["head_dim"], model["kv_heads"] * model["head_dim"]

    def run(x, layers):
        for layer in layers:
            if fused:
                wqkv, wo, wgu, wd = layer
                qkv, gate_up = product(x, wqkv), product(x, wgu)
                q, k, v = qkv[:, :q_out], qkv[:, q_out:q_out + kv_out], qkv[:, q_out + kv_out:]
                up = gate_up[:, :model["intermediate"]] * gate_up[:, model["intermediate"]:]
            else:
                wq, wk, wv, wo, wg, wu, wd = layer
                q, k, v = product(x, wq), product(x, wk), product(x, wv)
                up = product(x, wg) * product(x, wu)
            used = (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True)).astype(x.dtype)
            x = x + product(q, wo) + product(up, wd) + used
        return x

    return run


def _median_seconds(fn, iters: int) -> float:
    fn()  # compiles
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check(model: dict, group: int, interpret: bool) -> None:
    """The int4 forms' first and last products against the kernel's reference, the int8 split form's against XLA's
    int8 form; raises when a result is off by more than bfloat16's rounding."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hf_tpu.kernels.int4_matmul import reference

    x = jax.random.normal(jax.random.key(2), (3, model["hidden"]), jnp.bfloat16)
    for shape in _shapes(model)[:1] + _shapes(model)[-1:]:
        w = _weights("int4 Pallas", shape, jax.random.key(3), group)
        xs = x if shape[1] == model["hidden"] else jnp.tile(x, (1, shape[1] // model["hidden"] + 1))[:, :shape[1]]
        expected = np.asarray(reference(xs, *w, group), np.float32)
        for form in ("int4 XLA", "int4 Pallas"):
            actual = np.asarray(jax.jit(_product(form, group, interpret))(xs, w), np.float32)
            error = np.abs(actual - expected).max() / np.abs(expected).max()
            print(f"check {form} {shape}: largest error {error:.2e} of the largest output")
            if error > 2e-2:
                raise AssertionError(f"{form} differs from the reference by {error:.2e} on {shape}")
        w = _weights("int8", shape, jax.random.key(3), group)
        expected = np.asarray(jax.jit(_product("int8", group, interpret))(xs, w), np.float32)
        actual = np.asarray(jax.jit(_product("int8 split", group, interpret))(xs, w), np.float32)
        error = np.abs(actual - expected).max() / np.abs(expected).max()
        print(f"check int8 split {shape}: largest error {error:.2e} of the largest output")
        if error > 2e-2:
            raise AssertionError(f"int8 split differs from int8 by {error:.2e} on {shape}")


def measure(model: dict, batches, group: int, iters: int, interpret: bool, forms=FORMS, fused: bool = False) -> list:
    """(form, batch, seconds, bytes held) for each form and batch."""
    import jax
    import jax.numpy as jnp

    results = []
    for form in forms:
        keys = iter(jax.random.split(jax.random.key(1), 8 * model["layers"]))
        layers = [[_weights(form, shape, next(keys), group) for shape in _shapes(model, fused)]
                  for _ in range(model["layers"])]
        held = sum(a.size * a.dtype.itemsize for layer in layers for w in layer for a in w)
        run = jax.jit(_chain(_product(form, group, interpret), model, fused))
        for batch in batches:
            x = jax.random.normal(jax.random.key(batch), (batch, model["hidden"]), jnp.bfloat16)
            seconds = _median_seconds(lambda: run(x, layers).block_until_ready(), iters)
            results.append((form, batch, seconds, held))
            print(f"{form} batch {batch}: {seconds * 1e3:.3f} ms", flush=True)
        del layers
        gc.collect()
    return results


def sweep(model: dict, batches, group: int, iters: int, interpret: bool, tiles_kb=(512, 1024, 2048, 4096),
          stacked=(128, 256)) -> list:
    """The kernel alone at each tile size (packed bytes) and limit on stacked rows, beside its defaults: which
    block sizes the chip prefers. Lines as `report`'s, without the bf16 column."""
    from hf_tpu.kernels import int4_matmul

    defaults = int4_matmul._TILE_BYTES, int4_matmul._PREFERRED_STACKED_ROWS
    lines = []
    try:
        for tile_bytes in (kb << 10 for kb in tiles_kb):
            for stacked_rows in stacked:
                int4_matmul._TILE_BYTES, int4_matmul._PREFERRED_STACKED_ROWS = tile_bytes, stacked_rows
                for form, batch, seconds, held in measure(model, batches, group, iters, interpret, ("int4 Pallas",)):
                    lines.append(f"tile {tile_bytes >> 10:5d} KB, stacked rows {stacked_rows}: batch {batch:3d} "
                                 f"{seconds * 1e3:8.3f} ms  {held / seconds / 1e9:7.1f} GB/s")
                    print(lines[-1], flush=True)
    finally:
        int4_matmul._TILE_BYTES, int4_matmul._PREFERRED_STACKED_ROWS = defaults
    return lines


def report(results: list) -> list:
    bf16 = {batch: seconds for form, batch, seconds, _ in results if form == "bf16"}
    return [f"{form:14s} batch {batch:3d}: {seconds * 1e3:8.3f} ms  {held / seconds / 1e9:7.1f} GB/s of "
            f"{held / 1e6:.1f} MB held" + (f"  {bf16[batch] / seconds:5.2f}x bf16" if batch in bf16 else "")
            for form, batch, seconds, held in results]


def main(argv=None) -> None:
    import jax

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the kernel interpreted off a TPU)")
    parser.add_argument("--group", type=int, default=128, help="int4 group size (default 128)")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per form (default 20, --sweep 10, "
                        "--tiny 2)")
    parser.add_argument("--sweep", action="store_true", help="the kernel alone at other block sizes, no other form")
    parser.add_argument("--tiles-kb", default="512,1024,2048,4096", help="--sweep's tile sizes (KB of packed bytes)")
    parser.add_argument("--stacked-rows", default="128,256", help="--sweep's limits on stacked rows (at one to eight "
                        "rows, 8 x the groups of a K block: 32 is 4 groups, 128 is 16)")
    parser.add_argument("--fused", action="store_true", help="a layer's q, k and v weights stored as one, its gate "
                        "and up as one: 4 products a layer, not 7 (does a fixed cost per product bound the step?)")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated forms of {FORMS + INT8_FORMS} "
                        "(default: the first four); bf16 among them for the speed against it")
    args = parser.parse_args(argv)
    model = TINY if args.tiny else LLAMA_1B
    interpret = jax.devices()[0].platform != "tpu"
    print(f"{jax.devices()[0].device_kind}; {model['layers']} layers of {model}, int4 group {args.group}"
          f"{', Pallas interpret mode' if interpret else ''}")
    batches = [int(b) for b in args.batches.split(",")]
    iters = args.iters or (2 if args.tiny else 10 if args.sweep else 20)
    check(model, args.group, interpret)
    if args.sweep:
        sweep(model, batches, args.group, iters, interpret, [int(n) for n in args.tiles_kb.split(",")],
              [int(n) for n in args.stacked_rows.split(",")])
        return
    forms = tuple(args.forms.split(","))
    unknown = set(forms) - set(FORMS + INT8_FORMS)
    if unknown:
        parser.error(f"unknown forms {sorted(unknown)}: choose among {FORMS + INT8_FORMS}")
    print("\n".join(report(measure(model, batches, args.group, iters, interpret, forms, args.fused))))


if __name__ == "__main__":
    main()
