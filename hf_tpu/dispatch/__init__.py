"""The one entry point from PyTorch's dispatcher into the lowerings.

Every `tpu` kernel, and the PrivateUse1 fallback, is the C entry `_entry.entry(signature, ...)`:
it binds the call to the op's schema and launches strict eager's common calls itself; every other
call continues here, in `run_bound`, which builds a key from what decides the compiled code (op,
static arguments, shapes, dtypes and view layouts of the tensors, Python types of the scalars), and
runs the cached program for that key through the current execution mode. On a miss it asks PyTorch's meta kernel for the output shapes and
dtypes (which also raises PyTorch's own errors for bad input), and builds the program: read operands
through their views, promote, lower, cast to PyTorch's result dtypes, write mutated operands back.

In-place (`add_`) and `out=` (`add.out`) overloads run the lowering of their functional overload;
that derivation lives here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import threading
import typing
import warnings
import zlib

import jax
import jax.numpy as jnp
import torch
from torch._prims_common import elementwise_dtypes

from .. import counters, dtypes, platform
from .. import modes as _modes
from ..device import rng
from ..memory import buffer
from ..ops.registry import BACKEND_CHOICES, CPU_VIEW_KERNELS, KERNELS, LOWERINGS, Lowering
from . import _entry as _native
from . import index_checks

aten = torch.ops.aten
_counters = counters.counters

# --- Schemas, read once per op.

TENSOR, OPT_TENSOR, TENSOR_LIST, SCALAR, SCALAR_LIST, GENERATOR, STATIC = range(7)


def _kind(arg) -> int:
    t = str(arg.type)
    if t == "Tensor":
        return TENSOR
    if t == "Optional[Tensor]":
        return OPT_TENSOR
    if t in ("List[Tensor]", "List[Optional[Tensor]]"):
        return TENSOR_LIST
    if t == "number" or t == "Scalar":
        return SCALAR
    if t == "List[number]":  # Scalar[]: foreach ops' per-tensor scalars (an optimizer's step sizes): traced
        return SCALAR_LIST
    if t == "Optional[Generator]":
        return GENERATOR
    return STATIC


@dataclasses.dataclass
class Signature:
    """What dispatch needs to know about one OpOverload."""

    op: torch._ops.OpOverload
    names: tuple
    kinds: tuple
    kwarg_only: tuple  # per argument
    defaults: tuple
    mutated: tuple  # argument indices written by the op, in return order
    returns_mutated: tuple  # per return: index of the argument it aliases, or None
    lowering: Lowering | None
    kernel: object  # a storage kernel taking the bound values, or None
    index_check: object  # raises PyTorch's error for out-of-range indices (when checks are on), or None
    check: object  # the lowering's check of argument values (`Lowering.check`), or None
    functional: torch._ops.OpOverload | None  # for in-place/out= overloads: the op that computes
    returns_list: bool  # the op returns Tensor[] (its one return is a list)
    num_returns: int
    written: tuple | None  # for a variant writing arguments it does not return: each functional result's argument
    static_args: tuple  # per argument: True where the lowering asked for the Python value
    static_values: tuple  # per argument: the values compiled in when passed (Lowering.static_values), or None
    write_checks: tuple  # for a writing op: what it checks of the tensors it writes, see `_write_checks`
    inputs: frozenset  # the names of the arguments it computes from: all but an out= variant's outs
    default_keys: tuple  # per argument: its default's part of a call's key (`_hashable`), or None
    # the op in a call's key: an int, as an OpOverload hashes in Python (every eager op hashes its key,
    # every deferred flush the keys of all its ops)
    ident: int = dataclasses.field(default_factory=itertools.count().__next__)

    @property
    def plain(self) -> bool:
        """A lowered op that writes nothing and checks no argument: strict eager may launch its common
        calls from C (`_entry.c`)."""
        return (self.kernel is None and self.lowering is not None and self.check is None
                and self.index_check is None and not self.mutated)

    @functools.cached_property
    def native(self) -> tuple:
        """What the C entry reads of the signature on every call, in one tuple."""
        return self.names, self.defaults, self.kinds, self.default_keys, self.ident, self.plain

    @property
    def name(self) -> str:
        """`aten::add.Tensor`, or `aten::abs` for a default overload, as PyTorch's errors name ops."""
        overload = self.op._overloadname
        return self.op._schema.name + ("" if overload == "default" else f".{overload}")


def _functional_counterpart(op):
    """`add_.Tensor` -> `add.Tensor`, `add.out` -> `add.Tensor`: the overload whose values an
    in-place or out= overload writes."""
    schema = op._schema
    packet_name = op._schema.name.split("::")[1]
    out_names = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if packet_name.endswith("_") and not packet_name.endswith("__"):
        packet = getattr(aten, packet_name[:-1], None)
        if packet is None:
            return None
        overload = op._overloadname
        cand = getattr(packet, overload, None)
        if cand is not None and not cand._schema.is_mutable:
            return cand
        return None
    factory_args = {"dtype", "layout", "device", "pin_memory", "memory_format"}

    def signature_of(arguments):
        return [(a.name, str(a.type)) for a in arguments if a.name not in out_names and a.name not in factory_args]

    inputs = signature_of(schema.arguments)
    packet = getattr(aten, packet_name, None)
    if packet is None:
        return None
    for name in packet.overloads():
        cand = getattr(packet, name)
        if cand._schema.is_mutable:
            continue
        if signature_of(cand._schema.arguments) == inputs and len(cand._schema.returns) == len(out_names):
            return cand
    return None


