"""Linear algebra beyond products (torch.linalg): Cholesky, LU, solves, inverses, determinants, QR, SVD,
eigendecompositions and least squares, lowered to `jax.lax.linalg` with PyTorch's conventions and outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from .. import dispatch, dtypes, modes
from ..dispatch import Promote, handler, lowering
from .products import matmul

aten = torch.ops.aten

# Conventions follow PyTorch's: pivots are 1-based int32 (LAPACK's), `info` is LAPACK's (0 on
# success), and `check_errors` is honoured by `_linalg_check_errors`, which reads `info` on the host.
# Like PyTorch's CPU kernels, `_linalg_det` and `_linalg_slogdet` factor a real `A` transposed
# (PyTorch does so when `A` is contiguous): their derivatives solve with the returned LU and assume
# so. A lowering cannot see strides, so a non-contiguous real `A` gets the transposed LU too; only
# the backward of those two ops, which reads `A.is_contiguous()`, notices.


def _mH(x):
    return jnp.conj(jnp.swapaxes(x, -1, -2))


def _broadcast_batch(a, b):
    """Broadcast the batch dimensions (all but the last two) of two matrices."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _triangular_solve(a, b, lower, left=True, adjoint=False, unit_diagonal=False):
    """op(a) X = b (left) or X op(a) = b (right), op the conjugate transpose when `adjoint`."""
    a, b = _broadcast_batch(a, b)
    return jax.lax.linalg.triangular_solve(
        a, b, left_side=left, lower=lower, transpose_a=adjoint, conjugate_a=adjoint, unit_diagonal=unit_diagonal
    )


def _first_failure(failed):
    """LAPACK's `info`: the 1-based position of the first failure along the last axis, else 0."""
    if failed.shape[-1] == 0:
        return jnp.zeros(failed.shape[:-1], jnp.int32)
    return jnp.where(failed.any(-1), jnp.argmax(failed, axis=-1) + 1, 0).astype(jnp.int32)


def _cholesky(a, upper):
    """Reads only the triangle named by `upper`, like LAPACK's potrf."""
    if upper:
        return _mH(jax.lax.linalg.cholesky(_mH(a), symmetrize_input=False))
    return jax.lax.linalg.cholesky(a, symmetrize_input=False)


