"""Indexing, gather/scatter, embedding, search and histogram ops, and those whose output shape
depends on the data (nonzero, masked_select, unique, bincount: the core runs them on concrete arrays).

Index tensors are used as they are: XLA clamps (gathers) or drops (scatters) out-of-range indices
where PyTorch raises; the core checks them inside each op's program (`dispatch/index_checks.py`).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import torch

from .. import dispatch
from ..dispatch import handler, lowering
from .elementwise import value_fits

aten = torch.ops.aten


def _update(target, where, values, method):
    """`target.at[where].<method>(values)`; bools reduce as 0/1 integers (add is `or`, multiply `and`)."""
    if target.dtype == jnp.bool_:
        return _update(target.astype(jnp.int32), where, values.astype(jnp.int32), method).astype(jnp.bool_)
    return getattr(target.at[where], method)(values.astype(target.dtype), mode="drop")


# --- Advanced indexing: `self[indices]` with PyTorch's List[Optional[Tensor]] of indices.


def _is_mask(index) -> bool:
    return index is not None and index.dtype in (jnp.bool_, jnp.uint8)


def _numpy_index(indices, padded_to=None):
    """PyTorch's index list as a NumPy index tuple: None is a full slice, a k-dim mask is its k
    nonzero coordinate arrays. A mask's true count is data-dependent: with `padded_to`, masks give
    that many coordinates, padded with out-of-range ones (for scatters with mode="drop")."""
    out = []
    for index in indices:
        if index is None:
            out.append(slice(None))
        elif _is_mask(index):
            if padded_to is None:
                out.extend(_nonzero_coordinates(index))
            else:
                fill = tuple(index.shape)
                out.extend(jnp.nonzero(index, size=padded_to, fill_value=fill))
        else:
            out.append(index)
    return tuple(out)


def _check_masks(self, indices):
    """PyTorch's IndexError for a mask whose shape is not that of the dims it indexes: its meta kernel
    gives up before this check (a mask's result size is data-dependent), and XLA would index anyway."""
    k = 0  # the dim of `self` the next index starts at
    for index in indices:
        if not _is_mask(index):
            k += 1
            continue
        if k + index.ndim > self.ndim:
            raise IndexError(f"too many indices for tensor of dimension {self.ndim}")
        for j, n in enumerate(index.shape):
            if n != self.shape[k + j]:
                raise IndexError(f"The shape of the mask {list(index.shape)} at index {j} does not match "
                                 f"the shape of the indexed tensor {list(self.shape)} at index {k + j}")
        k += index.ndim


_INDEX_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool)


@handler(aten.index.Tensor)
def index_tensor(sig, values):
    """PyTorch's CPU and CUDA kernels read a uint8 index as a mask, with a deprecation warning, and
    raise an IndexError for an index of another dtype; its meta kernel, which gives our result shapes,
    rejects a uint8 mask and raises a RuntimeError: such masks become bool first."""
    self, indices = values
    if any(i is not None and i.dtype not in _INDEX_DTYPES for i in indices):
        raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    if any(i is not None and i.dtype == torch.uint8 for i in indices):
        warnings.warn("indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead.")
        indices = [i.bool() if i is not None and i.dtype == torch.uint8 else i for i in indices]
    return dispatch.run_lowered(sig, [self, indices])


@lowering(aten.index.Tensor)
def index(self, indices):
    _check_masks(self, indices)
    return self[_numpy_index(indices)]


def _advanced_position(index_tuple):
    """Where NumPy's rules place the broadcast advanced-index dims in the result."""
    advanced = [i for i, x in enumerate(index_tuple) if not isinstance(x, slice)]
    if advanced != list(range(advanced[0], advanced[-1] + 1)):
        return 0
    return advanced[0]


