"""Elementwise ops: arithmetic, comparison, logic and math functions, with PyTorch's promotion.

Ops whose PyTorch semantics are exactly a JAX function's are registered from tables; ops where
PyTorch's definition differs (integer division, NaN and signed-zero rules, edge values) have their
own lowering written after PyTorch's CPU kernel. Promotion kinds follow `torch/_refs`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
import torch
from jax import lax

from .. import dtypes
from ..dispatch import Promote, lowering

aten = torch.ops.aten


def _register(promote, table):
    for op, fn in table.items():
        lowering(op, promote=promote)(fn)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _is_bool(x) -> bool:
    return jnp.result_type(x) == jnp.bool_


# --- Unary math.

_register(Promote.INT_TO_FLOAT, {
    aten.exp.default: jnp.exp,
    aten.exp2.default: jnp.exp2,
    aten.expm1.default: jnp.expm1,
    aten.log.default: jnp.log,
    aten.log2.default: jnp.log2,
    aten.log10.default: jnp.log10,
    aten.log1p.default: jnp.log1p,
    aten.sqrt.default: jnp.sqrt,
    aten.rsqrt.default: lax.rsqrt,
    aten.reciprocal.default: jnp.reciprocal,
    aten.sin.default: jnp.sin,
    aten.cos.default: jnp.cos,
    aten.tan.default: jnp.tan,
    aten.asin.default: jnp.arcsin,
    aten.acos.default: jnp.arccos,
    aten.atan.default: jnp.arctan,
    aten.sinh.default: jnp.sinh,
    aten.cosh.default: jnp.cosh,
    aten.tanh.default: jnp.tanh,
    aten.asinh.default: jnp.arcsinh,
    aten.acosh.default: jnp.arccosh,
    aten.atanh.default: jnp.arctanh,
    aten.sigmoid.default: jax.nn.sigmoid,
    aten.erf.default: lax.erf,
    aten.erfc.default: lax.erfc,
    aten.erfinv.default: lax.erf_inv,
    aten.lgamma.default: lax.lgamma,
    aten.sinc.default: jnp.sinc,
    aten.deg2rad.default: jnp.deg2rad,
    aten.rad2deg.default: jnp.rad2deg,
    aten.i0.default: jsp.i0,
    aten.special_i0e.default: jsp.i0e,
    aten.special_i1.default: jsp.i1,
    aten.special_i1e.default: jsp.i1e,
    aten.special_modified_bessel_i0.default: jsp.i0,
    aten.special_modified_bessel_i1.default: jsp.i1,
    aten.special_ndtri.default: jsp.ndtri,
    aten.special_log_ndtr.default: jsp.log_ndtr,
    aten.special_erfcx.default: jsp.erfcx,
    aten.special_entr.default: jsp.entr,
    aten.igamma.default: jsp.gammainc,
    aten.igammac.default: jsp.gammaincc,
    aten.atan2.default: jnp.arctan2,
    aten.copysign.Tensor: jnp.copysign,
    aten.copysign.Scalar: jnp.copysign,
})

_register(Promote.DEFAULT, {
    aten.neg.default: jnp.negative,
    aten.ceil.default: jnp.ceil,
    aten.floor.default: jnp.floor,
    aten.trunc.default: jnp.trunc,
    aten.round.default: jnp.round,  # half to even, like std::nearbyint
    aten.bitwise_not.default: jnp.invert,
    aten.maximum.default: jnp.maximum,
    aten.minimum.default: jnp.minimum,
    aten.clamp_min.default: jnp.maximum,
    aten.clamp_min.Tensor: jnp.maximum,
    aten.clamp_max.default: jnp.minimum,
    aten.clamp_max.Tensor: jnp.minimum,
    aten.fmax.default: jnp.fmax,
    aten.fmin.default: jnp.fmin,
    aten.fmod.Tensor: jnp.fmod,
    aten.fmod.Scalar: jnp.fmod,
    # fmod, then + divisor where the signs differ: PyTorch's remainder for ints and floats alike
    aten.remainder.Tensor: jnp.remainder,
    aten.remainder.Scalar: jnp.remainder,
    aten.remainder.Scalar_Tensor: jnp.remainder,
    aten.hypot.default: jnp.hypot,
    aten.logaddexp.default: jnp.logaddexp,
    aten.logaddexp2.default: jnp.logaddexp2,
    aten.gcd.default: jnp.gcd,
    aten.lcm.default: jnp.lcm,
    aten.bitwise_and.Tensor: jnp.bitwise_and,
    aten.bitwise_and.Scalar: jnp.bitwise_and,
    aten.bitwise_and.Scalar_Tensor: jnp.bitwise_and,
    aten.bitwise_or.Tensor: jnp.bitwise_or,
    aten.bitwise_or.Scalar: jnp.bitwise_or,
    aten.bitwise_or.Scalar_Tensor: jnp.bitwise_or,
    aten.bitwise_xor.Tensor: jnp.bitwise_xor,
    aten.bitwise_xor.Scalar: jnp.bitwise_xor,
    aten.bitwise_xor.Scalar_Tensor: jnp.bitwise_xor,
})

_register(Promote.ALWAYS_BOOL, {
    aten.isnan.default: jnp.isnan,
    aten.isinf.default: jnp.isinf,
    aten.isposinf.default: jnp.isposinf,
    aten.isneginf.default: jnp.isneginf,
    aten.eq.Tensor: jnp.equal,
    aten.eq.Scalar: jnp.equal,
    aten.ne.Tensor: jnp.not_equal,
    aten.ne.Scalar: jnp.not_equal,
    aten.lt.Tensor: jnp.less,
    aten.lt.Scalar: jnp.less,
    aten.le.Tensor: jnp.less_equal,
    aten.le.Scalar: jnp.less_equal,
    aten.gt.Tensor: jnp.greater,
    aten.gt.Scalar: jnp.greater,
    aten.ge.Tensor: jnp.greater_equal,
    aten.ge.Scalar: jnp.greater_equal,
    aten.logical_not.default: jnp.logical_not,
    aten.logical_and.default: jnp.logical_and,
    aten.logical_or.default: jnp.logical_or,
    aten.logical_xor.default: jnp.logical_xor,
})

_register(Promote.NO_OPMATH, {
    aten.nextafter.default: jnp.nextafter,  # in the operands' own dtype: the next bfloat16 is not the next float32
})

_register(None, {
    aten.conj_physical.default: jnp.conj,
    aten._conj_physical.default: jnp.conj,
})


@lowering(aten.abs.default, promote=Promote.COMPLEX_TO_FLOAT)
def absolute(self):
    if _is_bool(self):
        raise NotImplementedError("\"abs_tpu\" not implemented for 'Bool'")  # PyTorch's error on CPU and CUDA
    return jnp.abs(self)


@lowering(aten.sign.default, promote=Promote.DEFAULT)
def sign(self):
    """(0 < x) - (x < 0), as PyTorch: NaN and -0.0 give 0."""
    if _is_bool(self):
        return self
    return (self > 0).astype(self.dtype) - (self < 0).astype(self.dtype)


@lowering(aten.sgn.default, promote=Promote.DEFAULT)
def sgn(self):
    if jnp.iscomplexobj(self):
        magnitude = jnp.abs(self)
        return jnp.where(magnitude == 0, 0, self / jnp.where(magnitude == 0, 1, magnitude))
    return sign(self)


@lowering(aten.signbit.default, promote=Promote.ALWAYS_BOOL)
def signbit(self):
    return jnp.zeros(self.shape, jnp.bool_) if _is_bool(self) else jnp.signbit(self)


@lowering(aten.frac.default, promote=Promote.DEFAULT)
def frac(self):
    return self - jnp.trunc(self)


@lowering(aten.round.decimals, promote=Promote.DEFAULT)
def round_decimals(self, *, decimals):
    """Scales by 10**|decimals| (dividing for negative decimals, as PyTorch does, rather than
    multiplying by an inexact 10**decimals)."""
    scale = 10.0 ** (-decimals if decimals < 0 else decimals)
    if decimals < 0:
        return jnp.round(self / scale) * scale
    return jnp.round(self * scale) / scale


@lowering(aten.angle.default, promote=Promote.INT_TO_FLOAT)
def angle(self):
    if jnp.iscomplexobj(self):
        return jnp.angle(self)
    return jnp.where(self < 0, jnp.pi, jnp.where(jnp.isnan(self), self, 0))


@lowering(aten.nan_to_num.default)
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    """Not promoted: the default replacements are the largest values of the input's own dtype."""
    if not _is_float(self):
        return self
    return jnp.nan_to_num(self, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


@lowering(aten.logit.default, promote=Promote.INT_TO_FLOAT)
def logit(self, eps=None):
    if eps is not None:
        self = jnp.clip(self, eps, 1 - eps)
    return jnp.log(self / (1 - self))


@lowering(aten.digamma.default, promote=Promote.INT_TO_FLOAT)
def digamma(self):
    """PyTorch's digamma is -inf at +0 and +inf at -0 (XLA gives NaN at both)."""
    return jnp.where(self == 0, jnp.copysign(jnp.inf, -self), lax.digamma(self))


def _trigamma(x):
    """PyTorch's series with reflection below 1/2 (XLA's zeta-based polygamma is wrong for x < -8)."""
    reflected = x < 0.5
    sin_pi_x = jnp.sin(jnp.pi * x)
    result = jnp.where(reflected, -(jnp.pi**2) / (sin_pi_x * sin_pi_x), 0)
    x = jnp.where(reflected, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / x
    return jnp.where(reflected, -result, result)


_ZETA_TAIL = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
              -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
              1.8152105401943546773e17, -7.1661652561756670113e18)
_CEPHES_MACHEP = 1.11022302462515654042e-16


def _zeta(x, q):
    """Hurwitz zeta as PyTorch's Cephes port: the direct sum until q + i > 9 (at least 9 terms),
    then an Euler-Maclaurin tail. XLA's zeta sums a fixed number of terms: wrong for q < -8."""
    x, q = jnp.broadcast_arrays(x, q)
    nonpositive_q = q <= 0
    pole = nonpositive_q & (q == jnp.floor(q))
    undefined = nonpositive_q & (x != jnp.floor(x))  # a negative base to a fractional power
    summing = ~(pole | undefined | (x <= 1))

    def more_terms(state):
        return jnp.any(state[4])

    def next_term(state):
        i, a, b, s, summing, converged = state
        a = jnp.where(summing, a + 1, a)
        b = jnp.where(summing, a**-x, b)
        s = jnp.where(summing, s + b, s)
        converged = converged | (summing & (jnp.abs(b) < _CEPHES_MACHEP * s))
        i = i + 1
        return i, a, b, s, summing & ~converged & ((i < 9) | (a <= 9)), converged

    zero = jnp.zeros_like(q)
    _, a, b, s, _, done = lax.while_loop(
        more_terms, next_term, (0, q, zero, jnp.where(summing, q**-x, zero), summing, ~summing))
    w = a
    s = jnp.where(done, s, s + b * w / (x - 1) - 0.5 * b)
    factor, k = jnp.ones_like(q), 0
    for coefficient in _ZETA_TAIL:
        factor = factor * (x + k)
        b = b / w
        term = factor * b / coefficient
        s = jnp.where(done, s, s + term)
        done = done | (jnp.abs(term / s) < _CEPHES_MACHEP)
        factor = factor * (x + k + 1)
        b = b / w
        k += 2
    s = jnp.where(undefined, jnp.nan, jnp.where(pole, jnp.inf, s))
    return jnp.where(x == 1, jnp.inf, jnp.where(x < 1, jnp.nan, s))


@lowering(aten.polygamma.default, promote=Promote.INT_TO_FLOAT)
def polygamma(n, self):
    if n == 0:
        return digamma(self)
    if n == 1:
        return _trigamma(self)
    return (1 if n % 2 else -1) * math.exp(math.lgamma(n + 1)) * _zeta(jnp.asarray(n + 1, self.dtype), self)


@lowering(aten.mvlgamma.default, promote=Promote.INT_TO_FLOAT)
def mvlgamma(self, p):
    return jsp.multigammaln(self, p)


@lowering(aten.special_spherical_bessel_j0.default, promote=Promote.INT_TO_FLOAT)
def special_spherical_bessel_j0(x):
    safe = jnp.where(x == 0, 1, x)
    return jnp.where(x == 0, 1, jnp.where(jnp.isinf(x), 0, jnp.sin(safe) / safe))


@lowering(aten.special_zeta.default, aten.special_zeta.self_scalar, aten.special_zeta.other_scalar,
          promote=Promote.INT_TO_FLOAT)
def special_zeta(self, other):
    return _zeta(jnp.asarray(self), jnp.asarray(other))


def _x_times_log(log):
    """x * log(y), but 0 where x == 0 and NaN wherever y is NaN (PyTorch's xlogy/xlog1py)."""

    def fn(self, other):
        return jnp.where(jnp.isnan(other), jnp.nan, jnp.where(self == 0, 0, self * log(other)))

    return fn


xlogy = lowering(aten.xlogy.Tensor, aten.xlogy.Scalar_Self, aten.xlogy.Scalar_Other,
                 promote=Promote.INT_TO_FLOAT)(_x_times_log(jnp.log))
special_xlog1py = lowering(aten.special_xlog1py.default, aten.special_xlog1py.self_scalar,
                           aten.special_xlog1py.other_scalar, promote=Promote.INT_TO_FLOAT)(_x_times_log(jnp.log1p))


@lowering(aten.frexp.Tensor)
def frexp(self):
    return jnp.frexp(self)


# --- Arithmetic.


@lowering(aten.add.Tensor, aten.add.Scalar, promote=Promote.DEFAULT)
def add(self, other, alpha=1):
    return self + other * alpha if not (isinstance(alpha, int) and alpha == 1) else self + other


def _no_bool_subtraction(values):
    """PyTorch's `sub_check`: its CPU kernel rejects a bool operand, which its meta kernel lets through."""
    self, other = values[0], values[1]
    bools = [isinstance(v, bool) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool) for v in (self, other)]
    if all(bools):
        raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not supported. "
                           "Use the `^` or `logical_xor()` operator instead.")
    if any(bools):
        raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not supported. "
                           "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead.")