def _written_args(args, mutated, returns_mutated, functional) -> tuple | None:
    """For a variant that writes arguments it does not return (foreach ops, fused optimizer steps, AMP's
    grad scaler), the argument each result of its functional form is written to, else None.
    Functionalization names those results after the arguments (`grads_out`); an unnamed or `self_out`
    one goes to `out` in an out= variant, to `self` in an in-place one."""
    if set(mutated) <= set(returns_mutated) or None in returns_mutated:
        return None
    position = {a.name: i for i, a in enumerate(args)}
    targets = []
    for result in functional._schema.returns:
        target = position.get(result.name[:-4]) if result.name.endswith("_out") else None
        if target not in mutated:
            target = next((position[n] for n in ("out", "self") if position.get(n) in mutated
                           and position[n] not in targets), None)
        if target is None or target in targets:
            return None
        targets.append(target)
    return tuple(targets) if set(targets) == set(mutated) else None


@functools.cache
def signature(op) -> Signature:
    schema = op._schema
    args = schema.arguments
    mutated = [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
    returns_mutated = []
    for r in schema.returns:
        alias = None
        if r.alias_info is not None:
            for i in mutated:
                if args[i].alias_info.before_set == r.alias_info.before_set:
                    alias = i
        returns_mutated.append(alias)
    functional = None
    low = LOWERINGS.get(op)
    if low is None and mutated:
        functional = _functional_counterpart(op)
        if functional is not None:
            low = LOWERINGS.get(functional)
    return Signature(
        op=op,
        names=tuple(a.name for a in args),
        kinds=tuple(SCALAR if low is not None and a.name in low.traced and str(a.type) == "float" else _kind(a)
                    for a in args),
        kwarg_only=tuple(a.kwarg_only for a in args),
        defaults=tuple(a.default_value if a.has_default_value() else None for a in args),
        mutated=tuple(mutated),
        returns_mutated=tuple(returns_mutated),
        lowering=low,
        kernel=KERNELS.get(op),
        index_check=index_checks.check_for(op),
        check=low.check if low is not None else None,
        functional=functional,
        returns_list=len(schema.returns) == 1 and str(schema.returns[0].type) == "List[Tensor]",
        num_returns=len(schema.returns),
        written=_written_args(args, mutated, returns_mutated, functional) if functional is not None else None,
        static_args=tuple(low is not None and a.name in low.static for a in args),
        static_values=tuple(dict(low.static_values).get(a.name) if low is not None else None for a in args),
        write_checks=_write_checks(op, low),
        inputs=frozenset(a.name for a in (functional or op)._schema.arguments),
        default_keys=tuple(_hashable(a.default_value) if a.has_default_value() else None for a in args),
    )


# --- Analysing one call.


class _Operand(typing.NamedTuple):
    """A tensor argument as the program sees it: its buffer and how it is viewed."""

    tensor: torch.Tensor
    buf: buffer.Buffer | None
    view: object


# every op builds one per tensor argument: tuple.__new__ skips the NamedTuple's Python-level __new__
_operand = functools.partial(tuple.__new__, _Operand)


_LIVE = buffer.allocator.live
_analyse_common = _native.analyse
_allocate = buffer.allocator.new_tensor
_matmul_precision = torch._C._get_float32_matmul_precision
_view_of = buffer.view_of


def _device_mismatch(sig, a, b) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! "
        f"(when checking arguments for {sig.name})"
    )


class _Call:
    """One op call split into operands, scalars and a hashable key."""

    __slots__ = ("sig", "values", "operands", "arrays", "scalars", "key", "device_index", "rng")

    def __init__(self, sig: Signature, values: list, analysed=None):
        self.sig = sig
        self.values = values
        self.scalars = []
        self.rng = False
        # the float32 matmul precision is read while a program is traced, so it decides the program
        precision = _matmul_precision()
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
                elif _is_static_scalar(sig, i, v):
                    key.append(_hashable(v))
                else:  # a Python number PyTorch wrapped as a tensor: a scalar here
                    if type(v) is int:
                        ints.append((len(scalars), len(key), sig.names[i]))
                    scalars.append(v)
                    key.append(type(v))
            elif kind == STATIC:
                key.append(_hashable(v))
            elif kind == SCALAR:
                default = sig.defaults[i]  # the schema's default (alpha=1) first: the common case
                if (type(v) is type(default) and v == default) or _is_static_scalar(sig, i, v):
                    key.append(_hashable(v))
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
        self.key = tuple(key)
        self.device_index = device_index

    def _operand(self, t, operands, key, device_index, host_ok=False):
        if t.is_cpu:
            if t.dim() == 0 or host_ok:
                # PyTorch lets a CPU scalar tensor join an op on an accelerator: its value is an input
                host = buffer.host_array(t)
                operands.append(_operand((t, None, host)))
                self.arrays.append(host)
                key.append(("cpu", tuple(t.shape), t.dtype))
                return device_index
            raise _device_mismatch(self.sig, f"tpu:{device_index or 0}", t.device)
        # a tensor at its storage's start (every op result) is found by its data pointer, cheaper to
        # read than its storage's
        buf = _LIVE.get(t.data_ptr()) or _LIVE.get(t.untyped_storage().data_ptr())
        if buf is None:
            if t.device.type != "tpu":
                raise _device_mismatch(self.sig, f"tpu:{device_index or 0}", t.device)
            buf = buffer.buffer_of(t)  # raises its error for a storage hf_tpu did not create
        if device_index is not None and buf.device_index != device_index:
            raise _device_mismatch(self.sig, f"tpu:{device_index}", f"tpu:{buf.device_index}")
        view = _view_of(t, buf)
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
        compute = _promotion(sig, values)
        if compute.is_floating_point or compute.is_complex:
            scalars[j], key[k] = float(v), float
        else:
            scalars[j] = (v + 2**63) % 2**64 - 2**63


def _is_number(v) -> bool:
    return isinstance(v, (bool, int, float, complex))


