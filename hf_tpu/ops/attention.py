"""Scaled dot-product attention as one XLA program, forward and backward.

`F.scaled_dot_product_attention` picks its backend through a C++ DispatchStub that a Python
backend cannot register, so on `tpu` it takes the math path (`_scaled_dot_product_attention_math`,
composite: matmuls and `_safe_softmax`). The fused CPU op lowered here serves graphs that call it
directly (export, compile) and is the same computation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from .nn import _opmath, _safe_softmax_along
from .registry import lowering

aten = torch.ops.aten


def _scores(query, key, attn_mask, is_causal, scale):
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = jnp.einsum("...le,...se->...ls", query, key) * scale
    if is_causal:
        length, source = scores.shape[-2:]
        scores = jnp.where(jnp.tril(jnp.ones((length, source), jnp.bool_)), scores, -jnp.inf)
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            scores = jnp.where(attn_mask, scores, -jnp.inf)
        else:
            scores = scores + _opmath(attn_mask)
    return scores


def _attention(query, key, value, attn_mask, is_causal, scale):
    """(output, logsumexp); rows with every position masked out give 0."""
    scores = _scores(query, key, attn_mask, is_causal, scale)
    out = jnp.einsum("...ls,...se->...le", _safe_softmax_along(scores, -1), value)
    return out, jax.nn.logsumexp(scores, -1)


def _no_dropout(dropout_p):
    if dropout_p > 0:
        # the op has no Generator argument, so its mask could not follow torch.manual_seed
        raise NotImplementedError("attention dropout on tpu: use F.scaled_dot_product_attention (math path)")


@lowering(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *,
                                                attn_mask=None, scale=None):
    _no_dropout(dropout_p)
    return _attention(_opmath(query), _opmath(key), _opmath(value), attn_mask, is_causal, scale)


@lowering(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                                                         is_causal, *, attn_mask=None, scale=None):
    _no_dropout(dropout_p)

    def forward(q, k, v):
        return _attention(q, k, v, attn_mask, is_causal, scale)[0]

    _, pullback = jax.vjp(forward, _opmath(query), _opmath(key), _opmath(value))
    return pullback(_opmath(grad_out))
