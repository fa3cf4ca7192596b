"""Histograms (`histogram`, `histogramdd`) and segment reductions (`segment_reduce` and its backward).

Bin counts are arguments, so every output shape is static; a range taken from the data is a traced
min/max, not a host read. The conventions are those of PyTorch's CPU kernels (Histogram.cpp,
SegmentReduce.cpp): an element belongs to the bin whose left edge it reaches, the rightmost bin
also holds its right edge, elements outside the edges (and NaN) are left out.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from .. import dtypes
from .factory import _linspace
from .registry import lowering

aten = torch.ops.aten


# --- Histograms. `histogram` is the one-dimensional `histogramdd`: points of shape (M, N), one bin
# edge sequence per dimension.


def _points(self):
    """`histogramdd`'s input as M points in N dimensions (every dim but the last flattened)."""
    return self.reshape(-1, self.shape[-1])


def _outer_edges(points, range):
    """(leftmost, rightmost) edge per dimension: `range`, else the data's min and max, else [0, 1]
    for no data; an empty range widens by 0.5 each side, as numpy does."""
    dims = points.shape[1]
    if range is not None:
        if len(range) != 2 * dims:
            raise RuntimeError(f"torch.histogramdd: for a {dims}-dimensional histogram range should have "
                               f"{2 * dims} elements, but got {len(range)}")
        low, high = jnp.asarray(range[0::2], jnp.float64), jnp.asarray(range[1::2], jnp.float64)
    elif points.shape[0]:
        low, high = jnp.min(points, axis=0).astype(jnp.float64), jnp.max(points, axis=0).astype(jnp.float64)
    else:
        low, high = jnp.zeros(dims, jnp.float64), jnp.ones(dims, jnp.float64)
    empty = low == high
    return jnp.where(empty, low - 0.5, low), jnp.where(empty, high + 0.5, high)


def _equal_width_edges(points, bin_counts, range):
    """PyTorch's `linspace` edges in the input's dtype, one sequence per dimension."""
    low, high = _outer_edges(points, range)
    dtype = dtypes.to_torch(points.dtype)
    return [_linspace(low[d], high[d], count + 1, dtype) for d, count in enumerate(bin_counts)]


def _histogramdd(points, edges, weight, density):
    """Sum of each point's weight (1 without weights) into the bin holding it in every dimension."""
    bins = tuple(e.shape[0] - 1 for e in edges)
    inside = jnp.ones(points.shape[0], bool)
    flat_bin = jnp.zeros(points.shape[0], jnp.int64)
    for d, e in enumerate(edges):
        x = points[:, d]
        inside &= (x >= e[0]) & (x <= e[-1])  # NaN is outside
        position = jnp.searchsorted(e, x, side="right") - 1
        position = jnp.where(position == bins[d], bins[d] - 1, position)  # the last bin is closed
        flat_bin = flat_bin * bins[d] + position
    contribution = jnp.ones(points.shape[0], points.dtype) if weight is None else weight.reshape(-1)
    hist = jnp.zeros(math.prod(bins), points.dtype).at[flat_bin].add(jnp.where(inside, contribution, 0), mode="drop")
    hist = hist.reshape(bins)
    if density:
        hist = hist / hist.sum()
        for d, e in enumerate(edges):
            shape = [1] * len(bins)
            shape[d] = bins[d]
            hist = hist / jnp.diff(e).reshape(shape)
    return hist


@lowering(aten.histogram.bin_ct)
def histogram(self, bins=100, *, range=None, weight=None, density=False):
    if bins <= 0:
        raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")
    points = self.reshape(-1, 1)
    (edges,) = _equal_width_edges(points, [bins], range)
    return _histogramdd(points, [edges], weight, density), edges


@lowering(aten.histogram.bins_tensor)
def histogram_bins_tensor(self, bins, *, weight=None, density=False):
    return _histogramdd(self.reshape(-1, 1), [bins], weight, density), bins


@lowering(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):
    return _equal_width_edges(_points(self), bins, range)


@lowering(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(self, bins, *, range=None, weight=None, density=False):
    points = _points(self)
    return _histogramdd(points, _equal_width_edges(points, bins, range), weight, density)


@lowering(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    return _histogramdd(_points(self), bins, weight, density)