def _is_static_scalar(sig: Signature, i: int, v) -> bool:
    """A scalar that is compiled into the program rather than passed to it: one the lowering asked for
    as a Python value (always, or for the values it special-cases), or one equal to the schema's default
    (`alpha=1`), which is cheaper to bake in than to transfer on every call and does not vary in practice."""
    if not _is_number(v):
        return False
    if sig.static_args[i]:
        return True
    values = sig.static_values[i]
    if values is not None and v in values and type(v) is not bool:
        return True
    default = sig.defaults[i]
    return default is not None and type(v) is type(default) and v == default


def _wrapped_numbers(values, sig: Signature, device):
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


def _hashable(v):
    """A key for a value compiled into a program. Numbers are typed (2, 2.0 and True promote
    differently, yet are equal in Python) and floats exact (0.0 and -0.0 differ; a NaN equals itself)."""
    kind = type(v)
    if kind is int:
        return v
    if kind is float:
        return float, v.hex()
    if kind is bool:
        return bool, v
    if kind is complex:
        return complex, v.real.hex(), v.imag.hex()
    if kind is list:
        return tuple(_hashable(x) for x in v)
    if kind is torch.device:
        return str(v)
    return v


# --- Programs: what one key compiles to.


_RNG = object()  # placeholder for the PRNG key in a template


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index


@dataclasses.dataclass
class Program:
    """The pure function computing one op call's results from its operands' buffers."""

    fn: object  # (arrays, scalars, rng_key) -> list of arrays
    name: str  # the op's, as `aten::add.Tensor`
    out_specs: tuple | None  # per return: (shape, torch dtype) or ("mutated", operand, shape, jax dtype)
    device_index: int | None
    jitted: object = None
    positional: bool = False  # `jitted` takes the arrays as arguments and returns the one result
    jitted_donating: object = None  # the same program taking the overwritten operands' arrays as donations
    # output shapes depend on the data (nonzero, masked_select, unique): run on concrete arrays,
    # a sync point, and take the specs from the results
    data_dependent: bool = False
    # per schema return: False where PyTorch returns an undefined tensor (None)
    defined: tuple = ()
    # (shape, dtype) of the one new tensor that is all the op returns (`a + b`): returned without the
    # general path's loop over results
    only_result: tuple | None = None
    # (jitted, shape, dtype) where strict eager launches the program with its arrays alone and makes
    # its one new tensor: the C entry's whole work for a common call (`_entry.c`)
    direct: tuple | None = None

    @functools.cached_property
    def content_hash(self) -> int:
        """32 bits of the op and its results' shapes, the same in every process (deferred cut points)."""
        return zlib.crc32(f"{self.name} {self.out_specs}".encode())

    @functools.cached_property
    def some_undefined(self) -> bool:
        return not all(self.defined)

    @functools.cached_property
    def overwritten(self) -> tuple:
        """The operand slots whose buffers the results overwrite (in-place and out= ops), ascending."""
        return tuple(sorted({spec[1] for spec in self.out_specs or () if spec[0] == "mutated"}))


def _to_meta(values, sig: Signature):
    """The call with every tensor replaced by a meta tensor of the same layout."""

    def meta(t):
        if t is None or not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")

    out = []
    for kind, v in zip(sig.kinds, _wrapped_numbers(values, sig, "meta")):
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


def _call_with(sig: Signature, op, values):
    args, kwargs = [], {}
    for name, kw, v in zip(sig.names, sig.kwarg_only, values):
        if kw:
            kwargs[name] = v
        else:
            args.append(v)
    return op(*args, **kwargs)


def _flatten_returns(result):
    if isinstance(result, (tuple, list)):
        return list(result)
    return [result]


def _out_specs(call: _Call):
    """Shapes and dtypes of the results, from PyTorch's meta kernel (and its errors for bad input)."""
    sig = call.sig
    if sig.lowering is not None and sig.lowering.own_shapes:
        return None
    meta_values = _to_meta(call.values, sig)
    # factory ops take device=tpu: meta needs device=meta
    for i, name in enumerate(sig.names):
        if name == "device" and meta_values[i] is not None:
            meta_values[i] = torch.device("meta")
    try:
        result = _call_with(sig, sig.op, meta_values)
    except NotImplementedError:
        return None  # no meta kernel: the lowering's own shapes are used
    except AssertionError as e:
        raise _checked_by_assert(sig, e) from e
    return [None if r is None else (tuple(r.shape), r.dtype) for r in _flatten_returns(result)]


# How PyTorch's CPU kernels take an out= tensor of another dtype than the result. Most cast to it, the
# elementwise ones with type promotion only when the cast is safe (TensorIterator). These functional
# ops or overloads want the result's dtype exactly: structured kernels' outputs, and the elementwise
# ops TensorIterator builds with check_all_same_dtype (`neg`, `clamp` of Python numbers).
_OUT_EXACT_DTYPE = frozenset((
    "abs", "sign", "sgn", "floor", "ceil", "round", "trunc", "frac", "neg", "bitwise_not", "nan_to_num", "where",
    "conj_physical", "clamp.default", "clamp_min.default", "clamp_max.default", "heaviside",
    "mm", "bmm", "addmm", "baddbmm", "mv", "gather", "index_select", "index_add", "index_copy", "take",
    "scatter.src", "scatter.value", "scatter_add", "scatter_reduce.two", "masked_select", "nonzero",
    "sort", "sort.stable", "topk", "max.dim", "min.dim", "amax", "amin", "aminmax", "all", "any", "isin",
    "tril", "triu",
    "slice_scatter", "_softmax", "_log_softmax", "logcumsumexp", "linalg_vector_norm", "linalg_cross",
    "renorm", "searchsorted", "bucketize", "multinomial", "histc", "softplus", "softshrink", "hardshrink",
    "gelu", "avg_pool3d", "_linalg_eigh", "_linalg_solve_ex", "linalg_lu_solve", "linalg_ldl_solve",
    "linalg_solve_triangular", "ormqr", "complex",
))


