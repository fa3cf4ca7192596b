"""Products with quantized weights whose layout no ATen op names: `hf_tpu::int4_linear`.

Int8 weights need no op of their own: a linear layer of int8 data and scales is PyTorch's own ops (a conversion,
a product, a scaling), which a traced program fuses (XLA converts the int8 data inside the product), and int8
activations times int8 weights are `_int_mm` (`hf_tpu.ops.products`). Int4 weights are two to a byte, and how
they are unpacked decides what a TPU reads: an op of their own keeps that choice in one lowering.

`int4_linear(input, qdata, scale, zero_point, group_size)` is `input @ W.T` (in `input`'s dtype, accumulated in
float32) for the weight `W[n, k] = q[n, k] * scale[k // group_size, n] + zero_point[k // group_size, n]`, where
`qdata` (N, K/2) int8 holds the signed 4-bit `q` two to a byte, column `2j` in the low nibble of byte `j` and
`2j + 1` in the high one: the plain int4 layout of torchao's `Int4Tensor` (mslk's `pack_int4` and
`int4_row_quantize_zp`), whose scales and zero points are (K/group_size, N).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from .. import platform
from ..dispatch import lowering
from ..kernels import int4_matmul as int4_kernel
from ..kernels import selection as kernel_selection
from ..memory import placement
from .products import dot, matmul_precision

_library = torch.library.Library("hf_tpu", "FRAGMENT")
_library.define("int4_linear(Tensor input, Tensor qdata, Tensor scale, Tensor zero_point, int group_size) -> Tensor")


def _check_int4_linear(input, qdata, scale, zero_point, group_size):
    """PyTorch-style errors on every device (the meta kernel)."""
    if qdata.dtype not in (torch.int8, torch.uint8) or qdata.dim() != 2:
        raise RuntimeError(f"hf_tpu.int4_linear: qdata must be a 2-d int8 tensor of packed int4 pairs, got "
                           f"{qdata.dtype} {tuple(qdata.shape)}")
    out_features, in_features = qdata.shape[0], 2 * qdata.shape[1]
    if input.shape[-1] != in_features:
        raise RuntimeError(f"hf_tpu.int4_linear: input {tuple(input.shape)} has {input.shape[-1]} features, the "
                           f"weight {in_features} ({tuple(qdata.shape)} packed)")
    if group_size <= 0 or group_size % 2 or in_features % group_size:
        raise RuntimeError(f"hf_tpu.int4_linear: group_size {group_size} must be even and divide the "
                           f"{in_features} input features")
    groups = (in_features // group_size, out_features)
    if tuple(scale.shape) != groups or tuple(zero_point.shape) != groups:
        raise RuntimeError(f"hf_tpu.int4_linear: scale {tuple(scale.shape)} and zero_point "
                           f"{tuple(zero_point.shape)} must be (in_features / group_size, out_features) = {groups}")


def _unpacked(qdata: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 from (N, K/2) packed pairs, the low nibble first, each sign-extended."""
    qdata = qdata.view(torch.int8)
    low = torch.bitwise_right_shift(torch.bitwise_left_shift(qdata, 4), 4)
    high = torch.bitwise_right_shift(qdata, 4)
    return torch.stack([low, high], dim=-1).reshape(qdata.shape[0], -1)


