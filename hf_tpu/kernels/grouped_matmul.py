"""Grouped matrix products for mixture-of-experts layers on a TPU: JAX's megablox kernels, and their reference.

`jax.experimental.pallas.ops.tpu.megablox` (JAX 0.10.2) has the two products an MoE layer and its
gradient need, with rows sorted by expert and `group_sizes` rows per expert:

- `gmm`: (m, k) rows x (groups, k, n) experts -> (m, n), each row through its group's matrix (the
  forward and the input gradient);
- `tgmm`: (k, m) x (m, n) -> (groups, k, n), the products of each group's rows (the weight gradient).

The kernel visits only the (row tile, expert) pairs that hold rows, where `lax.ragged_dot` on XLA
lowers to a dense loop. Rows past the last group are left unwritten by the kernel; PyTorch's
`_grouped_mm` gives zeros there, so the wrappers zero them.

Shape rules (`unsupported` says which one a call breaks): bfloat16 or float32 operands of one dtype,
and the dimensions the kernel tiles along its lanes (k and n) multiples of 128; the row count is
padded to whole tiles.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from . import selection

LANES = 128
DTYPES = (jnp.bfloat16, jnp.float32)
_EXPERT_TILE_BYTES = 4 * 2**20  # one (k, n) tile of an expert: double-buffered, well inside 16 MiB of VMEM


def _library():
    # `megablox/__init__.py` rebinds the name `gmm` to the differentiable function, hiding the module
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def unsupported(lhs, rhs, *, transposed=False):
    """Why the kernel cannot compute this product (a sentence), or None. `transposed`: the tgmm form,
    (k, m) x (m, n) grouped along m; else the gmm form, (m, k) x (groups, k, n)."""
    if not lhs.dtype == rhs.dtype or lhs.dtype not in DTYPES:
        return f"dtypes {lhs.dtype}, {rhs.dtype}: the kernel takes one of bfloat16, float32"
    k, n = (lhs.shape[0], rhs.shape[1]) if transposed else (lhs.shape[1], rhs.shape[2])
    if k % LANES or n % LANES:
        return f"dimensions {k} and {n} must be multiples of {LANES}"
    return None


def _tiling(m: int, k: int, n: int, itemsize: int = 2) -> tuple[int, int, int]:
    """(row, k, n) tiles. The kernel visits each row tile once per group it overlaps, and an MoE layer
    spreads few rows over many experts, so row tiles are short (128 rows, or the rows rounded up to 16
    when fewer). An expert's matrix is read whole where one tile of it fits `_EXPERT_TILE_BYTES`: on
    a v5e (2026-12-04, 512 rows x 128 experts of 2048 x 768, bfloat16) tiles (128, 2048, 768) took
    1.15 ms, (256, 512, 256) 1.92 ms and (128, 128, 128) 4.92 ms; `lax.ragged_dot` 1.29 ms."""
    def widest(size, budget_elements):
        return next((t for t in (size, 2048, 1024, 512, 256) if size % t == 0 and t <= budget_elements), LANES)

    tile_n = widest(n, 2048)
    tile_k = widest(k, _EXPERT_TILE_BYTES // (itemsize * tile_n))
    return min(128, -(-m // 16) * 16), tile_k, tile_n


def _pad_rows(x, rows: int, axis: int):
    extra = -x.shape[axis] % rows
    if not extra:
        return x
    return jnp.pad(x, [(0, extra if i == axis else 0) for i in range(x.ndim)])


@selection.in_32_bit_mode
def gmm(lhs, rhs, group_sizes, *, out_dtype=None, tiling=None, interpret=None):
    """(m, k) x (groups, k, n) -> (m, n): rows [sum(sizes[:g]), sum(sizes[:g+1])) through rhs[g]; rows
    past the groups are 0. Differentiable (megablox's custom_vjp: gmm and tgmm)."""
    from jax.experimental.pallas.ops.tpu.megablox import ops

    m = lhs.shape[0]
    tiling = tiling or _tiling(m, lhs.shape[1], rhs.shape[2], lhs.dtype.itemsize)
    interpret = selection.interpret() if interpret is None else interpret
    out = ops.gmm(_pad_rows(lhs, tiling[0], 0), rhs, group_sizes.astype(jnp.int32),
                  out_dtype or lhs.dtype, tiling, None, None, False, interpret)[:m]
    return jnp.where((jnp.arange(m) < group_sizes.sum())[:, None], out, jnp.zeros((), out.dtype))


@selection.in_32_bit_mode
def tgmm(lhs, rhs, group_sizes, *, out_dtype=None, tiling=None, interpret=None):
    """(k, m) x (m, n) -> (groups, k, n): group g is lhs[:, rows of g] @ rhs[rows of g]; empty groups
    and rows past the groups contribute 0."""
    m = lhs.shape[1]
    tiling = tiling or _tiling(m, lhs.shape[0], rhs.shape[1], lhs.dtype.itemsize)
    interpret = selection.interpret() if interpret is None else interpret
    in_groups = jnp.arange(m) < group_sizes.sum()  # rows past the groups: zero them, the kernel may read them
    lhs = jnp.where(in_groups[None, :], lhs, jnp.zeros((), lhs.dtype))
    return _library().tgmm(_pad_rows(lhs, tiling[0], 1), _pad_rows(rhs, tiling[0], 0), group_sizes.astype(jnp.int32),
                           out_dtype or lhs.dtype, tiling, interpret=interpret)


def reference_gmm(lhs, rhs, group_sizes, *, out_dtype=None):
    """gmm through `lax.ragged_dot`, float32 accumulation."""
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    rows = jnp.arange(lhs.shape[0]) < group_sizes.sum()
    return jnp.where(rows[:, None], out, 0.0).astype(out_dtype or lhs.dtype)


def reference_tgmm(lhs, rhs, group_sizes, *, out_dtype=None):
    """tgmm as one masked product per group, float32 accumulation."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(lhs.shape[1])
    member = (rows[None, :] >= (ends - group_sizes)[:, None]) & (rows[None, :] < ends[:, None])  # (groups, m)
    out = jnp.einsum("km,gm,mn->gkn", lhs.astype(jnp.float32), member.astype(jnp.float32), rhs.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype or lhs.dtype)
