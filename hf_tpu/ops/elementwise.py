"""Elementwise ops: arithmetic, comparison, logic and math functions, with PyTorch's promotion."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from .registry import Promote, lowering

aten = torch.ops.aten


@lowering(aten.add.Tensor, aten.add.Scalar, promote=Promote.DEFAULT)
def add(self, other, alpha=1):
    return self + other * alpha if not (isinstance(alpha, int) and alpha == 1) else self + other


@lowering(aten.sub.Tensor, aten.sub.Scalar, promote=Promote.DEFAULT)
def sub(self, other, alpha=1):
    return self - other * alpha if not (isinstance(alpha, int) and alpha == 1) else self - other


@lowering(aten.mul.Tensor, aten.mul.Scalar, promote=Promote.DEFAULT)
def mul(self, other):
    return self * other


@lowering(aten.fill.Scalar, aten.fill.Tensor)
def fill(self, value):
    return jnp.broadcast_to(jnp.asarray(value), self.shape)


@lowering(aten.zero.default)
def zero(self):
    return jnp.zeros_like(self)
