"""Cross-entropy over class logits that saves, for its backward, only its input and a logsumexp a row.

PyTorch's `cross_entropy` is a composite of `log_softmax` and `nll_loss`: autograd saves the log-probabilities
(rows x classes, in the input's dtype: float32 after the upcast a language model's loss makes) and the backward
builds their gradient, rows x classes again, before `log_softmax`'s backward turns it into the input's. On tpu,
`hf_tpu::cross_entropy` computes the loss from the logits and their logsumexp in one lowering, saves the logits
and that logsumexp, and its backward recomputes the probabilities from them in the expression that makes the
gradient, in the logits' dtype: XLA fuses the softmax, the one-hot difference and the cast into one pass over the
logits, and nothing of rows x classes in float32 exists in the program. The logits a language model passes are a
float32 upcast of bfloat16 ones: a traced step keeps such a saved upcast as its bfloat16 source
(`hf_tpu.remat.saved_values_materialized`), so the loss holds the bfloat16 logits and their bfloat16 gradient.

`cross_entropy_loss` on tpu takes this op for class-index targets over (rows, classes) logits, with or without
class weights, ignore_index, label smoothing and any reduction; other calls (probability targets, more dims,
weights that require grad) take PyTorch's decomposition, as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ..dispatch import backend_choice, lowering
from .nn import _REDUCTION_MEAN, _REDUCTION_NONE, _REDUCTION_SUM, _nll_weights, _opmath

aten = torch.ops.aten

_ARGUMENTS = "Tensor logits, Tensor target, Tensor? weight, int reduction, SymInt ignore_index, float label_smoothing"
_library = torch.library.Library("hf_tpu", "FRAGMENT")
_library.define(f"cross_entropy({_ARGUMENTS}) -> (Tensor, Tensor)")
_library.define(f"cross_entropy_backward(Tensor grad, {_ARGUMENTS}, Tensor logsumexp) -> Tensor")


def _fused_applies(self, target, weight, label_smoothing) -> bool:
    """Whether `hf_tpu::cross_entropy` computes this `cross_entropy_loss` call: class indices (int64) for a batch of
    rows of floating logits, optional per-class weights that need no gradient, a smoothing PyTorch accepts. What
    it leaves out takes PyTorch's decomposition, which also raises PyTorch's errors for bad input."""
    if self.dim() != 2 or not self.dtype.is_floating_point or 0 in self.shape:
        return False
    if target.dtype != torch.int64 or target.shape != self.shape[:1] or target.device != self.device:
        return False
    if weight is not None and (weight.shape != self.shape[1:] or weight.dtype != self.dtype
                               or weight.device != self.device or weight.requires_grad):
        return False
    return 0.0 <= label_smoothing <= 1.0


@backend_choice(aten.cross_entropy_loss.default)
def _cross_entropy_loss(self, target, weight=None, reduction=_REDUCTION_MEAN, ignore_index=-100, label_smoothing=0.0):
    if _fused_applies(self, target, weight, label_smoothing):
        if torch.is_autocast_enabled("tpu") and self.dtype in (torch.bfloat16, torch.float16):
            # autocast runs the composite's log_softmax and nll_loss in float32: so does the op (a float32 loss)
            self, weight = self.float(), None if weight is None else weight.float()
        return torch.ops.hf_tpu.cross_entropy(self, target, weight, reduction, ignore_index, label_smoothing)[0]
    return aten.cross_entropy_loss.default.decompose(self, target, weight, reduction, ignore_index, label_smoothing)


# --- The reference (the CPU kernels): PyTorch's own decomposition, and its gradient by autograd.


@torch.library.impl("hf_tpu::cross_entropy", "cpu", lib=_library)
def _cross_entropy_cpu(logits, target, weight, reduction, ignore_index, label_smoothing):
    loss = aten.cross_entropy_loss.default.decompose(logits, target, weight, reduction, ignore_index, label_smoothing)
    return loss, torch.logsumexp(logits.float(), 1)


@torch.library.impl("hf_tpu::cross_entropy_backward", "cpu", lib=_library)
def _cross_entropy_backward_cpu(grad, logits, target, weight, reduction, ignore_index, label_smoothing, logsumexp):
    with torch.enable_grad():
        x = logits.detach().requires_grad_()
        loss = aten.cross_entropy_loss.default.decompose(x, target, weight, reduction, ignore_index, label_smoothing)
        return torch.autograd.grad(loss, x, grad)[0]


@torch.library.register_fake("hf_tpu::cross_entropy", lib=_library)
def _cross_entropy_fake(logits, target, weight, reduction, ignore_index, label_smoothing):
    shape = target.shape if reduction == _REDUCTION_NONE else ()
    return logits.new_empty(shape), logits.new_empty(logits.shape[:1], dtype=torch.float32)


@torch.library.register_fake("hf_tpu::cross_entropy_backward", lib=_library)
def _cross_entropy_backward_fake(grad, logits, target, weight, reduction, ignore_index, label_smoothing, logsumexp):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    logits, target, weight, *ctx.options = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits, target, weight, output[1])


def _backward(ctx, grad, _):
    logits, target, weight, logsumexp = ctx.saved_tensors
    grad_logits = torch.ops.hf_tpu.cross_entropy_backward(grad, logits, target, weight, *ctx.options, logsumexp)
    return grad_logits, None, None, None, None, None


torch.library.register_autograd("hf_tpu::cross_entropy", _backward, setup_context=_setup_context, lib=_library)


# --- The lowerings. Every rows x classes value is an elementwise function of the logits or a reduction of one
# (no gather, no scatter), so XLA fuses it into the pass that reads the logits instead of keeping it.


def _is_target(logits, target):
    return jnp.arange(logits.shape[1], dtype=target.dtype)[None, :] == target[:, None]


def _row_weights(target, weight, ignore_index):
    """Each row's weight (its target's class weight; 1 without weights) and whether its target is ignored."""
    return _nll_weights(target, weight, ignore_index), target == ignore_index


def _smoothing_weights(logits, weight):
    """The classes' weights in the smoothing term and their sum (every class 1 without weights)."""
    if weight is None:
        return 1.0, logits.shape[1]
    weight = _opmath(weight)
    return weight[None, :], jnp.sum(weight)


