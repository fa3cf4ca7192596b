"""Programs: what one call's key compiles to.

On a cache miss dispatch asks PyTorch's meta kernel for the output shapes and dtypes (which also
raises PyTorch's own errors for bad input), and builds the program: read operands through their
views, promote, lower, cast to PyTorch's result dtypes, write mutated operands back. The program is
a pure function of the operands' arrays; the current execution mode decides how it runs
(`hf_tpu.modes`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import zlib

import jax
import jax.numpy as jnp
import torch

from .. import dtypes
from ..device_state import rng
from ..memory import out_of_memory, tensor_views
from ..modes import device_errors
from .call import Call, call_with, checked_by_assert, flatten_returns, is_number, is_static_scalar, promotion, to_meta
from .registry import lowering_function
from .signatures import GENERATOR, OPT_TENSOR, SCALAR, SCALAR_LIST, TENSOR, TENSOR_LIST
from .write_checks import check_out_dtypes

# every program built, by its call's key: the C entry (`_entry.c`) reads it too
PROGRAMS: dict = {}


_RNG = object()  # placeholder for the PRNG key in a template


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index


@dataclasses.dataclass(eq=False)
class Program:
    """The pure function computing one op call's results from its operands' buffers. Each is built
    once per call key, so it compares and hashes as itself: a deferred graph's structure names its
    nodes' programs by identity (`modes/deferred.py`)."""

    fn: object  # (arrays, scalars, rng_key) -> list of arrays
    name: str  # the op's, as `aten::add.Tensor`
    out_specs: tuple | None  # per return: (shape, torch dtype) or ("mutated", operand, shape, jax dtype)
    device_index: int | None
    jitted: object = None
    arrays_only_call: bool = False  # `jitted` takes the arrays as arguments and returns the one result
    returns_list: bool = False  # ... or with `arrays_only_call`, the list of its several results
    jitted_donating: object = None  # the same program taking the overwritten operands' arrays as donations
    # output shapes depend on the data (nonzero, masked_select, unique): run on concrete arrays,
    # a sync point, and take the specs from the results
    data_dependent: bool = False
    # per schema return: False where PyTorch returns an undefined tensor (None)
    defined: tuple = ()
    # (shape, dtype) of the one new tensor that is all the op returns (`a + b`): returned without the
    # general path's loop over results
    single_result_spec: tuple | None = None
    # (jitted, shape, dtype) where strict eager launches the program with its arrays alone and makes
    # its one new tensor: the C entry's whole work for a common call (`_entry.c`)
    direct_launch: tuple | None = None
    # what it checks of its indices (`index_checks.IndexCheck`), or None. Such a program takes its site's id and its
    # device's record of errors as its last two arrays, and returns the record, with what it found written in, after
    # its results (`modes.device_errors`)
    index_check: object = None

    @functools.cached_property
    def content_hash(self) -> int:
        """32 bits of the op and its results' shapes, the same in every process (deferred cut points)."""
        return zlib.crc32(f"{self.name} {self.out_specs}".encode())

    @functools.cached_property
    def result_bytes(self) -> int:
        """The bytes of the new tensors the program makes (not those it writes in place)."""
        return sum(math.prod(spec[0]) * spec[1].itemsize for spec in self.out_specs or () if spec[0] != "mutated")

    @functools.cached_property
    def large_result_bytes(self) -> int:
        """`result_bytes` where they are a large share of the device's memory (`out_of_memory.is_large`), checked
        against what it has left before each launch, else 0 (nothing checked)."""
        nbytes = self.result_bytes
        return nbytes if self.device_index is not None and out_of_memory.is_large(nbytes, self.device_index) else 0

    @functools.cached_property
    def result_layouts(self) -> tuple:
        """(shape, jax dtype) of each result array, in order: a deferred op's pending results."""
        record = ((device_errors.SHAPE, device_errors.DTYPE),) if self.index_check is not None else ()
        return tuple((spec[2], spec[3]) if spec[0] == "mutated" else (spec[0], dtypes.to_jax(spec[1]))
                     for spec in self.out_specs) + record

    @functools.cached_property
    def nested(self):
        """The program as a call inside a larger trace (`torch.compile`, `hf_tpu.jit`): a `jax.jit` that JAX
        traces once per input types and that the enclosing trace records as one call of that traced program.
        A model's layers call the same programs with the same shapes; each layer after the first adds one
        equation instead of running the lowerings again, which took half of a 16-layer Llama's decode-step
        trace. The call is not inlined into the trace (`inline=True` copies every equation again, which was
        half of what was left of a decode step's trace); XLA inlines it, and the optimized program is the same
        (on the development CPU, a tensor-parallel Llama's prefill and decode step: the same instructions and
        collectives). It is the function eager mode jits: its scalars are traced in both."""
        return jax.jit(self.fn)

    @functools.cached_property
    def some_undefined(self) -> bool:
        return not all(self.defined)

    @functools.cached_property
    def overwritten(self) -> tuple:
        """The operand slots whose buffers the results overwrite (in-place and out= ops), ascending."""
        return tuple(sorted({spec[1] for spec in self.out_specs or () if spec[0] == "mutated"}))


