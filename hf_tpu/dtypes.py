"""The dtype correspondence between PyTorch and JAX, in one place."""

from __future__ import annotations

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

# DLPack type codes: kDLInt=0, kDLUInt=1, kDLFloat=2, kDLBfloat=4, kDLComplex=5, kDLBool=6,
# kDLFloat8_e4m3fn=10, kDLFloat8_e5m2=12
_DLPACK = {
    torch.bool: (6, 8),
    torch.bfloat16: (4, 16),
    torch.float8_e4m3fn: (10, 8),
    torch.float8_e5m2: (12, 8),
}


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
