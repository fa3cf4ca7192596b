"""One op call, analysed: its operands (each tensor's buffer and view), its traced scalars and the
hashable key of the program it needs (`Call`); and the call's values as PyTorch's own kernels take
them (`to_meta`, `call_with`, `wrapped_numbers`).

The common case (whole-buffer tpu tensors, Scalars at their defaults) is analysed in C
(`_entry.analyse`), giving the same key as the loop here.
"""

from __future__ import annotations

import functools
import typing

import torch
from torch._prims_common import elementwise_dtypes

from .. import dtypes
from ..memory import buffer, host_transfers, tensor_views
from . import _entry
from .signatures import (GENERATOR, OPT_TENSOR, SCALAR, SCALAR_LIST, STATIC, TENSOR, TENSOR_LIST, Signature,
                        hashable)

class Operand(typing.NamedTuple):
    """A tensor argument as the program sees it: its buffer and how it is viewed."""

    tensor: torch.Tensor
    buf: buffer.Buffer | None
    view: object


# every op builds one per tensor argument: tuple.__new__ skips the NamedTuple's Python-level __new__
_operand = functools.partial(tuple.__new__, Operand)


LIVE = buffer.allocator.live

_analyse_common = _entry.analyse
matmul_precision = torch._C._get_float32_matmul_precision
_view_of = tensor_views.view_of
_keyed_view = tensor_views.keyed_view


def device_mismatch(sig, a, b) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! "
        f"(when checking arguments for {sig.name})"
    )


class Call:
    """One op call split into operands, scalars and a hashable key."""

    __slots__ = ("sig", "values", "operands", "arrays", "scalars", "starts", "key", "device_index", "rng")

    def __init__(self, sig: Signature, values: list, analysed=None):
        self.sig = sig
        self.values = values
        self.scalars = []
        self.starts = []  # the starts of views read at a start the program is given (`tensor_views.keyed_view`)
        self.rng = False
        # the float32 matmul precision is read while a program is traced, so it decides the program
        precision = matmul_precision()
        # the common case (whole-buffer tensors, default Scalars) in C, unless the C entry analysed the
        # call already (False: not the common case); the same key as the loop below
        if analysed is None:
            analysed = _analyse_common(sig.kinds, sig.defaults, sig.default_keys, values, sig.ident, precision)
        if analysed:
            self.key, self.operands, self.arrays, self.device_index = analysed
            return
        # the operands' arrays as they are: concrete, Lazy results of deferred ops, or None for an
        # uninitialised buffer (the program makes its zeros, which XLA drops when they are overwritten)
        self.arrays = []
        operands = []
        scalars = self.scalars
        key = [sig.ident, precision]
        device_index = None
        ints = []  # traced Python ints: (index in scalars, index in key, argument name)
        i = 0
        for kind in sig.kinds:
            v = values[i]
            if kind == TENSOR or kind == OPT_TENSOR:
                if isinstance(v, torch.Tensor):
                    device_index = self._operand(v, operands, key, device_index)
                elif v is None:
                    key.append(None)
                elif is_static_scalar(sig, i, v):
                    key.append(hashable(v))
                else:  # a Python number PyTorch wrapped as a tensor: a scalar here
                    if type(v) is int:
                        ints.append((len(scalars), len(key), sig.names[i]))
                    scalars.append(v)
                    key.append(type(v))
            elif kind == STATIC:
                key.append(hashable(v))
            elif kind == SCALAR:
                default = sig.defaults[i]  # the schema's default (alpha=1) first: the common case
                if (type(v) is type(default) and v == default) or is_static_scalar(sig, i, v):
                    key.append(hashable(v))
                else:
                    if type(v) is int:
                        ints.append((len(scalars), len(key), sig.names[i]))
                    scalars.append(v)
                    key.append(type(v))
            elif kind == SCALAR_LIST:
                scalars.append(list(v))
                key.append(tuple(type(x) for x in v))
            elif kind == TENSOR_LIST:
                key.append(len(v))
                # PyTorch lets CPU index tensors index an accelerator's tensor (`x[:, torch.arange(n)]`)
                host_indices = sig.names[i] == "indices"
                for t in v:
                    if t is None:
                        key.append(None)
                    else:
                        device_index = self._operand(t, operands, key, device_index, host_indices)
            else:  # GENERATOR
                self.rng = True
                key.append(GENERATOR)
            i += 1
        self.operands = operands
        if ints and sig.lowering.promote is not None:
            _convert_ints(sig, values, operands, scalars, key, ints)
        scalars.extend(self.starts)
        self.key = tuple(key)
        self.device_index = device_index

    def _operand(self, t, operands, key, device_index, host_ok=False):
        if t.is_cpu:
            if t.dim() == 0 or host_ok:
                # PyTorch lets a CPU scalar tensor join an op on an accelerator: its value is an input
                host = host_transfers.host_array(t)
                operands.append(_operand((t, None, host)))
                self.arrays.append(host)
                key.append(("cpu", tuple(t.shape), t.dtype))
                return device_index
            raise device_mismatch(self.sig, f"tpu:{device_index or 0}", t.device)
        # a tensor at its storage's start (every op result) is found by its data pointer, cheaper to
        # read than its storage's
        buf = LIVE.get(t.data_ptr()) or LIVE.get(t.untyped_storage().data_ptr())
        if buf is None:
            if t.device.type != "tpu":
                raise device_mismatch(self.sig, f"tpu:{device_index or 0}", t.device)
            buf = buffer.buffer_of(t)  # raises its error for a storage hf_tpu did not create
        if device_index is not None and buf.device_index != device_index:
            raise device_mismatch(self.sig, f"tpu:{device_index}", f"tpu:{buf.device_index}")
        view, start = _keyed_view(_view_of(t, buf), buf.shape, buf.dtype)
        if start is not None:  # the program's last scalars, in the operands' order
            self.starts.append(start)
        operands.append(_operand((t, buf, view)))
        array = buf._array
        self.arrays.append(array)
        key.append((buf.shape, buf.dtype, view, array is None))
        return buf.device_index


