"""Pairwise distances (cdist, pdist) and their gradients, with the p-norm cases of PyTorch's CPU kernels; the
Euclidean distance goes through a matrix product where PyTorch's does (more than 25 rows a side, or asked for)."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from ..dispatch import lowering
from .products import matmul

aten = torch.ops.aten


def _p_distance(diff, p):
    """The p-norm of `diff` along its last axis; p = 0 counts the nonzero differences."""
    magnitude = jnp.abs(diff)
    if p == 0:
        return jnp.sum(magnitude != 0, axis=-1).astype(diff.dtype)
    if p == 1:
        return jnp.sum(magnitude, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(magnitude * magnitude, axis=-1))
    if p == float("inf"):
        return jnp.max(magnitude, axis=-1, initial=0)
    return jnp.sum(magnitude**p, axis=-1) ** (1 / p)


def _p_distance_grad(diff, distance, p):
    """d distance / d diff, elementwise; 0 where the distance is 0, as on CPU."""
    sign = jnp.sign(diff)
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return sign
    distance = distance[..., None]
    safe = jnp.where(distance == 0, 1, distance)
    if p == float("inf"):
        grad = sign * (jnp.abs(diff) == distance)
    elif p == 2:
        grad = diff / safe
    else:
        # p < 2 leaves |diff|^(p - 1) undefined at 0: CPU takes 0 there
        grad = sign * jnp.where(diff == 0, 0, jnp.abs(diff) ** (p - 1)) / safe ** (p - 1)
    return jnp.where(distance == 0, 0, grad)


def _cdist_operands(x1, x2):
    """x1 (..., P, M) and x2 (..., R, M) with their batch dims broadcast."""
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    return jnp.broadcast_to(x1, batch + x1.shape[-2:]), jnp.broadcast_to(x2, batch + x2.shape[-2:])


def _uses_matmul(x1, x2, p, compute_mode):
    """PyTorch's choice for p = 2: through matrix products when asked (1), or by default (None, 0)
    when either side has more than 25 rows; never for 2."""
    mode = compute_mode or 0
    return p == 2 and (mode == 1 or (mode == 0 and (x1.shape[-2] > 25 or x2.shape[-2] > 25)))


def _euclidean_distance_by_matmul(x1, x2):
    """PyTorch's `_euclidean_dist`: |a|^2 - 2 a.b + |b|^2 as one product, clamped, square-rooted."""
    x1_norm = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    x2_norm = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    left = jnp.concatenate([-2 * x1, x1_norm, jnp.ones_like(x1_norm)], axis=-1)
    right = jnp.concatenate([x2, jnp.ones_like(x2_norm), x2_norm], axis=-1)
    return jnp.sqrt(jnp.maximum(matmul(left, jnp.swapaxes(right, -1, -2)), 1e-30))


@lowering(aten._cdist_forward.default)
def _cdist_forward(x1, x2, p, compute_mode):
    x1, x2 = _cdist_operands(x1, x2)
    if x1.shape[-1] == 0:
        return jnp.zeros(x1.shape[:-1] + x2.shape[-2:-1], x1.dtype)
    if _uses_matmul(x1, x2, p, compute_mode):
        return _euclidean_distance_by_matmul(x1, x2)
    return _p_distance(x1[..., :, None, :] - x2[..., None, :, :], p)


@lowering(aten._cdist_backward.default)
def _cdist_backward(grad, x1, x2, p, cdist):
    """The gradient for x1 in its batch-broadcast shape (autograd sums it down to x1's); zeros in
    x1's own shape when anything is empty, as on CPU."""
    if x1.size == 0 or x2.size == 0:
        return jnp.zeros_like(x1)
    x1, x2 = _cdist_operands(x1, x2)
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    return jnp.sum(grad[..., None] * _p_distance_grad(diff, cdist, p), axis=-2)


def _pairs(n):
    """The (i, j), i < j, row by row: pdist's order."""
    return jnp.triu_indices(n, 1)


@lowering(aten._pdist_forward.default)
def _pdist_forward(self, p=2.0):
    first, second = _pairs(self.shape[0])
    return _p_distance(self[first] - self[second], p)


@lowering(aten._pdist_backward.default)
def _pdist_backward(grad, self, p, pdist):
    first, second = _pairs(self.shape[0])
    pair_grad = grad[:, None] * _p_distance_grad(self[first] - self[second], pdist, p)
    return jnp.zeros_like(self).at[first].add(pair_grad).at[second].add(-pair_grad)
