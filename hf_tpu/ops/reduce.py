"""Reductions and scans: sums, means, extrema, statistics, norms, logical reductions, cumulative ops.

PyTorch's conventions, read once here: a `dim` of None or [] means every dim (except for
`all.dims`/`any.dims`, where [] reduces nothing); a 0-dim tensor accepts dim 0 and -1; integer and
bool sums and products accumulate in int64; low-precision floats accumulate in float32 (the CPU's
opmath). Result dtypes and most bad-input errors come from the meta kernels; `require_nonempty`
raises the ones they miss.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import torch

from .. import dtypes
from ..dispatch import Promote, lowering

aten = torch.ops.aten


def _axes(x, dim):
    """JAX axes for a PyTorch reduction `dim` (an int, a list, or None/[] for every dim)."""
    if x.ndim == 0:
        return ()
    if dim is None:
        return None
    dims = [dim] if isinstance(dim, int) else dim
    return tuple(d % x.ndim for d in dims) if dims else None


def _accumulator(x, dtype=None):
    """`x` in the dtype PyTorch accumulates it in, after `dtype=` when one is given."""
    if dtype is not None:
        x = x.astype(dtypes.to_jax(dtype))
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        return x.astype(jnp.int64)
    if x.dtype in (jnp.bfloat16, jnp.float16):
        return x.astype(jnp.float32)
    return x


def _count(x, axes) -> int:
    """How many elements each output of a reduction over `axes` reduces."""
    if axes is None:
        return x.size
    return math.prod(x.shape[a] for a in axes)


def require_nonempty(name, shape, axes):
    """PyTorch's error for a reduction with no identity over an empty dim (these ops' meta kernels
    do not raise it, or raise another type)."""
    if axes is None and math.prod(shape) == 0:
        raise RuntimeError(
            f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
            "Specify the reduction dim with the 'dim' argument."
        )
    for axis in axes or ():
        if shape[axis] == 0:
            raise IndexError(f"{name}(): Expected reduction dim {axis} to have non-zero size.")


def _nonempty_check(name):
    """The check of `name(self, dim, ...)`, run before PyTorch's meta kernel, which reports an empty
    reduced dim as RuntimeError where CPU raises IndexError; a dim out of range is left to the meta
    kernel's IndexError."""

    def check(values):
        self, dim = values[0], values[1]
        ndim = max(self.ndim, 1)
        if all(-ndim <= d < ndim for d in ([dim] if isinstance(dim, int) else dim or ())):
            require_nonempty(name, self.shape, _axes(self, dim))

    return check


def scalar_as_vector(fn):
    """PyTorch's single-dim ops treat a 0-dim tensor as a 1-element vector and return 0-dim
    results; JAX has no axis 0 on a scalar, so run on the vector and drop the dim."""

    @functools.wraps(fn)
    def lowered(self, *args, **kwargs):
        if self.ndim:
            return fn(self, *args, **kwargs)
        result = fn(self.reshape(1), *args, **kwargs)
        if isinstance(result, tuple):
            return tuple(r.reshape(()) for r in result)
        return result.reshape(())

    return lowered


# --- Sums, products, means.


@lowering(aten.sum.default, aten.sum.dim_IntList)
def sum_(self, dim=None, keepdim=False, *, dtype=None):
    return jnp.sum(_accumulator(self, dtype), _axes(self, dim), keepdims=keepdim)


@lowering(aten.nansum.default)
def nansum(self, dim=None, keepdim=False, *, dtype=None):
    x = _accumulator(self, dtype)
    return jnp.sum(jnp.where(jnp.isnan(x), 0, x), _axes(self, dim), keepdims=keepdim)


@lowering(aten.prod.default, aten.prod.dim_int)
def prod(self, dim=None, keepdim=False, *, dtype=None):
    return jnp.prod(_accumulator(self, dtype), _axes(self, dim), keepdims=keepdim)


@lowering(aten.mean.default, aten.mean.dim)
def mean(self, dim=None, keepdim=False, *, dtype=None):
    return jnp.mean(_accumulator(self, dtype), _axes(self, dim), keepdims=keepdim)


# --- Extrema. XLA's max and min propagate NaN, and argmax/argmin pick the first NaN or the first of
# equal values, as PyTorch does.


def _extreme(name, reduce, x, dim, keepdim):
    axes = _axes(x, dim)
    require_nonempty(name, x.shape, axes)
    return reduce(x, axes, keepdims=keepdim)


@lowering(aten.amax.default, check=_nonempty_check("amax"))
def amax(self, dim=(), keepdim=False):
    return _extreme("amax", jnp.max, self, dim, keepdim)


