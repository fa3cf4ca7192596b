"""Convolution, pooling, upsampling and im2col/col2im over the trailing spatial dims of NC... tensors.

Backward ops are the VJP of their forward lowering, so the two can never disagree.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..dispatch import lowering
from .products import accumulation_dtype, product_precision

aten = torch.ops.aten


def _vjp(forward, grad_output, primal):
    """The gradient of `forward` at `primal` for the cotangent `grad_output`."""
    out, pullback = jax.vjp(forward, primal)
    return pullback(grad_output.astype(out.dtype))[0]


def _expand(value, n):
    """An int or a 1-element list as an n-element list (PyTorch's `_pair`/`_triple`)."""
    value = list(value) if isinstance(value, (list, tuple)) else [value]
    return value * n if len(value) == 1 else value


# --- Convolution


def _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups):
    n = input.ndim - 2
    stride, padding, dilation, output_padding = (_expand(v, n) for v in (stride, padding, dilation, output_padding))
    spatial = "DHW"[3 - n :]
    numbers = jax.lax.conv_dimension_numbers(input.shape, weight.shape, ("NC" + spatial, "OI" + spatial, "NC" + spatial))
    if transposed:
        # The gradient of a convolution: dilate the input by the stride, pad by the kernel's reach,
        # and convolve with the flipped kernel whose in/out channels are swapped within each group.
        in_channels, out_per_group, *kernel_size = weight.shape
        weight = weight.reshape(groups, in_channels // groups, out_per_group, *kernel_size)
        weight = jnp.swapaxes(weight, 1, 2).reshape(groups * out_per_group, in_channels // groups, *kernel_size)
        weight = jnp.flip(weight, axis=tuple(range(2, 2 + n)))
        reach = [d * (k - 1) for d, k in zip(dilation, kernel_size)]
        pads = [(r - p, r - p + op) for r, p, op in zip(reach, padding, output_padding)]
        strides, lhs_dilation = [1] * n, stride
    else:
        pads = [(p, p) for p in padding]
        strides, lhs_dilation = stride, [1] * n
    return jax.lax.conv_general_dilated(
        input,
        weight,
        window_strides=strides,
        padding=pads,
        lhs_dilation=lhs_dilation,
        rhs_dilation=dilation,
        dimension_numbers=numbers,
        feature_group_count=groups,
        precision=product_precision(jnp.result_type(input, weight)),
        preferred_element_type=accumulation_dtype(jnp.result_type(input, weight)),
    )


def _window_arguments(values):
    """The checks of PyTorch's convolution kernels on stride, padding and dilation."""
    stride, padding, dilation = values[3], values[4], values[5]
    if any(s <= 0 for s in stride):
        raise RuntimeError("non-positive stride is not supported")
    if any(p < 0 for p in padding):
        raise RuntimeError("negative padding is not supported")
    if any(d <= 0 for d in dilation):
        raise RuntimeError("dilation should be greater than zero")


@lowering(aten.convolution.default, check=_window_arguments)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    out = _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((1, -1) + (1,) * (out.ndim - 2))
    return out


@lowering(aten.convolution_backward.default)
def convolution_backward(
    grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    def conv(input, weight):
        return _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups)

    out, pullback = jax.vjp(conv, input, weight)
    grad_input, grad_weight = pullback(grad_output.astype(out.dtype))
    grad_bias = jnp.sum(grad_output.astype(out.dtype), axis=(0, *range(2, grad_output.ndim)))
    if bias_sizes is not None and math.prod(bias_sizes) == 0:  # no bias: its gradient is empty
        grad_bias = jnp.zeros(bias_sizes, out.dtype)
    # a gradient left out of output_mask is undefined; XLA drops its computation
    return tuple(g if wanted else None for g, wanted in zip((grad_input, grad_weight, grad_bias), output_mask))


# --- Windows: pooling and im2col gather each output position's window over the last n dims.


def _window_taps(out_size, kernel_size, stride, padding, dilation):
    """Input positions of each window (out, kernel) along one dim, as numpy (fixed at trace time)."""
    return np.arange(out_size)[:, None] * stride - padding + np.arange(kernel_size)[None, :] * dilation


def _adaptive_taps(in_size, out_size):
    """Adaptive pooling's windows along one dim: [floor(o*L/out), ceil((o+1)*L/out)), padded to the
    widest with positions past the end (which `_inside` then masks)."""
    starts = np.arange(out_size) * in_size // out_size
    ends = -(-(np.arange(1, out_size + 1) * in_size) // out_size)
    taps = starts[:, None] + np.arange(int((ends - starts).max()))[None, :]
    return np.where(taps < ends[:, None], taps, in_size)


def _interleaved(per_dim):
    """Per-dim (out, kernel) arrays laid out to broadcast as (out_0, k_0, out_1, k_1, ...)."""
    n = len(per_dim)
    return [a.reshape((1,) * 2 * d + a.shape + (1,) * 2 * (n - d - 1)) for d, a in enumerate(per_dim)]


def _windows_last(a, n):
    """(..., out_0, k_0, out_1, k_1, ...) -> (..., out_0, out_1, ..., k_0 * k_1 * ...)."""
    lead = a.ndim - 2 * n
    order = list(range(lead)) + [lead + 2 * d for d in range(n)] + [lead + 2 * d + 1 for d in range(n)]
    a = jnp.transpose(a, order) if isinstance(a, jax.Array) else np.transpose(a, order)
    return a.reshape(a.shape[: lead + n] + (math.prod(a.shape[lead + n :]),))


def _windows(x, taps, fill):
    """Gather windows over the last len(taps) dims. Returns the values (..., *out, K) with `fill`
    outside the input, whether each element is inside (*out, K), and its flat spatial index (*out, K)."""
    n = len(taps)
    lead = x.ndim - n
    spatial = x.shape[lead:]
    for d, (t, size) in enumerate(zip(taps, spatial)):
        x = jnp.take(x, np.clip(t, 0, size - 1), axis=lead + 2 * d)
    shape = tuple(s for t in taps for s in t.shape)
    inside = functools.reduce(np.logical_and, _interleaved([(t >= 0) & (t < size) for t, size in zip(taps, spatial)]))
    flat = sum(_interleaved([t * math.prod(spatial[d + 1 :]) for d, t in enumerate(taps)]))
    inside, flat = (_windows_last(np.broadcast_to(a, shape), n) for a in (inside, flat))
    return jnp.where(inside, _windows_last(x, n), fill), inside, flat


def _pooled_size(in_size, kernel_size, stride, padding, dilation, ceil_mode):
    span = in_size + 2 * padding - dilation * (kernel_size - 1) - 1
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= in_size + padding:  # the last window must start inside
        out -= 1
    return out


def _pool_taps(x, n, kernel_size, stride, padding, dilation, ceil_mode):
    """Each dim's window positions for a pooling op over the last n dims (empty stride: the kernel)."""
    kernel_size = _expand(kernel_size, n)
    stride = _expand(stride, n) if stride else kernel_size
    padding, dilation = _expand(padding, n), _expand(dilation, n)
    return [
        _window_taps(_pooled_size(size, k, s, p, d, ceil_mode), k, s, p, d)
        for size, k, s, p, d in zip(x.shape[x.ndim - n :], kernel_size, stride, padding, dilation)
    ]


def _lowest(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _max_with_index(values, flat):
    """Max over the last axis (NaN wins) and the flat index of the first maximum."""
    arg = jnp.argmax(values, axis=-1)
    index = jnp.take_along_axis(jnp.broadcast_to(flat, values.shape), arg[..., None], axis=-1)[..., 0]
    return jnp.max(values, axis=-1), index


def _scatter_to_input(grad_output, self, indices, n):
    """Max pooling's gradient: each output's gradient added at the input position it came from."""
    rows = math.prod(self.shape[: self.ndim - n])
    outputs = math.prod(grad_output.shape[self.ndim - n :])
    grad = grad_output.astype(accumulation_dtype(grad_output.dtype)).reshape(rows, outputs)
    out = jnp.zeros((rows, math.prod(self.shape[self.ndim - n :])), grad.dtype)
    out = out.at[jnp.arange(rows)[:, None], indices.reshape(rows, outputs)].add(grad)
    return out.reshape(self.shape)


def _max_pool(self, n, kernel_size, stride, padding, dilation, ceil_mode):
    taps = _pool_taps(self, n, kernel_size, stride, padding, dilation, ceil_mode)
    values, _, flat = _windows(self, taps, _lowest(self.dtype))
    return _max_with_index(values, flat)


@lowering(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, 2, kernel_size, stride, padding, dilation, ceil_mode)


@lowering(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, 3, kernel_size, stride, padding, dilation, ceil_mode)


@lowering(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_to_input(grad_output, self, indices, 2)


@lowering(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_to_input(grad_output, self, indices, 3)


def _avg_pool(self, n, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """Sums in float32 for low-precision floats; integers divide with truncation, like PyTorch."""
    taps = _pool_taps(self, n, kernel_size, stride, padding, 1, ceil_mode)
    x = self.astype(accumulation_dtype(self.dtype))
    values, _, _ = _windows(x, taps, 0)
    total = jnp.sum(values, axis=-1)
    if divisor_override:
        divisor = np.asarray(divisor_override)
    else:
        padding = _expand(padding, n)
        spatial = self.shape[self.ndim - n :]
        # positions counted: inside the padded input, or inside the input itself
        counted = [
            (t >= -p) & (t < size + p) if count_include_pad else (t >= 0) & (t < size)
            for t, size, p in zip(taps, spatial, padding)
        ]
        divisor = math.prod(c.sum(axis=1).reshape((1,) * d + (-1,) + (1,) * (n - d - 1)) for d, c in enumerate(counted))
    return jax.lax.div(total, jnp.broadcast_to(jnp.asarray(divisor, total.dtype), total.shape))


@lowering(aten.avg_pool2d.default)
def avg_pool2d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(self, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lowering(aten.avg_pool3d.default)
def avg_pool3d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(self, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lowering(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    args = (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    return _vjp(lambda x: _avg_pool(x, 2, *args), grad_output, self)


@lowering(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    args = (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    return _vjp(lambda x: _avg_pool(x, 3, *args), grad_output, self)


def _adaptive_windows(self, output_size, fill):
    n = len(output_size)
    taps = [_adaptive_taps(size, out) for size, out in zip(self.shape[self.ndim - n :], output_size)]
    return _windows(self, taps, fill)


def _adaptive_avg_pool(self, output_size):
    values, inside, _ = _adaptive_windows(self.astype(accumulation_dtype(self.dtype)), output_size, 0)
    return jnp.sum(values, axis=-1) / inside.sum(axis=-1)


def _adaptive_max_pool(self, output_size):
    values, _, flat = _adaptive_windows(self, output_size, _lowest(self.dtype))
    return _max_with_index(values, flat)


@lowering(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool(self, output_size):
    return _adaptive_avg_pool(self, output_size)


@lowering(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(grad_output, self):
    return _vjp(lambda x: _adaptive_avg_pool(x, grad_output.shape[-2:]), grad_output, self)


@lowering(aten._adaptive_avg_pool3d_backward.default)
def adaptive_avg_pool3d_backward(grad_output, self):
    return _vjp(lambda x: _adaptive_avg_pool(x, grad_output.shape[-3:]), grad_output, self)


@lowering(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def adaptive_max_pool(self, output_size):
    return _adaptive_max_pool(self, output_size)


@lowering(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _scatter_to_input(grad_output, self, indices, 2)


@lowering(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return _scatter_to_input(grad_output, self, indices, 3)


def _fractional_starts(samples, in_size, out_size, pool_size):
    """Window starts along one dim from each plane's sample u in [0, 1), in the samples' dtype as
    PyTorch's CPU kernel computes them: int((i + u) * alpha) - int(u * alpha), the last window
    ending at the input's end."""
    dtype = samples.dtype
    alpha = jnp.asarray(in_size - pool_size, dtype) / jnp.asarray(max(out_size - 1, 1), dtype)
    i = jnp.arange(out_size, dtype=dtype)
    starts = ((i + samples[:, None]) * alpha).astype(jnp.int32) - (samples[:, None] * alpha).astype(jnp.int32)
    return jnp.where(jnp.arange(out_size) == out_size - 1, in_size - pool_size, starts)


def _fractional_max_pool(self, kernel_size, output_size, random_samples):
    """Max over pseudo-random windows: each plane (sample, channel) draws its own window starts per
    dim from `random_samples` (..., n), ordered (W, H) for 2-d and (T, H, W) for 3-d, as PyTorch."""
    n = len(kernel_size)
    lead, spatial = self.shape[: self.ndim - n], self.shape[self.ndim - n :]
    planes = self.reshape((-1,) + spatial)
    samples = random_samples.reshape(-1, n)
    if n == 2:
        samples = samples[:, ::-1]
    x, flat = planes, jnp.zeros((planes.shape[0],) + (1,) * 2 * n, jnp.int64)
    for d, (in_size, out_size, pool_size) in enumerate(zip(spatial, output_size, kernel_size)):
        positions = _fractional_starts(samples[:, d], in_size, out_size, pool_size)[:, :, None] + jnp.arange(pool_size)
        gather_shape = [planes.shape[0]] + [1] * n
        gather_shape[1 + d] = out_size * pool_size
        x = jnp.take_along_axis(x, positions.reshape(gather_shape), axis=1 + d, mode="clip")
        per_dim_shape = [planes.shape[0]] + [1] * 2 * n
        per_dim_shape[1 + 2 * d], per_dim_shape[2 + 2 * d] = out_size, pool_size
        flat = flat + positions.reshape(per_dim_shape) * math.prod(spatial[d + 1 :])
    windows_shape = (planes.shape[0],) + tuple(s for o, k in zip(output_size, kernel_size) for s in (o, k))
    values = _windows_last(x.reshape(windows_shape), n)
    flat = _windows_last(jnp.broadcast_to(flat, windows_shape), n)
    output, indices = _max_with_index(values, flat)
    return output.reshape(lead + tuple(output_size)), indices.reshape(lead + tuple(output_size))


@lowering(aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default)
def fractional_max_pool(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, kernel_size, output_size, random_samples)


@lowering(aten.fractional_max_pool2d_backward.default, aten.fractional_max_pool3d_backward.default)
def fractional_max_pool_backward(grad_output, self, kernel_size, output_size, indices):
    return _scatter_to_input(grad_output, self, indices, len(kernel_size))


def _im2col(self, kernel_size, dilation, padding, stride):
    taps = [
        _window_taps(_pooled_size(size, k, s, p, d, False), k, s, p, d)
        for size, k, s, p, d in zip(self.shape[-2:], kernel_size, stride, padding, dilation)
    ]
    values, _, _ = _windows(self, taps, 0)  # (..., C, oh, ow, K)
    values = jnp.moveaxis(values, -1, -3)  # (..., C, K, oh, ow)
    return values.reshape(values.shape[:-4] + (values.shape[-4] * values.shape[-3], values.shape[-2] * values.shape[-1]))


@lowering(aten.im2col.default)
def im2col(self, kernel_size, dilation, padding, stride):
    return _im2col(self, kernel_size, dilation, padding, stride)


@lowering(aten.col2im.default)
def col2im(self, output_size, kernel_size, dilation, padding, stride):
    """The adjoint of im2col: overlapping window elements add up."""
    channels = self.shape[-2] // math.prod(kernel_size)
    image = jnp.zeros(self.shape[:-2] + (channels, *output_size), self.dtype)
    return _vjp(lambda x: _im2col(x, kernel_size, dilation, padding, stride), self, image)


# --- Upsampling: separable along each spatial dim, as taps (input positions and weights) per output
# position, computed with numpy in float32 (PyTorch's arithmetic for the source positions).


def _scale(in_size, out_size, scale):
    """Input positions per output position (PyTorch's `compute_scales_value`)."""
    return np.float32(1.0 / scale if scale is not None and scale > 0 else in_size / out_size)


def _nearest_taps(in_size, out_size, scale):
    source = np.floor(np.arange(out_size, dtype=np.float32) * _scale(in_size, out_size, scale))
    return np.minimum(source.astype(np.int64), in_size - 1)[:, None], None


def _nearest_exact_taps(in_size, out_size, scale):
    source = np.floor((np.arange(out_size, dtype=np.float32) + 0.5) * _scale(in_size, out_size, scale))
    return np.minimum(source.astype(np.int64), in_size - 1)[:, None], None


def _source_positions(in_size, out_size, scale, align_corners, cubic):
    """PyTorch's `area_pixel_compute_source_index`."""
    out = np.arange(out_size, dtype=np.float32)
    if align_corners:
        return out * np.float32((in_size - 1) / (out_size - 1) if out_size > 1 else 0)
    source = _scale(in_size, out_size, scale) * (out + np.float32(0.5)) - np.float32(0.5)
    return source if cubic else np.maximum(source, 0)


def _linear_taps(in_size, out_size, scale, align_corners):
    source = _source_positions(in_size, out_size, scale, align_corners, cubic=False)
    low = np.minimum(source.astype(np.int64), in_size - 1)
    weight = np.clip(source - low, 0, 1).astype(np.float32)
    high = np.minimum(low + 1, in_size - 1)
    return np.stack([low, high], 1), np.stack([1 - weight, weight], 1)


def _cubic_taps(in_size, out_size, scale, align_corners):
    """Keys' cubic convolution with A = -0.75 over 4 neighbours clamped to the edge."""
    source = _source_positions(in_size, out_size, scale, align_corners, cubic=True)
    low = np.floor(source)
    t = (source - low).astype(np.float32)
    taps = np.clip(low.astype(np.int64)[:, None] + np.arange(-1, 3), 0, in_size - 1)
    return taps, np.stack(_cubic_weights(t), 1)


def _keys_near(x, a):
    """Keys' cubic convolution kernel for |x| <= 1 (NumPy or JAX values)."""
    return ((a + 2) * x - (a + 3)) * x * x + 1


def _keys_far(x, a):
    """Keys' cubic convolution kernel for 1 < |x| < 2."""
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a


def _cubic_weights(t, a=-0.75):
    """The weights of the 4 neighbours at offsets -1..2 of a position `t` past the lower one, with
    PyTorch's A = -0.75 (resize and grid sampling)."""
    return [_keys_far(t + 1, a), _keys_near(t, a), _keys_near(1 - t, a), _keys_far(2 - t, a)]


def _upsample(self, output_size, taps_of):
    """`taps_of(in_size, out_size, d)` gives dim d's taps; weighted taps sum in float32 for
    low-precision floats, unweighted (nearest) ones copy."""
    n = len(output_size)
    x = self
    for d, out_size in enumerate(output_size):
        axis = x.ndim - n + d
        taps, weights = taps_of(x.shape[axis], out_size, d)
        x = jnp.take(x, taps, axis=axis)  # (..., out, T, ...)
        if weights is None:
            x = jnp.squeeze(x, axis + 1)
        else:
            x = x.astype(accumulation_dtype(x.dtype))
            weights = weights.reshape(weights.shape + (1,) * (x.ndim - axis - 2))
            x = jnp.sum(x * weights.astype(x.dtype), axis=axis + 1)
    return x


def _upsample_nearest(self, output_size, scales, taps):
    return _upsample(self, output_size, lambda size, out, d: taps(size, out, scales[d]))


def _upsample_interpolated(self, output_size, align_corners, scales, taps):
    taps_of = lambda size, out, d: taps(size, out, scales[d], align_corners)  # noqa: E731
    if self.dtype == jnp.uint8:
        return _uint8_resize(self, output_size, taps_of)
    return _upsample(self, output_size, taps_of)


@lowering(aten.upsample_nearest1d.default, aten.upsample_nearest2d.default, aten.upsample_nearest3d.default)
def upsample_nearest(self, output_size, *scales):
    return _upsample_nearest(self, output_size, scales, _nearest_taps)


@lowering(
    aten._upsample_nearest_exact1d.default, aten._upsample_nearest_exact2d.default, aten._upsample_nearest_exact3d.default
)
def upsample_nearest_exact(self, output_size, *scales):
    return _upsample_nearest(self, output_size, scales, _nearest_exact_taps)


@lowering(aten.upsample_linear1d.default, aten.upsample_bilinear2d.default, aten.upsample_trilinear3d.default)
def upsample_linear(self, output_size, align_corners, *scales):
    return _upsample_interpolated(self, output_size, align_corners, scales, _linear_taps)


@lowering(aten.upsample_bicubic2d.default)
def upsample_bicubic2d(self, output_size, align_corners, *scales):
    return _upsample_interpolated(self, output_size, align_corners, scales, _cubic_taps)


def _zeros_input(grad_output, input_size):
    return jnp.zeros(input_size, accumulation_dtype(grad_output.dtype))


@lowering(
    aten.upsample_nearest1d_backward.default,
    aten.upsample_nearest2d_backward.default,
    aten.upsample_nearest3d_backward.default,
)
def upsample_nearest_backward(grad_output, output_size, input_size, *scales):
    forward = functools.partial(_upsample_nearest, output_size=output_size, scales=scales, taps=_nearest_taps)
    return _vjp(forward, grad_output, _zeros_input(grad_output, input_size))


@lowering(
    aten._upsample_nearest_exact1d_backward.default,
    aten._upsample_nearest_exact2d_backward.default,
    aten._upsample_nearest_exact3d_backward.default,
)
def upsample_nearest_exact_backward(grad_output, output_size, input_size, *scales):
    forward = functools.partial(_upsample_nearest, output_size=output_size, scales=scales, taps=_nearest_exact_taps)
    return _vjp(forward, grad_output, _zeros_input(grad_output, input_size))


@lowering(
    aten.upsample_linear1d_backward.default,
    aten.upsample_bilinear2d_backward.default,
    aten.upsample_trilinear3d_backward.default,
)
def upsample_linear_backward(grad_output, output_size, input_size, align_corners, *scales):
    forward = functools.partial(
        _upsample_interpolated, output_size=output_size, align_corners=align_corners, scales=scales, taps=_linear_taps
    )
    return _vjp(forward, grad_output, _zeros_input(grad_output, input_size))


@lowering(aten.upsample_bicubic2d_backward.default)
def upsample_bicubic2d_backward(grad_output, output_size, input_size, align_corners, *scales):
    forward = functools.partial(
        _upsample_interpolated, output_size=output_size, align_corners=align_corners, scales=scales, taps=_cubic_taps
    )
    return _vjp(forward, grad_output, _zeros_input(grad_output, input_size))


# --- Antialiased resize (`interpolate(..., antialias=True)`, what torchvision and image processors
# use to downscale): PIL's separable filters, as in PyTorch's CPU kernel. Each output position
# averages the inputs under the filter stretched by the downscaling factor, with weights
# normalised to sum to one; upscaling uses the plain filter.


def _antialias_scale(in_size, out_size, scale, align_corners):
    """PyTorch's `area_pixel_compute_scale`: align_corners changes only the scale, not the centres."""
    if align_corners:
        return np.float32((in_size - 1) / (out_size - 1) if out_size > 1 else 0)
    return _scale(in_size, out_size, scale)


def _triangle_filter(x):
    return np.maximum(1 - np.abs(x), 0)


def _keys_filter(x):
    """Keys' cubic with A = -0.5 (PIL's choice; non-antialiased bicubic uses -0.75)."""
    x, a = np.abs(x), -0.5
    return np.where(x < 1, _keys_near(x, a), np.where(x < 2, _keys_far(x, a), 0))


def _antialiased_taps(filter_fn, filter_size):
    """Taps of PyTorch's `_compute_indices_min_size_weights_aa`: a window of the filter's support
    around each output centre, truncated at the input's edges (padded with zero weights)."""

    def taps_of(in_size, out_size, scale, align_corners):
        scale = float(_antialias_scale(in_size, out_size, scale, align_corners))
        support = filter_size / 2 * scale if scale >= 1 else filter_size / 2
        width = math.ceil(support) * 2 + 1
        center = scale * (np.arange(out_size) + 0.5)
        low = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
        size = np.clip(np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - low, 0, width)
        offsets = np.arange(width)
        stretch = 1 / scale if scale >= 1 else 1
        weights = filter_fn((offsets + low[:, None] - center[:, None] + 0.5) * stretch)
        weights = np.where(offsets < size[:, None], weights, 0).astype(np.float32)
        total = weights.sum(1, keepdims=True)
        weights = np.where(total != 0, weights / np.where(total != 0, total, 1), weights)
        return np.minimum(low[:, None] + offsets, in_size - 1), weights

    return taps_of


_antialiased_linear_taps = _antialiased_taps(_triangle_filter, 2)
_antialiased_cubic_taps = _antialiased_taps(_keys_filter, 4)


@lowering(aten._upsample_bilinear2d_aa.default)
def upsample_bilinear2d_aa(self, output_size, align_corners, *scales):
    return _upsample_interpolated(self, output_size, align_corners, scales, _antialiased_linear_taps)


@lowering(aten._upsample_bicubic2d_aa.default)
def upsample_bicubic2d_aa(self, output_size, align_corners, *scales):
    return _upsample_interpolated(self, output_size, align_corners, scales, _antialiased_cubic_taps)


def _antialiased_backward(grad_output, output_size, input_size, align_corners, scales, taps):
    forward = functools.partial(
        _upsample_interpolated, output_size=output_size, align_corners=align_corners, scales=scales, taps=taps
    )
    return _vjp(forward, grad_output, _zeros_input(grad_output, input_size))


@lowering(aten._upsample_bilinear2d_aa_backward.default)
def upsample_bilinear2d_aa_backward(grad_output, output_size, input_size, align_corners, *scales):
    return _antialiased_backward(grad_output, output_size, input_size, align_corners, scales, _antialiased_linear_taps)


@lowering(aten._upsample_bicubic2d_aa_backward.default)
def upsample_bicubic2d_aa_backward(grad_output, output_size, input_size, align_corners, *scales):
    return _antialiased_backward(grad_output, output_size, input_size, align_corners, scales, _antialiased_cubic_taps)


# --- uint8 images (bilinear and bicubic, antialiased or not): PyTorch's CPU kernel resizes them as
# PIL does, whatever the channel count: one pass per resized dim, the last dim first, each in int16
# fixed point (weights scaled by 2**precision, the most bits up to 22 that keep the largest weight
# below 2**15), rounded and clamped back to uint8 before the next pass.


def _fixed_point(weights):
    """Float64 weights as PyTorch's int16 weights, and their precision in bits."""
    precision = 0
    while precision < 22 and int(0.5 + weights.max() * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    return np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32), precision


def _uint8_resize(self, output_size, taps_of):
    x = self
    dims = len(output_size)
    for d in reversed(range(dims)):
        axis = x.ndim - dims + d
        in_size, out_size = x.shape[axis], output_size[d]
        if in_size == out_size:  # PyTorch skips the pass
            continue
        taps, weights = taps_of(in_size, out_size, d)
        # one weight per input position: taps clamped to the same edge position add up first
        matrix = np.zeros((out_size, in_size))
        np.add.at(matrix, (np.arange(out_size)[:, None], taps), weights.astype(np.float64))
        matrix, precision = _fixed_point(matrix)
        total = jnp.moveaxis(jnp.tensordot(x.astype(jnp.int32), matrix.T, axes=([axis], [0])), -1, axis)
        x = jnp.clip((total + (1 << (precision - 1))) >> precision, 0, 255).astype(jnp.uint8)
    return x


# --- Grid sampling: `F.grid_sample` over NCHW input at (x, y) positions in [-1, 1]

_BILINEAR, _NEAREST, _BICUBIC = range(3)
_ZEROS, _BORDER, _REFLECTION = range(3)


def _unnormalize(coord, size, align_corners):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord, twice_low, twice_high):
    """Fold `coord` into [twice_low / 2, twice_high / 2] by reflecting at the edges."""
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    coord = jnp.abs(coord - low)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(flips % 2 == 0, extra + low, span - extra + low)


def _pad_coordinate(coord, size, padding_mode, align_corners):
    """PyTorch's `compute_coordinates`: where `border`/`reflection` padding moves a position."""
    if padding_mode == _BORDER:
        return jnp.clip(coord, 0, size - 1)
    if padding_mode == _REFLECTION:
        twice = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        return jnp.clip(_reflect(coord, *twice), 0, size - 1)
    return coord


def _taps_sum(image, taps):
    """Sum over taps `(position, weight)` of weight * image[position] (image N, *spatial, C; each
    position one (N, *out) coordinate array per spatial dim); positions off the image contribute
    nothing (zeros padding)."""
    sizes = image.shape[1:-1]
    batch = jnp.arange(image.shape[0]).reshape((-1,) + (1,) * len(sizes))
    total = 0
    for position, weight in taps:
        inside = functools.reduce(jnp.logical_and, [(p >= 0) & (p <= n - 1) for p, n in zip(position, sizes)])
        index = [jnp.clip(p, 0, n - 1).astype(jnp.int32) for p, n in zip(position, sizes)]
        total = total + image[(batch, *index)] * jnp.where(inside, weight, 0)[..., None]
    return total


def _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners):
    """Shared by 2-d and 3-d sampling; the grid's last dim lists x (the last spatial dim) first."""
    compute = accumulation_dtype(input.dtype)
    image = jnp.moveaxis(input, 1, -1).astype(compute)
    grid = grid.astype(compute)
    sizes = input.shape[2:]
    coords = [_unnormalize(grid[..., len(sizes) - 1 - d], n, align_corners) for d, n in enumerate(sizes)]
    if interpolation_mode == _BICUBIC:
        # taps around the unpadded position, each tap moved by the padding on its own
        (y, x), (height, width) = coords, sizes
        x0, y0 = jnp.floor(x), jnp.floor(y)
        wx, wy = _cubic_weights(x - x0), _cubic_weights(y - y0)
        taps = [((_pad_coordinate(y0 - 1 + j, height, padding_mode, align_corners),
                  _pad_coordinate(x0 - 1 + i, width, padding_mode, align_corners)), wx[i] * wy[j])
                for j in range(4) for i in range(4)]
    else:
        coords = [_pad_coordinate(c, n, padding_mode, align_corners) for c, n in zip(coords, sizes)]
        if interpolation_mode == _NEAREST:
            taps = [([jnp.round(c) for c in coords], jnp.ones_like(coords[0]))]
        else:  # (bi/tri)linear: the 2**dims corners around the position
            lows = [jnp.floor(c) for c in coords]
            fractions = [c - low for c, low in zip(coords, lows)]
            taps = []
            for corner in itertools.product((0, 1), repeat=len(sizes)):
                position = [low + k for low, k in zip(lows, corner)]
                weight = functools.reduce(jnp.multiply, [f if k else 1 - f for f, k in zip(fractions, corner)])
                taps.append((position, weight))
    return jnp.moveaxis(_taps_sum(image, taps), -1, 1).astype(input.dtype)


@lowering(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler(input, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)


@lowering(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def grid_sampler_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    def forward(input, grid):
        return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)

    out, pullback = jax.vjp(forward, input, grid)
    grad_input, grad_grid = pullback(grad_output.astype(out.dtype))
    return (grad_input if output_mask[0] else None), grad_grid
