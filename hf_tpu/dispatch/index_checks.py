"""Out-of-range indices: XLA clamps a gather (index_select fills with NaN) and drops a scatter's write, silently;
PyTorch on CPU raises. Class labels of nll_loss (cross_entropy), bincount's values and one_hot's classes are
indices too.

Each checked op's rule looks at the call's shapes and static arguments when its program is built (never at a
device value) and gives the `IndexCheck` the program computes beside its results, or None where nothing can be
out of range (an empty index). A check is written over an array namespace: `jax.numpy` in the program, NumPy on
the host, where a trace decides it from indices whose values it knows (`in_range_on_host`). The program writes
what it finds into its device's record of errors, and the first error is raised at the next host read, naming the
op and where it was called (`modes.device_errors`); with HF_TPU_CHECK_INDICES=1 or in launch-blocking mode, at the
op's call, with a host sync per op. Either way the exception is the type and message PyTorch's CPU kernel raises
for the same call (`tests/core/test_index_checks.py` compares them), and only values CPU rejects are flagged:
negative indices where CPU takes them (`x[-1]`, `index_fill`, `take`), ignore_index, empty indices.
"""

from __future__ import annotations

import typing

import numpy as np
import torch

from ..memory import host_transfers


class IndexCheck(typing.NamedTuple):
    """What a checked op's program computes of its indices, and the error that stands for."""

    # (the lowering's arguments by name (arrays), their array namespace: jax.numpy or NumPy) -> (whether an index
    # is out of range, the first such value in PyTorch's order, a detail the message needs: a dim, a position)
    find: typing.Callable
    error: typing.Callable  # (value, detail) -> the exception PyTorch's CPU kernel raises


def _first(flat, outside, xp):
    """(whether any of `outside` is true, the element of `flat` at the first true one, its position): one min-reduction
    of positions, which XLA computes faster than an argmax."""
    n = flat.shape[0]
    first = xp.min(xp.where(outside, xp.arange(n, dtype=xp.int32 if n < 2**31 else xp.int64), n))
    return first < n, flat[xp.minimum(first, n - 1)], first


def _first_outside(index, low: int, high: int, xp):
    """(whether an element of `index` lies outside [low, high), the first such in row-major order, its position)."""
    flat = index.reshape(-1)
    return _first(flat, (flat < low) | (flat >= high), xp)


# The error of an index out of range along one dim: (self, the dim's size, the dim) -> (value, detail) -> exception


def _out_of_bounds(error, prefix=""):
    def make(self, size, dim):
        return lambda value, _: error(f"{prefix}index {value} is out of bounds for dimension {dim} with size {size}")
    return make


def _out_of_range_in_self(self, size, dim):
    return lambda value, _: IndexError("index out of range in self")


def _index_add_error(self, size, dim):
    if self.dim() > 1 and dim in (0, self.dim() - 1):  # CPU's kernel adds through scatter_add when alpha is 1
        scatter_error = _out_of_bounds(RuntimeError)(self, size, dim)
        return lambda value, alpha_is_one: (scatter_error(value, None) if alpha_is_one
                                            else IndexError("index out of range in self"))
    return _out_of_range_in_self(self, size, dim)


def _index_select_error(self, size, dim):
    if dim == 1 and self.dim() > 1:  # CPU's kernel along dim 1 checks with its own message
        return lambda value, _: RuntimeError(f"INDICES element is out of DATA bounds, id={value} axis_dim={size}")
    return _out_of_range_in_self(self, size, dim)


# per op along one dim: (whether negative indices count from the end, its error)
_ALONG_DIM = {
    "gather": (False, _out_of_bounds(RuntimeError)),
    "scatter": (False, _out_of_bounds(RuntimeError)),
    "scatter_add": (False, _out_of_bounds(RuntimeError)),
    "scatter_reduce": (False, _out_of_bounds(RuntimeError)),
    "index_select": (False, _index_select_error),
    "index_add": (False, _index_add_error),
    "index_reduce": (False, _out_of_range_in_self),
    "index_copy": (False, _out_of_bounds(IndexError, "index_copy_(): ")),
    "index_fill": (True, _out_of_bounds(IndexError)),
}


