"""Out-of-range indices: XLA clamps gathers (index_select fills) and drops scatters silently; PyTorch on CPU
raises. Class labels of nll_loss (cross_entropy) and bincount's values are indices too.

Checking needs the indices on the host (a sync per indexing op), so it is off by default and on under
`DEFER_NEVER_AND_LAUNCH_BLOCKING` or with `HF_TPU_CHECK_INDICES=1`. Each check raises the exception
type and message PyTorch's CPU kernel raises for the same call.
"""

from __future__ import annotations


import torch

from .. import modes, settings

aten = torch.ops.aten


def enabled() -> bool:
    if settings.get("HF_TPU_CHECK_INDICES"):
        return True
    return modes.current().kind is modes.ModeKind.DEFER_NEVER_AND_LAUNCH_BLOCKING


def _bounds(index: torch.Tensor):
    if index.numel() == 0:
        return None
    both = torch.stack([index.min(), index.max()]).cpu().tolist()
    return both


def _check_dim(index, size, dim, error, message=None):
    bounds = _bounds(index)
    if bounds is None:
        return
    for value in bounds:
        if value >= size or value < -size:
            raise error(message or f"index {value} is out of bounds for dimension {dim} with size {size}")


def _index_select(values):
    self, dim, index = values[0], values[1], values[2]
    dim = dim % max(self.dim(), 1)
    if self.dim() > 1 and self.shape[dim] == 0:
        return  # a shape error on the CPU, whatever the values: the lowering's check raises it
    _check_dim(index, self.shape[dim] if self.dim() else 1, dim, IndexError, "index out of range in self")


def _embedding(values):
    weight, indices = values[0], values[1]
    _check_dim(indices, weight.shape[0], 0, IndexError, "index out of range in self")


def _along_dim(values):  # gather, scatter*, index_add, index_copy, index_fill, index_reduce
    self, dim, index = values[0], values[1], values[2]
    dim = dim % max(self.dim(), 1)
    _check_dim(index, self.shape[dim] if self.dim() else 1, dim, RuntimeError)


def _advanced(values):  # index.Tensor, index_put
    self, indices = values[0], values[1]
    indexed = [dim for dim, index in enumerate(indices) if index is not None]
    if self.numel() == 0 and all(self.shape[dim] for dim in indexed):
        return  # PyTorch checks each index as it reads an element: with none to read it checks none
    for dim, index in enumerate(indices):
        if index is not None and index.dtype not in (torch.bool, torch.uint8):
            _check_dim(index, self.shape[dim], dim, IndexError)


def _take(values):
    self, index = values[0], values[1]
    bounds = _bounds(index)
    if bounds is None:
        return
    for value in bounds:
        if value >= self.numel() or value < -self.numel():
            raise IndexError(f"out of range: tried to access index {value} on a tensor of {self.numel()} elements.")


def _nll_loss(values):  # nll_loss_forward, nll_loss2d_forward: the first target out of range, not ignored
    self, target, ignore_index = values[0], values[1], values[4]
    if target.numel() == 0:
        return
    classes = self.shape[-1] if self.dim() <= 2 else self.shape[1]
    target = target.cpu().reshape(-1)
    bad = target[(target != ignore_index) & ((target < 0) | (target >= classes))]
    if bad.numel():
        raise IndexError(f"Target {bad[0].item()} is out of bounds.")


def _bincount(values):
    self = values[0]
    if self.dim() != 1 or (self.numel() and self.min().item() < 0):
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")


CHECKS = {
    "index_select": _index_select,
    "embedding": _embedding,
    "gather": _along_dim,
    "scatter": _along_dim,
    "scatter_add": _along_dim,
    "scatter_reduce": _along_dim,
    "index_add": _along_dim,
    "index_copy": _along_dim,
    "index_fill": _along_dim,
    "index_reduce": _along_dim,
    "index": _advanced,
    "index_put": _advanced,
    "_index_put_impl": _advanced,
    "take": _take,
    "nll_loss_forward": _nll_loss,
    "nll_loss2d_forward": _nll_loss,
    "bincount": _bincount,
}


def check_for(op):
    """The check for `op` (an indexing op), or None."""
    return CHECKS.get(op._schema.name.split("::")[1].rstrip("_"))
