"""Shape ops that copy: concatenation, flips and rolls, repeats, triangles, padding and the
`*_scatter` ops that write a view's values into a copy.

Views themselves (view, slice, select, transpose, expand, ...) are PyTorch's own kernels over shared
storage (ops/memory.py); the `*_copy` view variants already run as view + copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from ..dispatch import lowering


aten = torch.ops.aten


def _no_scalars(values):
    for i, t in enumerate(values[0]):
        if t.dim() == 0:  # PyTorch's meta kernel fails on them with an IndexError of its own
            raise RuntimeError(f"zero-dimensional tensor (at position {i}) cannot be concatenated")


@lowering(aten.cat.default, check=_no_scalars)
def cat(tensors, dim=0):
    # PyTorch still skips 1-D empty tensors whatever their rank next to the others (legacy behaviour)
    kept = [t for t in tensors if t.shape != (0,)] or list(tensors[:1])
    dtype = jnp.result_type(*kept)
    return jnp.concatenate([t.astype(dtype) for t in kept], axis=dim % max(kept[0].ndim, 1))


@lowering(aten.flip.default)
def flip(self, dims):
    return jnp.flip(self, axis=tuple(d % self.ndim for d in dims)) if dims and self.ndim else self


@lowering(aten.roll.default)
def roll(self, shifts, dims=()):
    if not dims:
        return jnp.roll(self.reshape(-1), shifts[0]).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), axis=tuple(dims))


@lowering(aten.repeat.default)
def repeat(self, repeats):
    return jnp.tile(self.reshape((1,) * (len(repeats) - self.ndim) + self.shape), tuple(repeats))


@lowering(aten.channel_shuffle.default)
def channel_shuffle(self, groups):
    """Channels (dim 1) read as groups x per-group, written as per-group x groups."""
    batch, channels, *rest = self.shape
    grouped = self.reshape(batch, groups, channels // groups, *rest)
    return jnp.swapaxes(grouped, 1, 2).reshape(self.shape)


@lowering(aten.tril.default)
def tril(self, diagonal=0):
    return jnp.tril(self, diagonal)


@lowering(aten.triu.default)
def triu(self, diagonal=0):
    return jnp.triu(self, diagonal)


# --- Padding: the pad list runs from the last dim backwards, (before, after) per dim.


def _pairs(pad, ndim):
    """ATen's flat pad list as jnp.pad's per-dim pairs for all `ndim` dims."""
    pairs = [(0, 0)] * ndim
    for i in range(len(pad) // 2):
        pairs[ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return pairs


@lowering(aten.constant_pad_nd.default)
def constant_pad_nd(self, pad, value=0):
    # lax.pad crops with negative amounts, as PyTorch does
    config = [(lo, hi, 0) for lo, hi in _pairs(pad, self.ndim)]
    return jax.lax.pad(self, jnp.asarray(value).astype(self.dtype), config)


def _pad(self, padding, mode):
    """jnp.pad, after cropping where `padding` is negative (PyTorch crops, jnp.pad rejects it)."""
    pairs = _pairs(padding, self.ndim)
    crop = [(min(lo, 0), min(hi, 0), 0) for lo, hi in pairs]
    cropped = jax.lax.pad(self, jnp.zeros((), self.dtype), crop)
    return jnp.pad(cropped, [(max(lo, 0), max(hi, 0)) for lo, hi in pairs], mode=mode)


def _reflect(self, padding):
    return _pad(self, padding, "reflect")


def _replicate(self, padding):
    """Output position i of a dim takes input position clamp(i - before, 0, n - 1), as PyTorch's kernel
    does: with a negative pad the copied edge is the input's own edge, not the cropped one's."""
    pairs = _pairs(padding, self.ndim)
    if all(lo >= 0 and hi >= 0 for lo, hi in pairs):
        return jnp.pad(self, pairs, mode="edge")
    for axis, (lo, hi) in enumerate(pairs):
        n = self.shape[axis]
        if lo or hi:
            self = jnp.take(self, jnp.clip(jnp.arange(n + lo + hi) - lo, 0, n - 1), axis=axis)
    return self


def _pad_backward(pad):
    """The backward of a padding: the transpose of `pad` (overlapping reflected/replicated
    elements add up), one program instead of ATen's decomposition into scatter-adds."""

    def backward(grad_output, self, padding):
        _, transpose = jax.vjp(lambda x: pad(x, padding), self)
        return transpose(grad_output.astype(self.dtype))[0]

    return backward


lowering(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default)(_reflect)
lowering(aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default)(
    _replicate
)
lowering(
    aten.reflection_pad1d_backward.default,
    aten.reflection_pad2d_backward.default,
    aten.reflection_pad3d_backward.default,
)(_pad_backward(_reflect))
lowering(
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
)(_pad_backward(_replicate))


# --- Diagonals and the *_scatter ops (the functional form of writing into a view).


def _diagonal_coordinates(n_rows, n_cols, offset):
    length = max(min(n_rows + min(offset, 0), n_cols - max(offset, 0)), 0)
    rows = jnp.arange(length) - min(offset, 0)
    return rows, rows + offset


@lowering(aten.diag_embed.default)
def diag_embed(self, offset=0, dim1=-2, dim2=-1):
    n = self.shape[-1] + abs(offset)
    ndim = self.ndim + 1
    rows, cols = _diagonal_coordinates(n, n, offset)
    out = jnp.zeros(self.shape[:-1] + (n, n), self.dtype).at[..., rows, cols].set(self)
    return jnp.moveaxis(out, (-2, -1), (dim1 % ndim, dim2 % ndim))


@lowering(aten.diagonal_scatter.default)
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    dims = (dim1 % self.ndim, dim2 % self.ndim)
    moved = jnp.moveaxis(self, dims, (-2, -1))
    rows, cols = _diagonal_coordinates(moved.shape[-2], moved.shape[-1], offset)
    moved = moved.at[..., rows, cols].set(src.astype(self.dtype))
    return jnp.moveaxis(moved, (-2, -1), dims)


@lowering(aten.select_scatter.default)
def select_scatter(self, src, dim, index):
    return self.at[(slice(None),) * (dim % self.ndim) + (index,)].set(src.astype(self.dtype))


@lowering(aten.slice_scatter.default)
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    where = (slice(None),) * (dim % self.ndim) + (slice(start, end, step),)
    return self.at[where].set(src.astype(self.dtype))


def _view_within_self(values):
    self, size, stride, offset = values[0], values[2], values[3], values[4] or 0
    if any(n == 0 for n in size):
        return
    needed = (offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1) * self.element_size()
    if needed > self.numel() * self.element_size():
        raise RuntimeError(
            f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and itemsize "
            f"{self.element_size()} requiring a storage size of {needed} are out of bounds for storage of size "
            f"{self.numel() * self.element_size()}"
        )


@lowering(aten.as_strided_scatter.default, check=_view_within_self)
def as_strided_scatter(self, src, size, stride, storage_offset=None):
    """`src` written through `as_strided(size, stride, storage_offset)` of a contiguous copy of self."""
    flat_index = jnp.asarray(storage_offset or 0)
    for d, s in enumerate(stride):
        flat_index = flat_index + jax.lax.broadcasted_iota(jnp.int64, tuple(size), d) * s
    flat = self.reshape(-1).at[flat_index].set(src.astype(self.dtype))
    return flat.reshape(self.shape)
