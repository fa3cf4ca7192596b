"""Matrix products: `dot` (the one way a lowering asks XLA for a product), the mm/bmm/addmm/mv/dot family with
operands handed whole (`tensor_views.Transposed`, `tensor_views.Flattened`), grouped products (`_grouped_mm`, with
megablox's Pallas kernel on a TPU) and int8 products counted in int32 (`out_dtype`).

Float32 and float16 products follow `torch.get_float32_matmul_precision()` (which `allow_tf32` also sets), read
when the program is traced, and bfloat16 ones ask for no precision (`product_precision`); bfloat16/float16
products accumulate in float32 and round once, like PyTorch's CPU and CUDA kernels (on a TPU, where the matrix unit
does so by itself, a bfloat16 product of many rows is asked for in bfloat16: `_product_dtype`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import torch

from .. import dtypes, platform
from ..dispatch import lowering
from ..kernels import grouped_matmul
from ..kernels import selection as kernel_selection
from ..memory import tensor_views

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


def product_precision(dtype):
    """The precision a product of `dtype` operands asks XLA for: the float32 matmul precision for float32 and
    float16 (which a TPU's matrix unit would otherwise take as bfloat16) products, none for bfloat16 ones, whose
    products are exact in the float32 accumulator at any precision: "highest" on bfloat16 operands changes no
    value but XLA's program for a TPU (the 1.1B Llama's 1x128 forward: 29.8k bundles a layer, 26.4k without),
    whose compile time tracks its size. Integer products ask for none."""
    if dtype == jnp.bfloat16 or not jnp.issubdtype(dtype, jnp.inexact):
        return None
    return matmul_precision()


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
      for in bfloat16 with `tensor_views.Flattened` inputs (133.29 ms in bfloat16 without them);
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
    Its precision is `product_precision`'s."""
    dtype = jnp.result_type(a, b)
    rows = math.prod(n for d, n in enumerate(a.shape) if d not in dimension_numbers[0][0])
    product = functools.partial(jax.lax.dot_general, precision=product_precision(dtype),
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


def matmul(a, b, epilogue: bool = False):
    """(..., n, k) @ (..., k, m) with equal batch dims; either side may be `tensor_views.Transposed`, whose
    array holds the matrix with its last two dims swapped, contracted where it lies; the left one may be
    `tensor_views.Flattened` (2-d products only), contracted in its buffer's shape, the product then flattened.
    `epilogue` as in `dot`."""
    b, rhs_contracted = (b.array, b.array.ndim - 1) if type(b) is tensor_views.Transposed else (b, b.ndim - 2)
    if type(a) is tensor_views.Flattened:
        product = dot(a.array, b, (((a.array.ndim - 1,), (rhs_contracted,)), ((), ())), epilogue)
        return product.reshape(-1, product.shape[-1])
    a, lhs_contracted = (a.array, a.array.ndim - 2) if type(a) is tensor_views.Transposed else (a, a.ndim - 1)
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
    return matmul(self, mat2)


lowering(aten.bmm.default, transposed=("self", "mat2"), type_check=_same_dtype_bmm)(mm)


@lowering(aten.mm.dtype, aten.bmm.dtype, transposed=("self", "mat2"))
def mm_out_dtype(self, mat2, out_dtype):
    return matmul(self, mat2, epilogue=True)


@lowering(aten.addmm.default, transposed=("mat1", "mat2"), flattened=("mat1",), type_check=_same_dtype_addmm)
def addmm(self, mat1, mat2, beta=1, alpha=1):
    return _scaled_sum(self, matmul(mat1, mat2, epilogue=True), beta, alpha)


lowering(aten.baddbmm.default, transposed=("batch1", "batch2"), type_check=_same_dtype_baddbmm)(addmm)


@lowering(aten.addmm.dtype, aten.baddbmm.dtype, transposed=("mat1", "mat2", "batch1", "batch2"))
def addmm_out_dtype(self, mat1, mat2, out_dtype, beta=1, alpha=1):
    return _scaled_sum(self, matmul(mat1, mat2, epilogue=True), beta, alpha)


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
        return matmul(self, mat2)
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
