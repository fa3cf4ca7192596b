"""The dtype correspondence between PyTorch and JAX, in one place."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
import torch

_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.uint8: jnp.uint8,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.bool: jnp.bool_,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
}
_JAX_TO_TORCH = {np.dtype(j): t for t, j in _TORCH_TO_JAX.items()}

# PyTorch's names for its dtypes in kernel errors (`"abs_cpu" not implemented for 'Bool'`)
_SCALAR_TYPE_NAMES = {
    torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long",
    torch.uint16: "UInt16", torch.uint32: "UInt32", torch.uint64: "UInt64", torch.bool: "Bool",
    torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float", torch.float64: "Double",
    torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
    torch.float8_e4m3fn: "Float8_e4m3fn", torch.float8_e5m2: "Float8_e5m2",
}


def scalar_type_name(dtype) -> str:
    """PyTorch's name for a torch or JAX dtype: Float, Long, Bool, ..."""
    if not isinstance(dtype, torch.dtype):
        dtype = to_torch(dtype)
    return _SCALAR_TYPE_NAMES.get(dtype, str(dtype))


def check_fits(value, dtype: torch.dtype) -> None:
    """PyTorch's error for a Python number that a kernel converts to `dtype` and that overflows it
    (`torch.full((2,), 10**10, dtype=torch.int32)`, `masked_fill(mask, -1e9)` in float16), by c10's
    `overflows`: infinities and NaN fit a float type, an unsigned type takes negatives down to -max."""
    if type(value) not in (int, float) or dtype in (torch.float64, torch.bool) or dtype.is_complex:
        return
    low, high = _convertible_range(dtype)
    if low <= value <= high or (dtype.is_floating_point and not math.isfinite(value)):
        return
    raise RuntimeError(f"value cannot be converted to type {dtype} without overflow")


@functools.cache
def _convertible_range(dtype: torch.dtype) -> tuple:
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        return info.min, info.max
    info = torch.iinfo(dtype)
    return -info.max if info.min == 0 else info.min, info.max


# DLPack type codes: kDLInt=0, kDLUInt=1, kDLFloat=2, kDLBfloat=4, kDLComplex=5, kDLBool=6,
# kDLFloat8_e4m3fn=10, kDLFloat8_e5m2=12
_DLPACK = {
    torch.bool: (6, 8),
    torch.bfloat16: (4, 16),
    torch.float8_e4m3fn: (10, 8),
    torch.float8_e5m2: (12, 8),
}


# dtypes NumPy cannot hold, moved between host and device as integers of their width (bit-exact)
HOST_BITS = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}

_NARROW_INTS = frozenset(map(np.dtype, (jnp.int8, jnp.uint8, jnp.int16, jnp.uint16)))
_FLOAT8_E4M3FN_MAX = 448.0


def cast(x, dtype):
    """`x` as the jax `dtype`, converted the way PyTorch's CPU kernels convert (JAX's `astype`
    saturates where they do not): a float goes to an 8- or 16-bit integer through int64, so it wraps
    (-1.0 -> 255 as uint8; C's conversion gives INT64_MIN, so 0, for NaN, infinities and values beyond
    int64), and to float8_e4m3fn, which has no infinity, it saturates at +-448 instead of becoming NaN."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(dtype)
    if dtype in _NARROW_INTS:
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))  # float16 cannot hold 2**63
        in_range = jnp.abs(x) < 2.0**63  # false for NaN
        return jnp.where(in_range, x, -(2.0**63)).astype(jnp.int64).astype(dtype)
    if dtype == np.dtype(jnp.float8_e4m3fn):
        return jnp.clip(x, -_FLOAT8_E4M3FN_MAX, _FLOAT8_E4M3FN_MAX).astype(dtype)
    return x.astype(dtype)


def to_jax(dtype: torch.dtype):
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported on tpu") from None


def to_torch(dtype) -> torch.dtype:
    return _JAX_TO_TORCH[np.dtype(dtype)]


def dlpack_code(dtype: torch.dtype) -> tuple[int, int]:
    code = _DLPACK.get(dtype)
    if code is not None:
        return code
    bits = dtype.itemsize * 8
    if dtype.is_complex:
        return 5, bits
    if dtype.is_floating_point:
        return 2, bits
    return (0 if dtype.is_signed else 1), bits
