"""Matrix products and linear algebra.

Float32 products follow `torch.get_float32_matmul_precision()` (which `allow_tf32` also sets), read
when the program is traced; bfloat16/float16 products accumulate in float32 and round once, like
PyTorch's CPU and CUDA kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from .registry import lowering

aten = torch.ops.aten

_PRECISIONS = {
    "highest": jax.lax.Precision.HIGHEST,
    "high": jax.lax.Precision.HIGH,
    "medium": jax.lax.Precision.DEFAULT,
}


def matmul_precision():
    """JAX precision for float32 products. Read at trace time, so the dispatch cache key must
    include `torch.get_float32_matmul_precision()` for a change to take effect."""
    return _PRECISIONS[torch.get_float32_matmul_precision()]


def accumulation_dtype(dtype):
    """Low-precision floats accumulate in float32; small integers in int32 (which wraps to the same
    result when cast back); others in their own dtype."""
    if dtype in (jnp.bfloat16, jnp.float16):
        return jnp.float32
    if jnp.issubdtype(dtype, jnp.integer) and jnp.dtype(dtype).itemsize < 4:
        return jnp.int32
    return dtype


def dot(a, b, dimension_numbers):
    """`lax.dot_general` with PyTorch's precision and accumulation; the caller casts the result."""
    return jax.lax.dot_general(
        a,
        b,
        dimension_numbers,
        precision=matmul_precision(),
        preferred_element_type=accumulation_dtype(jnp.result_type(a, b)),
    )


def _matmul(a, b):
    """(..., n, k) @ (..., k, m) with equal batch dims."""
    batch = tuple(range(a.ndim - 2))
    return dot(a, b, (((a.ndim - 1,), (b.ndim - 2,)), (batch, batch)))


def _scaled_sum(self, product, beta, alpha):
    """beta * self + alpha * product, where beta == 0 ignores self (NaN and inf included). The
    scalars take the product's dtype first (PyTorch truncates 0.5 to 0 for integer tensors)."""
    self = self.astype(product.dtype)
    beta, alpha = jnp.asarray(beta).astype(product.dtype), jnp.asarray(alpha).astype(product.dtype)
    return jnp.where(beta == 0, jnp.zeros_like(self), beta * self) + alpha * product


@lowering(aten.mm.default, aten.bmm.default, aten._int_mm.default)
def mm(self, mat2):
    return _matmul(self, mat2)


@lowering(aten.mm.dtype, aten.bmm.dtype)
def mm_out_dtype(self, mat2, out_dtype):
    return _matmul(self, mat2)


@lowering(aten.addmm.default, aten.baddbmm.default)
def addmm(self, mat1, mat2, beta=1, alpha=1):
    return _scaled_sum(self, _matmul(mat1, mat2), beta, alpha)


@lowering(aten.addmm.dtype, aten.baddbmm.dtype)
def addmm_out_dtype(self, mat1, mat2, out_dtype, beta=1, alpha=1):
    return _scaled_sum(self, _matmul(mat1, mat2), beta, alpha)


@lowering(aten.addbmm.default)
def addbmm(self, batch1, batch2, beta=1, alpha=1):
    return _scaled_sum(self, dot(batch1, batch2, (((0, 2), (0, 1)), ((), ()))), beta, alpha)


@lowering(aten.addmv.default)
def addmv(self, mat, vec, beta=1, alpha=1):
    return _scaled_sum(self, mv(mat, vec), beta, alpha)


@lowering(aten.addr.default)
def addr(self, vec1, vec2, beta=1, alpha=1):
    """Elementwise in the tensors' dtype, like PyTorch's kernel: bool is `beta & self | alpha & outer`."""
    dtype = jnp.result_type(self, vec1, vec2)
    beta, alpha = jnp.asarray(beta).astype(dtype), jnp.asarray(alpha).astype(dtype)
    if dtype == jnp.bool_:
        return (beta & self) | (alpha & vec1[:, None] & vec2[None, :])
    scaled = alpha * vec1[:, None] * vec2[None, :]
    return jnp.where(beta == 0, scaled, beta * self + scaled)


@lowering(aten.mv.default)
def mv(self, vec):
    return dot(self, vec, (((1,), (0,)), ((), ())))


@lowering(aten.dot.default)
def dot_product(self, other):
    return dot(self, other, (((0,), (0,)), ((), ())))


@lowering(aten.vdot.default)
def vdot(self, other):
    return dot(jnp.conj(self), other, (((0,), (0,)), ((), ())))


def _ragged_dot(lhs, rhs, group_sizes, lhs_ragged, rhs_group, contracting):
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(contracting, ((), ())),
        lhs_ragged_dimensions=[lhs_ragged],
        rhs_group_dimensions=rhs_group,
    )
    return jax.lax.ragged_dot_general(
        lhs,
        rhs,
        group_sizes,
        numbers,
        precision=matmul_precision(),
        preferred_element_type=accumulation_dtype(jnp.result_type(lhs, rhs)),
    )


@lowering(aten._grouped_mm.default)
def grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    """Groups are given by `offs` (cumulative ends) along the ragged dimension: the rows of a 2-D
    `self` against a 3-D `mat2`, the shared dimension of two 2-D operands, or the columns of a 2-D
    `mat2` against a 3-D `self`. Rows/columns past the last offset are zeros."""
    if self.ndim == 3 and mat2.ndim == 3:
        return _matmul(self, mat2)
    group_sizes = jnp.diff(offs.astype(jnp.int32), prepend=0)
    if self.ndim == 2 and mat2.ndim == 3:  # (m, k) x (g, k, n) -> (m, n)
        return _ragged_dot(self, mat2, group_sizes, 0, [0], ((1,), (1,)))
    if self.ndim == 2:  # (m, K) x (K, n) -> (g, m, n)
        return _ragged_dot(self, mat2, group_sizes, 1, [], ((1,), (0,)))
    # (g, m, k) x (k, N) -> (m, N): as the transposed (N, k) x (g, k, m) -> (N, m)
    return _ragged_dot(mat2.T, jnp.swapaxes(self, 1, 2), group_sizes, 0, [0], ((1,), (1,))).T
