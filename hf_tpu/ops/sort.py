"""Sorting and order statistics: sort, topk, kthvalue, median, nanmedian, mode.

All of them run on one stable sort (`lax.sort` orders NaN last and -0.0 equal to 0.0, as PyTorch
does), so equal values keep their original order and the indices PyTorch returns for ties follow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ..dispatch import lowering
from .reduce import require_nonempty, scalar_as_vector

aten = torch.ops.aten


def _sort(x, dim, descending=False):
    """Values and int64 indices of a stable sort along `dim`; descending keeps ties in order too."""
    axis = dim % x.ndim
    positions = jax.lax.broadcasted_iota(jnp.int64, x.shape, axis)
    if descending:
        x, positions = jax.lax.rev(x, (axis,)), jax.lax.rev(positions, (axis,))
    values, indices = jax.lax.sort((x, positions), dimension=axis, is_stable=True, num_keys=1)
    if descending:
        values, indices = jax.lax.rev(values, (axis,)), jax.lax.rev(indices, (axis,))
    return values, indices


def _take(arrays, position, axis, keepdim):
    """The entries at `position` (an int, or an array with size 1 along `axis`) of each array."""
    shape = list(arrays[0].shape)
    shape[axis] = 1
    position = jnp.broadcast_to(position, shape)
    picked = tuple(jnp.take_along_axis(a, position, axis) for a in arrays)
    return picked if keepdim else tuple(p.squeeze(axis) for p in picked)


def _dim_in_range(position: int):
    """PyTorch's CPU kernel of sort checks `dim`, which its meta kernel lets through (as it does any
    dim: `torch.sort(x, dim=5)`)."""
    def check(values):
        self, dim = values[0], values[position]
        ndim = max(self.dim(), 1)
        if not -ndim <= dim < ndim:
            raise IndexError(
                f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    return check


@lowering(aten.sort.default, type_check=_dim_in_range(1))
@scalar_as_vector
def sort(self, dim=-1, descending=False):
    return _sort(self, dim, descending)


@lowering(aten.sort.stable, type_check=_dim_in_range(2))
@scalar_as_vector
def sort_stable(self, *, stable=None, dim=-1, descending=False):
    return _sort(self, dim, descending)


# A full sort, not lax.top_k: PyTorch orders NaN above every number and breaks ties by index.
@lowering(aten.topk.default)
@scalar_as_vector
def topk(self, k, dim=-1, largest=True, sorted=True):
    values, indices = _sort(self, dim, descending=largest)
    axis = dim % self.ndim
    return jax.lax.slice_in_dim(values, 0, k, axis=axis), jax.lax.slice_in_dim(indices, 0, k, axis=axis)


@lowering(aten.kthvalue.default)
@scalar_as_vector
def kthvalue(self, k, dim=-1, keepdim=False):
    return _take(_sort(self, dim), k - 1, dim % self.ndim, keepdim)


def _median(x, dim, keepdim, ignore_nan):
    """The lower median along `dim` and its index. NaN sorts last: with `ignore_nan` the median is
    taken over the numbers; without, any NaN is the result (the first one, as PyTorch reports)."""
    axis = dim % x.ndim
    require_nonempty("median", x.shape, (axis,))
    values, indices = _sort(x, axis)
    n = x.shape[axis]
    numbers = jnp.sum(~jnp.isnan(x), axis, keepdims=True) if jnp.issubdtype(x.dtype, jnp.floating) else n
    if ignore_nan:
        position = jnp.maximum((numbers - 1) // 2, 0)
    else:
        position = jnp.where(numbers < n, numbers, (n - 1) // 2)
    return _take((values, indices), position, axis, keepdim)


def _median_of_all(x, ignore_nan):
    if x.size == 0:
        return jnp.array(jnp.nan)
    return _median(x.reshape(-1), 0, False, ignore_nan)[0]


@lowering(aten.median.default)
def median(self):
    return _median_of_all(self, ignore_nan=False)


@lowering(aten.nanmedian.default)
def nanmedian(self):
    return _median_of_all(self, ignore_nan=True)


@lowering(aten.median.dim)
@scalar_as_vector
def median_dim(self, dim, keepdim=False):
    return _median(self, dim, keepdim, ignore_nan=False)


@lowering(aten.nanmedian.dim)
@scalar_as_vector
def nanmedian_dim(self, dim, keepdim=False):
    return _median(self, dim, keepdim, ignore_nan=True)


@lowering(aten.mode.default)
@scalar_as_vector
def mode(self, dim=-1, keepdim=False):
    """The most frequent value (the smallest among equally frequent ones) and the index of its last
    occurrence: what PyTorch's CPU kernel returns while its unstable sort keeps equal values in order
    (beyond a few dozen elements its index among ties is arbitrary)."""
    axis = dim % self.ndim
    require_nonempty("mode", self.shape, (axis,))
    values, indices = _sort(self, axis)
    n = self.shape[axis]
    positions = jax.lax.broadcasted_iota(jnp.int64, values.shape, axis)
    changes = jax.lax.slice_in_dim(values, 1, n, axis=axis) != jax.lax.slice_in_dim(values, 0, n - 1, axis=axis)
    edge = jnp.ones_like(jax.lax.slice_in_dim(values, 0, 1, axis=axis), bool)
    starts_run = jnp.concatenate([edge, changes], axis)
    ends_run = jnp.concatenate([changes, edge], axis)
    run_start = jax.lax.cummax(jnp.where(starts_run, positions, 0), axis=axis)
    run_length = jnp.where(ends_run, positions - run_start + 1, 0)
    best = jnp.argmax(run_length, axis, keepdims=True)
    return _take((values, indices), best, axis, keepdim)
