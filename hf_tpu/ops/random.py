"""Random ops: each draws from the JAX key its `Generator?` argument arrives as.

The factories (`rand`, `randn`, `randint`, `normal(float, float, size)`, ...) are composite over
`empty` and the in-place samplers here, so they need no lowering of their own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from .. import dtypes
from ..dispatch import lowering

aten = torch.ops.aten


def _sample_dtype(x):
    """Draw float64 tensors in float64 and every other dtype in float32."""
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def _uniform(key, like, low=0.0, high=1.0):
    return jax.random.uniform(key, like.shape, _sample_dtype(like), low, high)


def _normal(key, like):
    return jax.random.normal(key, like.shape, _sample_dtype(like))


# --- PyTorch's argument checks (its meta kernels leave them to the CPU and CUDA kernels). The
# arguments checked are Python numbers here, so a bad call raises while its program is traced.

# the C++ type names PyTorch's messages give each dtype
_C_NAMES = {jnp.dtype(jnp.uint8): "unsigned char", jnp.dtype(jnp.int8): "signed char",
            jnp.dtype(jnp.int16): "short int", jnp.dtype(jnp.int32): "int", jnp.dtype(jnp.bool_): "bool",
            jnp.dtype(jnp.float32): "float", jnp.dtype(jnp.float64): "double",
            jnp.dtype(jnp.float16): "c10::Half", jnp.dtype(jnp.bfloat16): "c10::BFloat16"}


def _require(ok: bool, message: str):
    if not ok:
        raise RuntimeError(message)


def _check_uniform_range(x, from_, to):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise NotImplementedError(f'"check_uniform_bounds" not implemented for '
                                  f"'{dtypes.scalar_type_name(x.dtype)}'")
    name = _C_NAMES.get(x.dtype, str(x.dtype))
    limit = float(jnp.finfo(x.dtype).max)
    _require(-limit <= from_ <= limit, f"from is out of bounds for {name}")
    _require(-limit <= to <= limit, f"to is out of bounds for {name}")
    _require(from_ <= to, f"uniform_ expects to return a [from, to) range, but found from={from_:g} > to={to:g}")


def _check_integer_range(x, from_, to):
    _require(from_ < to, f"random_ expects 'from' to be less than 'to', but got from={from_} >= to={to}")
    if x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer):
        name = _C_NAMES.get(x.dtype, str(x.dtype))
        low, high = (0, 1) if x.dtype == jnp.bool_ else (int(jnp.iinfo(x.dtype).min), int(jnp.iinfo(x.dtype).max))
        _require(from_ >= low, f"from is out of bounds for {name}")
        _require(to - 1 <= high, f"to - 1 is out of bounds for {name}")


@lowering(aten.uniform.default)
def uniform(self, from_=0.0, to=1.0, *, generator=None):
    _check_uniform_range(self, from_, to)
    return _uniform(generator, self, from_, to)


@lowering(aten.normal_.default)
def normal_(self, mean=0.0, std=1.0, *, generator=None):
    return mean + std * _normal(generator, self)


@lowering(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor)
def normal(mean, std=1.0, *, generator=None):
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    dtype = jnp.result_type(mean, std, jnp.float32)
    return mean + std * jax.random.normal(generator, shape, dtype)


@lowering(aten.log_normal.default)
def log_normal(self, mean=1.0, std=2.0, *, generator=None):
    return jnp.exp(mean + std * _normal(generator, self))


@lowering(aten.exponential.default)
def exponential(self, lambd=1.0, *, generator=None):
    return jax.random.exponential(generator, self.shape, _sample_dtype(self)) / lambd


@lowering(aten.cauchy.default)
def cauchy(self, median=0.0, sigma=1.0, *, generator=None):
    return median + sigma * jnp.tan(math.pi * (_uniform(generator, self) - 0.5))


@lowering(aten.geometric.default)
def geometric(self, p, *, generator=None):
    # the number of Bernoulli(p) trials up to the first success: at least 1
    return jnp.ceil(jnp.log1p(-_uniform(generator, self)) / math.log1p(-p)) if p < 1 else jnp.ones_like(self)


@lowering(aten.bernoulli.default)
def bernoulli(self, *, generator=None):
    return _uniform(generator, self) < self


@lowering(aten.bernoulli.p, aten.bernoulli.Tensor, aten.bernoulli_.float)
def bernoulli_p(self, p, *, generator=None):
    # bernoulli_.float has no functional overload of its own; bernoulli.p computes the same values
    if isinstance(p, float):  # not bernoulli.Tensor's array of probabilities
        _require(0 <= p <= 1, f"bernoulli_ expects p to be in [0, 1], but got p={p:g}")
    return _uniform(generator, self) < p


def _integers(key, like, low, high):
    """Uniform integers in [low, high) for `like`'s shape."""
    return jax.random.randint(key, like.shape, low, high, jnp.int64)


def _default_high(x):
    """random_'s exclusive upper bound for a dtype: 2**mantissa digits + 1 for floats (every
    integer below is exact), the largest value + 1 for integers."""
    if x.dtype == jnp.bool_:
        return 2
    if jnp.issubdtype(x.dtype, jnp.floating):
        return 2 ** jnp.finfo(x.dtype).nmant + 2
    return int(jnp.iinfo(x.dtype).max)  # randint's bound is exclusive: the maximum itself is left out


@lowering(aten.random.default)
def random(self, *, generator=None):
    return _integers(generator, self, 0, _default_high(self))


@lowering(aten.random.to)
def random_to(self, to, *, generator=None):
    _check_integer_range(self, 0, to)
    return _integers(generator, self, 0, to)


@lowering(getattr(aten.random, "from"))
def random_from(self, from_, to, *, generator=None):
    if to is not None:
        _check_integer_range(self, from_, to)
    return _integers(generator, self, from_, _default_high(self) if to is None else to)


def _multinomial_check(values):
    self, num_samples, replacement = values[0], values[1], values[2]
    _require(self.is_floating_point(),
             f"multinomial only supports floating-point dtypes for input, got: {dtypes.scalar_type_name(self.dtype)}")
    _require(num_samples > 0, "cannot sample n_sample <= 0 samples")
    if self.dim():
        _require(replacement or num_samples <= self.shape[-1],
                 "cannot sample n_sample > prob_dist.size(-1) samples without replacement")
        _require(self.shape[-1] <= 2**24, "number of categories cannot exceed 2^24")


@lowering(aten.multinomial.default, check=_multinomial_check)
def multinomial(self, num_samples, replacement=False, *, generator=None):
    logits = jnp.log(self.astype(_sample_dtype(self)))
    if replacement:
        batch = logits.shape[:-1]
        draws = jax.random.categorical(generator, logits, shape=(num_samples, *batch))
        return jnp.moveaxis(draws, 0, -1)
    # without replacement: the top num_samples of Gumbel-perturbed logits
    perturbed = logits + jax.random.gumbel(generator, logits.shape, logits.dtype)
    return jax.lax.top_k(perturbed, num_samples)[1]


@lowering(aten.randperm.generator)
def randperm(n, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    return jax.random.permutation(generator, n)


@lowering(aten.poisson.default)
def poisson(self, generator=None):
    return jax.random.poisson(generator, self, self.shape)


@lowering(aten._standard_gamma.default)
def _standard_gamma(self, generator=None):
    return jax.random.gamma(generator, self, self.shape, _sample_dtype(self))


@lowering(aten.binomial.default)
def binomial(count, prob, generator=None):
    return jax.random.binomial(generator, count, prob, jnp.broadcast_shapes(count.shape, prob.shape),
                               _sample_dtype(prob))
