"""What a float32 encoder's XLA compile costs at each matmul precision: HIGHEST, HIGH and DEFAULT.

    python -m benchmarks.float32_compile [--layers 1,6] [--precisions highest,high,default] [--json FILE]

all-MiniLM-L6-v2 runs in float32 at PyTorch's default matmul precision ("highest"), which hf-tpu passes on
to every float32 product as `lax.Precision.HIGHEST` (`torch.set_float32_matmul_precision` picks HIGH or
DEFAULT instead). On a v5e each of its length buckets compiled for 12.5-14.5 s, longer than the 1.1B Llama's
bfloat16 forward. This script compiles the encoder's layers written in raw JAX (BERT's: query, key and value
projections, scaled scores, softmax, the output projection, layer norms, an erf GELU; MiniLM's sizes: hidden
384, 12 heads of 32, intermediate 1536; batch 32 of 128 tokens) at each precision, each case in a fresh
process, since a process's earlier compiles change a later one's time. It prints XLA's compile, the run
time, and the largest difference from the HIGHEST result.

Off a TPU the shapes are small: a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HIDDEN, HEADS, INTERMEDIATE, BATCH, LENGTH = 384, 12, 1536, 32, 128
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `-m benchmarks...` is found


def _encoder(layers: int, precision, heads: int):
    """BERT's encoder layers (post-norm) as a JAX function of (hidden states, per-layer weights)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def matmul(x, w):
        return jnp.matmul(x, w, precision=precision)

    def norm(x):
        mean = x.mean(-1, keepdims=True)
        return (x - mean) * lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-12)

    def layer(x, weights):
        query, key, value, output, up, down = weights
        batch, length, hidden = x.shape

        def split(t):
            return t.reshape(batch, length, heads, hidden // heads).transpose(0, 2, 1, 3)

        q, k, v = split(matmul(x, query)), split(matmul(x, key)), split(matmul(x, value))
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=precision) / (hidden // heads) ** 0.5
        attended = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, -1), v, precision=precision)
        x = norm(x + matmul(attended.transpose(0, 2, 1, 3).reshape(batch, length, hidden), output))
        inner = matmul(x, up)
        return norm(x + matmul(0.5 * inner * (1 + lax.erf(inner / 2 ** 0.5)), down))

    def encoder(x, weights):
        for layer_weights in weights[:layers]:
            x = layer(x, layer_weights)
        return x

    return encoder


def _case(layers: int, precision_name: str, out: str) -> None:
    """One compile in this process: its timings, and its result saved to `out` (.npy)."""
    import jax
    import numpy as np

    from benchmarks.common import compile_timings

    tiny = jax.default_backend() != "tpu"
    hidden, heads, intermediate, batch, length = (32, 2, 64, 2, 16) if tiny else (HIDDEN, HEADS, INTERMEDIATE,
                                                                                 BATCH, LENGTH)
    rng = np.random.default_rng(0)
    shapes = [(hidden, hidden)] * 4 + [(hidden, intermediate), (intermediate, hidden)]
    weights = [tuple(jax.numpy.asarray(rng.standard_normal(s) / s[0] ** 0.5, "float32") for s in shapes)
               for _ in range(layers)]
    x = jax.numpy.asarray(rng.standard_normal((batch, length, hidden)), "float32")
    precision = getattr(jax.lax.Precision, precision_name.upper())
    jitted = jax.jit(_encoder(layers, precision, heads))
    row = compile_timings(jitted, (x, weights))
    np.save(out, np.asarray(jitted(x, weights)))
    print("ROW " + json.dumps({**row, "backend": jax.default_backend(), "tiny": tiny}), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="1,6", help="encoder depths to compile, comma-separated")
    parser.add_argument("--precisions", default="highest,high,default",
                        help="lax.Precision names, comma-separated; the first is the reference of the differences")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)  # layers, precision, output file
    args = parser.parse_args(argv)
    if args.case:
        return _case(int(args.case[0]), args.case[1], args.case[2])
    import tempfile

    import numpy as np

    from benchmarks.common import report_compile_timings

    rows, backend = {}, None
    with tempfile.TemporaryDirectory() as folder:
        for layers in [int(n) for n in args.layers.split(",")]:
            reference = None
            for precision in args.precisions.split(","):
                out = os.path.join(folder, f"{layers}-{precision}.npy")
                proc = subprocess.run([sys.executable, "-m", "benchmarks.float32_compile", "--case", str(layers),
                                       precision, out], env={**os.environ, "HF_TPU_CACHE_DIR": ""}, cwd=_ROOT,
                                      stdout=subprocess.PIPE, text=True, check=True)
                row = json.loads(next(line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")))
                backend = f"{row.pop('backend')}{' (small shapes)' if row.pop('tiny') else ''}"
                result = np.load(out)
                reference = result if reference is None else reference
                rows[f"{layers} layer{'s' * (layers > 1)}, {precision}"] = {
                    **row, "max_diff": float(np.abs(result - reference).max())}
    report_compile_timings(f"backend {backend}, float32 BERT-shaped encoder layers, each compiled in a fresh process",
                           "layers, precision", "call", rows, args.json)
    print("largest difference from the first precision's result: "
          + ", ".join(f"{name} {row['max_diff']:.1e}" for name, row in rows.items()))


if __name__ == "__main__":
    main()