# Scalar arguments that CPU kernels convert to the op's dtype with c10's overflow check
_CONVERTED_SCALARS = frozenset(("alpha", "value"))


def _convert_ints(sig, values, operands, scalars, key, ints):
    """The traced Python ints of an elementwise op, as PyTorch's CPU kernels take them: `alpha` and
    `value` converted into an integer op's dtype with c10's overflow check; any other int beyond int64
    (which PyTorch wraps as a uint64 tensor) modulo 2**64 in an integer op and as a float in a floating
    one. JAX would reject every int beyond int64 with its own OverflowError."""
    for j, k, name in ints:
        v = scalars[j]
        fits_int64 = -2**63 <= v < 2**63
        checked = name in _CONVERTED_SCALARS
        if (fits_int64 and not checked) or not operands:  # `x + 1`: the common case
            continue
        if checked:  # the kernel's dtype: its tensors', which the Scalar does not promote
            dtype = functools.reduce(torch.promote_types, [op.tensor.dtype for op in operands])
            if not (dtype.is_floating_point or dtype.is_complex):
                dtypes.check_fits(v, dtype)  # a bool kernel takes any int, as its truth value
                if not fits_int64:
                    scalars[j], key[k] = bool(v), bool
            elif not fits_int64:
                scalars[j], key[k] = float(v), float
            continue
        if all(op.tensor.dtype == torch.bool for op in operands):  # a uint64 tensor promotes with no bool
            raise RuntimeError("Promotion for uint16, uint32, uint64 types is not supported, attempted to "
                               "promote Bool and UInt64")
        compute = promotion(sig, values)
        if compute.is_floating_point or compute.is_complex:
            scalars[j], key[k] = float(v), float
        else:
            scalars[j] = (v + 2**63) % 2**64 - 2**63