@lowering(aten.sub.Tensor, aten.sub.Scalar, promote=Promote.DEFAULT, type_check=_no_bool_subtraction)
def sub(self, other, alpha=1):
    return self - other * alpha if not (isinstance(alpha, int) and alpha == 1) else self - other


@lowering(aten.rsub.Tensor, aten.rsub.Scalar, promote=Promote.DEFAULT, type_check=_no_bool_subtraction)
def rsub(self, other, alpha=1):
    return sub(other, self, alpha)


@lowering(aten.mul.Tensor, aten.mul.Scalar, promote=Promote.DEFAULT)
def mul(self, other):
    return self * other


def _default_float(x):
    """Integers as PyTorch's default float dtype: true division never computes in float64."""
    if _is_float(x):
        return x
    return jnp.asarray(x, dtype=jnp.dtype(str(torch.get_default_dtype()).removeprefix("torch.")))


@lowering(aten.div.Tensor, aten.div.Scalar, promote=Promote.INT_TO_FLOAT)
def div(self, other):
    return self / other


def _opmath(x):
    """bfloat16 and float16 computed in float32, as PyTorch's CPU kernels do."""
    return x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def _trunc_divide(a, b):
    if not _is_float(a):
        quotient = jnp.floor_divide(a, b)
        return quotient + ((a % b != 0) & ((a < 0) != (b < 0)))
    if a.dtype == jnp.bfloat16:  # PyTorch truncates the quotient rounded to bfloat16
        return jnp.trunc((_opmath(a) / _opmath(b)).astype(jnp.bfloat16))
    a, b = _opmath(a), _opmath(b)
    # Not trunc(a / b): XLA rewrites a / broadcast(b) as a * (1 / b), an ulp off, and 5.0 / 5.0
    # would truncate to 0. a - fmod(a, b) is a whole multiple of b, so its quotient rounds exactly.
    quotient = a / b
    whole = jnp.round((a - jnp.fmod(a, b)) / b)
    return jnp.where(jnp.isfinite(whole), jnp.copysign(whole, quotient), jnp.trunc(quotient))