@lowering(aten.amin.default, check=_nonempty_check("amin"))
def amin(self, dim=(), keepdim=False):
    return _extreme("amin", jnp.min, self, dim, keepdim)


@lowering(aten.max.default)
def max_(self):
    return _extreme("max", jnp.max, self, None, False)


@lowering(aten.min.default)
def min_(self):
    return _extreme("min", jnp.min, self, None, False)


@lowering(aten.max.dim)
@scalar_as_vector
def max_dim(self, dim, keepdim=False):
    return _extreme("max", jnp.max, self, dim, keepdim), jnp.argmax(self, dim, keepdims=keepdim)


@lowering(aten.min.dim)
@scalar_as_vector
def min_dim(self, dim, keepdim=False):
    return _extreme("min", jnp.min, self, dim, keepdim), jnp.argmin(self, dim, keepdims=keepdim)


def _arg_extreme_check(name):
    def check(values):
        self, dim = values[0], values[1]
        if self.dtype == torch.bool:
            raise RuntimeError(f"{name}(): does not support bool input")
        if dim is None and self.numel() == 0:
            raise IndexError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0.")
    return check


@lowering(aten.argmax.default, check=_arg_extreme_check("argmax"))
@scalar_as_vector
def argmax(self, dim=None, keepdim=False):
    return jnp.argmax(self, dim, keepdims=keepdim)


@lowering(aten.argmin.default, check=_arg_extreme_check("argmin"))
@scalar_as_vector
def argmin(self, dim=None, keepdim=False):
    return jnp.argmin(self, dim, keepdims=keepdim)


@lowering(aten.aminmax.default, check=_nonempty_check("aminmax"))
@scalar_as_vector
def aminmax(self, *, dim=None, keepdim=False):
    return _extreme("aminmax", jnp.min, self, dim, keepdim), _extreme("aminmax", jnp.max, self, dim, keepdim)


# --- Statistics.


def _var_and_mean(x, dim, correction, keepdim):
    axes = _axes(x, dim)
    mean_ = jnp.mean(x, axes, keepdims=True)
    squares = jnp.sum(jnp.square(jnp.abs(x - mean_)), axes, keepdims=keepdim)
    correction = 1 if correction is None else correction
    var_ = squares / jnp.maximum(_count(x, axes) - correction, 0)
    return var_, mean_.reshape(var_.shape)


def _floating_statistics(name: str):
    """PyTorch's CPU kernels of var and std reject integer and bool inputs, which their meta kernels let
    through."""
    def check(values):
        if not (values[0].is_floating_point() or values[0].is_complex()):
            raise RuntimeError(f"{name} only support floating point and complex dtypes")
    return check


@lowering(aten.var.correction, promote=Promote.INT_TO_FLOAT, type_check=_floating_statistics("std and var"))
def var(self, dim=None, *, correction=None, keepdim=False):
    return _var_and_mean(self, dim, correction, keepdim)[0]


@lowering(aten.std.correction, promote=Promote.INT_TO_FLOAT, type_check=_floating_statistics("std and var"))
def std(self, dim=None, *, correction=None, keepdim=False):
    return jnp.sqrt(_var_and_mean(self, dim, correction, keepdim)[0])


@lowering(aten.var_mean.correction, promote=Promote.INT_TO_FLOAT, type_check=_floating_statistics("var_mean"))
def var_mean(self, dim=None, *, correction=None, keepdim=False):
    return _var_and_mean(self, dim, correction, keepdim)


@lowering(aten.std_mean.correction, promote=Promote.INT_TO_FLOAT, type_check=_floating_statistics("std_mean"))
def std_mean(self, dim=None, *, correction=None, keepdim=False):
    var_, mean_ = _var_and_mean(self, dim, correction, keepdim)
    return jnp.sqrt(var_), mean_


@lowering(aten.logsumexp.default, promote=Promote.INT_TO_FLOAT)
def logsumexp(self, dim, keepdim=False):
    return jax.nn.logsumexp(self, _axes(self, dim), keepdims=keepdim)


# --- Norms.


# The orders with a computation of their own: compiled in when passed (`static_values`), each as its case.
NORM_ORDERS = frozenset({math.inf, -math.inf, 0, 1, 2})