@lowering(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(self, upper=False, check_errors=False):
    """JAX turns a failed factorization into NaNs, so `info` is the first non-finite diagonal entry
    (not always the order of the first non-positive-definite minor, as LAPACK's)."""
    factor = _cholesky(self, upper)
    return factor, _first_failure(~jnp.isfinite(jnp.diagonal(factor, axis1=-2, axis2=-1)))


@lowering(aten.cholesky.default)
def cholesky(self, upper=False):
    return _cholesky(self, upper)


def _cholesky_solve(b, factor, upper):
    """A X = b with A = L L^H (or U^H U)."""
    lower = not upper
    y = _triangular_solve(factor, b, lower=lower, adjoint=upper)
    return _triangular_solve(factor, y, lower=lower, adjoint=lower)


@lowering(aten.cholesky_solve.default, aten._cholesky_solve_helper.default)
def cholesky_solve(self, input2, upper=False):
    return _cholesky_solve(self, input2, upper)


@lowering(aten.cholesky_inverse.default)
def cholesky_inverse(self, upper=False):
    eye = jnp.broadcast_to(jnp.eye(self.shape[-1], dtype=self.dtype), self.shape)
    return _cholesky_solve(eye, self, upper)


def _lu_factor(a):
    """(LU, 1-based int32 pivots, info) of a (..., m, n) matrix, with partial pivoting."""
    lu, pivots, _ = jax.lax.linalg.lu(a)
    return lu, pivots + 1, _first_failure(jnp.diagonal(lu, axis1=-2, axis2=-1) == 0)


def _permutation(pivots, m):
    """The row order `perm` with A[perm] = L U, from 1-based LAPACK pivots."""
    return jax.lax.linalg.lu_pivots_to_permutation(pivots - 1, m)


def _lu_solve(lu, pivots, b, adjoint=False):
    """A X = b (or A^H X = b) with P^T A = L U, for A (..., n, n) and b (..., n, k)."""
    lu, b = _broadcast_batch(lu, b)
    perm = jnp.broadcast_to(_permutation(pivots, lu.shape[-1])[..., None], b.shape)
    if not adjoint:
        b = jnp.take_along_axis(b, perm, axis=-2)
        y = _triangular_solve(lu, b, lower=True, unit_diagonal=True)
        return _triangular_solve(lu, y, lower=False)
    y = _triangular_solve(lu, b, lower=False, adjoint=True)
    x = _triangular_solve(lu, y, lower=True, adjoint=True, unit_diagonal=True)
    return jnp.take_along_axis(x, jnp.argsort(perm, axis=-2), axis=-2)  # P x, the inverse of x[perm]


def _lu_solve_sided(lu, pivots, b, left, adjoint):
    """Right-sided X A = B is A^H X^H = B^H."""
    if left:
        return _lu_solve(lu, pivots, b, adjoint)
    return _mH(_lu_solve(lu, pivots, _mH(b), not adjoint))


@lowering(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(A, pivot=True, check_errors=False):
    if not pivot:
        raise NotImplementedError("linalg.lu_factor: LU without pivoting is not implemented on tpu")
    return _lu_factor(A)


def _lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2:]
    k = min(m, n)
    empty = jnp.zeros((0,), lu.dtype)
    P = L = U = empty
    if unpack_pivots:
        perm = _permutation(pivots, m)
        P = jnp.swapaxes(jax.nn.one_hot(perm, m, dtype=lu.dtype), -1, -2)  # A = P L U
    if unpack_data:
        L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
        U = jnp.triu(lu[..., :k, :])
    return P, L, U


@lowering(aten.lu_unpack.default)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    return _lu_unpack(LU_data, LU_pivots, unpack_data, unpack_pivots)


@lowering(aten.linalg_lu.default)
def linalg_lu(A, pivot=True):
    lu, pivots, _ = linalg_lu_factor_ex(A, pivot)
    return _lu_unpack(lu, pivots)


@lowering(aten.linalg_lu_solve.default)
def linalg_lu_solve(LU, pivots, B, left=True, adjoint=False):
    return _lu_solve_sided(LU, pivots, B, left, adjoint)


def _factor_for_det(A):
    """(LU, pivots): see the section comment for why a real `A` is factored transposed."""
    lu, pivots, _ = _lu_factor(A if jnp.iscomplexobj(A) else jnp.swapaxes(A, -1, -2))
    return lu, pivots


def _is_vector_rhs(A, B):
    return B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])


@lowering(aten._linalg_solve_ex.default)
def linalg_solve_ex(A, B, left=True, check_errors=False):
    lu, pivots, info = _lu_factor(A)
    if _is_vector_rhs(A, B):
        return _lu_solve_sided(lu, pivots, B[..., None], left, False)[..., 0], lu, pivots, info
    return _lu_solve_sided(lu, pivots, B, left, False), lu, pivots, info


@lowering(aten.linalg_inv_ex.default)
def linalg_inv_ex(A, check_errors=False):
    lu, pivots, info = _lu_factor(A)
    eye = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)
    return _lu_solve(lu, pivots, eye), info


def _lu_sign_and_diagonal(lu, pivots):
    """det(A) = sign * prod(diagonal) with sign the parity of the row exchanges."""
    swaps = jnp.count_nonzero(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=pivots.dtype), axis=-1)
    return jnp.where(swaps % 2 == 1, -1, 1).astype(lu.dtype), jnp.diagonal(lu, axis1=-2, axis2=-1)


@lowering(aten._linalg_det.default)
def linalg_det(A):
    lu, pivots = _factor_for_det(A)
    sign, diagonal = _lu_sign_and_diagonal(lu, pivots)
    return sign * jnp.prod(diagonal, axis=-1), lu, pivots