def dequantized_int4(qdata, scale, zero_point, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight `int4_linear` multiplies by, (N, K) in `dtype` (computed in float32, then rounded once)."""
    q = _unpacked(qdata).float()
    rows, columns = q.shape
    grouped = q.reshape(rows, columns // group_size, group_size)
    weight = grouped * scale.float().t()[:, :, None] + zero_point.float().t()[:, :, None]
    return weight.reshape(rows, columns).to(dtype)


@torch.library.impl("hf_tpu::int4_linear", "cpu", lib=_library)
def _int4_linear_cpu(input, qdata, scale, zero_point, group_size):
    """The reference: the dequantized weight, then PyTorch's linear."""
    _check_int4_linear(input, qdata, scale, zero_point, group_size)
    return torch.nn.functional.linear(input, dequantized_int4(qdata, scale, zero_point, group_size, input.dtype))


@torch.library.register_fake("hf_tpu::int4_linear", lib=_library)
def _int4_linear_fake(input, qdata, scale, zero_point, group_size):
    _check_int4_linear(input, qdata, scale, zero_point, group_size)
    return input.new_empty(*input.shape[:-1], qdata.shape[0])


def _nibbles(qdata):
    """(low, high) int8 halves of the packed pairs, sign-extended: columns 2j and 2j + 1."""
    if qdata.dtype == jnp.uint8:
        qdata = jax.lax.bitcast_convert_type(qdata, jnp.int8)
    return (qdata << 4) >> 4, qdata >> 4


def _takes_kernel(input, qdata, scale, zero_point, group_size) -> bool:
    """Whether this call runs the Pallas kernel (`hf_tpu.kernels.int4_matmul`): where Pallas is enabled
    (`hf_tpu.kernels.selection`), for the shapes it takes (decode's rows and prefill's), in float32 only below the
    "highest" matmul precision, and not on operands split over several chips: XLA's partitioner cannot split a
    Mosaic kernel's call (it would need a `shard_map` around it), so a tensor-parallel layer keeps the XLA form."""
    if not kernel_selection.pallas_enabled():
        return False
    if input.dtype == jnp.float32 and matmul_precision() == jax.lax.Precision.HIGHEST:
        return False
    if placement.traced_over_chips(input, qdata, scale, zero_point):
        return False
    return int4_kernel.unsupported(input, qdata, scale, zero_point, group_size) is None


@lowering(torch.ops.hf_tpu.int4_linear.default)
def int4_linear(input, qdata, scale, zero_point, group_size):
    """On a TPU the Pallas kernel, for any number of rows (`_takes_kernel`): XLA on the chip does not fuse the
    nibbles' unpacking and scaling into `two_products` and writes a dequantized copy of every weight at every
    call. Where the kernel cannot serve: on a TPU, for fewer rows than half a group, `grouped_products`, which
    writes no weight; every other call, `two_products`."""
    if _takes_kernel(input, qdata, scale, zero_point, group_size):
        return int4_kernel.int4_matmul(input, qdata, scale, zero_point, group_size)
    if platform.name() == "tpu" and 2 * math.prod(input.shape[:-1]) < group_size:
        return grouped_products(input, qdata, scale, zero_point, group_size)
    return two_products(input, qdata, scale, zero_point, group_size)


def grouped_products(input, qdata, scale, zero_point, group_size):
    """The groups as a batch dimension of the product, their scales applied to its partial results
    (`out = sum_g scale_g * (x_g . q_g) + zero_point_g * sum(x_g)`, as the kernel's decode form computes it): the
    weight operands are the nibbles converted to the input's dtype, a conversion XLA on a TPU fuses into the
    product, so no dequantized weight is written. The partial results, (groups, rows, N) in float32, are written
    instead: fewer bytes than a bfloat16 weight (N, K) while rows are fewer than half a group."""
    out_features, half = qdata.shape
    group_half = group_size // 2
    groups = half // group_half
    dtype = input.dtype
    x = input.reshape(-1, 2 * half)
    even, odd = (x[:, parity::2].reshape(-1, groups, group_half) for parity in (0, 1))
    low, high = (n.reshape(out_features, groups, group_half).astype(dtype) for n in _nibbles(qdata))
    numbers = (((2,), (2,)), ((1,), (1,)))  # (rows, groups, k) x (N, groups, k) -> (groups, rows, N)
    partial = dot(even, low, numbers, epilogue=True) + dot(odd, high, numbers, epilogue=True)
    scaled = jnp.sum(partial * scale.astype(jnp.float32)[:, None, :], axis=0)
    sums = jnp.sum(even.astype(jnp.float32) + odd.astype(jnp.float32), axis=-1)  # (rows, groups)
    shifted = jnp.dot(sums, zero_point.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return (scaled + shifted).astype(dtype).reshape(*input.shape[:-1], out_features)


def two_products(input, qdata, scale, zero_point, group_size):
    """The even and the odd input features times the weight's low and high nibbles: two products over the packed
    array as it lies, each nibble converted and scaled inside its product, so that a compiler fusing a conversion
    into its product writes no unpacked weight (the CPU's XLA does; the TPU's does not). Interleaving the nibbles
    into one (N, K) operand instead would change the minor dimension's layout, which on a TPU means a copy of the
    weight at every call."""
    rows, half = qdata.shape
    dtype = input.dtype
    scale = scale.astype(jnp.float32).T[:, :, None]  # (N, groups, 1)
    zero_point = zero_point.astype(jnp.float32).T[:, :, None]
    group_half = group_size // 2  # a group of `group_size` columns is `group_half` bytes

    def weight(nibbles):
        grouped = nibbles.astype(jnp.float32).reshape(rows, half // group_half, group_half)
        return (grouped * scale + zero_point).reshape(rows, half).astype(dtype)

    low, high = _nibbles(qdata)
    numbers = (((input.ndim - 1,), (1,)), ((), ()))
    product = (dot(input[..., 0::2], weight(low), numbers, epilogue=True)
               + dot(input[..., 1::2], weight(high), numbers, epilogue=True))
    return product.astype(dtype)
