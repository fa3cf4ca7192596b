"""Matrix products and linear algebra.

Float32 products follow `torch.get_float32_matmul_precision()` (which `allow_tf32` also sets), read
when the program is traced; bfloat16/float16 products accumulate in float32 and round once, like
PyTorch's CPU and CUDA kernels (on a TPU, where the matrix unit does so by itself, a bfloat16 product of
many rows is asked for in bfloat16: `_product_dtype`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import torch

from .. import dispatch, dtypes, modes, platform
from ..dispatch import Promote, handler, lowering
from ..kernels import grouped_matmul
from ..kernels import selection as kernel_selection
from ..memory import buffer

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


# the rows (a product's left side's elements per contracted element) from which a TPU asks for a bfloat16 product
# in bfloat16; see `_product_dtype`
_BFLOAT16_PRODUCT_ROWS = 8192


def _product_dtype(dtype, rows: int):
    """The dtype `dot` asks XLA for, for a product whose left side has `rows` rows. On a TPU a bfloat16 product
    of `_BFLOAT16_PRODUCT_ROWS` rows or more is asked for in bfloat16 (the matrix unit accumulates in float32
    either way); below, in float32 and then rounded, as everywhere else. Which is faster depends on the layouts
    and fusions XLA then picks, measured on the v5e with the 1.1B Llama's compiled forward (2026-12-06):

    - at 8x1024 (8192 rows), asked for in float32, XLA laid the residual stream out token-minor from the first
      linear layer on and relaid it around every layer's attention: 133.20 ms a call, against 125.63 ms asked
      for in bfloat16 with `buffer.Flattened` inputs (133.29 ms in bfloat16 without them);
    - at 1x1024 (1024 rows), asked for in bfloat16, XLA's fusion of each down projection with the residual add
      and the next norm's statistics took 345 us against 189 us: 18.61 ms a call against 16.28 ms (device
      16.69 against 14.20 ms). At 1x4096 the forward took 78.3 ms (bfloat16) against 75.3 ms (float32, an
      earlier run); at 1x128 5.0 against 5.3 ms. The crossover between 4096 and 8192 rows is not measured.

    Raw JAX (`benchmarks.linear_layouts`) gives logits within 0.07 of the float32 form's for both. A product
    split over chips (a row-parallel linear layer) may then be summed across them in bfloat16, as Megatron-LM's
    row-parallel layers sum theirs. A product with an epilogue (`dot`'s) keeps float32 everywhere: a linear
    layer with a bias (`addmm`) adds it before the one rounding, as PyTorch does."""
    if dtype == jnp.bfloat16 and platform.name() == "tpu" and rows >= _BFLOAT16_PRODUCT_ROWS:
        return dtype
    return accumulation_dtype(dtype)


def dot(a, b, dimension_numbers, epilogue: bool = False):
    """`lax.dot_general` with PyTorch's precision and accumulation; the caller casts the result. `epilogue`: the
    caller adds to the product (addmm's `beta * self`) or casts it to a dtype of its own before it is rounded, so
    it is asked for in its accumulation dtype on every platform, rounded once as PyTorch's CPU kernels round it.
    A precision is a float product's choice: an integer product (int8 x int8 -> int32, the TPU's int8 matrix unit)
    asks for none."""
    dtype = jnp.result_type(a, b)
    rows = math.prod(n for d, n in enumerate(a.shape) if d not in dimension_numbers[0][0])
    precision = matmul_precision() if jnp.issubdtype(dtype, jnp.inexact) else None
    product = functools.partial(jax.lax.dot_general, precision=precision,
                                preferred_element_type=accumulation_dtype(dtype) if epilogue
                                else _product_dtype(dtype, rows))
    vector_side = _half_precision_vector_on_cpu(a, b, dimension_numbers)
    if vector_side is None:
        return product(a, b, dimension_numbers)
    return _vector_as_two_rows(product, a, b, dimension_numbers, vector_side)


def _free_dims(x, contracting, batch) -> list:
    return [d for d in range(x.ndim) if d not in contracting and d not in batch]


def _half_precision_vector_on_cpu(a, b, dimension_numbers) -> int | None:
    """The side (0 or 1) of a bfloat16/float16 product on the CPU whose free dimensions hold one element (a matrix
    times a vector: a batch-1 decode step's every linear layer, the prefill's last-position logits) while the other
    side's hold more; None for any other product. XLA:CPU runs such a product through a float32 copy of the other
    side, made at every call: an 8192x2048 bfloat16 weight times one row took 17.7 ms on the development CPU, times
    two rows 1.3 ms (float32 operands take the vector path at 1.4 ms, and lose with two rows)."""
    if platform.name() != "cpu" or jnp.result_type(a, b) not in (jnp.bfloat16, jnp.float16):
        return None
    (contracting_a, contracting_b), (batch_a, batch_b) = dimension_numbers
    free_a = math.prod(a.shape[d] for d in _free_dims(a, contracting_a, batch_a))
    free_b = math.prod(b.shape[d] for d in _free_dims(b, contracting_b, batch_b))
    if free_a == 1 < free_b:
        return 0
    if free_b == 1 < free_a:
        return 1
    return None


def _vector_as_two_rows(product, a, b, dimension_numbers, vector_side: int):
    """`product(a, b, dimension_numbers)` with the vector side given a second row of zeros (along its free dimension
    of size 1, or a new one just before its contracted dimension, the layout of a row), which XLA:CPU multiplies
    without a float32 copy of the other side (see `_half_precision_vector_on_cpu`); the product's first row is
    what the vector alone gives."""
    contracting, batch = [list(dims) for dims in dimension_numbers]
    operands = [a, b]
    vector = operands[vector_side]
    free = _free_dims(vector, contracting[vector_side], batch[vector_side])
    axis = free[0] if free else min(contracting[vector_side])
    if not free:
        vector = jnp.expand_dims(vector, axis)
        contracting[vector_side], batch[vector_side] = (tuple(d + (d >= axis) for d in dims) for dims in
                                                        (contracting[vector_side], batch[vector_side]))
    operands[vector_side] = jnp.pad(vector, [(0, int(d == axis)) for d in range(vector.ndim)])
    out = product(*operands, (tuple(contracting), tuple(batch)))
    # the output's dims: the batch dims, the left side's free dims, then the right side's
    position = len(batch[0]) + (0 if vector_side == 0 else len(_free_dims(a, contracting[0], batch[0])))
    first = jax.lax.slice_in_dim(out, 0, 1, axis=position)
    return first if free else jnp.squeeze(first, position)


def _matmul(a, b, epilogue: bool = False):
    """(..., n, k) @ (..., k, m) with equal batch dims; either side may be `buffer.Transposed`, whose
    array holds the matrix with its last two dims swapped, contracted where it lies; the left one may be
    `buffer.Flattened` (2-d products only), contracted in its buffer's shape, the product then flattened.
    `epilogue` as in `dot`."""
    b, rhs_contracted = (b.array, b.array.ndim - 1) if type(b) is buffer.Transposed else (b, b.ndim - 2)
    if type(a) is buffer.Flattened:
        product = dot(a.array, b, (((a.array.ndim - 1,), (rhs_contracted,)), ((), ())), epilogue)
        return product.reshape(-1, product.shape[-1])
    a, lhs_contracted = (a.array, a.array.ndim - 2) if type(a) is buffer.Transposed else (a, a.ndim - 1)
    batch = tuple(range(a.ndim - 2))
    return dot(a, b, (((lhs_contracted,), (rhs_contracted,)), (batch, batch)), epilogue)


def _scaled_sum(self, product, beta, alpha):
    """beta * self + alpha * product, where beta == 0 ignores self (NaN and inf included). The
    scalars take the product's dtype first (PyTorch truncates 0.5 to 0 for integer tensors)."""
    self = self.astype(product.dtype)
    beta, alpha = jnp.asarray(beta).astype(product.dtype), jnp.asarray(alpha).astype(product.dtype)
    return jnp.where(beta == 0, jnp.zeros_like(self), beta * self) + alpha * product


# PyTorch's CPU kernels reject operands of different dtypes (which its meta kernels let through), each
# op with its own message; these raise the same, when a call's program is built (`Lowering.type_check`)
_SCALAR_TYPE = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
                torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
                torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat",
                torch.complex128: "ComplexDouble"}