def _check_out_dtypes(call: _Call):
    """Raise PyTorch's error for an out= tensor whose dtype the CPU kernel would not write (PyTorch's
    meta kernels leave most of these checks to the kernels)."""
    sig = call.sig
    meta_values = _to_meta(call.values, sig)
    try:
        results = _flatten_returns(sig.functional(**{n: v for n, v in zip(sig.names, meta_values) if n in sig.inputs}))
    except NotImplementedError:  # no meta kernel
        return
    name = sig.functional._schema.name.split("::")[1]
    overload = sig.functional._overloadname
    exact = name in _OUT_EXACT_DTYPE or f"{name}.{overload}" in _OUT_EXACT_DTYPE
    elementwise = sig.lowering.promote is not None
    for result, i in zip(results, sig.returns_mutated):
        out = None if i is None else call.values[i]
        if result is None or not isinstance(out, torch.Tensor) or out.dtype == result.dtype:
            continue
        want, got = dtypes.scalar_type_name(result.dtype), dtypes.scalar_type_name(out.dtype)
        if exact:
            raise RuntimeError(f"{sig.name}: expected out tensor to have dtype {want}, but got {got} instead")
        if elementwise and not torch.can_cast(result.dtype, out.dtype):
            raise RuntimeError(f"{sig.name}: result type {want} can't be cast to the desired output type {got}")


def _promotion(sig: Signature, values: list):
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


def _template(call: _Call):
    """The call's values with tensors, scalars and the generator replaced by placeholders."""
    sig = call.sig
    t_index = 0
    s_index = 0
    template = []
    for i, (kind, v) in enumerate(zip(sig.kinds, call.values)):
        if kind in (TENSOR, OPT_TENSOR) and not _is_number(v):
            if v is None:
                template.append(None)
            else:
                template.append(_Slot(t_index))
                t_index += 1
        elif kind == TENSOR_LIST:
            items = []
            for t in v:
                if t is None:
                    items.append(None)
                else:
                    items.append(_Slot(t_index))
                    t_index += 1
            template.append(items)
        elif kind == SCALAR_LIST:
            template.append(("scalar", s_index))
            s_index += 1
        elif kind in (SCALAR, TENSOR, OPT_TENSOR):  # a Scalar, or a number in a Tensor argument
            if _is_static_scalar(sig, i, v):
                template.append(v)
            else:
                template.append(("scalar", s_index))
                s_index += 1
        elif kind == GENERATOR:
            template.append(_RNG)
        else:
            template.append(v)
    return template