def _vector_norm(x, ord, dim, keepdim, dtype):
    """`ord` is a Python number for the orders in NORM_ORDERS, and the program computes that order's norm
    alone. Any other order is traced (dispatch keys a Scalar by its type, not its value): its program takes
    it as an input and picks the case with a switch, so that one program serves them all."""
    magnitudes = jnp.abs(_accumulator(x, dtype))
    axes = _axes(x, dim)
    reduce = functools.partial(jnp.sum, axis=axes, keepdims=keepdim)
    cases = {
        math.inf: lambda: jnp.max(magnitudes, axes, keepdims=keepdim, initial=0),
        -math.inf: lambda: jnp.min(magnitudes, axes, keepdims=keepdim, initial=math.inf),
        0: lambda: reduce(magnitudes != 0).astype(magnitudes.dtype),
        1: lambda: reduce(magnitudes),
        2: lambda: jnp.sqrt(reduce(jnp.square(magnitudes))),
    }
    if isinstance(ord, (int, float)) and ord in cases:
        return cases[ord]()
    ord = jnp.asarray(ord, magnitudes.dtype)
    general = lambda: reduce(magnitudes**ord) ** (1 / ord)  # noqa: E731
    branch = jnp.select([ord == order for order in cases], jnp.arange(len(cases)), len(cases))
    return jax.lax.switch(branch, [*cases.values(), general])


@lowering(aten.linalg_vector_norm.default, static_values={"ord": NORM_ORDERS})
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    return _vector_norm(self, ord, dim, keepdim, dtype)


@lowering(aten.norm.Scalar, aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype, aten.norm.ScalarOpt_dtype,
          static_values={"p": NORM_ORDERS})
def norm(self, p=2, dim=None, keepdim=False, *, dtype=None):
    return _vector_norm(self, 2 if p is None else p, dim, keepdim, dtype)


@lowering(aten.renorm.default)
def renorm(self, p, dim, maxnorm):
    """Slices along `dim` whose p-norm exceeds `maxnorm` are scaled down to it. As on CPU, the norm
    is accumulated in float32 and the scale rounded to self's dtype before the product."""
    dim = dim % self.ndim
    others = [d for d in range(self.ndim) if d != dim]
    norm = _vector_norm(self, p, others, True, None)
    scale = jnp.where(norm > maxnorm, maxnorm / (norm + 1e-7), 1)
    return self * scale.astype(self.dtype)


@lowering(aten.trace.default)
def trace(self):
    return jnp.sum(jnp.diagonal(_accumulator(self)))


# --- Logical reductions and counts.


def _logical_axes(x, dim):
    """`all.dims`/`any.dims`: [] reduces nothing, unlike the other reductions."""
    return () if isinstance(dim, list) and not dim else _axes(x, dim)


@lowering(aten.all.default, aten.all.dim, aten.all.dims)
def all_(self, dim=None, keepdim=False):
    return jnp.all(self, _logical_axes(self, dim), keepdims=keepdim)


@lowering(aten.any.default, aten.any.dim, aten.any.dims)
def any_(self, dim=None, keepdim=False):
    return jnp.any(self, _logical_axes(self, dim), keepdims=keepdim)


@lowering(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero(self, dim=None):
    return jnp.sum(self != 0, _axes(self, dim), dtype=jnp.int64)


# --- Scans.


@lowering(aten.cumsum.default)
@scalar_as_vector
def cumsum(self, dim, *, dtype=None):
    return jnp.cumsum(_accumulator(self, dtype), dim)


@lowering(aten.cumprod.default)
@scalar_as_vector
def cumprod(self, dim, *, dtype=None):
    return jnp.cumprod(_accumulator(self, dtype), dim)


def _cumulative_extreme(x, dim, scan):
    """Running extreme and the index of its latest occurrence (PyTorch's tie-break); NaN wins."""
    values = scan(x.astype(jnp.int8) if x.dtype == jnp.bool_ else x, axis=dim % x.ndim)
    positions = jax.lax.broadcasted_iota(jnp.int64, x.shape, dim % x.ndim)
    # the running extreme only changes where x equals it, so the latest such position is its index
    attained = (x == values) | jnp.isnan(x) if jnp.issubdtype(x.dtype, jnp.floating) else x == values
    return values, jax.lax.cummax(jnp.where(attained, positions, 0), axis=dim % x.ndim)


@lowering(aten.cummax.default)
@scalar_as_vector
def cummax(self, dim):
    return _cumulative_extreme(self, dim, jax.lax.cummax)


@lowering(aten.cummin.default)
@scalar_as_vector
def cummin(self, dim):
    return _cumulative_extreme(self, dim, jax.lax.cummin)


@lowering(aten.logcumsumexp.default, aten._logcumsumexp.default, promote=Promote.INT_TO_FLOAT)
@scalar_as_vector
def logcumsumexp(self, dim):
    return jax.lax.cumlogsumexp(self, axis=dim % self.ndim)