_CPP_TYPE = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
             torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int", torch.int16: "short int",
             torch.int8: "signed char", torch.uint8: "unsigned char", torch.bool: "bool",
             torch.complex64: "c10::complex<float>", torch.complex128: "c10::complex<double>"}


def _scalar_type(t):
    return _SCALAR_TYPE.get(t.dtype, str(t.dtype).replace("torch.", ""))


def _cpp_type(t):
    return _CPP_TYPE.get(t.dtype, str(t.dtype).replace("torch.", ""))


def _same_dtype_mm(values):
    self, mat2 = values[0], values[1]
    if self.dtype != mat2.dtype:
        raise RuntimeError(
            f"expected m1 and m2 to have the same dtype, but got: {_cpp_type(self)} != {_cpp_type(mat2)}")


def _same_dtype_bmm(values):
    self, mat2 = values[0], values[1]
    if self.dtype != mat2.dtype:
        raise RuntimeError(f"expected scalar type {_scalar_type(self)} but found {_scalar_type(mat2)}")


def _same_dtype_addmm(values):  # addmm, addbmm: self against mat2 first, then mat1 against mat2
    self, mat1, mat2 = values[0], values[1], values[2]
    if self.dtype != mat2.dtype:
        raise RuntimeError(
            f"self and mat2 must have the same dtype, but got {_scalar_type(self)} and {_scalar_type(mat2)}")
    if mat1.dtype != mat2.dtype:
        raise RuntimeError(
            f"mat1 and mat2 must have the same dtype, but got {_scalar_type(mat1)} and {_scalar_type(mat2)}")