def _build(call: _Call) -> Program:
    sig = call.sig
    low = sig.lowering
    if low.type_check is not None:
        low.type_check(call.values)
    specs = _out_specs(call)
    compute_dtype = _promotion(sig, call.values)
    template = _template(call)
    views = [op.view if op.buf is not None else None for op in call.operands]
    blank = [(op.buf.shape, dtypes.to_jax(op.buf.dtype)) if op.buf is not None else None for op in call.operands]
    names = sig.names
    slot_of_arg = {}
    first_slot = {}  # per tensor or Tensor[] argument: the operand slot of its (first) tensor
    t_index = 0
    for i, (kind, v) in enumerate(zip(sig.kinds, call.values)):
        if kind in (TENSOR, OPT_TENSOR) and isinstance(v, torch.Tensor):
            slot_of_arg[i] = first_slot[i] = t_index
            t_index += 1
        elif kind == TENSOR_LIST:
            first_slot[i] = t_index
            t_index += sum(t is not None for t in v)
    # per operand: the buffer's shape where the lowering takes it as `buffer.Transposed`, else None
    transposed = [None] * len(call.operands)
    if compute_dtype is None:
        for i, k in slot_of_arg.items():
            op = call.operands[k]
            if names[i] in low.transposed and op.buf is not None and buffer.swaps_last_two(op.view, op.buf.shape, op.buf.dtype):
                transposed[k] = op.buf.shape
    returns_mutated = sig.returns_mutated
    is_out_variant = sig.functional is not None and not sig.op._schema.name.endswith("_")
    if is_out_variant and sig.written is None:
        _check_out_dtypes(call)
    lowered_schema = (sig.functional or sig.op)._schema
    lowered_params = [(a.name, a.kwarg_only) for a in lowered_schema.arguments]
    jax_compute = dtypes.to_jax(compute_dtype) if compute_dtype is not None else None
    written_slots = _written_slots(call, first_slot)
    operand_dtypes = [op.tensor.dtype for op in call.operands]  # not the call: a program outlives its tensors

    def fn(arrays, scalars, rng_data):
        rng_key = rng.key_from_data(rng_data) if rng_data is not None else None
        arrays = [jnp.zeros(*blank[i]) if a is None else a for i, a in enumerate(arrays)]
        vals = [buffer.read(a, v) if whole is None else buffer.Transposed(a.reshape(whole))
                for a, v, whole in zip(arrays, views, transposed)]
        if jax_compute is not None:
            vals = [v.astype(jax_compute) if _promotable(v) else v for v in vals]

        def fill(x):
            if isinstance(x, _Slot):
                return vals[x.index]
            if isinstance(x, list):
                return [fill(y) for y in x]
            if isinstance(x, tuple) and len(x) == 2 and x[0] == "scalar":
                return scalars[x[1]]
            if x is _RNG:
                return rng_key
            return x

        by_name = {name: fill(x) for i, (name, x) in enumerate(zip(names, template))
                   if name in sig.inputs}
        # the lowering is written against the schema it was registered for: bind by name, since an
        # in-place variant may order its arguments differently (polygamma_(self, n) / polygamma(n, self))
        args = [by_name[name] for name, kw in lowered_params if not kw and name in by_name]
        kwargs = {name: by_name[name] for name, kw in lowered_params if kw and name in by_name}
        try:
            result = _flatten_returns(low.fn(*args, **kwargs))
        except (TypeError, ValueError) as e:
            if isinstance(e, _DATA_DEPENDENT_ERRORS) or not _raised_by_library(e):
                raise
            raise _lowering_error(sig.name, operand_dtypes, e) from e
        if written_slots is not None:  # each result (a list's elements one by one) overwrites its argument
            result = [r for x in result for r in (x if isinstance(x, (list, tuple)) else [x])]
            written = {}  # elements may be views of one buffer: their writes compose
            for (k, base, dtype), r in zip(written_slots, result):
                written[base] = buffer.write(written.get(base, arrays[k]), views[k], dtypes.cast(jnp.asarray(r), dtype))
            return [written[base] for _, base, _ in written_slots]
        outs = []
        for j, r in enumerate(result):
            if specs is not None and specs[j] is None:  # an undefined result (e.g. a masked-off gradient)
                continue
            r = jnp.asarray(r)
            if specs is not None:
                shape, dtype = specs[j]
                r = dtypes.cast(r, dtypes.to_jax(dtype))
                if r.shape != shape:
                    r = jnp.broadcast_to(r, shape)
            target = returns_mutated[j] if j < len(returns_mutated) else None
            if target is not None:
                k = slot_of_arg[target]
                r = buffer.write(arrays[k], views[k], r)
            outs.append(r)
        return outs

    if written_slots is not None:
        return Program(fn=fn, name=call.sig.name, device_index=call.device_index,
                       out_specs=tuple(("mutated", k, *blank[k]) for k, _, _ in written_slots))
    if specs is None:
        try:
            specs = _eval_specs(fn, call)
        except _DATA_DEPENDENT_ERRORS:
            return Program(fn=fn, name=call.sig.name, out_specs=None, device_index=call.device_index,
                           data_dependent=True)
    out_specs = []
    for j, spec in enumerate(specs):
        target = returns_mutated[j] if j < len(returns_mutated) else None
        if spec is not None or target is not None:
            if target is None:
                out_specs.append(spec)
            else:  # the written buffer's whole array comes back
                out_specs.append(("mutated", slot_of_arg[target], *blank[slot_of_arg[target]]))
    program_returns = tuple(spec is not None or returns_mutated[j] is not None for j, spec in enumerate(specs))
    one_new = sig.num_returns == 1 and not sig.returns_list and len(out_specs) == 1 and out_specs[0][0] != "mutated"
    return Program(fn=fn, name=call.sig.name, out_specs=tuple(out_specs), device_index=call.device_index,
                   defined=program_returns, only_result=out_specs[0] if one_new else None)


def _written_slots(call: _Call, first_slot: dict):
    """For an op writing arguments it does not return (`Signature.written`): (operand slot, slot of the
    first operand sharing its buffer, jax dtype) of each tensor it writes, in its functional form's
    result order, else None."""
    sig = call.sig
    if sig.written is None:
        return None
    slots = []
    for i in sig.written:
        tensors = call.values[i] if sig.kinds[i] == TENSOR_LIST else [call.values[i]]
        slots.extend((first_slot[i] + j, t) for j, t in enumerate(tensors))
    base_of = {}
    for k, _ in slots:
        base_of.setdefault(id(call.operands[k].buf), k)
    return [(k, base_of[id(call.operands[k].buf)], dtypes.to_jax(t.dtype)) for k, t in slots]


_DATA_DEPENDENT_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.NonConcreteBooleanIndexError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _raised_by_library(error: Exception) -> bool:
    """Whether the error was raised in JAX or NumPy under a lowering, not by hf_tpu itself."""
    frame = error.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    return not frame.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR)


_DTYPE_WORDS = ("dtype", "data type", "integer", "inexact", "floating")


def _lowering_error(op_name: str, operand_dtypes: list, error: Exception) -> Exception:
    """PyTorch's exception type for what JAX rejected under a lowering. An operand's dtype (`bitwise_and`
    of floats, a shift of bools) is the case where PyTorch's CPU kernel has no code for that dtype:
    NotImplementedError, naming the op and dtypes. Any other argument JAX rejects (a negative
    dilation) is a kernel's argument check: RuntimeError."""
    message = str(error)
    if not any(word in message for word in _DTYPE_WORDS):
        return RuntimeError(f"{op_name}: {message}")
    names = dict.fromkeys(map(dtypes.scalar_type_name, operand_dtypes))
    return NotImplementedError(
        f'"{op_name}" not implemented for {", ".join(map(repr, names))} on tpu ({message}). '
        "See docs/compatibility.md."
    )


def _promotable(v) -> bool:
    return jnp.issubdtype(v.dtype, jnp.number) or v.dtype == jnp.bool_


def _eval_specs(fn, call):
    """Trace `fn` on the operands' shapes and dtypes only: no value is read, nothing is flushed."""
    arrays = [
        None if op.buf is None or op.buf.array is None
        else jax.ShapeDtypeStruct(op.buf.shape, dtypes.to_jax(op.buf.dtype))
        for op in call.operands
    ]
    arrays = [op.view if op.buf is None else a for op, a in zip(call.operands, arrays)]
    scalars = call.scalars
    key = rng.example_key() if call.rng else None
    shapes = jax.eval_shape(fn, arrays, scalars, key)
    return [(tuple(s.shape), dtypes.to_torch(s.dtype)) for s in shapes]