def _floor_divide(a, b):
    """PyTorch's div_floor: integers as Python; floats by fmod, like CPython's float floordiv (which
    also absorbs XLA's inexact division)."""
    if not _is_float(a):
        return jnp.floor_divide(a, b)
    mod = jnp.fmod(a, b)
    quotient = (a - mod) / b
    quotient = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), quotient - 1, quotient)
    floor = jnp.floor(quotient)
    floor = jnp.where(quotient - floor > 0.5, floor + 1, floor)
    true_quotient = a / b
    floor = jnp.where(quotient == 0, jnp.copysign(jnp.zeros_like(floor), true_quotient), floor)
    return jnp.where(b == 0, true_quotient, floor)


_ROUNDED_DIVISIONS = {
    None: lambda a, b: _default_float(a) / _default_float(b),
    "trunc": _trunc_divide,
    "floor": lambda a, b: _floor_divide(_opmath(a), _opmath(b)),
}


@lowering(aten.div.Tensor_mode, aten.div.Scalar_mode, promote=Promote.NO_OPMATH)
def div_mode(self, other, *, rounding_mode=None):
    """Promoted without opmath, and a Scalar divisor taken in the promoted dtype, as PyTorch does:
    its bfloat16 truncation sees the rounded quotient."""
    dtype = jnp.result_type(self, other)
    return _ROUNDED_DIVISIONS[rounding_mode](jnp.asarray(self, dtype), jnp.asarray(other, dtype))