def _same_dtype_baddbmm(values):
    self, batch1, batch2 = values[0], values[1], values[2]
    if self.dtype != batch1.dtype:
        raise RuntimeError(f"Input dtypes must be the same, got: input {_cpp_type(self)}, batch1: {_cpp_type(batch1)}, "
                           f"batch2: {_cpp_type(batch2)}")
    _same_dtype_bmm(values[1:])


def _same_dtype_addmv(values):
    self, mat, vec = values[0], values[1], values[2]
    if not self.dtype == mat.dtype == vec.dtype:
        raise RuntimeError(f"addmv input tensors must have the same dtype, but got {_scalar_type(self)}, "
                           f"{_scalar_type(mat)}, and {_scalar_type(vec)}")


def _same_dtype_mv(values):  # PyTorch's mv is addmv into a result of the vector's dtype
    _same_dtype_addmv([values[1], values[0], values[1]])


def _same_dtype_dot(values):  # dot and vdot
    self, other = values[0], values[1]
    if self.dtype != other.dtype:
        raise RuntimeError(f"dot : expected both vectors to have same dtype, but found {_scalar_type(self)} and "
                           f"{_scalar_type(other)}")


@lowering(aten.mm.default, aten._int_mm.default, transposed=("self", "mat2"), flattened=("self",),
          type_check=_same_dtype_mm)
def mm(self, mat2):
    return _matmul(self, mat2)


lowering(aten.bmm.default, transposed=("self", "mat2"), type_check=_same_dtype_bmm)(mm)


@lowering(aten.mm.dtype, aten.bmm.dtype, transposed=("self", "mat2"))
def mm_out_dtype(self, mat2, out_dtype):
    return _matmul(self, mat2, epilogue=True)


@lowering(aten.addmm.default, transposed=("mat1", "mat2"), flattened=("mat1",), type_check=_same_dtype_addmm)
def addmm(self, mat1, mat2, beta=1, alpha=1):
    return _scaled_sum(self, _matmul(mat1, mat2, epilogue=True), beta, alpha)


lowering(aten.baddbmm.default, transposed=("batch1", "batch2"), type_check=_same_dtype_baddbmm)(addmm)


@lowering(aten.addmm.dtype, aten.baddbmm.dtype, transposed=("mat1", "mat2", "batch1", "batch2"))
def addmm_out_dtype(self, mat1, mat2, out_dtype, beta=1, alpha=1):
    return _scaled_sum(self, _matmul(mat1, mat2, epilogue=True), beta, alpha)