# --- Execution modes plug in here.


_PROGRAMS: dict = {}


# How PyTorch's CPU kernels check a written tensor against the op's other tensors. In-place ops may not
# write through an expanded (stride 0) tensor, except these, which write one value per memory location.
_WRITES_ALLOWED_ON_EXPANDED = frozenset(("fill", "zero", "masked_fill", "masked_scatter", "index_fill", "index_put",
                                         "_index_put_impl", "index_copy", "put"))
# These index, gather and concatenation kernels reject any overlap of the written tensor with another
# operand (at::assert_no_overlap), even a full one: `x.index_fill_(0, x, 1)`, `torch.cat([a, b], out=a)`.
_REJECTS_ANY_OVERLAP = frozenset(("index_add", "index_copy", "index_fill", "index_reduce", "index_put",
                                  "_index_put_impl", "put", "scatter", "scatter_add", "scatter_reduce", "gather",
                                  "index_select", "take", "masked_select", "cat", "stack"))
# Elementwise kernels (TensorIterator), copy_ and the scans reject only a partial overlap: `x.add_(x)`
# reads each element before writing it. So does gather for its index (at::assert_no_partial_overlap).
_REJECTS_PARTIAL_OVERLAP = frozenset(("copy", "cumsum", "cumprod", "where"))
_MAY_OVERLAP_WHOLLY = {"gather": ("index",)}


def _write_checks(op, low: Lowering | None) -> tuple:
    """(expanded writes allowed, overlap rejected: "any", "partial" or None, the positions of arguments
    an "any" op lets overlap the written tensor wholly) for a writing op."""
    name = op._schema.name.split("::")[1].rstrip("_")
    if name in _REJECTS_ANY_OVERLAP:
        overlap = "any"
    elif name in _REJECTS_PARTIAL_OVERLAP or (low is not None and low.promote is not None):
        overlap = "partial"
    else:
        overlap = None
    names = [a.name for a in op._schema.arguments]
    wholly = tuple(names.index(n) for n in _MAY_OVERLAP_WHOLLY.get(name, ()))
    return name in _WRITES_ALLOWED_ON_EXPANDED, overlap, wholly