@lowering(aten.floor_divide.default, aten.floor_divide.Scalar, promote=Promote.DEFAULT)
def floor_divide(self, other):
    return _floor_divide(self, other)


# PyTorch computes these powers of a float tensor by multiplication and square roots, not exp(log):
# compiled in, they get the same values, and XLA fuses a multiply where a traced exponent costs a pow.
_SPECIAL_POWERS = {2: lambda x: x * x, 3: lambda x: x * x * x, 0.5: jnp.sqrt, -0.5: jax.lax.rsqrt,
                   -1: jnp.reciprocal, -2: lambda x: jnp.reciprocal(x * x)}


def _integer_power_check(values):
    self, exponent = values[0], values[1]
    if type(exponent) is int and isinstance(self, torch.Tensor) and not (self.is_floating_point() or self.is_complex()):
        if exponent < 0:
            raise RuntimeError("Integers to negative integer powers are not allowed.")
        dtypes.check_fits(exponent, torch.int64 if self.dtype == torch.bool else self.dtype)


@lowering(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar, promote=Promote.BOOL_TO_LONG,
          static_values={"exponent": _SPECIAL_POWERS}, check=_integer_power_check)
def power(self, exponent):
    special = _SPECIAL_POWERS.get(exponent) if type(exponent) in (int, float) else None
    if special is not None and _is_float(self):
        return special(self)
    if _is_float(self) or _is_float(exponent):
        return jnp.power(self, exponent)
    # integers to negative powers: 0, except 1 for a base of 1 and +-1 for a base of -1
    negative = exponent < 0
    reciprocal = jnp.where(self == 1, 1, jnp.where(self == -1, 1 - 2 * (exponent & 1), 0))
    return jnp.where(negative, reciprocal, jnp.power(self, jnp.where(negative, 0, exponent)))