@lowering(aten.addbmm.default, type_check=_same_dtype_addmm)
def addbmm(self, batch1, batch2, beta=1, alpha=1):
    return _scaled_sum(self, dot(batch1, batch2, (((0, 2), (0, 1)), ((), ())), epilogue=True), beta, alpha)


@lowering(aten.addmv.default, type_check=_same_dtype_addmv)
def addmv(self, mat, vec, beta=1, alpha=1):
    return _scaled_sum(self, dot(mat, vec, (((1,), (0,)), ((), ())), epilogue=True), beta, alpha)


@lowering(aten.addr.default)
def addr(self, vec1, vec2, beta=1, alpha=1):
    """Elementwise in the tensors' dtype, like PyTorch's kernel: bool is `beta & self | alpha & outer`."""
    dtype = jnp.result_type(self, vec1, vec2)
    beta, alpha = jnp.asarray(beta).astype(dtype), jnp.asarray(alpha).astype(dtype)
    if dtype == jnp.bool_:
        return (beta & self) | (alpha & vec1[:, None] & vec2[None, :])
    scaled = alpha * vec1[:, None] * vec2[None, :]
    return jnp.where(beta == 0, scaled, beta * self + scaled)


@lowering(aten.mv.default, type_check=_same_dtype_mv)
def mv(self, vec):
    return dot(self, vec, (((1,), (0,)), ((), ())))


@lowering(aten.dot.default, type_check=_same_dtype_dot)
def dot_product(self, other):
    return dot(self, other, (((0,), (0,)), ((), ())))


@lowering(aten.vdot.default, type_check=_same_dtype_dot)
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
        # a precision is a float32 product's choice; on a TPU, ragged_dot's Pallas lowering refuses
        # bfloat16 operands with float32 contract precision ("Bad lhs type", v5e, 2026-12-04)
        precision=matmul_precision() if jnp.result_type(lhs, rhs) == jnp.float32 else None,
        preferred_element_type=accumulation_dtype(jnp.result_type(lhs, rhs)),
    )


# PyTorch's meta kernel accepts only bfloat16 off the CPU (a CUDA kernel's limit); XLA has none, and
# Transformers' MoE layers call grouped_mm on tpu in every dtype (torch.compile's meta: below).
@lowering(aten._grouped_mm.default, own_shapes=True)
def grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    """Groups are given by `offs` (cumulative ends) along the ragged dimension: the rows of a 2-D
    `self` against a 3-D `mat2`, the shared dimension of two 2-D operands, or the columns of a 2-D
    `mat2` against a 3-D `self`. Rows/columns past the last offset are zeros. On a TPU the first two
    forms run megablox's Pallas kernels where they apply (`_grouped_kernel_applies`)."""
    result = _grouped_product(self, mat2, offs)
    if bias is not None:
        result = result + bias
    return result.astype(dtypes.to_jax(out_dtype) if out_dtype is not None else self.dtype)


