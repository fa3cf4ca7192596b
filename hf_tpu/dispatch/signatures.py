"""What dispatch knows of one operator: its `Signature`, read once from its ATen schema.

An op's kinds of arguments decide how a call is analysed (`call.py`); its lowering, or the Python
handler it has instead, decides how it runs (`run.py`). In-place (`add_`) and `out=` (`add.out`)
overloads run the lowering of their functional overload (`functional_counterpart`); that derivation
lives here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from . import index_checks
from .registry import HANDLERS, LOWERINGS, Lowering

aten = torch.ops.aten

# The kinds of an argument. The C entry (`_entry.c`) knows TENSOR, OPT_TENSOR, SCALAR and STATIC by
# these values: `registration.py` hands them over, and `_entry.c` checks them, at import.
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


# What the C entry reads of a signature on every call, in this order (`Signature.entry_fields`):
# `_entry.c` unpacks them by position and checks this order at import.
ENTRY_FIELDS = ("names", "defaults", "kinds", "default_keys", "ident", "fast_path_eligible")


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
    handler: object  # a Python function taking the bound call in place of a lowering (`registry.handler`), or None
    # the call's values -> what its program checks of its indices (`index_checks.IndexCheck`) or None; or None
    index_rule: object
    check: object  # the lowering's check of argument values (`Lowering.check`), or None
    functional: torch._ops.OpOverload | None  # for in-place/out= overloads: the op that computes
    returns_list: bool  # the op returns Tensor[] (its one return is a list)
    num_returns: int
    written: tuple | None  # for a variant writing arguments it does not return: each functional result's argument
    static_args: tuple  # per argument: True where the lowering asked for the Python value
    static_values: tuple  # per argument: the values compiled in when passed (Lowering.static_values), or None
    write_rules: tuple  # for a writing op: what it checks of the tensors it writes, see `write_rules`
    inputs: frozenset  # the names of the arguments it computes from: all but an out= variant's outs
    default_keys: tuple  # per argument: its default's part of a call's key (`hashable`), or None
    # the op in a call's key: an int, as an OpOverload hashes in Python (every eager op hashes its key,
    # every deferred flush the keys of all its ops)
    ident: int = dataclasses.field(default_factory=itertools.count().__next__)

    @property
    def fast_path_eligible(self) -> bool:
        """A lowered op that writes nothing and checks no argument: strict eager may launch its common
        calls from C (`_entry.c`)."""
        return (self.handler is None and self.lowering is not None and self.check is None
                and self.index_rule is None and not self.mutated)

    @functools.cached_property
    def entry_fields(self) -> tuple:
        """What the C entry reads of the signature on every call, in one tuple (`ENTRY_FIELDS`)."""
        return tuple(getattr(self, name) for name in ENTRY_FIELDS)

    @property
    def name(self) -> str:
        """`aten::add.Tensor`, or `aten::abs` for a default overload, as PyTorch's errors name ops."""
        overload = self.op._overloadname
        return self.op._schema.name + ("" if overload == "default" else f".{overload}")


def functional_counterpart(op):
    """`add_.Tensor` -> `add.Tensor`, `add.out` -> `add.Tensor`: the overload whose values an
    in-place or out= overload writes."""
    schema = op._schema
    packet_name = op._schema.name.split("::")[1]
    out_names = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if packet_name.endswith("_") and not packet_name.endswith("__"):
        packet = getattr(getattr(torch.ops, op.namespace), packet_name[:-1], None)
        if packet is None:
            return None
        def arguments(overload):
            return [(a.name, str(a.type)) for a in overload._schema.arguments]

        # the overload of the same name, unless another takes the same arguments: `pow_.Scalar` writes
        # `pow.Tensor_Scalar(Tensor self, Scalar exponent)`, not `pow.Scalar(Scalar self, Tensor exponent)`
        named = getattr(packet, op._overloadname, None)
        candidates = [named] + [getattr(packet, name) for name in packet.overloads()]
        functional = [c for c in candidates if c is not None and not c._schema.is_mutable]
        same_arguments = next((c for c in functional if arguments(c) == arguments(op)), None)
        if same_arguments is not None:
            return same_arguments
        return named if named is not None and named in functional else None
    factory_args = {"dtype", "layout", "device", "pin_memory", "memory_format"}

    def signature_of(arguments):
        return [(a.name, str(a.type)) for a in arguments if a.name not in out_names and a.name not in factory_args]

    inputs = signature_of(schema.arguments)
    packet = getattr(getattr(torch.ops, op.namespace), packet_name, None)
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
        functional = functional_counterpart(op)
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
        handler=HANDLERS.get(op),
        index_rule=index_checks.rule_for(op),
        check=low.check if low is not None else None,
        functional=functional,
        returns_list=len(schema.returns) == 1 and str(schema.returns[0].type) == "List[Tensor]",
        num_returns=len(schema.returns),
        written=_written_args(args, mutated, returns_mutated, functional) if functional is not None else None,
        static_args=tuple(low is not None and a.name in low.static for a in args),
        static_values=tuple(dict(low.static_values).get(a.name) if low is not None else None for a in args),
        write_rules=write_rules(op, low),
        inputs=frozenset(a.name for a in (functional or op)._schema.arguments),
        default_keys=tuple(hashable(a.default_value) if a.has_default_value() else None for a in args),
    )


def hashable(v):
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
        return tuple(hashable(x) for x in v)
    if kind is torch.device:
        return str(v)
    return v


# --- What a writing op checks of the tensors it writes (`Signature.write_rules`; the checks
# themselves: `write_checks.py`).


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


def write_rules(op, low: Lowering | None) -> tuple:
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