@lowering(aten._linalg_slogdet.default)
def linalg_slogdet(A):
    lu, pivots = _factor_for_det(A)
    sign, diagonal = _lu_sign_and_diagonal(lu, pivots)
    magnitude = jnp.abs(diagonal)
    unit = jnp.where(magnitude == 0, 0, diagonal / jnp.where(magnitude == 0, 1, magnitude))
    return sign * jnp.prod(unit, axis=-1), jnp.sum(jnp.log(magnitude), axis=-1), lu, pivots


@lowering(aten.triangular_solve.default)
def triangular_solve(self, A, upper=True, transpose=False, unitriangular=False):
    """`transpose` is a plain transpose, also for complex A."""
    a = jnp.swapaxes(A, -1, -2) if transpose else A
    return _triangular_solve(a, self, lower=upper == transpose, unit_diagonal=unitriangular), A


@lowering(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(self, B, upper, left=True, unitriangular=False):
    return _triangular_solve(self, B, lower=not upper, left=left, unit_diagonal=unitriangular)


@lowering(aten.linalg_qr.default)
def linalg_qr(A, mode="reduced"):
    if mode == "r":
        return jnp.zeros((0,), A.dtype), jnp.linalg.qr(A, mode="r")
    return jnp.linalg.qr(A, mode=mode)


@lowering(aten.linalg_householder_product.default)
def linalg_householder_product(input, tau):
    return jax.lax.linalg.householder_product(input, tau)


@lowering(aten._linalg_svd.default)
def linalg_svd(A, full_matrices=False, compute_uv=True, driver=None):
    if not compute_uv:
        empty = jnp.zeros((0,), A.dtype)
        return empty, jnp.linalg.svd(A, compute_uv=False), empty
    return tuple(jnp.linalg.svd(A, full_matrices=full_matrices))


@lowering(aten._linalg_eigh.default)
def linalg_eigh(A, UPLO="L", compute_v=True):
    """Reads only the triangle named by UPLO, like LAPACK's syevd."""
    eigenvalues, eigenvectors = jnp.linalg.eigh(A, UPLO=UPLO, symmetrize_input=False)
    return eigenvalues, eigenvectors if compute_v else jnp.zeros((0,), A.dtype)


@lowering(aten.linalg_cross.default)
def linalg_cross(self, other, dim=-1):
    """In the inputs' (equal) dtype, rounding each product like PyTorch's kernel."""
    self, other = jnp.broadcast_arrays(self, other)
    return jnp.cross(self, other, axis=dim)


@lowering(aten.linalg_matrix_exp.default, promote=Promote.DEFAULT)
def linalg_matrix_exp(self):
    """Pade approximation (JAX) where PyTorch uses a Taylor polynomial: the two differ by a few
    ulps for large norms. bfloat16 is computed in float32 and rounded once."""
    return jax.scipy.linalg.expm(self)


@handler(aten._linalg_check_errors.default)
def linalg_check_errors(sig, values):
    """PyTorch raises its own error from `info` read on the host. CUDA syncs here on every call; on
    `tpu` the check waits for the next host read (`modes.check_on_device`), so a loop of small solves
    (a UniPC scheduler step) never waits for the device."""
    info, api_name, is_matrix = values
    modes.check_on_device(info, lambda info: aten._linalg_check_errors(info, api_name, is_matrix=is_matrix))


# XLA has a non-symmetric eigensolver only on the CPU platform: these ops run on PyTorch's CPU
# kernels through the fallback, and without it the error says why.
@handler(aten.linalg_eig, aten.linalg_eigvals.out, aten._linalg_eigvals)
def linalg_eig_on_cpu(sig, values):
    if not dispatch.cpu_fallback_enabled():
        raise NotImplementedError(
            f"{dispatch.unsupported(sig, values)} XLA has no non-symmetric eigensolver off the CPU, so "
            "linalg.eig and linalg.eigvals need the CPU fallback; for symmetric or Hermitian matrices, "
            "torch.linalg.eigh and eigvalsh run on tpu."
        )
    return dispatch.cpu_fallback(sig, values)


# --- Least squares: every driver through the SVD, with PyTorch's CPU outputs per driver.

_LSTSQ_DRIVERS = ("gels", "gelsy", "gelsd", "gelss")


def _check_lstsq_args(A, B, driver):
    if driver not in _LSTSQ_DRIVERS:
        raise RuntimeError("torch.linalg.lstsq: parameter `driver` should be one of (gels, gelsy, gelsd, gelss)")
    if A.ndim < 2:
        raise RuntimeError("torch.linalg.lstsq: input must have at least 2 dimensions.")
    if B.ndim < 1:
        raise RuntimeError("torch.linalg.lstsq: other must have at least 1 dimension.")
    if not 0 <= A.ndim - B.ndim <= 1:
        raise RuntimeError(
            "torch.linalg.lstsq: input.dim() must be greater or equal to other.dim() and "
            "(input.dim() - other.dim()) <= 1"
        )
    if A.dtype != B.dtype:
        raise RuntimeError(
            "torch.linalg.lstsq: Expected input and other to have the same dtype, but got input's dtype "
            f"{dtypes.to_torch(A.dtype)} and other's dtype {dtypes.to_torch(B.dtype)}"
        )
    rows_of_B = B.shape[-1] if A.ndim - B.ndim == 1 else B.shape[-2]
    if A.shape[-2] != rows_of_B:
        raise RuntimeError("torch.linalg.lstsq: input.size(-2) should match other.size(-2)")


@lowering(aten.linalg_lstsq.default)
def linalg_lstsq(self, b, rcond=None, *, driver=None):
    """The minimum-norm solution from the SVD, singular values at most `rcond` times the largest
    treated as zero: what gelsd/gelss compute, and what gels and gelsy compute for the matrices
    they are meant for (full rank; gelsy's rank comes from a pivoted QR, which agrees away from
    the threshold). As on PyTorch's CPU (default driver gelsy): `rank` for all but gels, singular
    values for gelsd/gelss, residuals for m > n and drivers other than gelsy, and for gelsd/gelss
    only when every matrix has full rank, which makes their shape depend on the data (a sync).
    Outputs a driver does not give are empty (0,) tensors."""
    driver = "gelsy" if driver is None else driver.lower()
    _check_lstsq_args(self, b, driver)
    vector_rhs = self.ndim - b.ndim == 1
    A, B = _broadcast_batch(self, b[..., None] if vector_rhs else b)
    m, n = A.shape[-2:]
    real_dtype = jnp.finfo(A.dtype).dtype
    if rcond is None:
        rcond = jnp.finfo(A.dtype).eps * max(m, n)
    u, s, vh = jnp.linalg.svd(A, full_matrices=False)
    kept = s > rcond * s[..., :1]
    inverse_s = jnp.where(kept, 1 / jnp.where(kept, s, 1), 0).astype(A.dtype)
    projected = matmul(_mH(u), B)  # U^H B
    solution = matmul(_mH(vh), inverse_s[..., None] * projected)
    rank = jnp.count_nonzero(kept, axis=-1).astype(jnp.int64)
    empty = jnp.zeros((0,), real_dtype)
    residuals = empty
    if m > n and driver != "gelsy" and (driver == "gels" or bool(jnp.all(rank == n))):
        residuals = jnp.sum(jnp.abs(B - matmul(u, projected)) ** 2, axis=-2).astype(real_dtype)
        if driver == "gels" and A.size == 0:  # PyTorch's gels skips LAPACK for an empty A: zeros
            residuals = jnp.zeros_like(residuals)
    return (
        solution[..., 0] if vector_rhs else solution,
        residuals,
        jnp.zeros((0,), jnp.int64) if driver == "gels" else rank,
        s if driver in ("gelsd", "gelss") else empty,
    )
