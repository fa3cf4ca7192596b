"""FFT: the three ATen primitives every `torch.fft` function reduces to.

`torch.fft.fft`, `rfft`, `ihfft`, `fftn`, ... are composite over `_fft_r2c` (real in, complex out),
`_fft_c2r` (Hermitian complex in, real out) and `_fft_c2c`. Each computes the unnormalised transform
over `dim` in its direction and then scales by `normalization` (PyTorch's fft_norm_mode: 0 none,
1 by 1/sqrt(n), 2 by 1/n, n being the product of the signal sizes).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch
from ..dispatch import lowering


aten = torch.ops.aten


def _normalized(result, signal_sizes, normalization):
    n = math.prod(signal_sizes)
    if normalization == 1:
        return result / math.sqrt(n)
    if normalization == 2:
        return result / n
    return result


def _complex(x):
    return x if jnp.iscomplexobj(x) else x.astype(jnp.result_type(x.dtype, jnp.complex64))


@lowering(aten._fft_r2c.default)
def _fft_r2c(self, dim, normalization, onesided):
    if onesided:
        result = jnp.fft.rfftn(self, axes=dim)
    else:
        result = jnp.fft.fftn(_complex(self), axes=dim)
    return _normalized(result, [self.shape[d] for d in dim], normalization)


@lowering(aten._fft_c2r.default)
def _fft_c2r(self, dim, normalization, last_dim_size):
    sizes = [self.shape[d] for d in dim[:-1]] + [last_dim_size]
    # norm="forward" leaves the inverse transform unscaled
    result = jnp.fft.irfftn(self, s=sizes, axes=dim, norm="forward")
    return _normalized(result, sizes, normalization)


@lowering(aten._fft_c2c.default)
def _fft_c2c(self, dim, normalization, forward):
    if not dim:
        return self
    if forward:
        result = jnp.fft.fftn(self, axes=dim)
    else:
        result = jnp.fft.ifftn(self, axes=dim, norm="forward")
    return _normalized(result, [self.shape[d] for d in dim], normalization)