def _along_dim(name):
    negatives, make_error = _ALONG_DIM[name]

    def rule(values):
        self, dim, index = values[0], values[1], values[2]
        if index.numel() == 0:
            return None
        dim = dim % max(self.dim(), 1)
        size = self.shape[dim] if self.dim() else 1
        low = -size if negatives else 0

        def find(args, xp):
            bad, value, _ = _first_outside(args["index"], low, size, xp)
            return bad, value, xp.asarray(args.get("alpha", 1)) == 1  # index_add: which kernel CPU takes

        return IndexCheck(find, make_error(self, size, dim))
    return rule


def _embedding(values):
    weight, indices = values[0], values[1]
    if indices.numel() == 0:
        return None
    rows = weight.shape[0]
    return IndexCheck(lambda args, xp: _first_outside(args["indices"], 0, rows, xp),
                      _out_of_range_in_self(weight, rows, 0))


def _embedding_bag(values):
    weight, indices = values[0], values[1]
    if indices.numel() == 0:
        return None
    rows = weight.shape[0]
    return IndexCheck(
        lambda args, xp: _first_outside(args["indices"], 0, rows, xp),
        lambda value, position: RuntimeError(
            f"Index {position} of input takes value {value} which is not in the valid range [0, {rows})"))


def _is_mask(index) -> bool:
    return index.dtype in (torch.bool, torch.uint8)


def _advanced(values):  # index.Tensor, index_put, _index_put_impl
    """PyTorch's index kernels check each element of the broadcast indices as they read it, in row-major order and
    for each element the index tensors in order; the dim its error names counts the index tensors before it (a
    k-dim mask is k of them), its size is that of the dim of `self` it indexes."""
    self, indices = values[0], values[1]
    checked = []  # (position in `indices`, the dim the error names, the size of the dim indexed)
    indexed = set()  # the dims of `self` an index tensor or a mask covers
    dim = named = 0
    for k, index in enumerate(indices):
        if index is None:
            dim += 1
        elif _is_mask(index):
            indexed.update(range(dim, dim + index.dim()))
            dim += index.dim()
            named += index.dim()
        else:
            if self.shape[dim] == 0 and index.numel():  # a shape error, raised at once whatever the values
                raise IndexError("index is out of bounds for dimension with size 0")
            checked.append((k, named, self.shape[dim]))
            indexed.add(dim)
            dim += 1
            named += 1
    empty_result = any(n == 0 for d, n in enumerate(self.shape) if d not in indexed)
    if not checked or empty_result or any(indices[k].numel() == 0 for k, _, _ in checked):
        return None  # no element is read, so none is checked
    sizes = {named: size for _, named, size in checked}
    if any(index is not None and _is_mask(index) for index in indices):
        # a mask's true elements are known on the device only: each index tensor checked in turn
        def find(args, xp):
            found = [_first_outside(args["indices"][k], -size, size, xp) for k, _, size in checked]
            bad = xp.stack([bad for bad, _, _ in found])
            first = xp.argmax(bad)
            return (bad.any(), xp.stack([value.astype(xp.int64) for _, value, _ in found])[first],
                    xp.asarray([named for _, named, _ in checked])[first])
    else:
        def find(args, xp):
            tensors = [args["indices"][k] for k, _, _ in checked]
            shape = xp.broadcast_shapes(*(t.shape for t in tensors))
            flat = xp.stack([xp.broadcast_to(t, shape).reshape(-1).astype(xp.int64) for t in tensors])  # (k, n)
            limits = xp.asarray([size for _, _, size in checked], xp.int64)[:, None]
            outside = (flat < -limits) | (flat >= limits)
            bad, _, element = _first(flat[0], outside.any(0), xp)
            element = xp.minimum(element, flat.shape[1] - 1)
            which = xp.argmax(outside[:, element])  # among the few index tensors
            return bad, flat[which, element], xp.asarray([named for _, named, _ in checked])[which]
    return IndexCheck(find, lambda value, named: IndexError(
        f"index {value} is out of bounds for dimension {named} with size {sizes[named]}"))