def is_number(v) -> bool:
    return isinstance(v, (bool, int, float, complex))


def is_static_scalar(sig: Signature, i: int, v) -> bool:
    """A scalar that is compiled into the program rather than passed to it: one the lowering asked for
    as a Python value (always, or for the values it special-cases), or one equal to the schema's default
    (`alpha=1`), which is cheaper to bake in than to transfer on every call and does not vary in practice."""
    if not is_number(v):
        return False
    if sig.static_args[i]:
        return True
    values = sig.static_values[i]
    if values is not None and v in values and type(v) is not bool:
        return True
    default = sig.defaults[i]
    return default is not None and type(v) is type(default) and v == default


def promotion(sig: Signature, values: list):
    """The computation dtype for PyTorch's elementwise type promotion, or None."""
    low = sig.lowering
    if low.promote is None:
        return None
    participants = []
    for name, kind, v in zip(sig.names, sig.kinds, values):
        if name not in sig.inputs:  # an out= tensor receives the result, it does not promote
            continue
        if kind in (TENSOR, OPT_TENSOR) and isinstance(v, torch.Tensor):
            participants.append(torch.empty((0,) * v.dim(), dtype=v.dtype, device="meta"))
        elif kind in (SCALAR, TENSOR, OPT_TENSOR) and v is not None:
            participants.append(v)
    if not participants:
        return None
    compute, _ = elementwise_dtypes(*participants, type_promotion_kind=low.promote)
    return compute


# --- The call's values as PyTorch's own kernels take them: meta tensors for its shapes and errors,
# CPU tensors for the fallback.


def wrapped_numbers(values, sig: Signature, device):
    """Python numbers that PyTorch unwrapped from Tensor arguments, made acceptable to an OpOverload
    call again while promoting like wrapped numbers: floats and complex pass as they are (PyTorch
    wraps them), an int or bool becomes a 0-dim tensor of a dtype that does not change the result."""
    int_dtype = next(
        (v.dtype for kind, v in zip(sig.kinds, values)
         if kind in (TENSOR, OPT_TENSOR) and isinstance(v, torch.Tensor) and not v.dtype.is_floating_point
         and not v.dtype.is_complex and v.dtype != torch.bool),
        torch.int64,
    )
    out = []
    for kind, v in zip(sig.kinds, values):
        if kind in (TENSOR, OPT_TENSOR) and isinstance(v, bool):
            out.append(torch.tensor(v, device=device))
        elif kind in (TENSOR, OPT_TENSOR) and isinstance(v, int):
            out.append(torch.tensor(v, dtype=int_dtype, device=device))
        else:
            out.append(v)
    return out


def to_meta(values, sig: Signature):
    """The call with every tensor replaced by a meta tensor of the same layout."""

    def meta(t):
        if t is None or not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")

    out = []
    for kind, v in zip(sig.kinds, wrapped_numbers(values, sig, "meta")):
        if kind in (TENSOR, OPT_TENSOR):
            out.append(meta(v))
        elif kind == TENSOR_LIST:
            out.append([meta(t) for t in v])
        elif kind == GENERATOR:
            out.append(None)
        elif isinstance(v, torch.device):
            out.append(torch.device("meta"))
        else:
            out.append(v)
    return out


def call_with(sig: Signature, op, values):
    args, kwargs = [], {}
    for name, kw, v in zip(sig.names, sig.kwarg_only, values):
        if kw:
            kwargs[name] = v
        else:
            args.append(v)
    return op(*args, **kwargs)


def flatten_returns(result):
    if isinstance(result, (tuple, list)):
        return list(result)
    return [result]


def checked_by_assert(sig: Signature, error: AssertionError) -> RuntimeError:
    """Some of PyTorch's Python meta kernels and decompositions check arguments with `assert`
    (`embedding`'s 2-D weight); the C++ kernels they stand for raise RuntimeError."""
    return RuntimeError(f"{sig.name}: {error}")
