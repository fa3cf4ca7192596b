"""Factories whose values are not a fill: ranges, identity matrices and triangle indices.

`zeros`, `ones`, `full`, `scalar_tensor`, `*_like` and the `arange`/`eye` overloads without a step
or second size are composite over `empty` plus a fill or the overloads here.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes
from ..dispatch import lowering

aten = torch.ops.aten


def _compute_dtype(dtype):
    """PyTorch steps integer ranges in double and float ranges in their own precision."""
    dtype = dtype or torch.get_default_dtype()
    if dtype.is_floating_point and dtype.itemsize >= 4:
        return dtypes.to_jax(dtype)
    return jnp.float64 if not dtype.is_floating_point else jnp.float32


@lowering(aten.arange.start_step, static=("start", "end", "step"))
def arange(start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    # the length depends on the values, so they are static
    length = max(math.ceil((end - start) / step), 0)
    exact = all(isinstance(v, int) for v in (start, end, step))
    return start + step * jnp.arange(length, dtype=jnp.int64 if exact else jnp.float64)


def _linspace(start, end, steps, dtype):
    """PyTorch's symmetric linspace: the first half steps up from start, the second down from end."""
    compute = _compute_dtype(dtype)
    start, end = jnp.asarray(start, compute), jnp.asarray(end, compute)
    step = (end - start) / max(steps - 1, 1)
    i = jnp.arange(steps, dtype=compute)
    return jnp.where(i < max(steps // 2, 1), start + step * i, end - step * (steps - 1 - i))  # 1 step: start


@lowering(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar,
          aten.linspace.Scalar_Tensor)
def linspace(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _linspace(start, end, steps, dtype)


@lowering(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar,
          aten.logspace.Scalar_Tensor)
def logspace(start, end, steps, base=10.0, *, dtype=None, layout=None, device=None, pin_memory=None):
    exponents = _linspace(start, end, steps, dtype)
    return jnp.power(jnp.asarray(base, exponents.dtype), exponents)


@lowering(aten.eye.default)
def eye(n, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n)


@lowering(aten.eye.m)
def eye_m(n, m, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, m)


@lowering(aten.tril_indices.default)
def tril_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(np.stack(np.tril_indices(row, offset, col)))


@lowering(aten.triu_indices.default)
def triu_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(np.stack(np.triu_indices(row, offset, col)))