def _flat(name):  # take, put: indices into the flattened tensor, negative ones from the end
    def rule(values):
        self, index = values[0], values[1]
        n = self.numel()
        if index.numel() == 0:
            return None
        if n == 0 and name == "take":
            raise IndexError("take(): tried to take from an empty tensor")
        return IndexCheck(
            lambda args, xp: _first_outside(args["index"], -n, n, xp),
            lambda value, _: IndexError(f"out of range: tried to access index {value} on a tensor of {n} elements."))
    return rule


def _nll_loss(values):  # nll_loss_forward, nll_loss2d_forward, hf_tpu::cross_entropy: the first target out of range and not ignored
    self, target, ignore_index = values[0], values[1], values[4]
    if target.numel() == 0:
        return None
    classes = self.shape[-1] if self.dim() <= 2 else self.shape[1]

    def find(args, xp):
        flat = args["target"].reshape(-1)
        return _first(flat, (flat != ignore_index) & ((flat < 0) | (flat >= classes)), xp)

    return IndexCheck(find, lambda value, _: IndexError(f"Target {value} is out of bounds."))


def _one_hot(values):
    """CPU checks that no class is negative, then that none reaches num_classes."""
    classes = values[1]

    def find(args, xp):
        flat = args["self"].reshape(-1)
        bad, value, _ = _first(flat, (flat < 0) | (flat >= classes), xp)
        return bad, value, (flat < 0).any()

    return IndexCheck(find, lambda value, negative: RuntimeError(
        "Class values must be non-negative." if negative else "Class values must be smaller than num_classes."))


_BINCOUNT = "bincount only supports 1-d non-negative integral inputs."


def _bincount(values):
    self = values[0]
    if self.dim() != 1:
        raise RuntimeError(_BINCOUNT)  # a shape error, raised at once
    if self.numel() == 0:
        return None

    def find(args, xp):
        flat = args["self"].reshape(-1)
        return _first(flat, flat < 0, xp)

    return IndexCheck(find, lambda value, _: RuntimeError(_BINCOUNT))


RULES = {
    **{name: _along_dim(name) for name in _ALONG_DIM},
    "embedding": _embedding,
    "_embedding_bag": _embedding_bag,
    "_embedding_bag_forward_only": _embedding_bag,
    "index": _advanced,
    "index_put": _advanced,
    "_index_put_impl": _advanced,
    "take": _flat("take"),
    "put": _flat("put"),
    "nll_loss_forward": _nll_loss,
    "nll_loss2d_forward": _nll_loss,
    "cross_entropy": _nll_loss,
    "bincount": _bincount,
    "one_hot": _one_hot,
}


# Where a trace knows tensors' values on the host: for each trace running (innermost last), a function of a tensor
# giving its CPU value or None. `constant_masks.KnownValues` adds its own (the values computed from constants alone)
# while it is the trace's mode; the dispatch, below that mode, reads them here.
HOST_VALUES: list = []


def in_range_on_host(check: IndexCheck, names: tuple, values: list) -> bool:
    """Whether a call's indices are all in range, found on the host from their values where the innermost trace
    knows each tensor argument's (`HOST_VALUES`). False where a value is not known, or an index is out of range:
    the program then checks them. A check decided so is left out of the traced program, and with it every op that
    computes only what the check read (the index ops of an attention mask that a known pattern replaced).

    Computed with NumPy: through JAX each of the check's ops (a comparison, a reduction, a slice) would be an
    eager program XLA compiles for its shapes, some 20 per checked op (a Llama forward's mask indexes its position
    ids twice), paid by a process's first trace (41 programs, 1.5 s of a tiny Llama's first trace on the
    development CPU)."""
    if not HOST_VALUES:
        return False
    known = HOST_VALUES[-1]

    def on_host(value):
        if isinstance(value, torch.Tensor):
            host = known(value)
            if host is None:
                raise LookupError
            return host_transfers.host_array(host)
        if isinstance(value, (list, tuple)):
            return type(value)(on_host(v) for v in value)
        return value

    try:
        args = {name: on_host(value) for name, value in zip(names, values)}
    except LookupError:
        return False
    return not bool(check.find(args, np)[0])


def rule_for(op):
    """The index check rule of `op` (an indexing op): the call's values -> its `IndexCheck` or None; or None."""
    return RULES.get(op._schema.name.split("::")[1].rstrip("_"))
