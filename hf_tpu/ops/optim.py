"""Fused optimizer steps and AMP's grad scaling: one program for every parameter of a step.

PyTorch accepts `fused=True` for `Adam`, `AdamW` and `SGD` on any PrivateUse1 device, and Transformers'
Trainer asks for fused AdamW by default; `torch.amp.GradScaler` unscales and checks gradients through
`_amp_foreach_non_finite_check_and_unscale_` and adjusts its scale with `_amp_update_scale_`. Each
lowering follows PyTorch's CPU kernel (aten/src/ATen/native/cpu/Fused*Kernel.cpp,
AmpGradScalerKernels.cpp) element for element, in float32 (the kernels' opmath for float32 and
bfloat16 parameters). The in-place forms, which write several lists, are derived from these
functional ones by dispatch (`Signature.written`). A step that found an inf or NaN (`found_inf` 1)
changes nothing, as the CPU kernels return early.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from ..dispatch import lowering


aten = torch.ops.aten

# traced, so a learning-rate schedule never recompiles; the others choose code paths, as in the kernels
_ADAM_TRACED = ("lr", "beta1", "beta2", "eps")


def _unscaled(grad, grad_scale):
    grad = grad.astype(jnp.float32)
    return grad if grad_scale is None else grad / grad_scale.astype(jnp.float32).reshape(())


def _skipped(found_inf):
    return None if found_inf is None else found_inf.reshape(()) == 1.0


def _unless_skipped(skip, new, old):
    """The step's new value, or the old one where the scaler found an inf or NaN."""
    new = new.astype(old.dtype)
    return new if skip is None else jnp.where(skip, old, new)


def _adam(adamw: bool):
    def step(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
             weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
        skip = _skipped(found_inf)
        lr = jnp.asarray(lr, jnp.float32).reshape(())
        new_params, new_grads, new_exp_avgs, new_exp_avg_sqs = [], [], [], []
        new_max_exp_avg_sqs = [] if amsgrad else list(max_exp_avg_sqs)
        for k, (param, grad, exp_avg, exp_avg_sq, step_count) in enumerate(
                zip(self, grads, exp_avgs, exp_avg_sqs, state_steps)):
            g = _unscaled(grad, grad_scale)
            unscaled = g
            g = -g if maximize else g
            p = param.astype(jnp.float32)
            if weight_decay != 0:
                if adamw:
                    p = p * (1 - lr * weight_decay)
                else:
                    g = g + p * weight_decay
            m = exp_avg.astype(jnp.float32)
            weight = 1 - beta1  # exp_avg.lerp_(grad, 1 - beta1), in lerp's two forms as the kernel writes it
            m = jnp.where(jnp.abs(weight) < 0.5, m + weight * (g - m), g - (g - m) * (1 - weight))
            m = m.astype(exp_avg.dtype).astype(jnp.float32)  # the kernel stores it, then reads it back
            v = exp_avg_sq.astype(jnp.float32) * beta2 + (1 - beta2) * g * g
            t = step_count.astype(jnp.float32).reshape(())
            bias_correction2_sqrt = jnp.sqrt(1 - beta2 ** t)
            if amsgrad:
                v_max = jnp.maximum(max_exp_avg_sqs[k].astype(jnp.float32), v)
                new_max_exp_avg_sqs.append(_unless_skipped(skip, v_max, max_exp_avg_sqs[k]))
                denom = jnp.sqrt(v_max) / bias_correction2_sqrt + eps
            else:
                denom = jnp.sqrt(v) / bias_correction2_sqrt + eps
            p = p - (lr / (1 - beta1 ** t)) * m / denom
            new_params.append(_unless_skipped(skip, p, param))
            new_grads.append(_unless_skipped(skip, unscaled, grad))
            new_exp_avgs.append(_unless_skipped(skip, m, exp_avg))
            new_exp_avg_sqs.append(_unless_skipped(skip, v, exp_avg_sq))
        return new_params, new_grads, new_exp_avgs, new_exp_avg_sqs, new_max_exp_avg_sqs

    return step


lowering(aten._fused_adam, traced=_ADAM_TRACED)(_adam(adamw=False))
lowering(aten._fused_adamw, traced=_ADAM_TRACED)(_adam(adamw=True))


@lowering(aten._fused_sgd, traced=("lr",))
def _fused_sgd(self, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov, maximize,
               is_first_step, grad_scale=None, found_inf=None):
    skip = _skipped(found_inf)
    lr = jnp.asarray(lr, jnp.float32).reshape(())
    params, unscaled_grads, buffers = [], [], []
    for k, (param, grad) in enumerate(zip(self, grads)):
        g = _unscaled(grad, grad_scale)
        unscaled_grads.append(_unless_skipped(skip, g, grad))
        g = -g if maximize else g
        p = param.astype(jnp.float32)
        if weight_decay != 0:
            g = g + p * weight_decay
        if momentum != 0:
            old = momentum_buffer_list[k]
            buf = g if is_first_step else momentum * old.astype(jnp.float32) + (1 - dampening) * g
            buffers.append(_unless_skipped(skip, buf, old))
            g = g + momentum * buf if nesterov else buf
        params.append(_unless_skipped(skip, p - lr * g, param))
    return params, unscaled_grads, buffers if momentum != 0 else list(momentum_buffer_list)


@lowering(aten._amp_foreach_non_finite_check_and_unscale)
def _amp_foreach_non_finite_check_and_unscale(self, found_inf, inv_scale):
    """`GradScaler.unscale_`: every gradient times 1/scale, and `found_inf` set to 1 where any is inf or NaN."""
    inv_scale = inv_scale.astype(jnp.float32).reshape(())
    found = found_inf
    unscaled = []
    for grad in self:
        found = jnp.where(jnp.all(jnp.isfinite(grad)), found, jnp.ones_like(found))
        unscaled.append((grad.astype(jnp.float32) * inv_scale).astype(grad.dtype))
    return unscaled, found


@lowering(aten._amp_update_scale)
def _amp_update_scale(self, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    """`GradScaler.update`: back off after an inf or NaN, grow after `growth_interval` clean steps
    (never to inf)."""
    found = found_inf.reshape(self.shape) != 0
    successful = growth_tracker + 1
    grown = self * jnp.float32(scale_growth_factor)
    grow = successful == growth_interval
    scale = jnp.where(found, self * jnp.float32(scale_backoff_factor),
                      jnp.where(grow & jnp.isfinite(grown), grown, self))
    tracker = jnp.where(found | grow, jnp.zeros_like(growth_tracker), successful)
    return scale, tracker