def _values_for_padded_masks(self, index_tuple, values, padded_to):
    """`values` broadcast to `self[index_tuple]` when masks were padded to `padded_to` coordinates:
    a dim holding one value per true mask element is padded to match."""
    indexed = jax.eval_shape(lambda a: a[index_tuple], self).shape
    advanced = [x for x in index_tuple if not isinstance(x, slice)]
    advanced_shape = jnp.broadcast_shapes(*(x.shape for x in advanced))
    start = _advanced_position(index_tuple)
    lead = len(indexed) - values.ndim
    pad = [(0, 0)] * values.ndim
    for d in range(start, start + len(advanced_shape)):
        k = d - lead
        if 0 <= k < values.ndim and values.shape[k] not in (1, indexed[d]):
            pad[k] = (0, indexed[d] - values.shape[k])
    return jnp.broadcast_to(jnp.pad(values, pad) if values.ndim else values, indexed)


@lowering(aten.index_put.default)
def index_put(self, indices, values, accumulate=False):
    _check_masks(self, indices)
    if any(_is_mask(i) for i in indices):
        padded_to = max(i.size for i in indices if _is_mask(i))
        index_tuple = _numpy_index(indices, padded_to)
        values = _values_for_padded_masks(self, index_tuple, values, padded_to)
    else:
        index_tuple = _numpy_index(indices)
    return _update(self, index_tuple, values, "add" if accumulate else "set")


@lowering(aten._index_put_impl_.default)
def index_put_impl_(self, indices, values, accumulate=False, unsafe=False):
    """In-place only in ATen (no functional overload): returns the new value of `self`."""
    return index_put(self, indices, values, accumulate)


# --- gather/scatter along one dim: index has self's rank; other dims are position-for-position.


def _coordinates(dim, index):
    """The full index tuple of `gather`/`scatter`: `index` at `dim`, iotas elsewhere."""
    return tuple(
        index if d == dim else jax.lax.broadcasted_iota(jnp.int64, index.shape, d) for d in range(index.ndim)
    )


def _leading(src, shape):
    """The part of `src` a same-rank index of `shape` addresses (its sizes may exceed the index's)."""
    return src[tuple(slice(0, n) for n in shape)] if src.ndim else src


def _dim(dim, ndim):
    return dim % max(ndim, 1)


@lowering(aten.gather.default)
def gather(self, dim, index, sparse_grad=False):
    if index.size == 0:  # then the index's rank may differ from self's
        return jnp.zeros(index.shape, self.dtype)
    if self.ndim == 0:
        return jnp.broadcast_to(self, index.shape)
    return self[_coordinates(_dim(dim, self.ndim), index)]


def _lowest(dtype):
    if dtype == jnp.bool_:
        return False
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _highest(dtype):
    if dtype == jnp.bool_:
        return True
    return jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max


# The reductions of scatter_reduce/index_reduce, with the value that leaves an element unchanged.
_REDUCTIONS = {
    "sum": ("add", lambda dtype: 0),
    "mean": ("add", lambda dtype: 0),
    "prod": ("multiply", lambda dtype: 1),
    "amax": ("max", _lowest),
    "amin": ("min", _highest),
}


def _reduce_into(self, where, src, reduce, include_self=True):
    """`self` with `src` reduced into the positions `where` (a NumPy index tuple), as
    scatter_reduce/index_reduce: `include_self=False` ignores the old value of each written position;
    "mean" divides by the number of values reduced into a position (floor division for integers)."""
    method, identity = _REDUCTIONS[reduce]
    base = self if include_self else self.at[where].set(identity(self.dtype), mode="drop")
    out = _update(base, where, src, method)
    if reduce != "mean":
        return out
    count = jnp.zeros(self.shape, jnp.int64).at[where].add(1, mode="drop") + int(include_self)
    count = jnp.maximum(count, 1)
    if jnp.issubdtype(self.dtype, jnp.floating):
        return out / count.astype(self.dtype)
    return jnp.floor_divide(out, count).astype(self.dtype)


