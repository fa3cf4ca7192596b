"""Connectionist temporal classification loss: `_ctc_loss` and `_ctc_loss_backward`.

The forward-backward recursions of Graves et al. (2006) in log space, as PyTorch's CPU kernel
(LossCTC.cpp) computes them, with `lax.scan` over time and the whole batch and every state of the
extended target (blank, l1, blank, l2, ..., blank) at each step. Each sequence's own input and
target lengths mask the states and times it does not have. `ctc_loss` itself (reductions,
`zero_infinity` on the loss) is PyTorch's composite over these two ops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from ..dispatch import lowering


aten = torch.ops.aten


def _log_add3(a, b, c):
    """log(e^a + e^b + e^c) around the largest term, -inf when all are -inf (the CPU's formula)."""
    largest = jnp.maximum(jnp.maximum(a, b), c)
    largest = jnp.where(largest == -jnp.inf, 0, largest)
    return jnp.log(jnp.exp(a - largest) + jnp.exp(b - largest) + jnp.exp(c - largest)) + largest


def _shift(x, by):
    """x[..., s - by] along the last axis (by > 0 looks back, by < 0 ahead), -inf where out of range."""
    pad = jnp.full(x.shape[:-1] + (abs(by),), -jnp.inf, x.dtype)
    if by > 0:
        return jnp.concatenate([pad, x[..., :-by]], axis=-1)
    return jnp.concatenate([x[..., -by:], pad], axis=-1)


class _Alignment:
    """The extended targets of a batch and what the recursions need of them: per sequence (N), the
    label of each state s (blank at even s, target (s - 1) // 2 at odd s), whether state s may be
    reached from s - 2 (a label differing from the one two states back), which states exist
    (s <= 2 * target_length), and each state's log-probability at each time (T, N, S)."""

    def __init__(self, log_probs, targets, input_lengths, target_lengths, blank, max_target_length):
        batch, labels = log_probs.shape[1], log_probs.shape[2]
        self.input_lengths = jnp.asarray(input_lengths, jnp.int64)
        self.target_lengths = jnp.asarray(target_lengths, jnp.int64)
        position = jnp.arange(max_target_length)
        if targets.ndim == 1:  # concatenated targets
            starts = jnp.cumsum(self.target_lengths) - self.target_lengths
            index = jnp.clip(starts[:, None] + position, 0, max(targets.shape[0] - 1, 0))
            padded = targets[index] if targets.shape[0] else jnp.zeros((batch, max_target_length), jnp.int64)
        else:
            padded = targets[:, :max_target_length]
        padded = jnp.clip(padded.astype(jnp.int64), 0, labels - 1)  # past a sequence's end: unused
        states = 2 * max_target_length + 1
        self.label = jnp.full((batch, states), blank, jnp.int64).at[:, 1::2].set(padded)
        self.skip = jnp.concatenate(
            [jnp.zeros((batch, min(2, states)), bool), self.label[:, 2:] != self.label[:, :-2]], axis=1)
        self.exists = jnp.arange(states) <= 2 * self.target_lengths[:, None]
        self.log_probs = jnp.take_along_axis(log_probs, self.label[None], axis=2)


def _forward(a: _Alignment):
    """log alpha (N, T, S): -inf at the states and times a sequence does not have."""
    lp = a.log_probs
    start = jnp.full(lp.shape[1:], -jnp.inf, lp.dtype).at[:, 0].set(lp[0, :, 0])
    if lp.shape[2] > 1:
        start = start.at[:, 1].set(jnp.where(a.target_lengths > 0, lp[0, :, 1], -jnp.inf))

    def step(previous, lp_t):
        alpha = _log_add3(previous, _shift(previous, 1), jnp.where(a.skip, _shift(previous, 2), -jnp.inf)) + lp_t
        alpha = jnp.where(a.exists, alpha, -jnp.inf)
        return alpha, alpha

    _, rest = jax.lax.scan(step, start, lp[1:])
    log_alpha = jnp.concatenate([start[None], rest]).transpose(1, 0, 2)
    reached = jnp.arange(lp.shape[0]) < a.input_lengths[:, None]
    return jnp.where(reached[:, :, None], log_alpha, -jnp.inf)


def _negative_log_likelihood(a: _Alignment, log_alpha):
    """-log p(target | input): the last time's final blank and final label; 0 or inf without input."""
    last = jnp.take_along_axis(log_alpha, jnp.maximum(a.input_lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    end = 2 * a.target_lengths[:, None]
    final_blank = jnp.take_along_axis(last, end, axis=1)[:, 0]
    final_label = jnp.take_along_axis(last, jnp.maximum(end - 1, 0), axis=1)[:, 0]
    largest = jnp.maximum(final_blank, final_label)
    largest = jnp.where(largest == -jnp.inf, 0, largest)
    both = jnp.log(jnp.exp(final_blank - largest) + jnp.exp(final_label - largest)) + largest
    nll = -jnp.where(a.target_lengths == 0, final_blank, both)
    no_input = jnp.where(a.target_lengths == 0, 0, jnp.inf).astype(nll.dtype)
    return jnp.where(a.input_lengths == 0, no_input, nll)


def _backward(a: _Alignment):
    """log beta (T, N, S), from each sequence's last input backwards."""
    lp = a.log_probs
    end = 2 * a.target_lengths[:, None]
    states = jnp.arange(lp.shape[2])
    skip_ahead = jnp.concatenate([a.skip[:, 2:], jnp.zeros((lp.shape[1], min(2, lp.shape[2])), bool)], axis=1)

    def step(following, inputs):
        t, lp_t = inputs
        last = jnp.where((states == end) | ((states == end - 1) & (end > 0)), lp_t, -jnp.inf)
        beta = _log_add3(following, _shift(following, -1), jnp.where(skip_ahead, _shift(following, -2), -jnp.inf)) + lp_t
        beta = jnp.where(a.exists, beta, -jnp.inf)
        final_time = (a.input_lengths - 1)[:, None]
        beta = jnp.where(t == final_time, last, jnp.where(t < final_time, beta, -jnp.inf))
        return beta, beta

    times = jnp.arange(lp.shape[0])
    _, log_beta = jax.lax.scan(step, jnp.full(lp.shape[1:], -jnp.inf, lp.dtype), (times, lp), reverse=True)
    return log_beta


@lowering(aten._ctc_loss.default, aten._ctc_loss.Tensor)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """(negative log-likelihood per sequence, log alpha). Log alpha's size follows the longest
    target: with length tensors (`_ctc_loss.Tensor`) the core reads them first."""
    if not 0 <= blank < log_probs.shape[2]:
        raise RuntimeError("blank must be in label range")
    max_target_length = int(np.max(target_lengths, initial=0))  # a traced tensor raises: data-dependent
    a = _Alignment(log_probs, targets, input_lengths, target_lengths, blank, max_target_length)
    if log_probs.shape[0] == 0:
        log_alpha = jnp.zeros((log_probs.shape[1], 0, 2 * max_target_length + 1), log_probs.dtype)
    else:
        log_alpha = _forward(a)
    return _negative_log_likelihood(a, log_alpha), log_alpha


@lowering(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha,
                      blank, zero_infinity=False):
    """d loss / d log_probs = (p - posterior occupancy of each label) * grad, where the occupancy
    collects alpha * beta / p over the states carrying that label; zero past each input's end,
    and for infinite losses under `zero_infinity`."""
    a = _Alignment(log_probs, targets, input_lengths, target_lengths, blank, (log_alpha.shape[2] - 1) // 2)
    alpha_beta = log_alpha.transpose(1, 0, 2) + _backward(a)  # (T, N, S)
    largest = jnp.max(alpha_beta, axis=2, keepdims=True, initial=-jnp.inf)
    largest = jnp.where(largest == -jnp.inf, 0, largest)
    batch = jnp.arange(log_probs.shape[1])[:, None]
    collected = jnp.zeros_like(log_probs).at[:, batch, a.label].add(jnp.exp(alpha_beta - largest))
    log_collected = jnp.log(collected) + largest
    nll = neg_log_likelihood[None, :, None]
    gradient = (jnp.exp(log_probs) - jnp.exp(log_collected + nll - log_probs)) * grad[None, :, None]
    keep = jnp.arange(log_probs.shape[0])[:, None] < a.input_lengths[None, :]
    if zero_infinity:
        keep &= neg_log_likelihood[None, :] != jnp.inf
    return jnp.where(keep[:, :, None], gradient, 0)
