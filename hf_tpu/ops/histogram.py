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
from ..dispatch import lowering
from .factory import _linspace
from .products import accumulation_dtype

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


def _bins_per_dimension(values):
    self, bins = values[0], values[1]
    if len(bins) != (self.shape[-1] if self.dim() else 1):
        raise RuntimeError("histogramdd: The size of bins must be equal to the innermost dimension of the input.")


@lowering(aten._histogramdd_bin_edges.default, check=_bins_per_dimension)
def histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):
    return _equal_width_edges(_points(self), bins, range)


@lowering(aten._histogramdd_from_bin_cts.default, check=_bins_per_dimension)
def histogramdd_from_bin_cts(self, bins, *, range=None, weight=None, density=False):
    points = _points(self)
    return _histogramdd(points, _equal_width_edges(points, bins, range), weight, density)


@lowering(aten._histogramdd_from_bin_tensors.default, check=_bins_per_dimension)
def histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    return _histogramdd(_points(self), bins, weight, density)


# --- Segment reductions: data of shape (*batch, M, *inner) reduced along `axis` (the last dim of
# `lengths`/`offsets`, of shape (*batch, S) or (*batch, S + 1)) in S contiguous segments.

_SEGMENT_REDUCTIONS = ("max", "mean", "min", "sum", "prod")


def _segment_layout(data, lengths, offsets, axis):
    """Data as (B, M, K) rows, and per row its flat segment id: b * (S + 1) + segment, where
    segment S collects the rows in no segment (before the first offset, or past the lengths' sum
    with `unsafe`). Also the segments' lengths as (B, S)."""
    axis = axis % data.ndim
    batch, rows = math.prod(data.shape[:axis]), data.shape[axis]
    if offsets is not None:
        offsets = offsets.reshape(batch, -1).astype(jnp.int64)
        starts, ends = offsets[:, :-1], offsets[:, 1:]
    else:
        ends = jnp.cumsum(lengths.reshape(batch, -1).astype(jnp.int64), axis=1)
        starts = jnp.concatenate([jnp.zeros((batch, 1), jnp.int64), ends[:, :-1]], axis=1)
    count = ends.shape[1]
    position = jnp.arange(rows)
    segment = jax.vmap(lambda e: jnp.searchsorted(e, position, side="right"))(ends)
    first_start = starts[:, :1] if count else jnp.zeros((batch, 1), jnp.int64)
    segment = jnp.where(position >= first_start, segment, count)
    ids = (jnp.arange(batch)[:, None] * (count + 1) + segment).reshape(-1)
    return data.reshape(batch * rows, -1), ids, count, ends - starts


def _per_segment(values, batch, count):
    """Rows of a (B * (S + 1), ...) segment result back to (B, S, ...), dropping the no-segment bucket."""
    return values.reshape(batch, count + 1, *values.shape[1:])[:, :count]


@lowering(aten.segment_reduce.default)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """Without `initial`, an empty segment gives max -inf, min +inf, sum 0, prod 1, mean NaN; with
    it, `initial` also takes part in every segment's reduction (mean: (initial + sum) / length).
    bfloat16/float16 accumulate in float32 and round once (the CPU rounds after every element)."""
    if reduce not in _SEGMENT_REDUCTIONS:
        raise RuntimeError(f"unsupported reduction given! {reduce}")
    if lengths is None and offsets is None:
        raise RuntimeError("segment_reduce(): Either lengths or offsets must be defined.")
    rows, ids, count, segment_lengths = _segment_layout(data, lengths, offsets, axis)
    rows = rows.astype(accumulation_dtype(rows.dtype))
    if initial is not None:  # rounded to data's dtype first, as on CPU
        initial = jnp.asarray(initial, data.dtype).astype(rows.dtype)
    batch = segment_lengths.shape[0]
    buckets = batch * (count + 1)
    reduce_by_segment = {"max": jax.ops.segment_max, "min": jax.ops.segment_min, "prod": jax.ops.segment_prod}
    if reduce in ("sum", "mean"):
        result = _per_segment(jax.ops.segment_sum(rows, ids, buckets), batch, count)
        if initial is not None:
            result = result + initial
    else:
        result = _per_segment(reduce_by_segment[reduce](rows, ids, buckets), batch, count)
        if initial is not None:
            combine = {"max": jnp.maximum, "min": jnp.minimum, "prod": jnp.multiply}[reduce]
            result = combine(initial, result)
        if reduce != "prod":  # the CPU kernel's max/min keep the first NaN they meet
            has_nan = _per_segment(jax.ops.segment_max(jnp.isnan(rows), ids, buckets), batch, count)
            result = jnp.where(has_nan, jnp.nan, result)
    if reduce == "mean":
        length = segment_lengths[:, :, None].astype(result.dtype)
        empty = jnp.nan if initial is None else initial
        result = jnp.where(length > 0, result / jnp.maximum(length, 1), empty)
    out_shape = list(data.shape)
    out_shape[axis % data.ndim] = count
    return result.reshape(out_shape)


@lowering(aten._segment_reduce_backward.default)
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None):
    """PyTorch's CPU gradient: max/min send the gradient to every element equal to the result (or
    NaN), divided among them only where it is positive; prod divides the result by each element,
    except at zeros and NaNs, whose gradient is the product of the others."""
    rows, ids, count, segment_lengths = _segment_layout(data, lengths, offsets, axis)
    batch = segment_lengths.shape[0]
    buckets = batch * (count + 1)

    def at_rows(per_segment):
        """A (B, S, ...) per-segment value at each data row (zeros in the no-segment bucket)."""
        padded = jnp.concatenate([per_segment, jnp.zeros_like(per_segment[:, :1])], axis=1)
        return padded.reshape(buckets, *per_segment.shape[2:])[ids]

    def per_segment(values):
        return _per_segment(jax.ops.segment_sum(values, ids, buckets), batch, count)

    g = at_rows(grad.reshape(batch, count, -1))
    in_segment = at_rows(jnp.ones((batch, count, 1), bool))
    if reduce == "sum":
        result = g
    elif reduce == "mean":
        result = g / at_rows(jnp.maximum(segment_lengths, 1)[:, :, None]).astype(g.dtype)
    elif reduce in ("max", "min"):
        chosen = jnp.isnan(rows) | (rows == at_rows(output.reshape(batch, count, -1)))
        ties = at_rows(per_segment(chosen.astype(jnp.int64)))
        result = jnp.where(chosen, g, 0)
        result = jnp.where(chosen & (ties >= 2) & (result > 0), result / ties.astype(g.dtype), result)
    else:  # prod
        zero, nan = rows == 0, jnp.isnan(rows)
        regular = at_rows(_per_segment(jax.ops.segment_prod(jnp.where(zero | nan, 1, rows), ids, buckets), batch, count))
        other_zeros = at_rows(per_segment(zero.astype(jnp.int64))) - zero
        other_nans = at_rows(per_segment(nan.astype(jnp.int64))) - nan
        start = jnp.asarray(1 if initial is None else initial, rows.dtype)
        others = start * regular * jnp.where(other_nans > 0, jnp.nan, jnp.where(other_zeros > 0, 0, 1))
        divided = g * at_rows(output.reshape(batch, count, -1)) / rows
        result = jnp.where(zero | nan, g * others, divided)
    return jnp.where(in_segment, result, 0).reshape(data.shape)
