"""How a tensor sits in its buffer (`View`) and the pure functions that read and write a buffer's array
through it.

Reading a tensor derives its value from the buffer through its strides; writing through a tensor
(an in-place op on a view) computes the buffer's new value with a scatter. Both are pure functions of
static view metadata, so they fuse into the jitted computation of the op that needs them, and into
a deferred graph just the same. See docs/design/memory-model.md.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .. import dtypes
from . import buffer
from .buffer import Buffer, buffer_of


class View(NamedTuple):
    """How a tensor sits in its buffer, when it is anything but the buffer itself."""

    shape: tuple
    strides: tuple
    offset: int
    dtype: torch.dtype
    conj: bool = False  # PyTorch's lazy conjugate / negative bits on complex views
    neg: bool = False


class Transposed(NamedTuple):
    """A matrix operand whose last two dims are swapped from its buffer's (`w.t()`, `k.transpose(-1, -2)`),
    handed as the buffer's own array to a lowering that contracts it in place: XLA:CPU copies a
    transposed matrix before a matrix-vector product instead of folding the transpose into the dot,
    which in a decode step rewrote every weight on every token."""

    array: object


class Flattened(NamedTuple):
    """A matrix operand that is its whole buffer of 3 or more dims with the leading ones flattened (a linear
    layer's input, `x.view(-1, x.shape[-1])`), handed in the buffer's own shape to a lowering that contracts
    it there: the product keeps the (batch, tokens) dims XLA lays out the rest of the model in. With bfloat16
    products asked for in bfloat16 (`ops.products._product_dtype`) the 1.1B Llama's compiled forward at 8x1024
    took 125.63 ms a call on the v5e (2026-12-06) against 133.20 ms."""

    array: object


def flattened_shape(view: View | None, shape: tuple, dtype: torch.dtype) -> tuple | None:
    """Where `view` is its whole contiguous buffer (of `shape` and `dtype`) as a matrix whose rows flatten two
    or more leading dims and whose columns flatten the rest: those leading dims and the columns' count (the
    shape a `tensor_views.Flattened` operand takes); else None."""
    if view is None or view.offset or view.conj or view.neg or view.dtype != dtype or len(view.shape) != 2:
        return None
    rows, columns = view.shape
    if view.strides != (columns, 1):
        return None
    for j in range(2, len(shape)):
        if math.prod(shape[:j]) == rows and math.prod(shape[j:]) == columns:
            return (*shape[:j], columns)
    return None


def swaps_last_two(view: View | None, shape: tuple, dtype: torch.dtype) -> bool:
    """Whether `view` is its whole buffer (of `shape` and `dtype`) with the last two dims swapped."""
    if view is None or view.offset or view.conj or view.neg or view.dtype != dtype or len(shape) < 2:
        return False
    swapped = shape[:-2] + (shape[-1], shape[-2])
    strides = _contiguous_strides(shape)
    return view.shape == swapped and view.strides == strides[:-2] + (strides[-1], strides[-2])


def view_of(t: torch.Tensor, buf: Buffer):
    """None when `t` is exactly its buffer (the common case, read for free), else its `View`."""
    dtype = t.dtype
    if t.is_neg() or t.is_conj():  # the negative bit also marks real views: `z.conj().imag`, `_neg_view`
        return View(tuple(t.shape), tuple(t.stride()), t.storage_offset(), dtype, t.is_conj(), t.is_neg())
    offset = t.storage_offset()
    if offset == 0 and t.is_contiguous():
        shape = t.shape  # a torch.Size: equal to the buffer's tuple when the sizes are
        if dtype == buf.dtype and shape == buf.shape:
            return None
        if dtype != buf.dtype and dtype != torch.bool and math.prod(shape) * dtype.itemsize == buf.nbytes:
            # e.g. bytes restored by torch.load, read as float32; never as bool, which keeps only 0 or 1
            # of a byte whose other views (`x.view(torch.bool)` of uint8) still see all its bits
            _adopt_layout(buf, tuple(shape), dtype)
            return None
    return View(tuple(t.shape), tuple(t.stride()), offset, dtype)


def _adopt_layout(buf: Buffer, shape, dtype):
    """Re-express a whole buffer in the layout of the tensor that covers it, so later reads of that
    tensor are free instead of reinterpreting bytes every time (the bytes do not change)."""
    if buf.array is not None:
        array = buf.value()
        view = View(shape, _contiguous_strides(shape), 0, dtype)
        buf.array = _reinterpret_jit(array.shape, array.dtype, view)(array)
    buf.shape, buf.dtype = shape, dtype


_REINTERPRETERS: dict = {}


def _reinterpret_jit(shape, dtype, view):
    key = (shape, dtype, view)
    fn = _REINTERPRETERS.get(key)
    if fn is None:
        fn = _REINTERPRETERS[key] = jax.jit(lambda a: read(a, view))
    return fn


def _contiguous_strides(shape):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


class _Dense(NamedTuple):
    """A strided view expressed as slice -> reshape -> slice -> transpose (no gather)."""

    dims: tuple  # the view's dims of size > 1 and stride > 0, outermost first
    block: tuple  # reshape of the flat segment
    take: tuple  # per block dim: how many to keep (a last dim of the innermost stride: 1)
    length: int  # flat segment length


def _dense_plan(view: View):
    dims = [d for d, n in enumerate(view.shape) if n > 1 and view.strides[d] != 0]
    dims.sort(key=lambda d: -view.strides[d])
    if not dims:
        return _Dense((), (1,), (1,), 1)
    strides = [view.strides[d] for d in dims]
    sizes = [view.shape[d] for d in dims]
    for i in range(len(dims) - 1):
        if strides[i] % strides[i + 1] or strides[i] < strides[i + 1] * sizes[i + 1]:
            return None
    block = [sizes[0]] + [strides[i] // strides[i + 1] for i in range(len(dims) - 1)]
    take = tuple(sizes)
    if strides[-1] != 1:  # every strides[-1]-th element: a last dim to take the first of
        block.append(strides[-1])
        take += (1,)
    # A contiguous innermost dim gets no trailing dim of size 1: on a TPU such a dim is the minor one of
    # its (8, 128) tiles, and the 1.1B model's forward at 8x1024 ran 1.7 ms longer on the v5e's device
    # with it (141.2 against 139.5 ms, profiles of 2026-12-06).
    return _Dense(tuple(dims), tuple(block), take, sizes[0] * strides[0])


def _as_bytes(flat):
    if flat.dtype == jnp.bool_:
        return flat.astype(jnp.uint8)
    if jnp.issubdtype(flat.dtype, jnp.complexfloating):
        flat = jnp.stack([flat.real, flat.imag], -1).reshape(-1)
    return lax.bitcast_convert_type(flat, jnp.uint8).reshape(-1)


def _from_bytes(data, dtype):
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return data != 0
    if jnp.issubdtype(dtype, jnp.complexfloating):
        parts = _from_bytes(data, jnp.finfo(dtype).dtype).reshape(-1, 2)
        return lax.complex(parts[:, 0], parts[:, 1])
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(data, dtype)
    return lax.bitcast_convert_type(data.reshape(-1, dtype.itemsize), dtype)


def _reinterpret(flat, dtype):
    """The same bytes seen as another dtype (PyTorch's `view(dtype)`, and storages read as bytes)."""
    dtype = jnp.dtype(dtype)
    if flat.dtype == dtype:
        return flat
    plain = (jnp.bool_, jnp.complex64, jnp.complex128)
    if flat.dtype.itemsize == dtype.itemsize and flat.dtype not in plain and dtype not in plain:
        return lax.bitcast_convert_type(flat, dtype)
    return _from_bytes(_as_bytes(flat), dtype)


def _flat(array, dtype):
    return _reinterpret(array.reshape(-1), dtypes.to_jax(dtype))


def _blocks(plan: _Dense, total: int):
    """The buffer of `total` elements in the plan's block shape, or None where it does not divide."""
    outer = math.prod(plan.block[1:])
    return None if total % outer else (total // outer,) + plan.block[1:]


def _aligned(plan: _Dense, offset: int, total: int):
    """The plan's block laid over the whole buffer instead of over a segment starting at `offset`:
    (the buffer's shape as blocks, the view's start in it), or None when the view's range crosses a
    block boundary there. Reads and writes then reshape and slice the buffer's own array, which XLA's
    partitioner follows through a sharded array; a flat segment of it would make it gather the whole."""
    whole = _blocks(plan, total)
    if whole is None:
        return None
    start, rest = [], offset
    for i in range(len(whole)):
        radix = math.prod(whole[i + 1:])
        start.append(rest // radix)
        rest %= radix
        if start[-1] + plan.take[i] > whole[i]:
            return None
    return whole, tuple(start)


# `View.offset` of a view that a program reads at a start it is given (`keyed_view`)
START_IS_AN_INPUT = -1
# offsets of one view shape compiled into programs before the next ones are given as inputs
_OFFSETS_COMPILED_IN = 2

_KEYED_VIEWS: dict = {}  # (view, the buffer's shape and dtype) -> `keyed_view`'s answer
_OFFSETS_SEEN: dict = {}  # (the view keyed without its offset, the buffer's shape and dtype) -> offsets keyed
_KEYED_VIEWS_CACHED = 4096


def keyed_view(view: View | None, buffer_shape: tuple, buffer_dtype: torch.dtype):
    """(the view as a program is keyed by it, the start the program is given or None).

    A loop over `w[i]` (Transformers' eager Mixture-of-Experts layer takes each expert's weights so) compiled
    one program per i for the row and for every op that read it, each offset compiled in. So once views of
    one shape and strides have come at `_OFFSETS_COMPILED_IN` offsets, a view at a further one whose range
    the aligned read covers (a row, a column, a narrow) is keyed with its offset as `START_IS_AN_INPUT`, and
    its program reads it with `lax.dynamic_slice` at the start per block dim (an int32 or int64 array) it is
    given: one program for every later i. The first offsets stay compiled in, since a start given costs each
    call an input (a few microseconds in strict eager on the development CPU), which a view always taken at the same
    offset (`logits[:, -1]`, the second half of a `chunk`) would pay for nothing. Views stay compiled in
    once sharded arrays exist: XLA's partitioner follows a constant slice of a sharded array, where a
    slice at a start known only when the program runs may gather the whole array."""
    if view is None or not view.offset or buffer.sharded_arrays_exist:
        return view, None
    key = (view, buffer_shape, buffer_dtype)
    entry = _KEYED_VIEWS.get(key)
    if entry is None:
        if len(_KEYED_VIEWS) >= _KEYED_VIEWS_CACHED:
            _KEYED_VIEWS.clear()
            _OFFSETS_SEEN.clear()
        entry = _KEYED_VIEWS[key] = _keyed_view(view, buffer_shape, buffer_dtype)
    return entry


def _keyed_view(view: View, buffer_shape: tuple, buffer_dtype: torch.dtype):
    total = math.prod(buffer_shape)
    plain = view.dtype == buffer_dtype and not view.conj and not view.neg and math.prod(view.shape)
    plan = _dense_plan(view) if plain else None
    aligned = None if plan is None else _aligned(plan, view.offset, total)
    if aligned is None:
        return view, None
    movable = view._replace(offset=START_IS_AN_INPUT)
    family = (movable, buffer_shape, buffer_dtype)
    seen = _OFFSETS_SEEN.get(family, 0)
    if seen < _OFFSETS_COMPILED_IN:
        _OFFSETS_SEEN[family] = seen + 1
        return view, None
    return movable, np.asarray(aligned[1], np.int32 if total < 2**31 else np.int64)


def _shaped(array, flat, shape):
    """The buffer's values (`flat`, in the view's dtype) in `shape`, reshaped from the array itself when
    no reinterpretation was needed: one reshape the partitioner can follow, not two."""
    return array.reshape(shape) if flat.dtype == array.dtype else flat.reshape(shape)


def _segment(flat, offset, length):
    """flat[offset:offset+length], padded with zeros where the range runs past the end."""
    end = min(flat.shape[0], offset + length)
    seg = lax.slice(flat, (offset,), (end,))
    if end - offset < length:
        seg = jnp.pad(seg, (0, length - (end - offset)))
    return seg


def _gather_index(view: View, limit: int):
    idx_dtype = jnp.int32 if limit < 2**31 else jnp.int64
    idx = jnp.full(view.shape, view.offset, idx_dtype)
    for d, stride in enumerate(view.strides):
        if view.shape[d] > 1 and stride:
            idx = idx + lax.broadcasted_iota(idx_dtype, view.shape, d) * stride
    return idx


def read(array, view: View | None, start=None):
    """The value of a tensor given its buffer's array (inside or outside jit); `start`: the view's start
    where its offset is `START_IS_AN_INPUT` (`keyed_view`)."""
    if view is None:
        return array
    if view.conj or view.neg:
        value = read(array, view._replace(conj=False, neg=False))
        value = jnp.conj(value) if view.conj else value
        return -value if view.neg else value
    flat = _flat(array, view.dtype)
    numel = math.prod(view.shape)
    if numel == 0:
        return jnp.zeros(view.shape, flat.dtype)
    if view.offset == 0 and numel == flat.shape[0] and view.strides == _contiguous_strides(view.shape):
        return _shaped(array, flat, view.shape)
    plan = _dense_plan(view)
    if plan is None:
        return flat[_gather_index(view, flat.shape[0])]
    if start is not None:  # a start given: the view is aligned (`keyed_view`)
        blocks, begin = _shaped(array, flat, _blocks(plan, flat.shape[0])), list(start)
    elif (aligned := _aligned(plan, view.offset, flat.shape[0])) is not None:
        whole, begin = aligned
        blocks, begin = _shaped(array, flat, whole), list(begin)
    else:
        blocks, begin = _segment(flat, view.offset, plan.length).reshape(plan.block), [0] * len(plan.block)
    # the block dims in the view's order (a last dim of the innermost stride stays last)
    order = sorted(range(len(plan.dims)), key=lambda i: plan.dims[i])
    order += range(len(plan.dims), len(plan.block))
    take = list(plan.take)
    # A view taking half its blocks or more is transposed before the slice, not after it: views of one buffer
    # in one order then slice one transposed array, which XLA computes once, and the optimization barrier keeps
    # that array whole (without it, XLA on a TPU folds the transpose into each consumer again). Rotary
    # embeddings read q whole and as its two halves. On the v5e (2026-12-06, 4 attention blocks of the 1.1B
    # model at 8x1024, `benchmarks.rotary_layouts`) transposing each slice took 14.9 ms, slicing the transposed
    # q 13.2 ms, slicing it behind the barrier 12.3 ms, no rotary embeddings 10.9 ms; the whole model's forward
    # at 8x1024 ran 4.4 ms less device time with the barrier. XLA:CPU drops the barrier and fuses as before. A
    # smaller view keeps the slice first: XLA:CPU transposed the whole buffer for it (y.permute(3, 2, 1, 0)[1]
    # of a 64**4 float32 buffer: 0.5-7 ms against 0.1 ms).
    transposed_first = order != sorted(order) and 2 * math.prod(take) >= math.prod(blocks.shape)
    if transposed_first:
        blocks = lax.optimization_barrier(jnp.transpose(blocks, order))
        begin, take = [begin[i] for i in order], [take[i] for i in order]
    if start is not None:
        value = lax.dynamic_slice(blocks, begin, take)
    else:
        value = lax.slice(blocks, begin, [a + n for a, n in zip(begin, take)])
    if not transposed_first:  # sorted dims -> the view's order
        value = jnp.transpose(value.reshape([view.shape[d] for d in plan.dims]), order[:len(plan.dims)])
    # size-1 and broadcast dims back in
    kept = [n if (n > 1 and view.strides[d] != 0) else 1 for d, n in enumerate(view.shape)]
    return jnp.broadcast_to(value.reshape(kept), view.shape)


_READERS: dict = {}  # view -> jitted read: a tensor read outside a program is one launch


def array_of(t: torch.Tensor, buf: Buffer | None = None, value=None):
    """A tpu tensor's value as one array: its buffer's (or `value`, an array of the buffer's shape and dtype in
    its place), read through the tensor's view (inside a trace too, where the buffer holds a tracer)."""
    buf = buffer_of(t) if buf is None else buf
    view, start = keyed_view(view_of(t, buf), buf.shape, buf.dtype)  # may lay the buffer out anew: read it after
    value = buf.value() if value is None else value
    if view is None:
        return value
    reader = _READERS.get(view)
    if reader is None:
        reader = _READERS[view] = jax.jit(functools.partial(read, view=view))
    return reader(value) if start is None else reader(value, start=start)


def write(array, view: View | None, value, start=None):
    """The buffer's new array after writing `value` (of the view's shape and dtype) through `view` (`start` as
    in `read`)."""
    if view is None:
        return value.reshape(array.shape).astype(array.dtype)
    if view.conj or view.neg:  # what is stored is the conjugate / negation of what the view shows
        value = -value if view.neg else value
        value = jnp.conj(value) if view.conj else value
        view = view._replace(conj=False, neg=False)
    flat = _flat(array, view.dtype)
    numel = math.prod(view.shape)
    if numel == 0:
        return array
    value = value.astype(flat.dtype)
    broadcast = [d for d, (n, s) in enumerate(zip(view.shape, view.strides)) if n > 1 and s == 0]
    if broadcast:  # one memory location per expanded dim: its first value is written
        value = value[tuple(slice(0, 1) if d in broadcast else slice(None) for d in range(value.ndim))]
        shape = tuple(1 if d in broadcast else n for d, n in enumerate(view.shape))
        view = View(shape, view.strides, view.offset, view.dtype)
        numel = math.prod(shape)
    plan = _dense_plan(view)
    if plan is None:
        flat = flat.at[_gather_index(view, flat.shape[0]).reshape(-1)].set(value.reshape(-1))
        return _reinterpret(flat, array.dtype).reshape(array.shape)
    squeezed = value.reshape([view.shape[d] for d in sorted(plan.dims)])
    rank = {d: i for i, d in enumerate(sorted(plan.dims))}
    sorted_value = jnp.transpose(squeezed, [rank[d] for d in plan.dims]) if plan.dims else squeezed
    aligned = (_blocks(plan, flat.shape[0]), start) if start is not None else _aligned(plan, view.offset, flat.shape[0])
    if aligned is not None:
        whole, start = aligned
        written = lax.dynamic_update_slice(_shaped(array, flat, whole), sorted_value.reshape(plan.take), start)
        return _reinterpret(written.reshape(-1), array.dtype).reshape(array.shape)
    block = _segment(flat, view.offset, plan.length).reshape(plan.block)
    block = lax.dynamic_update_slice(block, sorted_value.reshape(plan.take), (0,) * len(plan.block))
    valid = min(plan.length, flat.shape[0] - view.offset)
    flat = lax.dynamic_update_slice(flat, block.reshape(-1)[:valid], (view.offset,))
    return _reinterpret(flat, array.dtype).reshape(array.shape)


def is_whole_buffer(view: View | None, buf: Buffer) -> bool:
    """Whether a tensor of `view` reads its buffer's elements in order (none: the buffer itself; or the buffer
    under another shape, as `logits[:, -1]` of logits shaped [batch, 1, vocab])."""
    return view is None or (not view.offset and not view.conj and not view.neg and view.dtype == buf.dtype
                            and math.prod(view.shape) == math.prod(buf.shape)
                            and view.strides == _contiguous_strides(view.shape))


def read_one_array(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether tpu tensors `a` and `b` of one shape and dtype each read a computed array whole, the same one
    (one buffer's, or the kept upload of equal values that `from_host` gives every buffer made from them)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    buf_a, buf_b = buffer_of(a), buffer_of(b)
    array = buf_a.array
    return (isinstance(array, jax.Array) and buf_b.array is array
            and is_whole_buffer(view_of(a, buf_a), buf_a) and is_whole_buffer(view_of(b, buf_b), buf_b))