def _check_writable(call: _Call):
    expanded_ok, overlap, wholly = call.sig.write_checks
    for i in call.sig.mutated:
        v = call.values[i]
        if not isinstance(v, torch.Tensor):
            continue
        if not expanded_ok and any(n > 1 and s == 0 for n, s in zip(v.shape, v.stride())):
            raise RuntimeError(
                "unsupported operation: more than one element of the written-to tensor refers to a "
                "single memory location. Please clone() the tensor before performing the operation."
            )
        if overlap is not None:
            _check_no_overlap(v, call.operands, overlap == "any", [call.values[k] for k in wholly] if wholly else ())


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some order of its dims is contiguous."""
    expected = 1
    for stride, n in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= n
    return True


def _check_no_overlap(written: torch.Tensor, operands, full_too: bool, wholly_ok=()):
    """Raise PyTorch's error when another operand shares memory with the written tensor (its own
    operand, the first one that is it, aside): computed functionally here, the op would give the answer
    of a clone, where CPU and CUDA raise. PyTorch's rules (at::get_overlap_status): only dense tensors
    are compared, and equal byte ranges overlap fully when the strides are equal too, partially when
    not; a full overlap is an error only with `full_too`, and never for the tensors in `wholly_ok`."""
    buf = next((op.buf for op in operands if op.tensor is written), None)
    if buf is None or not written.numel():
        return
    own_skipped = False
    for op in operands:
        other = op.tensor
        if other is written and not own_skipped:
            own_skipped = True
            continue
        if op.buf is not buf or not other.numel():
            continue
        if other is written:
            full = True
        elif not (_dense(written) and _dense(other)):
            continue
        else:
            begin, other_begin = written.data_ptr(), other.data_ptr()
            end = begin + written.numel() * written.element_size()
            other_end = other_begin + other.numel() * other.element_size()
            if (begin, end) == (other_begin, other_end):
                full = written.stride() == other.stride()
            elif begin < other_end and other_begin < end:
                full = False
            else:
                continue
        if not full or (full_too and not any(other is t for t in wholly_ok)):
            raise RuntimeError(
                "unsupported operation: some elements of the input tensor and the written-to tensor refer "
                "to a single memory location. Please clone() the tensor before performing the operation."
            )


def run_lowered(sig: Signature, values: list, analysed=None):
    """Run an op that has a lowering (directly or through its functional overload)."""
    if sig.check is not None:
        sig.check(values)
    if sig.index_check is not None and index_checks.enabled():
        sig.index_check(values)
    call = _Call(sig, values, analysed)
    if sig.mutated:
        _check_writable(call)
        if _resize_outs(call):  # PyTorch checks the out= tensors it resized (sharing their storage still)
            _check_writable(call)
    mode = _modes._current[0]
    program = _PROGRAMS.get(call.key)
    new = program is None
    if new:
        program = _build(call)
        if not program.data_dependent and mode.name == "DEFER_AND_FUSE":
            # trace once now, so a lowering's error surfaces at the user's op, not at a later flush
            _eval_specs(program.fn, call)
    _counters["ops_dispatched"] += 1
    device_index = call.device_index
    if device_index is None:
        device_index = _factory_device(sig, values)
    rng_key = _modes.random_key(device_index, _generator_arg(sig, values)) if call.rng else None
    if program.data_dependent:
        _modes.host_read(f"{sig.name} has a data-dependent output shape")
        concrete = [op.buf.value() if op.buf is not None else op.view for op in call.operands]
        if buffer.sharded_arrays_exist:
            concrete = buffer.place_together(concrete)
        results = program.fn(concrete, call.scalars, rng_key)
        out_specs = [(tuple(r.shape), dtypes.to_torch(r.dtype)) for r in results]
    else:
        arrays = call.arrays
        if buffer.sharded_arrays_exist:  # a sharded tensor (hf_tpu.distributed) may meet single-chip ones
            arrays = buffer.place_together(arrays)
        results = mode.execute(program, call.key, arrays, call.scalars, rng_key, device_index)
        out_specs = program.out_specs
    if new:  # kept once it has run: a lowering that rejects its arguments raises in every mode
        _PROGRAMS[call.key] = program
    only = program.only_result
    if only is not None:
        return _allocate(only[0], only[1], device_index, results[0])[0]
    outputs = []
    for spec, array in zip(out_specs, results):
        if spec[0] == "mutated":
            operand = call.operands[spec[1]]
            operand.buf.array = array
            outputs.append(operand.tensor)
        else:  # spec[0] is a tuple of ints already: straight to the allocator
            outputs.append(_allocate(spec[0], spec[1], device_index, array)[0])
    if sig.written is not None:  # it returns the arguments it wrote that its schema returns, if any
        returned = [values[i] for i in sig.returns_mutated]
        return None if not returned else returned[0] if len(returned) == 1 else tuple(returned)
    if program.some_undefined:
        produced = iter(outputs)
        outputs = [next(produced) if defined else None for defined in program.defined]
    if sig.returns_list:
        return outputs
    if sig.num_returns == 1:
        return outputs[0]
    if sig.num_returns == 0:
        return None
    return tuple(outputs)


def _generator_arg(sig, values):
    for kind, v in zip(sig.kinds, values):
        if kind == GENERATOR:
            return v
    return None


def _factory_device(sig: Signature, values) -> int:
    for name, v in zip(sig.names, values):
        if name == "device" and v is not None:
            return current_index_for(torch.device(v))
    return current_device_index()


_current_device = [0]


def current_device_index() -> int:
    return _current_device[0]


def current_index_for(device: torch.device) -> int:
    index = device.index if device.index is not None else _current_device[0]
    platform.jax_device(index)  # raises a clear error for a chip that does not exist
    return index


def _resize_outs(call: _Call) -> bool:
    """out= tensors of the wrong shape are resized first, as PyTorch does. Whether any was."""
    sig = call.sig
    if sig.functional is None or sig.op._schema.name.endswith("_"):
        return False
    specs = _out_specs(call)
    if specs is None:
        return False
    resized = False
    for j, target in enumerate(sig.returns_mutated):
        if target is None:
            continue
        out = call.values[target]
        shape = specs[j][0]
        if tuple(out.shape) != shape:
            out.resize_(shape)
            resized = True
    # operands changed: analyse again
    fresh = _Call(sig, call.values)
    call.operands, call.arrays, call.key = fresh.operands, fresh.arrays, fresh.key
    return resized


# --- Ops with no lowering: PyTorch's decompositions, then the CPU fallback.


def _cpu_fallback_enabled() -> bool:
    return os.environ.get("HF_TPU_CPU_FALLBACK", "1") != "0"


def describe_call(sig: Signature, values) -> str:
    parts = []
    for name, v in zip(sig.names, values):
        if isinstance(v, torch.Tensor):
            parts.append(f"{name}: {str(v.dtype).replace('torch.', '')}{list(v.shape)} on {v.device}")
        elif isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
            parts.append(f"{name}: [{', '.join(str(t.dtype).replace('torch.', '') + str(list(t.shape)) for t in v)}]")
    return ", ".join(parts)


def unsupported(sig: Signature, values) -> NotImplementedError:
    return NotImplementedError(
        f"The operator '{sig.name}' has no tpu lowering yet ({describe_call(sig, values)}). "
        "Set HF_TPU_CPU_FALLBACK=1 to run it on the CPU (slow: data moves to the host and back), "
        "and see docs/compatibility.md for what is supported."
    )


_warned_fallbacks: set = set()


def cpu_fallback(sig: Signature, values):
    """Run the op on the CPU: operands to the host, results (and in-place writes) back to `tpu`."""
    _modes.current().sync("cpu fallback " + sig.name)
    name = sig.name
    _counters["cpu_fallbacks"][name] += 1
    if name not in _warned_fallbacks:
        _warned_fallbacks.add(name)
        warnings.warn(
            f"The operator '{name}' has no tpu lowering; it runs on the CPU (data moves to the host and "
            "back). Set HF_TPU_CPU_FALLBACK=0 to raise instead.",
            stacklevel=3,
        )
    device_index = None

    def to_cpu(v):
        nonlocal device_index
        if isinstance(v, torch.Tensor) and v.device.type == "tpu":
            device_index = v.device.index
            return v.cpu()
        if isinstance(v, (list, tuple)):
            return type(v)(to_cpu(x) for x in v)
        if isinstance(v, torch.device) and v.type == "tpu":
            device_index = current_index_for(v)
            return torch.device("cpu")
        return v

    cpu_values = [to_cpu(v) for v in _wrapped_numbers(values, sig, "cpu")]
    if device_index is None:
        device_index = current_device_index()
    result = _call_with(sig, sig.op, cpu_values)
    for i in sig.mutated:  # a written Tensor[] (a fused optimizer's lists) element by element
        written = zip(values[i], cpu_values[i]) if sig.kinds[i] == TENSOR_LIST else [(values[i], cpu_values[i])]
        for target, value in written:
            if target is None:
                continue
            if target.shape != value.shape:
                target.resize_(value.shape)
            target.copy_(value)
    returns = _flatten_returns(result) if sig.op._schema.returns else []
    outs = []
    for j, r in enumerate(returns):
        target = sig.returns_mutated[j] if j < len(sig.returns_mutated) else None
        if target is not None:
            outs.append(values[target])
        elif isinstance(r, torch.Tensor):
            outs.append(r.to(f"tpu:{device_index}"))
        else:
            outs.append(r)
    if not sig.op._schema.returns:
        return None
    if len(sig.op._schema.returns) == 1 and not isinstance(result, (tuple, list)):
        return outs[0]
    return type(result)(outs) if isinstance(result, tuple) else outs


_decomposing = threading.local()


@functools.cache
def _decompositions() -> dict:
    """PyTorch's ATen-to-ATen decompositions (not the `torch._refs` ones, which lower to prims)."""
    from torch._decomp import decomposition_table

    return {op: fn for op, fn in decomposition_table.items() if fn.__module__.startswith("torch._decomp")}