def meta_out_specs(call: Call):
    """Shapes and dtypes of the results, from PyTorch's meta kernel (and its errors for bad input)."""
    sig = call.sig
    if sig.lowering is not None and sig.lowering.own_shapes:
        return None
    meta_values = to_meta(call.values, sig)
    # factory ops take device=tpu: meta needs device=meta
    for i, name in enumerate(sig.names):
        if name == "device" and meta_values[i] is not None:
            meta_values[i] = torch.device("meta")
    try:
        result = call_with(sig, sig.op, meta_values)
    except NotImplementedError:
        return None  # no meta kernel: the lowering's own shapes are used
    except AssertionError as e:
        raise checked_by_assert(sig, e) from e
    return [None if r is None else (tuple(r.shape), r.dtype) for r in flatten_returns(result)]


def _template(call: Call):
    """The call's values with tensors, scalars and the generator replaced by placeholders."""
    sig = call.sig
    t_index = 0
    s_index = 0
    template = []
    for i, (kind, v) in enumerate(zip(sig.kinds, call.values)):
        if kind in (TENSOR, OPT_TENSOR) and not is_number(v):
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
            if is_static_scalar(sig, i, v):
                template.append(v)
            else:
                template.append(("scalar", s_index))
                s_index += 1
        elif kind == GENERATOR:
            template.append(_RNG)
        else:
            template.append(v)
    return template


