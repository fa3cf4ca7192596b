"""Factorizations in LAPACK's compact forms: Householder QR (`geqrf`, and `ormqr` applying its Q)
and the Bunch-Kaufman LDL^T of a symmetric matrix (`linalg_ldl_factor_ex`, `linalg_ldl_solve`).

These ops return LAPACK's own encodings (reflectors below the diagonal with their `tau` factors;
L, D and 1-based pivot indices in one matrix), so they follow LAPACK's algorithms step for step:
the CPU results they are compared with come from LAPACK itself.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from ..dispatch import lowering
from .products import matmul_precision


aten = torch.ops.aten


# --- Householder QR.


@lowering(aten.geqrf.default)
def geqrf(self):
    reflectors, tau = jnp.linalg.qr(self, mode="raw")  # numpy's raw form is the transpose of LAPACK's
    return jnp.swapaxes(reflectors, -1, -2), tau


@lowering(aten.ormqr.default)
def ormqr(self, input2, input3, left=True, transpose=False):
    """Q @ C (or C @ Q, with Q^H for `transpose`) for the Q that `geqrf` encoded in (self, input2)."""
    return jax.lax.linalg.ormqr(self, input2, input3, left=left, transpose=transpose)


# --- Bunch-Kaufman LDL^T of the lower triangle (LAPACK's sytf2 and sytrs with uplo="L"), one
# matrix at a time under vmap. The step taken at column k (a 1x1 or a 2x2 block of D) depends on
# the values, so both loops are `lax.while_loop`s over k whose body selects between the two.

_BUNCH_KAUFMAN_ALPHA = (1 + 17**0.5) / 8  # bounds the growth of the entries of L


def _abs1(x):
    """LAPACK's cabs1 (|re| + |im|), which its complex symmetric routines compare; |x| for reals."""
    return jnp.abs(x.real) + jnp.abs(x.imag) if jnp.iscomplexobj(x) else jnp.abs(x)


def _require_symmetric(A, hermitian):
    if hermitian and jnp.iscomplexobj(A):
        raise NotImplementedError("torch.linalg.ldl_factor/ldl_solve with hermitian=True on complex matrices "
                                  "have no tpu lowering yet; use hermitian=False or HF_TPU_CPU_FALLBACK=1")


def _swap(x, i, j, axis):
    """x with its rows (axis 0) or columns (axis 1) i and j exchanged, i and j traced."""
    order = jnp.arange(x.shape[axis])
    order = jnp.where(order == i, j, jnp.where(order == j, i, order))
    return jnp.take(x, order, axis=axis)


def _sytf2_lower(A):
    """(LD, 1-based pivots, info) as LAPACK's sytf2 returns them for A's lower triangle. S holds the
    trailing submatrix still to factor, kept whole (symmetric) so that interchanges are row and
    column swaps; LD receives each finished column."""
    n = A.shape[0]
    if n == 0:  # nothing to factor (the loop body cannot even be traced)
        return A, jnp.zeros(0, jnp.int32), jnp.int32(0)
    rows, cols = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    lower = jnp.tril(A)
    start = (jnp.int64(0), lower + jnp.tril(lower, -1).T, jnp.zeros_like(A), jnp.zeros(n, jnp.int32), jnp.int32(0))

    def step(carry):
        k, S, LD, pivots, info = carry
        trailing = (rows >= k) & (cols >= k)
        below = jnp.arange(n) > k
        absakk = _abs1(S[k, k])
        column = jnp.where(below, _abs1(S[:, k]), -1)
        imax = jnp.argmax(column)  # the first largest, as LAPACK's i?amax
        colmax = jnp.maximum(column[imax], 0)
        singular = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        rowmax = jnp.max(jnp.where((jnp.arange(n) >= k) & (jnp.arange(n) != imax), _abs1(S[imax]), 0))
        keep_k = singular | (absakk >= _BUNCH_KAUFMAN_ALPHA * colmax) | (
            absakk >= _BUNCH_KAUFMAN_ALPHA * colmax * (colmax / rowmax))
        one_by_one = keep_k | (_abs1(S[imax, imax]) >= _BUNCH_KAUFMAN_ALPHA * rowmax)
        kp = jnp.where(keep_k, k, imax)
        kk = jnp.where(one_by_one, k, k + 1)
        S = _swap(_swap(S, kk, kp, 0), kk, kp, 1)  # only the trailing part matters

        # 1x1: D(k) = S[k, k], L's column = S's column / D(k), rank-1 update as BLAS's syr
        d = S[k, k]
        x = jnp.where(below, S[:, k], 0)
        update_1 = S + x[:, None] * (-(1 / d) * x)[None, :]
        column_1 = jnp.where(below, x * (1 / d), jnp.where(jnp.arange(n) == k, d, 0))

        # 2x2: D = S[k:k+2, k:k+2], columns k and k+1 of L from sytf2's formulas
        past = jnp.arange(n) > k + 1
        d21 = S[k + 1, k]
        d11, d22 = S[k + 1, k + 1] / d21, S[k, k] / d21
        d21 = (1 / (d11 * d22 - 1)) / d21
        wk = jnp.where(past, d21 * (d11 * S[:, k] - S[:, k + 1]), 0)
        wkp1 = jnp.where(past, d21 * (d22 * S[:, k + 1] - S[:, k]), 0)
        update_2 = S - jnp.where(past, S[:, k], 0)[:, None] * wk[None, :] - jnp.where(past, S[:, k + 1], 0)[:, None] * wkp1[None, :]
        head = jnp.arange(n) <= k + 1
        column_2k = jnp.where(past, wk, jnp.where(head & (jnp.arange(n) >= k), S[:, k], 0))
        column_2k1 = jnp.where(past, wkp1, jnp.where(jnp.arange(n) == k + 1, S[:, k + 1], 0))

        updated = jnp.where(singular, S, jnp.where(one_by_one, update_1, update_2))
        updated = jnp.where(trailing, jnp.tril(updated) + jnp.tril(updated, -1).T, S)  # syr writes one triangle
        LD = jnp.where((cols == k) & singular, jnp.where(rows >= k, S[:, k][:, None], 0), LD)
        LD = jnp.where((cols == k) & ~singular & one_by_one, column_1[:, None], LD)
        LD = jnp.where((cols == k) & ~one_by_one, column_2k[:, None], LD)
        LD = jnp.where((cols == k + 1) & ~one_by_one, column_2k1[:, None], LD)
        pivot = jnp.where(one_by_one, kp + 1, -(kp + 1)).astype(jnp.int32)
        pivots = jnp.where((jnp.arange(n) == k) | ((jnp.arange(n) == k + 1) & ~one_by_one), pivot, pivots)
        info = jnp.where((info == 0) & singular, k + 1, info).astype(jnp.int32)
        return k + jnp.where(one_by_one, 1, 2), updated, LD, pivots, info

    _, _, LD, pivots, info = jax.lax.while_loop(lambda carry: carry[0] < n, step, start)
    return LD, pivots, info