# In-place overloads dispatch cannot pair with their functional overload (another overload name, or
# the arguments in another order), lowered directly.
lowering(aten.pow_.Tensor, promote=Promote.BOOL_TO_LONG)(power)
lowering(aten.floor_divide_.Tensor, promote=Promote.DEFAULT)(floor_divide)


@lowering(aten.polygamma_.default, promote=Promote.INT_TO_FLOAT)
def polygamma_(self, n):
    return polygamma(n, self)


def _shift_width(a, b) -> int:
    return jnp.iinfo(jnp.result_type(a, b)).bits


@lowering(aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
          aten.bitwise_left_shift.Scalar_Tensor, aten.__lshift__.Tensor, aten.__lshift__.Scalar,
          promote=Promote.DEFAULT)
def bitwise_left_shift(self, other):
    """Shifting by a negative amount or by the width or more gives 0."""
    in_range = (other >= 0) & (other < _shift_width(self, other))
    return jnp.where(in_range, jnp.left_shift(self, jnp.where(in_range, other, 0)), 0)


@lowering(aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
          aten.bitwise_right_shift.Scalar_Tensor, aten.__rshift__.Tensor, aten.__rshift__.Scalar,
          promote=Promote.DEFAULT)
def bitwise_right_shift(self, other):
    """Shifting by a negative amount or by the width or more shifts by the largest amount that is
    defined (width - 1 for signed types: the sign fills the result)."""
    dtype = jnp.result_type(self, other)
    largest = _shift_width(self, other) - jnp.issubdtype(dtype, jnp.signedinteger)
    return jnp.right_shift(self, jnp.where((other < 0) | (other > largest), largest, other))


