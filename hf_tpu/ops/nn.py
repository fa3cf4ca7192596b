"""Neural-network ops: softmax, normalisations, activations, losses and dropout's backward.

Backward ops of smooth functions are the VJP of the forward lowering (recomputing the forward is
free inside one XLA program); piecewise ones spell out PyTorch's choice at the kinks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from .. import dispatch
from ..dispatch import Promote, floating_kernel, handler, lowering

aten = torch.ops.aten

_REDUCTION_NONE, _REDUCTION_MEAN, _REDUCTION_SUM = 0, 1, 2


def _opmath(x):
    """PyTorch computes low-precision floats in float32."""
    if x is not None and x.dtype in (jnp.bfloat16, jnp.float16):
        return x.astype(jnp.float32)
    return x


def _along(fn, dim, *arrays):
    """`fn(*arrays, axis)` for a normalised `dim`; a 0-dim tensor behaves as one element."""
    if arrays[0].ndim == 0:
        return fn(*(a[None] for a in arrays), 0)[0]
    return fn(*arrays, dim % arrays[0].ndim)


def _vjp(fn, grad, *primals):
    """The gradients of `fn` at `primals` for the output gradient `grad`."""
    out, pullback = jax.vjp(fn, *primals)
    return pullback(grad.astype(out.dtype))


def _reduce(loss, reduction):
    if reduction == _REDUCTION_MEAN:
        return jnp.mean(loss)
    if reduction == _REDUCTION_SUM:
        return jnp.sum(loss)
    return loss


# --- Softmax.


def _softmax_kernel(name: str):
    """The name of PyTorch's CPU kernel for `name` (softmax or log_softmax) along this call's dim, as its dtype
    error says it: one kernel for the last dim (a 0-dim tensor's too), one for the others."""
    def kernel(values):
        self, dim = values[0], values[1]
        return f"{name}_lastdim_kernel_impl" if self.dim() <= 1 or dim % self.dim() == self.dim() - 1 \
            else f"{name}_kernel_impl"
    return kernel


@lowering(aten._softmax.default, type_check=floating_kernel(_softmax_kernel("softmax")))
def _softmax(self, dim, half_to_float):
    return _along(lambda x, axis: jax.nn.softmax(x, axis=axis), dim, _opmath(self))


@lowering(aten._log_softmax.default, type_check=floating_kernel(_softmax_kernel("log_softmax")))
def _log_softmax(self, dim, half_to_float):
    return _along(lambda x, axis: jax.nn.log_softmax(x, axis=axis), dim, _opmath(self))


def _safe_softmax_along(x, axis):
    """Softmax whose rows of only -inf give 0 rather than NaN (SDPA's fully masked rows). Such a row is
    one whose maximum is -inf: the maximum softmax takes anyway, where `all(x == -inf)` is one more pass
    over the scores (on XLA:CPU a third of a small model's attention)."""
    if x.shape[axis] == 0:
        return x
    masked = jnp.max(x, axis=axis, keepdims=True) == -jnp.inf
    return jnp.where(masked, 0, jax.nn.softmax(x, axis=axis))


@lowering(aten._safe_softmax.default)
def _safe_softmax(self, dim, dtype=None):
    return _along(_safe_softmax_along, dim, _opmath(self))


@lowering(aten._softmax_backward_data.default)
def _softmax_backward_data(grad_output, output, dim, input_dtype):
    def grad(g, y, axis):
        return y * (g - jnp.sum(g * y, axis, keepdims=True))

    return _along(grad, dim, _opmath(grad_output), _opmath(output))


@lowering(aten._log_softmax_backward_data.default)
def _log_softmax_backward_data(grad_output, output, dim, input_dtype):
    def grad(g, y, axis):
        return g - jnp.exp(y) * jnp.sum(g, axis, keepdims=True)

    return _along(grad, dim, _opmath(grad_output), _opmath(output))


# --- Normalisations. Statistics are float32 for low-precision inputs, as on PyTorch's CPU.
# Backward lowerings compute every gradient; `_masked_backward` drops those not asked for.


def _masked_backward(op, params, param_shape):
    """Run a backward op with every output asked for, then return None (an undefined tensor) for
    those that were not. The dispatcher expects a tensor for every return while meta returns None
    for masked-off or parameter-less gradients, so absent `params` are passed as ones of
    `param_shape(values)` (the same gradients as no parameter)."""

    def run(sig, values):
        values = list(values)
        mask_index = sig.names.index("output_mask")
        mask = values[mask_index]
        values[mask_index] = [True] * len(mask)
        input = values[sig.names.index("input")]
        for name in params:
            i = sig.names.index(name)
            if values[i] is None:
                values[i] = torch.ones(param_shape(values), dtype=input.dtype, device=input.device)
        results = dispatch.run_lowered(sig, values)
        return tuple(r if keep else None for r, keep in zip(results, mask))

    return handler(op)(run)


def _channel_shape(input):
    return (1, -1) + (1,) * (input.ndim - 2)


def _affine(x, weight, bias, shape):
    if weight is not None:
        x = x * _opmath(weight).reshape(shape)
    if bias is not None:
        x = x + _opmath(bias).reshape(shape)
    return x


def _normalize(x, axes, eps):
    """(x - mean) * rstd over `axes` (biased variance), with the statistics as kept dims."""
    mean = jnp.mean(x, axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axes, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    return (x - mean) * rstd, mean, rstd


def _normalized_grad(grad_x_hat, x_hat, rstd, axes):
    """The gradient through x_hat = (x - mean(x)) * rstd(x), statistics over `axes`."""
    mean_grad = jnp.mean(grad_x_hat, axes, keepdims=True)
    mean_proj = jnp.mean(grad_x_hat * x_hat, axes, keepdims=True)
    return rstd * (grad_x_hat - mean_grad - x_hat * mean_proj)


def _scaled(grad_out, weight, shape):
    return grad_out * _opmath(weight).reshape(shape) if weight is not None else grad_out


@lowering(aten.native_layer_norm.default, type_check=floating_kernel("LayerNormKernelImpl"))
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    y, mean, rstd = _normalize(_opmath(input), axes, eps)
    return _affine(y, weight, bias, tuple(normalized_shape)), mean, rstd


@lowering(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    shape = tuple(normalized_shape)
    axes = tuple(range(input.ndim - len(shape), input.ndim))
    batch_axes = tuple(range(input.ndim - len(shape)))
    g = _opmath(grad_out)
    x_hat = (_opmath(input) - mean) * rstd
    grad_input = _normalized_grad(_scaled(g, weight, shape), x_hat, rstd, axes)
    return grad_input, jnp.sum(g * x_hat, batch_axes), jnp.sum(g, batch_axes)


_masked_backward(aten.native_layer_norm_backward.default, ("weight", "bias"), lambda values: values[2])


def _grouped(x, n, group):
    return x.reshape(n, group, x.size // max(n * group, 1))  # not -1: the sizes may be 0


@lowering(aten.native_group_norm.default, type_check=floating_kernel("GroupNormKernelImpl"))
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = _grouped(_opmath(input), N, group)
    y, mean, rstd = _normalize(x, (2,), eps)
    y = _affine(y.reshape(input.shape), weight, bias, _channel_shape(input))
    return y, mean.reshape(N, group), rstd.reshape(N, group)


@lowering(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    g = _opmath(grad_out).reshape(N, C, HxW)
    x_hat = (_grouped(_opmath(input), N, group) - mean[..., None]) * rstd[..., None]
    grad_x_hat = _grouped(_scaled(g, weight, (1, C, 1)), N, group)
    grad_input = _normalized_grad(grad_x_hat, x_hat, rstd[..., None], (2,)).reshape(input.shape)
    x_hat = x_hat.reshape(N, C, HxW)
    return grad_input, jnp.sum(g * x_hat, (0, 2)), jnp.sum(g, (0, 2))


_masked_backward(aten.native_group_norm_backward.default, ("weight",), lambda values: (values[6],))


def _batch_axes(input):
    return (0,) + tuple(range(2, input.ndim))


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """(output, save_mean, save_invstd, new running mean, new running var)."""
    x = _opmath(input)
    shape = _channel_shape(input)
    if training:
        axes = _batch_axes(input)
        y, mean, rstd = _normalize(x, axes, eps)
        mean, rstd = mean.reshape(-1), rstd.reshape(-1)
        if running_mean is not None:
            n = input.size // input.shape[1]
            unbiased_var = jnp.var(x, axes) * (n / max(n - 1, 1))
            running_mean = momentum * mean + (1 - momentum) * running_mean
            running_var = momentum * unbiased_var + (1 - momentum) * running_var
    else:
        mean, rstd = running_mean, jax.lax.rsqrt(running_var + eps)
        y = (x - mean.reshape(shape)) * rstd.reshape(shape)
    return _affine(y, weight, bias, shape), mean, rstd, running_mean, running_var


@lowering(aten._native_batch_norm_legit_functional.default, type_check=floating_kernel("batch_norm"))
def _native_batch_norm_legit_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


@lowering(aten._native_batch_norm_legit.no_stats, type_check=floating_kernel("batch_norm"))
def _native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    return _batch_norm(input, weight, bias, None, None, training, momentum, eps)[:3]


_BATCH_NORM_FUNCTIONAL = aten._native_batch_norm_legit_functional.default


@handler(aten.native_batch_norm.default, aten._native_batch_norm_legit.default)
def _batch_norm_updating_stats(sig, values):
    """The dispatcher cannot write arguments an op mutates without returning them (running
    statistics), so the functional op computes them and they are copied in here."""
    input, weight, bias, running_mean, running_var, training, momentum, eps = values
    if running_mean is None:
        return dispatch.run_lowered(dispatch.signature(aten._native_batch_norm_legit.no_stats),
                                    [input, weight, bias, training, momentum, eps])
    out, mean, rstd, new_mean, new_var = dispatch.run_lowered(dispatch.signature(_BATCH_NORM_FUNCTIONAL), values)
    if training:
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
    return out, mean, rstd


@handler(aten._batch_norm_with_update.default)
def _batch_norm_with_update(sig, values):
    input, weight, bias, running_mean, running_var, momentum, eps = values
    out, mean, rstd = _batch_norm_updating_stats(
        sig, [input, weight, bias, running_mean, running_var, True, momentum, eps])
    reserve = torch.empty(0, dtype=torch.uint8, device=input.device)
    return out, mean, rstd, reserve


def _batch_norm_grads(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps):
    shape = _channel_shape(input)
    axes = _batch_axes(input)
    if train:
        mean, invstd = save_mean, save_invstd
    else:
        mean, invstd = running_mean, jax.lax.rsqrt(running_var + eps)
    g = _opmath(grad_out)
    mean, invstd = _opmath(mean).reshape(shape), _opmath(invstd).reshape(shape)
    x_hat = (_opmath(input) - mean) * invstd
    grad_x_hat = _scaled(g, weight, shape)
    grad_input = _normalized_grad(grad_x_hat, x_hat, invstd, axes) if train else grad_x_hat * invstd
    return grad_input, jnp.sum(g * x_hat, axes), jnp.sum(g, axes)


@lowering(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train,
                               eps, output_mask):
    return _batch_norm_grads(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps)


@lowering(aten.batch_norm_backward.default)
def batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps,
                        output_mask, reserve):
    return _batch_norm_grads(grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps)


for _op in (aten.native_batch_norm_backward.default, aten.batch_norm_backward.default):
    _masked_backward(_op, ("weight",), lambda values: values[1].shape[1:2])


# --- Activations.


@lowering(aten.relu.default, promote=Promote.DEFAULT)
def relu(self):
    return jnp.maximum(self, 0)


@lowering(aten.threshold.default, promote=Promote.DEFAULT)
def threshold(self, threshold, value):
    return jnp.where(self <= threshold, value, self)


@lowering(aten.threshold_backward.default, promote=Promote.DEFAULT)
def threshold_backward(grad_output, self, threshold):
    return jnp.where(self <= threshold, 0, grad_output)


def _gelu(x, approximate):
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1 + jnp.tanh(inner))
    return 0.5 * x * (1 + jax.lax.erf(x * (1 / math.sqrt(2))))


@lowering(aten.gelu.default, promote=Promote.DEFAULT, type_check=floating_kernel("GeluKernelImpl"))
def gelu(self, *, approximate="none"):
    return _gelu(self, approximate)


@lowering(aten.gelu_backward.default, promote=Promote.DEFAULT)
def gelu_backward(grad_output, self, *, approximate="none"):
    return _vjp(lambda x: _gelu(x, approximate), grad_output, self)[0]


@lowering(aten.silu.default, promote=Promote.DEFAULT, type_check=floating_kernel("silu_cpu", complex=True))
def silu(self):
    return self * jax.nn.sigmoid(self)


def _softplus(x, beta, threshold):
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta)


@lowering(aten.softplus.default, promote=Promote.DEFAULT, type_check=floating_kernel("softplus_cpu"))
def softplus(self, beta=1, threshold=20):
    return _softplus(self, beta, threshold)


@lowering(aten.softplus_backward.default, promote=Promote.DEFAULT)
def softplus_backward(grad_output, self, beta, threshold):
    z = jnp.exp(self * beta)
    return jnp.where(self * beta > threshold, grad_output, grad_output * z / (z + 1))


@lowering(aten.mish.default, promote=Promote.DEFAULT, type_check=floating_kernel("mish_cpu"))
def mish(self):
    return self * jnp.tanh(_softplus(self, 1, 20))


@lowering(aten.elu.default, promote=Promote.DEFAULT, type_check=floating_kernel("elu_cpu"))
def elu(self, alpha=1, scale=1, input_scale=1):
    return jnp.where(self > 0, self * scale, jnp.expm1(self * input_scale) * (alpha * scale))


@lowering(aten.elu_backward.default, promote=Promote.DEFAULT)
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    x = self_or_result
    if is_result:
        negative = grad_output * input_scale * (x + alpha * scale)
    else:
        negative = grad_output * input_scale * alpha * scale * jnp.exp(x * input_scale)
    return jnp.where(x <= 0, negative, grad_output * scale)


@lowering(aten.leaky_relu.default, promote=Promote.DEFAULT, type_check=floating_kernel("leaky_relu_cpu"))
def leaky_relu(self, negative_slope=0.01):
    return jnp.where(self > 0, self, self * negative_slope)


@lowering(aten.leaky_relu_backward.default, promote=Promote.DEFAULT)
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    return jnp.where(self > 0, grad_output, grad_output * negative_slope)


@lowering(aten.hardtanh.default, promote=Promote.DEFAULT)
def hardtanh(self, min_val=-1, max_val=1):
    # NaN stays NaN, as PyTorch's clamp
    return jnp.where(self < min_val, min_val, jnp.where(self > max_val, max_val, self))


@lowering(aten.hardtanh_backward.default, promote=Promote.DEFAULT)
def hardtanh_backward(grad_output, self, min_val, max_val):
    return jnp.where((self <= min_val) | (self >= max_val), 0, grad_output)


@lowering(aten.hardsigmoid.default, promote=Promote.DEFAULT, type_check=floating_kernel("hardsigmoid_cpu"))
def hardsigmoid(self):
    return jnp.clip(self + 3, 0, 6) / 6


@lowering(aten.hardsigmoid_backward.default, promote=Promote.DEFAULT)
def hardsigmoid_backward(grad_output, self):
    return jnp.where((self > -3) & (self < 3), grad_output / 6, 0)


@lowering(aten.hardswish.default, promote=Promote.DEFAULT, type_check=floating_kernel("hardswish_cpu"))
def hardswish(self):
    return self * jnp.clip(self + 3, 0, 6) / 6


@lowering(aten.hardswish_backward.default, promote=Promote.DEFAULT)
def hardswish_backward(grad_output, self):
    inside = jnp.where(self <= 3, grad_output * (self / 3 + 0.5), grad_output)
    return jnp.where(self < -3, 0, inside)


@lowering(aten.hardshrink.default, promote=Promote.DEFAULT, type_check=floating_kernel("hardshrink_cpu"))
def hardshrink(self, lambd=0.5):
    return jnp.where((self >= -lambd) & (self <= lambd), 0, self)


@lowering(aten.softshrink.default, promote=Promote.DEFAULT, type_check=floating_kernel("softshrink_check"))
def softshrink(self, lambd=0.5):
    # inside the band self * 0, not 0: NaN stays NaN, as on CPU
    return jnp.where(self > lambd, self - lambd, jnp.where(self < -lambd, self + lambd, self * 0))


@lowering(aten.hardshrink_backward.default, aten.softshrink_backward.default, promote=Promote.DEFAULT)
def shrink_backward(grad_out, self, lambd):
    return jnp.where((self >= -lambd) & (self <= lambd), 0, grad_out)


def _glu(x, dim):
    a, b = jnp.split(x, 2, axis=dim)
    return a * jax.nn.sigmoid(b)


@lowering(aten.glu.default, promote=Promote.DEFAULT, type_check=floating_kernel("glu_cpu"))
def glu(self, dim=-1):
    return _glu(self, dim)


@lowering(aten.glu_backward.default, promote=Promote.DEFAULT)
def glu_backward(grad_output, self, dim):
    return _vjp(lambda x: _glu(x, dim), grad_output, self)[0]


@lowering(aten.log_sigmoid_forward.default, promote=Promote.DEFAULT, type_check=floating_kernel("log_sigmoid_cpu"))
def log_sigmoid_forward(self):
    return jax.nn.log_sigmoid(self), jnp.zeros_like(self)


@lowering(aten.log_sigmoid_backward.default, promote=Promote.DEFAULT)
def log_sigmoid_backward(grad_output, self, buffer):
    return grad_output * jax.nn.sigmoid(-self)


@lowering(aten._prelu_kernel.default, promote=Promote.DEFAULT, type_check=floating_kernel("prelu_cpu"))
def _prelu_kernel(self, weight):
    return jnp.where(self > 0, self, weight * self)


@lowering(aten._prelu_kernel_backward.default, promote=Promote.DEFAULT)
def _prelu_kernel_backward(grad_output, self, weight):
    positive = self > 0
    grad_input = jnp.where(positive, grad_output, weight * grad_output)
    # the weight gradient keeps the broadcast shape, as on CPU: autograd sums it to the weight's
    return grad_input, jnp.where(positive, 0, self * grad_output)


@lowering(aten.rrelu_with_noise_functional.default, promote=Promote.DEFAULT,
          type_check=floating_kernel("rrelu_with_noise_out_cpu"))
def rrelu_with_noise_functional(self, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    """(output, noise). Training: each negative element is scaled by a slope drawn uniformly from
    [lower, upper], which becomes its noise (1 for the others); eval: the mean slope, noise kept."""
    if not training:
        return jnp.where(self > 0, self, self * ((lower + upper) / 2)), noise
    slopes = jax.random.uniform(generator, self.shape, self.dtype, lower, upper)
    noise = jnp.where(self <= 0, slopes, 1)
    return self * noise, noise


_RRELU_FUNCTIONAL = aten.rrelu_with_noise_functional.default


@handler(aten.rrelu_with_noise.default)
def rrelu_with_noise(sig, values):
    """rrelu_with_noise writes its noise argument without returning it: the functional op computes
    it and it is copied in here (the backward reads the slopes from it)."""
    output, noise = dispatch.run_lowered(dispatch.signature(_RRELU_FUNCTIONAL), values)
    values[1].copy_(noise)
    return output


@handler(aten.rrelu_with_noise_.default)
def rrelu_with_noise_(sig, values):
    values[0].copy_(rrelu_with_noise(sig, values))
    return values[0]


@lowering(aten.native_dropout_backward.default, promote=Promote.DEFAULT)
def native_dropout_backward(grad_output, mask, scale):
    return grad_output * mask * scale


# --- Recurrent cells. PyTorch's LSTM and GRU run these fused cells on every device but the CPU (which
# has no kernel for them). Each workspace holds what CUDA's kernel keeps for the backward: the LSTM's
# activated gates (i, f, g, o); the GRU's reset and update gates, candidate, previous state and the
# hidden part of the candidate's pre-activation (r, z, n, hx, hn). They compute in float32 and return
# the gates' dtype, as CUDA's kernels do; the ops without a usable meta kernel set their dtypes here.


def _gate_sums(input_gates, hidden_gates, input_bias, hidden_bias):
    input_gates, hidden_gates = _opmath(input_gates), _opmath(hidden_gates)
    if input_bias is not None:
        input_gates = input_gates + _opmath(input_bias)
        hidden_gates = hidden_gates + _opmath(hidden_bias)
    return input_gates, hidden_gates


# own shapes: PyTorch's meta kernel fails on a cell without biases (it reads `input_bias.device`)
@lowering(aten._thnn_fused_lstm_cell.default, own_shapes=True)
def _thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    input_gates, hidden_gates = _gate_sums(input_gates, hidden_gates, input_bias, hidden_bias)
    i, f, g, o = jnp.split(input_gates + hidden_gates, 4, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * _opmath(cx) + i * g
    dtype = cx.dtype
    return (o * jnp.tanh(cy)).astype(dtype), cy.astype(dtype), jnp.concatenate([i, f, g, o], axis=1).astype(dtype)


@lowering(aten._thnn_fused_lstm_cell_backward_impl.default)
def _thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """(gradient of the gates' pre-activations, of cx, of the bias or None)."""
    i, f, g, o = jnp.split(_opmath(workspace), 4, axis=1)
    cx, tanh_cy = _opmath(cx), jnp.tanh(_opmath(cy))
    grad_hy = jnp.zeros_like(tanh_cy) if grad_hy is None else _opmath(grad_hy)
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy) + (0 if grad_cy is None else _opmath(grad_cy))
    grad_gates = jnp.concatenate([grad_c * g * i * (1 - i), grad_c * cx * f * (1 - f), grad_c * i * (1 - g * g),
                                  grad_hy * tanh_cy * o * (1 - o)], axis=1)
    return grad_gates, grad_c * f, grad_gates.sum(0) if has_bias else None


@lowering(aten._thnn_fused_gru_cell.default)
def _thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    input_gates, hidden_gates = _gate_sums(input_gates, hidden_gates, input_bias, hidden_bias)
    input_r, input_z, input_n = jnp.split(input_gates, 3, axis=1)
    hidden_r, hidden_z, hidden_n = jnp.split(hidden_gates, 3, axis=1)
    r, z = jax.nn.sigmoid(input_r + hidden_r), jax.nn.sigmoid(input_z + hidden_z)
    n = jnp.tanh(input_n + r * hidden_n)
    dtype, hx = hx.dtype, _opmath(hx)
    return (n + z * (hx - n)).astype(dtype), jnp.concatenate([r, z, n, hx, hidden_n], axis=1).astype(dtype)


@lowering(aten._thnn_fused_gru_cell_backward.default)
def _thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias):
    """(gradients of the input gates, hidden gates, hx, input bias, hidden bias)."""
    dtype = grad_hy.dtype
    r, z, n, hx, hidden_n = jnp.split(_opmath(workspace), 5, axis=1)
    grad_hy = _opmath(grad_hy)
    grad_z = grad_hy * (hx - n) * z * (1 - z)
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_r = grad_n * hidden_n * r * (1 - r)
    grad_input = jnp.concatenate([grad_r, grad_z, grad_n], axis=1)
    grad_hidden = jnp.concatenate([grad_r, grad_z, grad_n * r], axis=1)
    grads = grad_input, grad_hidden, grad_hy * z, grad_input.sum(0), grad_hidden.sum(0)
    return [grad.astype(dtype) for grad in grads]


# --- Losses. reduction: 0 none, 1 mean, 2 sum.


def _grad_of_reduction(grad_output, reduction, numel):
    return grad_output / numel if reduction == _REDUCTION_MEAN else grad_output


def _nll_weights(target, weight, ignore_index):
    w = jnp.ones(target.shape, jnp.float32) if weight is None else _opmath(weight)[jnp.clip(target, 0, weight.shape[0] - 1)]
    return jnp.where(target == ignore_index, 0, w)


def _class_axis(self):
    return 0 if self.ndim == 1 else 1


def _picked(self, target):
    """self[..., target, ...] along the class axis; out-of-range (ignored) targets pick class 0."""
    axis = _class_axis(self)
    index = jnp.expand_dims(jnp.clip(target, 0, self.shape[axis] - 1), axis)
    return jnp.squeeze(jnp.take_along_axis(self, index, axis), axis)


@lowering(aten.nll_loss_forward.default, type_check=floating_kernel("nll_loss_out_frame"))
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    w = _nll_weights(target, weight, ignore_index)
    loss = -_picked(_opmath(self), target) * w
    total_weight = jnp.sum(w)
    if reduction == _REDUCTION_MEAN:
        return jnp.sum(loss) / total_weight, total_weight
    return _reduce(loss, reduction), total_weight


lowering(aten.nll_loss2d_forward.default, type_check=floating_kernel("nll_loss2d_forward_out_frame"))(nll_loss_forward)


@lowering(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    w = _nll_weights(target, weight, ignore_index)
    g = _opmath(grad_output)
    if reduction == _REDUCTION_MEAN:
        g = g / total_weight
    axis = _class_axis(self)
    one_hot = jax.nn.one_hot(target, self.shape[axis], axis=axis, dtype=jnp.float32)
    return one_hot * jnp.expand_dims(-w * g, axis)


@lowering(aten.mse_loss.default, promote=Promote.DEFAULT, type_check=floating_kernel("mse_cpu"))
def mse_loss(self, target, reduction=_REDUCTION_MEAN):
    return _reduce(jnp.square(self - target), reduction)


@lowering(aten.mse_loss_backward.default, promote=Promote.DEFAULT)
def mse_loss_backward(grad_output, self, target, reduction):
    return 2 * (self - target) * _grad_of_reduction(grad_output, reduction, self.size)


_LOG_FLOOR = -100.0  # PyTorch clamps log(x) and log(1 - x) here so that 0 * log(0) stays finite


def _weighted(loss, weight):
    return loss if weight is None else loss * weight


@lowering(aten.binary_cross_entropy.default, promote=Promote.DEFAULT,
          type_check=floating_kernel("binary_cross_entropy"))
def binary_cross_entropy(self, target, weight=None, reduction=_REDUCTION_MEAN):
    log_x = jnp.maximum(jnp.log(self), _LOG_FLOOR)
    log_1mx = jnp.maximum(jnp.log1p(-self), _LOG_FLOOR)
    return _reduce(_weighted(-(target * log_x + (1 - target) * log_1mx), weight), reduction)


@lowering(aten.binary_cross_entropy_backward.default, promote=Promote.DEFAULT)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=_REDUCTION_MEAN):
    grad = (self - target) / jnp.maximum((1 - self) * self, 1e-12)
    return _weighted(grad * _grad_of_reduction(grad_output, reduction, self.size), weight)


@lowering(aten.binary_cross_entropy_with_logits.default, promote=Promote.DEFAULT,
          type_check=floating_kernel("log_sigmoid_cpu"))
def binary_cross_entropy_with_logits(self, target, weight=None, pos_weight=None, reduction=_REDUCTION_MEAN):
    softplus_neg = jnp.log1p(jnp.exp(-jnp.abs(self))) + jnp.maximum(-self, 0)  # log(1 + exp(-x)), stably
    log_weight = 1 if pos_weight is None else (pos_weight - 1) * target + 1
    return _reduce(_weighted((1 - target) * self + log_weight * softplus_neg, weight), reduction)


@lowering(aten.smooth_l1_loss.default, promote=Promote.DEFAULT, type_check=floating_kernel("smooth_l1_cpu"))
def smooth_l1_loss(self, target, reduction=_REDUCTION_MEAN, beta=1.0):
    z = jnp.abs(self - target)
    loss = z if beta == 0 else jnp.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta)
    return _reduce(loss, reduction)


@lowering(aten.smooth_l1_loss_backward.default, promote=Promote.DEFAULT)
def smooth_l1_loss_backward(grad_output, self, target, reduction, beta):
    d = self - target
    grad = jnp.sign(d) if beta == 0 else jnp.clip(d / beta, -1, 1)
    return grad * _grad_of_reduction(grad_output, reduction, self.size)


def _margin_grad_scale(grad_output, self, reduction):
    """The factor each sample's hinge terms are scaled by in the margin losses' backward: the output
    gradient (per sample without reduction) over the classes, and over the samples for a mean."""
    classes = self.shape[-1] if self.ndim else 1
    samples = self.shape[0] if self.ndim == 2 else 1
    g = _opmath(grad_output) / classes
    if reduction == _REDUCTION_NONE:
        return g.reshape(samples, 1)
    return jnp.broadcast_to(g / samples if reduction == _REDUCTION_MEAN else g, (samples, 1))


@lowering(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=_REDUCTION_MEAN):
    """Each class d other than the target t with margin - x[t] + x[d] > 0 (strictly, as on CPU) gets
    that term's derivative; the target gets minus their sum."""
    x = _opmath(self).reshape(-1, self.shape[-1] if self.ndim else 1)
    target = target.reshape(-1, 1)
    z = margin - jnp.take_along_axis(x, target, axis=1) + x
    is_target = jnp.arange(x.shape[1]) == target
    hinge = jnp.where(p == 1, 1, 2 * z)
    if weight is not None:
        hinge = hinge * _opmath(weight)[target]
    grad = jnp.where((z > 0) & ~is_target, hinge, 0) * _margin_grad_scale(grad_output, self, reduction)
    return (grad - is_target * jnp.sum(grad, axis=1, keepdims=True)).reshape(self.shape)


@lowering(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    """For every listed target j (up to the first -1) and every non-target class d with
    1 - x[j] + x[d] > 0, class d gains the sample's scale and class j loses it."""
    classes = self.shape[-1] if self.ndim else 1
    x = _opmath(self).reshape(-1, classes)
    target = target.reshape(-1, classes)
    listed = jnp.cumprod(target >= 0, axis=1).astype(bool)
    target = jnp.where(listed, target, 0)
    z = 1 - jnp.take_along_axis(x, target, axis=1)[:, :, None] + x[:, None, :]
    active = (z > 0) & listed[:, :, None] & (is_target.reshape(-1, 1, classes) == 0)
    scale = _margin_grad_scale(grad_output, self, reduction)
    gained = jnp.sum(active, axis=1)
    lost = jnp.zeros_like(x).at[jnp.arange(x.shape[0])[:, None], target].add(jnp.sum(active, axis=2))
    return ((gained - lost) * scale).reshape(self.shape)


@lowering(aten.huber_loss.default, promote=Promote.DEFAULT, type_check=floating_kernel("huber_cpu"))
def huber_loss(self, target, reduction=_REDUCTION_MEAN, delta=1.0):
    z = jnp.abs(self - target)
    return _reduce(jnp.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta)), reduction)


@lowering(aten.huber_loss_backward.default, promote=Promote.DEFAULT)
def huber_loss_backward(grad_output, self, target, reduction, delta):
    grad = jnp.clip(self - target, -delta, delta)
    return grad * _grad_of_reduction(grad_output, reduction, self.size)