@lowering(torch.ops.hf_tpu.cross_entropy.default)
def cross_entropy(logits, target, weight, reduction, ignore_index, label_smoothing):
    """PyTorch's `(1 - s) * nll_loss(log_softmax(x)) + s / classes * smoothing loss`, with log-probabilities
    `x - logsumexp(x)` never formed: the target's is its logit less the logsumexp, and the smoothing term, a
    weighted sum of them, is the weighted sum of the logits less the logsumexp times the weights' sum."""
    x = _opmath(logits)
    logsumexp = jax.nn.logsumexp(x, axis=1)
    row_weight, ignored = _row_weights(target, weight, ignore_index)
    picked = jnp.sum(jnp.where(_is_target(x, target), x, 0), axis=1)
    losses = jnp.where(ignored, 0, (logsumexp - picked) * row_weight)
    if label_smoothing > 0:
        class_weight, weight_sum = _smoothing_weights(x, weight)
        smoothing = jnp.where(ignored, 0, logsumexp * weight_sum - jnp.sum(x * class_weight, axis=1))
        losses = (1 - label_smoothing) * losses + label_smoothing / x.shape[1] * smoothing
    if reduction == _REDUCTION_MEAN:
        return jnp.sum(losses) / jnp.sum(row_weight), logsumexp
    return (jnp.sum(losses) if reduction == _REDUCTION_SUM else losses), logsumexp


@lowering(torch.ops.hf_tpu.cross_entropy_backward.default)
def cross_entropy_backward(grad, logits, target, weight, reduction, ignore_index, label_smoothing, logsumexp):
    """The gradient, `softmax(x) - onehot(target)` for each row (with weights and smoothing, their terms), scaled
    by the row's share of the loss's gradient; cast to the logits' dtype by the registry, in the same fusion."""
    x = _opmath(logits)
    probs = jnp.exp(x - logsumexp[:, None])
    row_weight, ignored = _row_weights(target, weight, ignore_index)
    grad = _opmath(grad)
    if reduction == _REDUCTION_MEAN:
        grad = grad / jnp.sum(row_weight)
    row_grad = jnp.where(ignored, 0, grad * jnp.ones_like(row_weight))  # an ignored row's gradient is 0, even 0/0
    grad_logits = (row_grad * row_weight)[:, None] * (probs - _is_target(x, target))
    if label_smoothing > 0:
        class_weight, weight_sum = _smoothing_weights(x, weight)
        smoothing = row_grad[:, None] * (probs * weight_sum - class_weight)
        grad_logits = (1 - label_smoothing) * grad_logits + label_smoothing / x.shape[1] * smoothing
    return grad_logits