def _bounds_fit(values):
    self = values[0]
    for bound in values[1:3]:
        if type(bound) in (int, float):
            dtypes.check_fits(bound, torch.result_type(self, bound))


@lowering(aten.clamp.default, aten.clamp.Tensor, promote=Promote.DEFAULT, check=_bounds_fit)
def clamp(self, min=None, max=None):
    if min is not None:
        self = jnp.maximum(self, min)
    if max is not None:
        self = jnp.minimum(self, max)
    return self


@lowering(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor, promote=Promote.DEFAULT)
def isin(elements, test_elements, *, assume_unique=False, invert=False):
    """A broadcast comparison against every test element (generate()'s end-of-sequence check runs
    this each step); PyTorch's sort-based path for large inputs gives the same booleans."""
    found = jnp.any(jnp.asarray(elements)[..., None] == jnp.ravel(jnp.asarray(test_elements)), axis=-1)
    return ~found if invert else found


@lowering(aten.where.self)
def where(condition, self, other):
    # not promoted: the condition must stay bool; jnp.where promotes self and other
    return jnp.where(condition, self, other)


@lowering(aten.lerp.Scalar, aten.lerp.Tensor, promote=Promote.DEFAULT)
def lerp(self, end, weight):
    """PyTorch's two-sided form: exact at both ends."""
    difference = end - self
    return jnp.where(jnp.abs(weight) < 0.5, self + weight * difference, end - difference * (1 - weight))


@lowering(aten.addcmul.default, promote=Promote.DEFAULT)
def addcmul(self, tensor1, tensor2, *, value=1):
    return self + value * tensor1 * tensor2


@lowering(aten.addcdiv.default, promote=Promote.INT_TO_FLOAT)
def addcdiv(self, tensor1, tensor2, *, value=1):
    return self + value * tensor1 / tensor2


@lowering(aten.heaviside.default, promote=Promote.DEFAULT)
def heaviside(self, values):
    return jnp.where(self == 0, values, self > 0)


# --- Complex numbers.


def _parts_of_one_dtype(values):
    real, imag = values[0], values[1]
    if real.dtype != imag.dtype:
        raise RuntimeError(f"Expected object of scalar type {dtypes.scalar_type_name(real.dtype)} but got scalar "
                           f"type {dtypes.scalar_type_name(imag.dtype)} for second argument")


@lowering(aten.complex.default, check=_parts_of_one_dtype)
def complex_from_parts(real, imag):
    return lax.complex(*jnp.broadcast_arrays(real, imag))


@lowering(aten.polar.default)
def polar(magnitude, angle):
    return complex_from_parts(magnitude * jnp.cos(angle), magnitude * jnp.sin(angle))


# --- Derivatives that autograd calls as ops of their own.


@lowering(aten.sigmoid_backward.default, promote=Promote.DEFAULT)
def sigmoid_backward(grad_output, output):
    return grad_output * (1 - output) * output


@lowering(aten.tanh_backward.default, promote=Promote.DEFAULT)
def tanh_backward(grad_output, output):
    return grad_output * (1 - output * output)


@lowering(aten.logit_backward.default, promote=Promote.DEFAULT)
def logit_backward(grad_output, self, eps=None):
    outside = (self < 0) | (self > 1) if eps is None else (self < eps) | (self > 1 - eps)
    return jnp.where(outside, jnp.nan if eps is None else 0, grad_output / (self * (1 - self)))


# --- Filling.


def value_fits(position: int):
    """A check that the Python number at `position` fits the dtype of `self`, which takes it."""
    def check(values):
        dtypes.check_fits(values[position], values[0].dtype)
    return check


@lowering(aten.fill.Scalar, aten.fill.Tensor, check=value_fits(1))
def fill(self, value):
    return jnp.broadcast_to(jnp.asarray(value), self.shape)


@lowering(aten.zero.default)
def zero(self):
    return jnp.zeros_like(self)