def _grouped_mm_shape(mat_a, mat_b, offs) -> tuple:
    if mat_a.dim() == 3 and mat_b.dim() == 3:
        return (mat_a.shape[0], mat_a.shape[1], mat_b.shape[2])
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        return (mat_a.shape[0], mat_b.shape[2])
    if mat_a.dim() == 2:
        return (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    return (mat_a.shape[1], mat_b.shape[1])


def _install_grouped_mm_meta() -> None:
    """`torch.compile`'s fake tensors run PyTorch's meta kernel, which checks what the CUDA kernel needs
    (bfloat16, 16-byte aligned strides): a float32 MoE decode step broke its graph there. On tpu the
    lowering above has none of those limits, so tpu tensors get its shape rule; others keep PyTorch's."""
    from torch._decomp import meta_table

    op = aten._grouped_mm.default
    pytorch_meta = meta_table[op]

    def meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        device = getattr(mat_a, "fake_device", mat_a.device)  # a fake tensor's own device reads "meta" here
        if device.type != "tpu" or not (mat_a.is_floating_point() and mat_b.dtype == mat_a.dtype):
            return pytorch_meta(mat_a, mat_b, offs, bias, out_dtype)
        return mat_a.new_empty(_grouped_mm_shape(mat_a, mat_b, offs), dtype=out_dtype or mat_a.dtype)

    meta_table[op] = meta
    op.py_kernels.pop(torch._C.DispatchKey.Meta, None)
    op.py_impl(torch._C.DispatchKey.Meta)(meta)


_install_grouped_mm_meta()


def _grouped_kernel_applies(lhs, rhs, transposed: bool) -> bool:
    """Whether megablox's Pallas kernel computes this grouped product (`hf_tpu.kernels.grouped_matmul`):
    where Pallas is enabled, for the shapes and dtypes it takes, in float32 only below the "highest"
    matmul precision."""
    if not kernel_selection.pallas_enabled():
        return False
    if lhs.dtype == jnp.float32 and matmul_precision() == jax.lax.Precision.HIGHEST:
        return False
    return grouped_matmul.unsupported(lhs, rhs, transposed=transposed) is None


def _grouped_product(self, mat2, offs):
    if self.ndim == 3 and mat2.ndim == 3:
        return _matmul(self, mat2)
    group_sizes = jnp.diff(offs.astype(jnp.int32), prepend=0)
    out_dtype = accumulation_dtype(jnp.result_type(self, mat2))
    if self.ndim == 2 and mat2.ndim == 3:  # (m, k) x (g, k, n) -> (m, n)
        if _grouped_kernel_applies(self, mat2, transposed=False):
            return grouped_matmul.gmm(self, mat2, group_sizes, out_dtype=out_dtype)
        return _ragged_dot(self, mat2, group_sizes, 0, [0], ((1,), (1,)))
    if self.ndim == 2:  # (m, K) x (K, n) -> (g, m, n)
        if _grouped_kernel_applies(self, mat2, transposed=True):
            return grouped_matmul.tgmm(self, mat2, group_sizes, out_dtype=out_dtype)
        return _ragged_dot(self, mat2, group_sizes, 1, [], ((1,), (0,)))
    # (g, m, k) x (k, N) -> (m, N): as the transposed (N, k) x (g, k, m) -> (N, m)
    return _ragged_dot(mat2.T, jnp.swapaxes(self, 1, 2), group_sizes, 0, [0], ((1,), (1,))).T


# --- Decompositions and solvers.
#
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
    projected = _matmul(_mH(u), B)  # U^H B
    solution = _matmul(_mH(vh), inverse_s[..., None] * projected)
    rank = jnp.count_nonzero(kept, axis=-1).astype(jnp.int64)
    empty = jnp.zeros((0,), real_dtype)
    residuals = empty
    if m > n and driver != "gelsy" and (driver == "gels" or bool(jnp.all(rank == n))):
        residuals = jnp.sum(jnp.abs(B - _matmul(u, projected)) ** 2, axis=-2).astype(real_dtype)
        if driver == "gels" and A.size == 0:  # PyTorch's gels skips LAPACK for an empty A: zeros
            residuals = jnp.zeros_like(residuals)
    return (
        solution[..., 0] if vector_rhs else solution,
        residuals,
        jnp.zeros((0,), jnp.int64) if driver == "gels" else rank,
        s if driver in ("gelsd", "gelss") else empty,
    )


# --- Pairwise distances (cdist, pdist), with the p-norm cases of PyTorch's CPU kernels.


def _p_distance(diff, p):
    """The p-norm of `diff` along its last axis; p = 0 counts the nonzero differences."""
    magnitude = jnp.abs(diff)
    if p == 0:
        return jnp.sum(magnitude != 0, axis=-1).astype(diff.dtype)
    if p == 1:
        return jnp.sum(magnitude, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(magnitude * magnitude, axis=-1))
    if p == float("inf"):
        return jnp.max(magnitude, axis=-1, initial=0)
    return jnp.sum(magnitude**p, axis=-1) ** (1 / p)


def _p_distance_grad(diff, distance, p):
    """d distance / d diff, elementwise; 0 where the distance is 0, as on CPU."""
    sign = jnp.sign(diff)
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return sign
    distance = distance[..., None]
    safe = jnp.where(distance == 0, 1, distance)
    if p == float("inf"):
        grad = sign * (jnp.abs(diff) == distance)
    elif p == 2:
        grad = diff / safe
    else:
        # p < 2 leaves |diff|^(p - 1) undefined at 0: CPU takes 0 there
        grad = sign * jnp.where(diff == 0, 0, jnp.abs(diff) ** (p - 1)) / safe ** (p - 1)
    return jnp.where(distance == 0, 0, grad)


def _cdist_operands(x1, x2):
    """x1 (..., P, M) and x2 (..., R, M) with their batch dims broadcast."""
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    return jnp.broadcast_to(x1, batch + x1.shape[-2:]), jnp.broadcast_to(x2, batch + x2.shape[-2:])


def _uses_matmul(x1, x2, p, compute_mode):
    """PyTorch's choice for p = 2: through matrix products when asked (1), or by default (None, 0)
    when either side has more than 25 rows; never for 2."""
    mode = compute_mode or 0
    return p == 2 and (mode == 1 or (mode == 0 and (x1.shape[-2] > 25 or x2.shape[-2] > 25)))


def _euclidean_distance_by_matmul(x1, x2):
    """PyTorch's `_euclidean_dist`: |a|^2 - 2 a.b + |b|^2 as one product, clamped, square-rooted."""
    x1_norm = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    x2_norm = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    left = jnp.concatenate([-2 * x1, x1_norm, jnp.ones_like(x1_norm)], axis=-1)
    right = jnp.concatenate([x2, jnp.ones_like(x2_norm), x2_norm], axis=-1)
    return jnp.sqrt(jnp.maximum(_matmul(left, jnp.swapaxes(right, -1, -2)), 1e-30))


@lowering(aten._cdist_forward.default)
def _cdist_forward(x1, x2, p, compute_mode):
    x1, x2 = _cdist_operands(x1, x2)
    if x1.shape[-1] == 0:
        return jnp.zeros(x1.shape[:-1] + x2.shape[-2:-1], x1.dtype)
    if _uses_matmul(x1, x2, p, compute_mode):
        return _euclidean_distance_by_matmul(x1, x2)
    return _p_distance(x1[..., :, None, :] - x2[..., None, :, :], p)


@lowering(aten._cdist_backward.default)
def _cdist_backward(grad, x1, x2, p, cdist):
    """The gradient for x1 in its batch-broadcast shape (autograd sums it down to x1's); zeros in
    x1's own shape when anything is empty, as on CPU."""
    if x1.size == 0 or x2.size == 0:
        return jnp.zeros_like(x1)
    x1, x2 = _cdist_operands(x1, x2)
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    return jnp.sum(grad[..., None] * _p_distance_grad(diff, cdist, p), axis=-2)


def _pairs(n):
    """The (i, j), i < j, row by row: pdist's order."""
    return jnp.triu_indices(n, 1)


@lowering(aten._pdist_forward.default)
def _pdist_forward(self, p=2.0):
    first, second = _pairs(self.shape[0])
    return _p_distance(self[first] - self[second], p)


@lowering(aten._pdist_backward.default)
def _pdist_backward(grad, self, p, pdist):
    first, second = _pairs(self.shape[0])
    pair_grad = grad[:, None] * _p_distance_grad(self[first] - self[second], pdist, p)
    return jnp.zeros_like(self).at[first].add(pair_grad).at[second].add(-pair_grad)


def _install_out_dtype() -> None:
    """`torch._higher_order_ops.out_dtype(aten.mm, torch.int32, a, b)` with int8 operands on tpu: the product of
    the int8 matrices counted in int32, through `_int_mm`, whose lowering asks XLA for int32 products of the int8
    operands (on a TPU, its int8 matrix unit, at twice the bfloat16 unit's rate). PyTorch's own rule off CUDA
    casts both operands to int32 first, a product of int32 matrices. torchao's int8 activation-and-weight layers
    call it (`safe_int_mm`) under `torch.compile` and in `hf_tpu.jit`'s trace; other calls keep PyTorch's rule."""
    from torch._higher_order_ops.out_dtype import out_dtype, out_dtype_fallback

    @out_dtype.py_impl(torch._C.DispatchKey.PrivateUse1)
    def out_dtype_on_tpu(op, output_dtype, *args):
        if (op is aten.mm.default and output_dtype == torch.int32 and len(args) == 2
                and args[0].dtype == args[1].dtype == torch.int8):
            return torch._int_mm(*args)
        return out_dtype_fallback(op, output_dtype, *args)


_install_out_dtype()