def _sytrs_lower(LD, pivots, B):
    """X with A X = B for A = P L D L^T P^T as sytf2 encoded it (LAPACK's sytrs)."""
    n = LD.shape[0]
    if n == 0:
        return B
    index = jnp.arange(n)

    def forward(carry):  # solve L D Y = P^T B, block by block
        k, B = carry
        one_by_one = pivots[k] > 0
        kp = jnp.where(one_by_one, pivots[k], -pivots[k]) - 1
        B = _swap(B, jnp.where(one_by_one, k, k + 1), kp, 0)
        B_1 = B - jnp.where(index > k, LD[:, k], 0)[:, None] * B[k][None, :]
        B_1 = jnp.where((index == k)[:, None], B_1 * (1 / LD[k, k]), B_1)
        past = (index > k + 1)[:, None]
        B_2 = B - jnp.where(past, LD[:, k][:, None], 0) * B[k][None, :]
        B_2 = B_2 - jnp.where(past, LD[:, k + 1][:, None], 0) * B[k + 1][None, :]
        akm1k = LD[k + 1, k]
        akm1, ak = LD[k, k] / akm1k, LD[k + 1, k + 1] / akm1k
        denom = akm1 * ak - 1
        bkm1, bk = B[k] / akm1k, B[k + 1] / akm1k
        B_2 = jnp.where((index == k)[:, None], ((ak * bkm1 - bk) / denom)[None, :], B_2)
        B_2 = jnp.where((index == k + 1)[:, None], ((akm1 * bk - bkm1) / denom)[None, :], B_2)
        return k + jnp.where(one_by_one, 1, 2), jnp.where(one_by_one, B_1, B_2)

    def backward(carry):  # solve L^T P^T X = Y, from the last block up
        k, B = carry
        one_by_one = pivots[k] > 0
        tail = jnp.where(index > k, 1, 0)[:, None] * B
        B = B.at[k].add(-jnp.matmul(LD[:, k], tail, precision=matmul_precision()))
        B = jnp.where(one_by_one, B, B.at[k - 1].add(-jnp.matmul(LD[:, k - 1], tail, precision=matmul_precision())))
        kp = jnp.where(one_by_one, pivots[k], -pivots[k]) - 1
        return k - jnp.where(one_by_one, 1, 2), _swap(B, k, kp, 0)

    _, B = jax.lax.while_loop(lambda carry: carry[0] < n, forward, (jnp.int64(0), B))
    _, B = jax.lax.while_loop(lambda carry: carry[0] >= 0, backward, (jnp.int64(n - 1), B))
    return B


def _batched(fn, core_dims):
    """fn over leading batch dims (each argument's last `core_dims[i]` dims are one problem's)."""
    def run(*args):
        batch = args[0].shape[:args[0].ndim - core_dims[0]]
        flat = [a.reshape((math.prod(batch),) + a.shape[a.ndim - d:]) for a, d in zip(args, core_dims)]
        results = jax.vmap(fn)(*flat)
        return tuple(r.reshape(batch + r.shape[1:]) for r in results) if isinstance(results, tuple) else \
            results.reshape(batch + results.shape[1:])
    return run


@lowering(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(self, *, hermitian=False, check_errors=False):
    _require_symmetric(self, hermitian)
    return _batched(_sytf2_lower, (2,))(self)


@lowering(aten.linalg_ldl_solve.default)
def linalg_ldl_solve(LD, pivots, B, *, hermitian=False):
    _require_symmetric(LD, hermitian)
    batch = jnp.broadcast_shapes(LD.shape[:-2], pivots.shape[:-1], B.shape[:-2])
    LD = jnp.broadcast_to(LD, batch + LD.shape[-2:])
    pivots = jnp.broadcast_to(pivots, batch + pivots.shape[-1:])
    B = jnp.broadcast_to(B, batch + B.shape[-2:])
    return _batched(_sytrs_lower, (2, 1, 2))(LD, pivots, B)