def build_program(call: Call) -> Program:
    sig = call.sig
    low = sig.lowering
    if low.type_check is not None:
        low.type_check(call.values)
    specs = meta_out_specs(call)
    check = sig.index_rule(call.values) if sig.index_rule is not None else None
    compute_dtype = promotion(sig, call.values)
    template = _template(call)
    views = [op.view if op.buf is not None else None for op in call.operands]
    # per operand: the index among the scalars of its view's start, where the program is given it
    start_of = [None] * len(views)
    first_start = len(call.scalars) - len(call.starts)
    for k in (k for k, v in enumerate(views) if v is not None and v.offset == tensor_views.START_IS_AN_INPUT):
        start_of[k], first_start = first_start, first_start + 1
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
    # per operand: (`tensor_views.Transposed` or `tensor_views.Flattened`, the shape its array takes) where the lowering
    # takes the buffer's array so, else None
    handed_whole = [None] * len(call.operands)
    if compute_dtype is None:
        for i, k in slot_of_arg.items():
            op = call.operands[k]
            if op.buf is None:
                continue
            if names[i] in low.transposed and tensor_views.swaps_last_two(op.view, op.buf.shape, op.buf.dtype):
                handed_whole[k] = (tensor_views.Transposed, op.buf.shape)
            elif names[i] in low.flattened:
                shape = tensor_views.flattened_shape(op.view, op.buf.shape, op.buf.dtype)
                handed_whole[k] = None if shape is None else (tensor_views.Flattened, shape)
    returns_mutated = sig.returns_mutated
    if sig.functional is not None and sig.written is None:  # out= and in-place variants
        check_out_dtypes(call)
    lowered_schema = (sig.functional or sig.op)._schema
    lowered_params = [(a.name, a.kwarg_only) for a in lowered_schema.arguments]
    jax_compute = dtypes.to_jax(compute_dtype) if compute_dtype is not None else None
    written_slots = _written_slots(call, first_slot)
    operand_dtypes = [op.tensor.dtype for op in call.operands]  # not the call: a program outlives its tensors

    def fn(arrays, scalars, rng_data):
        if check is not None:  # the op's site and the device's record of errors (`Program.index_check`)
            site, record, arrays = arrays[-2], arrays[-1], arrays[:-2]
        rng_key = rng.key_from_data(rng_data) if rng_data is not None else None
        arrays = [jnp.zeros(*blank[i]) if a is None else a for i, a in enumerate(arrays)]
        starts = [None if k is None else scalars[k] for k in start_of]
        vals = [tensor_views.read(a, v, s) if whole is None else whole[0](a.reshape(whole[1]))
                for a, v, s, whole in zip(arrays, views, starts, handed_whole)]
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
        checked = [] if check is None else [device_errors.fold(record, check.find(by_name, jnp), site)]
        try:
            lower = lowering_function(sig.functional or sig.op, low, args, kwargs)
            result = flatten_returns(lower(*args, **kwargs))
        except (TypeError, ValueError) as e:
            if isinstance(e, _DATA_DEPENDENT_ERRORS) or not _raised_by_library(e):
                raise
            raise _lowering_error(sig.name, operand_dtypes, e) from e
        if written_slots is not None:  # each result (a list's elements one by one) overwrites its argument
            result = [r for x in result for r in (x if isinstance(x, (list, tuple)) else [x])]
            written = {}  # elements may be views of one buffer: their writes compose
            for (k, base, dtype), r in zip(written_slots, result):
                written[base] = tensor_views.write(written.get(base, arrays[k]), views[k],
                                                   dtypes.cast(jnp.asarray(r), dtype), starts[k])
            return [written[base] for _, base, _ in written_slots] + checked
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
                r = tensor_views.write(arrays[k], views[k], r, starts[k])
            outs.append(r)
        return outs + checked

    if written_slots is not None:
        return Program(fn=fn, name=call.sig.name, device_index=call.device_index, index_check=check,
                       out_specs=tuple(("mutated", k, *blank[k]) for k, _, _ in written_slots))
    if specs is None:
        try:
            specs = eval_specs(fn, call, check is not None)
        except _DATA_DEPENDENT_ERRORS:
            return Program(fn=fn, name=call.sig.name, out_specs=None, device_index=call.device_index,
                           data_dependent=True, index_check=check)
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
                   defined=program_returns, single_result_spec=out_specs[0] if one_new else None, index_check=check)


def _written_slots(call: Call, first_slot: dict):
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


def eval_specs(fn, call, index_checked: bool = False):
    """Trace `fn` on the operands' shapes and dtypes only: no value is read, nothing is flushed. `index_checked`:
    `fn` takes and returns a record of errors too (`Program.index_check`), which is not among the specs."""
    arrays = [
        None if op.buf is None or op.buf.array is None
        else jax.ShapeDtypeStruct(op.buf.shape, dtypes.to_jax(op.buf.dtype))
        for op in call.operands
    ]
    arrays = [op.view if op.buf is None else a for op, a in zip(call.operands, arrays)]
    scalars = call.scalars
    if index_checked:
        arrays = [*arrays, jax.ShapeDtypeStruct((), device_errors.DTYPE),
                  jax.ShapeDtypeStruct(device_errors.SHAPE, device_errors.DTYPE)]
    key = rng.example_key() if call.rng else None
    shapes = jax.eval_shape(fn, arrays, scalars, key)
    if index_checked:
        shapes = shapes[:-1]
    return [(tuple(s.shape), dtypes.to_torch(s.dtype)) for s in shapes]