def _scatter(self, dim, index, src, reduce="set", include_self=True):
    """scatter and its reductions; `src` is a tensor or a scalar; 0-dim operands act as 1-element."""
    if index.size == 0:
        return self
    as_1d = (lambda a: a.reshape(1)) if self.ndim == 0 else (lambda a: a)
    index = as_1d(index)
    src = jnp.broadcast_to(_leading(as_1d(src), index.shape) if jnp.ndim(src) else src, index.shape)
    where = _coordinates(_dim(dim, self.ndim), index)
    if reduce == "set":
        out = as_1d(self).at[where].set(src.astype(self.dtype), mode="drop")
    else:
        out = _reduce_into(as_1d(self), where, src, reduce, include_self)
    return out.reshape(self.shape)


@lowering(aten.scatter.src, aten.scatter.value)
def scatter(self, dim, index, src):
    return _scatter(self, dim, index, src)


@lowering(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_with_reduce(self, dim, index, src, reduce):
    return _scatter(self, dim, index, src, {"add": "sum", "multiply": "prod"}[reduce])


@lowering(aten.scatter_add.default)
def scatter_add(self, dim, index, src):
    return _scatter(self, dim, index, src, "sum")


@lowering(aten.scatter_reduce.two)
def scatter_reduce(self, dim, index, src, reduce, include_self=True):
    return _scatter(self, dim, index, src, reduce, include_self)


# --- index_* along one dim: a 1-D index picks whole slices.


def _slices_at(dim, index):
    return (slice(None),) * dim + (index.reshape(-1),)


def _along_dim(fn):
    """Run `fn(self, dim, ...)` on `self` as at least 1-D (0-dim tensors index like 1-element ones)."""

    def run(self, dim, index, source, *args, **kwargs):
        if self.ndim == 0:
            return fn(self.reshape(1), 0, index, jnp.reshape(source, (-1,)), *args, **kwargs).reshape(())
        return fn(self, _dim(dim, self.ndim), index, source, *args, **kwargs)

    return run


def _indices_into_an_empty_dim(values):
    """PyTorch's CPU kernel rejects any index into a dim of size 0 (whatever its value), which its meta
    kernel lets through: a 1-D tensor as out of range, any other as a shape error."""
    self, dim, index = values[0], values[1], values[2]
    if self.dim() and self.shape[dim % self.dim()] == 0 and index.numel():
        if self.dim() == 1:
            raise IndexError("index out of range in self")
        raise RuntimeError("index_select(): self indexing axis dim should be positive")


@lowering(aten.index_select.default, type_check=_indices_into_an_empty_dim)
def index_select(self, dim, index):
    if self.ndim == 0:
        return self
    return jnp.take(self, index.reshape(-1), axis=_dim(dim, self.ndim))


@lowering(aten.index_add.default)
@_along_dim
def index_add(self, dim, index, source, alpha=1):
    return _update(self, _slices_at(dim, index), source * alpha, "add")


@lowering(aten.index_copy.default)
@_along_dim
def index_copy(self, dim, index, source):
    return _update(self, _slices_at(dim, index), source, "set")


# --- hf_tpu::dynamic_update_slice: `index_copy_` at contiguous positions from a start held in a tensor.
#
# A static KV cache writes each step's keys at `arange(n) + filled`: an `index_copy_` whose index XLA
# cannot know is contiguous, so it lowers to a scatter. On the v5e (`benchmarks.cache_write`, 32 caches
# of a 1.1B Llama) the scatter took 10.5 ms where one dynamic-update-slice took 3.1 ms for a 4096-token
# prompt, 4.1 ms against 3.5 ms for a decode step at batch 64, and compiled 0.4-0.7 s longer. The start is
# a tensor, so that one program serves every position.

_library = torch.library.Library("hf_tpu", "FRAGMENT")
_library.define("dynamic_update_slice(Tensor self, int dim, Tensor start, Tensor source) -> Tensor")
# in place, returning nothing: functionalization (torch.compile) takes no custom op that returns an alias
_library.define("dynamic_update_slice_(Tensor(a!) self, int dim, Tensor start, Tensor source) -> ()")


def _check_update_slice(self, dim, start, source):
    """`index_copy_`'s errors on every device (the meta kernel): the start is one integer, `source` is
    `self` with another (no longer) length along `dim`, of `self`'s dtype. The start's value is not
    checked on tpu (that would need a host sync): as in XLA, a start past the end is clamped to it."""
    if start.numel() != 1 or start.dtype.is_floating_point or start.dtype.is_complex or start.dtype == torch.bool:
        raise RuntimeError(f"hf_tpu.dynamic_update_slice: start must be one integer, got a {start.dtype} tensor "
                           f"of shape {tuple(start.shape)}")
    if source.dtype != self.dtype:
        raise RuntimeError(f"hf_tpu.dynamic_update_slice: self ({self.dtype}) and source ({source.dtype}) "
                           "must have the same dtype")
    dim = dim % max(self.dim(), 1)
    if (source.dim() != self.dim() or source.shape[dim] > self.shape[dim]
            or any(s != t for d, (s, t) in enumerate(zip(source.shape, self.shape)) if d != dim)):
        raise IndexError(f"hf_tpu.dynamic_update_slice: source {tuple(source.shape)} does not fit self "
                         f"{tuple(self.shape)} along dim {dim}")


@torch.library.impl("hf_tpu::dynamic_update_slice", "cpu", lib=_library)
def _dynamic_update_slice_cpu(self, dim, start, source):
    """The reference: `index_copy` at `start, start + 1, ...`, which raises as it does past the end."""
    _check_update_slice(self, dim, start, source)
    positions = torch.arange(source.shape[dim], device=self.device) + start.reshape(()).long()
    return self.index_copy(dim, positions, source)


@torch.library.impl("hf_tpu::dynamic_update_slice_", "cpu", lib=_library)
def _dynamic_update_slice_cpu_(self, dim, start, source):
    self.copy_(_dynamic_update_slice_cpu(self, dim, start, source))


@torch.library.register_fake("hf_tpu::dynamic_update_slice", lib=_library)
def _dynamic_update_slice_fake(self, dim, start, source):
    _check_update_slice(self, dim, start, source)
    return torch.empty_like(self)


@torch.library.register_fake("hf_tpu::dynamic_update_slice_", lib=_library)
def _dynamic_update_slice_fake_(self, dim, start, source):
    _check_update_slice(self, dim, start, source)


@lowering(torch.ops.hf_tpu.dynamic_update_slice.default)
def dynamic_update_slice(self, dim, start, source):
    dim = _dim(dim, self.ndim)
    starts = [jnp.zeros((), start.dtype)] * self.ndim
    starts[dim] = start.reshape(())
    return jax.lax.dynamic_update_slice(self, source.astype(self.dtype), starts)


@lowering(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor, check=value_fits(3))
@_along_dim
def index_fill(self, dim, index, value):
    return _update(self, _slices_at(dim, index), jnp.asarray(value), "set")


@lowering(aten.index_reduce.default)
@_along_dim
def index_reduce(self, dim, index, source, reduce, include_self=True):
    return _reduce_into(self, _slices_at(dim, index), source, reduce, include_self)


# --- Masks with static output shapes.


@lowering(aten.masked_fill.Scalar, aten.masked_fill.Tensor, check=value_fits(2))
def masked_fill(self, mask, value):
    return jnp.where(mask, jnp.asarray(value).astype(self.dtype), self)


def _boolean_mask(values):
    if values[1].dtype != torch.bool:
        raise RuntimeError(f"masked_scatter_ only supports boolean masks, but got mask with dtype {values[1].dtype}")


@lowering(aten.masked_scatter.default, check=_boolean_mask)
def masked_scatter(self, mask, source):
    """The i-th true element of `mask` (row-major, broadcast to `self`) takes `source`'s i-th element."""
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    self, mask = jnp.broadcast_to(self, shape).reshape(-1), jnp.broadcast_to(mask, shape).reshape(-1)
    position = jnp.clip(jnp.cumsum(mask) - 1, 0, max(source.size - 1, 0))
    taken = source.reshape(-1)[position] if source.size else jnp.zeros_like(self)
    return jnp.where(mask, taken.astype(self.dtype), self).reshape(shape)


# --- Flat indexing.


@lowering(aten.take.default)
def take(self, index):
    return self.reshape(-1)[index]


@lowering(aten.put.default)
def put(self, index, source, accumulate=False):
    flat = _update(self.reshape(-1), index.reshape(-1), source.reshape(-1), "add" if accumulate else "set")
    return flat.reshape(self.shape)


# --- Embedding.


@lowering(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return weight[indices]


# --- one_hot: PyTorch's composite kernel checks the classes on the host on CPU and leaves them to its scatter_'s
# device assert elsewhere; here it is an op of its own, whose program checks them as CPU does
# (`dispatch/index_checks.py`).


@handler(aten.one_hot.default)
def one_hot_call(sig, values):
    self, num_classes = values
    if self.dtype != torch.int64:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if self.numel() == 0:
        if num_classes <= 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        return torch.empty((*self.shape, num_classes), dtype=torch.int64, device=self.device)
    if num_classes < 1:  # counted from the values, or none fits: read on the host, as CPU reads them
        if self.min().item() < 0:
            raise RuntimeError("Class values must be non-negative.")
        if num_classes != -1:
            raise RuntimeError("Class values must be smaller than num_classes.")
        num_classes = self.max().item() + 1
    return dispatch.run_lowered(sig, [self, num_classes])


@lowering(aten.one_hot.default)
def one_hot(self, num_classes=-1):
    return (self[..., None] == jnp.arange(num_classes)).astype(jnp.int64)


@lowering(aten.embedding_renorm.default)
def embedding_renorm(self, indices, max_norm, norm_type):
    """Rows named in `indices` whose `norm_type`-norm exceeds `max_norm` are scaled down to it."""
    rows = self.astype(jnp.promote_types(self.dtype, jnp.float32))
    norm = jnp.linalg.norm(rows, ord=norm_type, axis=1)
    named = jnp.zeros(self.shape[0], bool).at[indices.reshape(-1)].set(True)
    scale = jnp.where(named & (norm > max_norm), max_norm / (norm + 1e-7), 1)
    return rows * scale[:, None]


@lowering(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    indices = indices.reshape(-1)
    grad = grad_output.reshape(indices.shape[0], -1)
    accumulate = jnp.promote_types(grad.dtype, jnp.float32)  # bfloat16 rows summed in float32
    grad = jnp.where((indices == padding_idx)[:, None], 0, grad.astype(accumulate))
    if scale_grad_by_freq:
        counts = jnp.zeros(num_weights, accumulate).at[indices].add(1)
        grad = grad / counts[indices][:, None]
    return jnp.zeros((num_weights, grad.shape[1]), accumulate).at[indices].add(grad)


# --- Embedding bags. mode: 0 sum, 1 mean, 2 max. Bag b holds the indices from offsets[b] up to the
# next bag's offset; the last bag runs to the end of `indices` (with include_last_offset too, as on
# CPU). Indices equal to padding_idx take no part. offset2bag (each index's bag), bag_size (its
# non-padding count, 0 in sum mode as on CPU) and max_indices (the weight row each maximum came from,
# first one among ties) are the forward's saved values, which the backward reads back.

_BAG_SUM, _BAG_MEAN, _BAG_MAX = 0, 1, 2


def _accumulated(x):
    """Low-precision floats summed in float32, as on CPU."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _bag_of_each_index(indices, offsets, bags):
    return jnp.clip(jnp.searchsorted(offsets[:bags], jnp.arange(indices.shape[0]), side="right") - 1, 0, bags - 1)


@lowering(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=_BAG_SUM, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    offset2bag = _bag_of_each_index(indices, offsets, bags)
    counted = indices != padding_idx
    rows = _accumulated(weight)[indices]
    if per_sample_weights is not None:
        rows = rows * _accumulated(per_sample_weights)[:, None]
    bag_size = jnp.zeros(offsets.shape[0], jnp.int64).at[offset2bag].add(counted)
    if mode == _BAG_MAX:
        # bags are scanned in index order: a later row replaces the maximum only if strictly larger
        ranked = jnp.where(counted[:, None], rows, -jnp.inf)
        best = jax.ops.segment_max(ranked, offset2bag, num_segments=bags)
        is_best = counted[:, None] & (ranked == best[offset2bag])
        position = jnp.where(is_best, jnp.arange(indices.shape[0])[:, None], indices.shape[0])
        first = jax.ops.segment_min(position, offset2bag, num_segments=bags)
        nonempty = bag_size[:bags, None] > 0
        max_indices = jnp.where(nonempty, indices[jnp.clip(first, 0, indices.shape[0] - 1)], 0)
        output = jnp.where(nonempty, best, 0)
        return output, offset2bag, bag_size, max_indices
    output = jax.ops.segment_sum(jnp.where(counted[:, None], rows, 0), offset2bag, num_segments=bags)
    if mode == _BAG_MEAN:
        output = output / jnp.maximum(bag_size[:bags], 1)[:, None]
    else:
        bag_size = jnp.zeros_like(bag_size)
    return output, offset2bag, bag_size, jnp.zeros((0,), jnp.int64)


@lowering(aten._embedding_bag_dense_backward.default)
def _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                  scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):
    grad = _accumulated(grad)
    if mode == _BAG_MAX:
        nonempty = bag_size[: grad.shape[0], None] > 0
        columns = jnp.arange(grad.shape[1])
        return jnp.zeros((num_weights, grad.shape[1]), grad.dtype).at[maximum_indices, columns].add(
            jnp.where(nonempty, grad, 0))
    scale = jnp.where(indices != padding_idx, 1, 0).astype(grad.dtype)
    if per_sample_weights is not None:
        scale = scale * _accumulated(per_sample_weights)
    if mode == _BAG_MEAN:
        scale = scale / jnp.maximum(bag_size[offset2bag], 1)
    if scale_grad_by_freq:
        scale = scale / jnp.zeros(num_weights, grad.dtype).at[indices].add(1)[indices]
    return jnp.zeros((num_weights, grad.shape[1]), grad.dtype).at[indices].add(grad[offset2bag] * scale[:, None])


@lowering(aten._embedding_bag_backward.default)
def _embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                            scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    if sparse:
        raise NotImplementedError("embedding_bag(sparse=True): tpu has no sparse tensors; use sparse=False")
    return _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                         scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@lowering(aten._embedding_bag_per_sample_weights_backward.default)
def _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    """Each sample's weight multiplied its row into its bag's sum: its gradient is their dot product."""
    products = jnp.sum(_accumulated(grad)[offset2bag] * _accumulated(weight)[indices], axis=1)
    return jnp.where(indices != padding_idx, products, 0)


# --- Sorted search and histograms.


def _searchsorted(sorted_sequence, values, right, sorter=None):
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    side = "right" if right else "left"
    search = lambda seq, v: jnp.searchsorted(seq, v, side=side, method="compare_all")  # noqa: E731
    if sorted_sequence.ndim <= 1:
        return search(sorted_sequence, values)
    batched = jnp.vectorize(search, signature="(n),(m)->(m)")
    return batched(sorted_sequence, values)


@lowering(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None):
    return _searchsorted(sorted_sequence, jnp.asarray(self), right or side == "right", sorter)


def _one_dimensional_boundaries(values):
    if values[1].dim() != 1:
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({values[1].dim()})")


@lowering(aten.bucketize.Tensor, aten.bucketize.Scalar, check=_one_dimensional_boundaries)
def bucketize(self, boundaries, *, out_int32=False, right=False):
    return _searchsorted(boundaries, jnp.asarray(self), right)


@lowering(aten.histc.default)
def histc(self, bins=100, min=0, max=0):
    """Equal-width bins over [min, max] (the data's range when both are 0); the last bin is closed.
    Bin positions are computed in self's dtype, as PyTorch does (it decides edge cases in bfloat16).
    Integer inputs are what Transformers' MoE layers count experts with on accelerators (CUDA takes them)."""
    low, high = jnp.asarray(min, self.dtype), jnp.asarray(max, self.dtype)
    unset = low == high
    limits = jnp.finfo(self.dtype) if jnp.issubdtype(self.dtype, jnp.floating) else jnp.iinfo(self.dtype)
    low = jnp.where(unset, jnp.min(self, initial=limits.max), low)
    high = jnp.where(unset, jnp.max(self, initial=limits.min), high)
    low, high = jnp.where(low == high, low - 1, low), jnp.where(low == high, high + 1, high)
    inside = (self >= low) & (self <= high)
    position = ((self - low) * bins / (high - low)).astype(jnp.int64)
    position = jnp.clip(position, 0, bins - 1)
    return jnp.zeros(bins, self.dtype).at[position.reshape(-1)].add(inside.reshape(-1).astype(self.dtype))


# --- Data-dependent output shapes: traced, these raise a concretization error and the core runs
# them again on concrete arrays (a host sync).


@jax.jit
def _every_coordinate_nonzero_first(array):
    """The coordinates of every element of `array`, (size, ndim) int64, the nonzero ones first in row-major
    order, and how many are nonzero: one program per input shape and dtype. `jnp.nonzero` on a concrete array
    runs about twenty one-op programs, five of them again for each new count, whose unravelling divides int64
    indices; on a TPU, which has no 64-bit integer unit, each such division compiled for 5-7 s (a MoE layer's
    per-expert `torch.where`, one count per expert). Here the index arithmetic is int32 (a mask of fewer than
    2**31 elements) and only the count varies with the data."""
    nonzero = array.reshape(-1) != 0
    size = nonzero.size
    index_dtype = jnp.int32 if size < 2**31 else jnp.int64
    rank = jnp.cumsum(nonzero, dtype=index_dtype) - 1  # each nonzero element's place among them
    flat = jnp.zeros(size, index_dtype).at[jnp.where(nonzero, rank, size)].set(
        jnp.arange(size, dtype=index_dtype), mode="drop")
    coordinates, stride = [], size
    for extent in array.shape:
        stride //= extent
        coordinates.append((flat // stride) % extent)
    return jnp.stack(coordinates, axis=1).astype(jnp.int64), jnp.sum(nonzero, dtype=index_dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _first_rows(coordinates, count: int, by_dim: bool = False):
    """The first `count` rows of `coordinates`: stacked, or one array per dim (an index tuple)."""
    rows = coordinates[:count]
    return tuple(rows[:, d] for d in range(rows.shape[1])) if by_dim else rows


def _nonzero_coordinates_stacked(array, by_dim: bool = False):
    """`jnp.stack(jnp.nonzero(array), axis=1)`, or with `by_dim` `jnp.nonzero(array)`, in two programs: one per
    shape, one per shape and count (a host sync reads the count between them; traced, that read raises JAX's
    concretization error, which makes the core run the op on concrete arrays)."""
    if array.size == 0:
        empty = jnp.zeros((0, array.ndim), jnp.int64)
        return tuple(empty[:, d] for d in range(array.ndim)) if by_dim else empty
    coordinates, count = _every_coordinate_nonzero_first(array)
    return _first_rows(coordinates, int(count), by_dim)


def _nonzero_coordinates(array) -> tuple:
    """`jnp.nonzero(array)`: one int64 array of coordinates per dim (see `_nonzero_coordinates_stacked`)."""
    return _nonzero_coordinates_stacked(array, by_dim=True)


@lowering(aten.nonzero.default)
def nonzero(self):
    return _nonzero_coordinates_stacked(self) if self.ndim else jnp.zeros((int(self != 0), 0), jnp.int64)


@lowering(aten.nonzero_static.default)
def nonzero_static(self, *, size, fill_value=-1):
    if self.size == 0:  # jnp.nonzero does not pad an empty array with fill_value
        return jnp.full((size, self.ndim), fill_value, jnp.int64)
    if self.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    return jnp.stack(jnp.nonzero(self, size=size, fill_value=fill_value), axis=1)


def _broadcast_shapes(a, b) -> tuple:
    """The broadcast of shapes `a` and `b`, or PyTorch's error where they cannot be broadcast."""
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + tuple(a), (1,) * (rank - len(b)) + tuple(b)
    for d, (m, n) in enumerate(zip(a, b)):
        if m != n and 1 not in (m, n):
            raise RuntimeError(f"The size of tensor a ({m}) must match the size of tensor b ({n}) at "
                               f"non-singleton dimension {d}")
    return tuple(max(m, n) if 0 not in (m, n) else 0 for m, n in zip(a, b))


@lowering(aten.masked_select.default)
def masked_select(self, mask):
    shape = _broadcast_shapes(mask.shape, self.shape)
    return jnp.broadcast_to(self, shape)[jnp.broadcast_to(mask, shape)]


@lowering(aten.bincount.default)
def bincount(self, weights=None, minlength=0):
    length = max(int(self.max()) + 1 if self.size else 0, minlength)
    if weights is None:
        return jnp.bincount(self, length=length).astype(jnp.int64)
    dtype = jnp.float32 if weights.dtype == jnp.float32 else jnp.float64  # as ATen's CPU kernel
    return jnp.zeros(length, dtype).at[self].add(weights.astype(dtype))


def _not_requested():
    """What ATen returns for an inverse/counts not asked for (made per call: an array built at import
    would start JAX's backends before `hf_tpu.distributed.initialize` can run)."""
    return jnp.zeros((0,), jnp.int64)


def _unique(self, axis):
    """Sorted unique values (each NaN distinct, as in PyTorch), inverse indices and counts."""
    values, inverse, counts = jnp.unique(
        self, return_inverse=True, return_counts=True, axis=axis, equal_nan=False
    )
    return values, inverse.astype(jnp.int64), counts.astype(jnp.int64)


@lowering(aten._unique2.default)
def unique2(self, sorted=True, return_inverse=False, return_counts=False):
    values, inverse, counts = _unique(self.reshape(-1), None)
    return (
        values,
        inverse.reshape(self.shape) if return_inverse else _not_requested(),
        counts if return_counts else _not_requested(),
    )


@lowering(aten._unique.default)
def unique(self, sorted=True, return_inverse=False):
    values, inverse, _ = _unique(self.reshape(-1), None)
    return values, inverse.reshape(self.shape) if return_inverse else _not_requested()


@lowering(aten.unique_dim.default)
def unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    return _unique(self, dim % self.ndim)  # ATen returns the inverse and counts even unasked


@lowering(aten.unique_consecutive.default)
def unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    x = self.reshape(-1) if dim is None else jnp.moveaxis(self, dim, 0)
    changed = (x[1:] != x[:-1]).reshape(max(x.shape[0] - 1, 0), math.prod(x.shape[1:])).any(axis=1)
    starts = jnp.concatenate([jnp.ones(min(x.shape[0], 1), bool), changed])
    inverse = jnp.cumsum(starts) - 1
    values = x[starts] if dim is None else jnp.moveaxis(x[starts], 0, dim)
    counts = jnp.bincount(inverse, length=int(starts.sum())).astype(jnp.int64)
    inverse = inverse.reshape(self.shape) if dim is None else inverse
    return (
        values,
        inverse.astype(jnp.int64) if return_inverse else _not_requested(),
        counts if return_counts else _not_requested(),
    )