def _checked_by_assert(sig: Signature, error: AssertionError) -> RuntimeError:
    """Some of PyTorch's Python meta kernels and decompositions check arguments with `assert`
    (`embedding`'s 2-D weight); the C++ kernels they stand for raise RuntimeError."""
    return RuntimeError(f"{sig.name}: {error}")


def run_unlowered(sig: Signature, values):
    decomp = _decompositions().get(sig.op)
    active = getattr(_decomposing, "ops", None)
    if active is None:
        active = _decomposing.ops = set()
    if decomp is not None and sig.op not in active:
        active.add(sig.op)
        try:
            return _call_with(sig, decomp, values)
        except AssertionError as e:
            raise _checked_by_assert(sig, e) from e
        finally:
            active.discard(sig.op)
    if _cpu_fallback_enabled():
        return cpu_fallback(sig, values)
    raise unsupported(sig, values)


def run_bound(sig: Signature, values: list, analysed=None):
    """An op with its arguments bound: where the C entry (`_entry.c`) hands every call it does not
    launch itself, with its analysis of the call if it made one (see `_Call`)."""
    if sig.kernel is not None:
        return sig.kernel(sig, values)
    if sig.lowering is not None:
        return run_lowered(sig, values, analysed)
    return run_unlowered(sig, values)


# --- Registration with PyTorch's dispatcher.

_libraries: list = []


def _is_composite_implicit(op) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _derived_variants(functional):
    """The in-place and out= overloads that compute through `functional`."""
    name = functional._schema.name.split("::")[1]
    for packet_name in (name, name + "_"):
        packet = getattr(aten, packet_name, None)
        if packet is None:
            continue
        for overload_name in packet.overloads():
            overload = getattr(packet, overload_name)
            if overload._schema.is_mutable and _functional_counterpart(overload) == functional:
                sig = signature(overload)
                if sig.written is None and not set(sig.mutated) <= set(sig.returns_mutated):
                    continue  # writes that cannot be matched to results: left to the fallback
                yield overload


def _kernel(sig: Signature):
    # the C entry, bound to the signature and what it reads of it
    return functools.partial(_native.entry, sig, sig.native)


_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _cpu_view_kernel(op):
    # a partial of the C++ redispatch: no Python frame between PyTorch's dispatcher and its CPU kernel
    return functools.partial(op._handle.redispatch_boxed, _CPU)


def _fallback(op, *args, **kwargs):
    sig = signature(op)
    return _native.entry(sig, sig.native, *args, **kwargs)


def register_kernels() -> None:
    """Register a tpu kernel for every op with a lowering (and its derived variants) or a storage
    kernel, PyTorch's CPU kernel for the view ops that only compute sizes and strides, and the backend
    choices of composite ops; everything else reaches the same entry point through the PrivateUse1
    fallback."""
    ops = set(KERNELS)
    for functional in LOWERINGS:
        if not _is_composite_implicit(functional):
            ops.add(functional)
        ops.update(_derived_variants(functional))
    libraries = {}  # namespace -> Library: aten, and hf_tpu's own custom ops
    for op in sorted(ops, key=str):
        if op in LOWERINGS and op not in KERNELS and _is_composite_implicit(op):
            continue
        namespace = op.namespace
        if namespace not in libraries:
            libraries[namespace] = torch.library.Library(namespace, "IMPL")
        libraries[namespace].impl(op, _kernel(signature(op)), "PrivateUse1")
    for op in CPU_VIEW_KERNELS:
        if op.namespace not in libraries:
            libraries[op.namespace] = torch.library.Library(op.namespace, "IMPL")
        libraries[op.namespace].impl(op, _cpu_view_kernel(op), "PrivateUse1")
    for op, choice in BACKEND_CHOICES.items():
        if op.namespace not in libraries:
            libraries[op.namespace] = torch.library.Library(op.namespace, "IMPL")
        for key in ("AutogradPrivateUse1", "PrivateUse1"):  # the latter where autograd is off (inference_mode)
            libraries[op.namespace].impl(op, choice, key)
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_fallback, "PrivateUse1")
    _libraries.extend([*libraries.values(), fallback])
    _hide_from_dynamo(run_bound.__code__, _fallback.__code__)  # the C entry has no frame


def _hide_from_dynamo(*entry_points) -> None:
    """Dynamo's frame hook stays set while a graph break runs eagerly, and it would try to trace
    these kernels (and fail on their buffer bookkeeping) when the eager code calls an op: skip them
    and everything they call."""
    from torch._C._dynamo import eval_frame

    skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP, eval_frame._FrameAction.SKIP)
    for code in entry_points:
        eval_frame.set_code_exec_strategy(code, skip)


_native.configure(torch.Tensor, _Operand, _LIVE, _hashable, _PROGRAMS, _modes._current,
                  _modes._MODES[_modes.EagerMode.DEFER_NEVER], buffer, _counters, _allocate, run_bound,
                  _matmul_precision)
