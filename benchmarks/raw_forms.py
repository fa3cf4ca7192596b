"""What the raw-JAX benchmarks of one piece of a model in several forms share (`rotary_layouts`,
`linear_layouts`): their arguments, Transformers' rotary tables, and each form timed against the first."""

from __future__ import annotations

import argparse
import time

import numpy as np


def parse(argv, doc: str, layers: str, iters: int, shapes: str | None = None):
    """`--json`, `--layers` (what one layer is, for the help), `--iters` (default `iters`) and `--tiny`; with
    `shapes` (the default, as `8x1024`) also `--shapes`, the batch x length shapes to run (None where not given)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--layers", type=int, default=4, help=f"{layers} chained in one program")
    parser.add_argument("--iters", type=int, default=iters, help="timed calls per form")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the default off a TPU)")
    if shapes is not None:
        parser.add_argument("--shapes", type=_shapes, help=f"batch x length shapes, comma-separated (default {shapes}; "
                            "tiny: 1x128)")
    return parser.parse_args(argv)


def _shapes(text: str) -> list:
    """`8x1024,1x4096` as [(8, 1024), (1, 4096)]."""
    try:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        raise argparse.ArgumentTypeError(f"expected shapes such as 8x1024,1x4096, got {text!r}")
    return shapes


def rotary_cos_sin(length: int, head_dim: int):
    """Llama's rotary tables for `length` positions: Transformers gives them in the model's dtype (bfloat16), and
    hf_tpu's ops read them in float32."""
    import jax.numpy as jnp

    angles = np.arange(length)[:, None] / (10000 ** (np.arange(0, head_dim, 2) / head_dim))[None]
    angles = np.concatenate([angles, angles], -1)
    return tuple(jnp.asarray(f(angles), jnp.bfloat16).astype(jnp.float32) for f in (np.cos, np.sin))


def time_forms(calls: dict, iters: int) -> list:
    """Per form (name -> a call of its program, inputs bound): the median ms of `iters` calls after a first one,
    the first call's seconds, and the largest difference of its output from the first form's."""
    import jax
    import jax.numpy as jnp

    rows, reference = [], None
    for name, call in calls.items():
        start = time.perf_counter()
        out = jax.block_until_ready(call())
        first = time.perf_counter() - start
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            jax.block_until_ready(call())
            times.append(time.perf_counter() - start)
        reference = out if reference is None else reference
        rows.append(dict(form=name, ms=float(np.median(times)) * 1e3, first_s=first,
                         max_diff=float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))))))
    return rows
