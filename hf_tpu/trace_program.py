"""One traced program of `hf_tpu.jit`: a call's function run once over tracers (`trace`), and what a call of the
program does after it (`Program`): which buffers it overwrites, how it rebuilds what the function returned (new
tensors, input tensors and state objects, plain values, objects the trace made), the gradients it set and the
entries it added to its state's dicts. A change to Python state the program cannot replay, a tensor written or kept
outside the inputs, make the trace fail (`Untraceable`)."""

from __future__ import annotations

import gc

import jax
import torch
from jax.extend import core as jax_core
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import constant_masks, modes, remat
from .device_state import rng
from .memory import buffer, donation, tensor_views
from .trace_inputs import DEPTH, PLAIN_TENSOR_TYPES, VALUE_TYPES, Inputs, plain_object, same_value
from .tracing import Tracing, Untraceable, count_trace

def _python_state_changes(snapshot: list) -> list:
    """What a trace changed in the Python state it could see (attributes, list and dict contents)."""
    return [entry for entry in snapshot if not _same_contents(entry[0], entry[1])]


def _state_additions(snapshot: list, inputs: Inputs, first_new_address: int, new_arrays: list, made: dict) -> list:
    """The entries a trace added to the dicts of its Python state, as outputs of the program: (the dict's place
    in `snapshot`, the key, how `_rebuild` makes the value). An optimizer makes its state at its first step
    (`opt.state[p]`, a dict of new tensors); the call adds those with the program's arrays. Any other change to the
    Python state (an entry replaced or removed, a list changed, entries that hold no tensor) is left to `trace`."""
    additions = []
    for place, (container, before, what) in enumerate(snapshot):
        if _tensors_added(container, before):
            additions += [(place, key, _added_value(value, inputs, first_new_address, new_arrays, made, what))
                          for key, value in container.items() if key not in before]
    return additions


def _tensors_added(container, before) -> bool:
    """Whether a dict of the Python state changed by entries added to it alone, tensors among them (an optimizer's
    state); a change that adds no tensor (a hook installed at a first call) is one `trace` may keep."""
    return (isinstance(container, dict) and len(container) > len(before)
            and all(k in container and same_value(container[k], v) for k, v in before.items())
            and any(_holds_tensors(v) for k, v in container.items() if k not in before))


def _added_value(value, inputs: Inputs, first_new_address: int, new_arrays: list, made: dict, what: str,
                 depth: int = 0):
    """How a call rebuilds a value a trace added to its state (`_rebuild`): a tensor as `_output` gives it, a dict,
    list or tuple of such values, or a plain value."""
    if isinstance(value, torch.Tensor):
        return _output(value, inputs, first_new_address, new_arrays, made)
    kind = type(value)
    if kind in (dict, list, tuple) and depth < DEPTH:
        items = value.items() if kind is dict else enumerate(value)
        specs = [(k, _added_value(v, inputs, first_new_address, new_arrays, made, what, depth + 1)) for k, v in items]
        return (kind.__name__, tuple(specs) if kind is dict else tuple(spec for _, spec in specs))
    if isinstance(value, VALUE_TYPES):
        return ("value", value)
    raise Untraceable(f"it adds a {type(value).__name__} to its Python state ({what}), which the program cannot "
                       "replay")


def _same_contents(now, before) -> bool:
    if len(now) != len(before):
        return False
    if isinstance(now, dict):
        return all(k in now and same_value(now[k], v) for k, v in before.items())
    return all(same_value(a, b) for a, b in zip(now, before))


def _new_values(changes: list):
    """The values a change to the Python state (`_python_state_changes`) put in place."""
    for container, before, _ in changes:
        if isinstance(container, dict):
            yield from (value for k, value in container.items() if k not in before or not same_value(value, before[k]))
        else:
            yield from container


def _holds_tensors(x, depth: int = 0) -> bool:
    """Whether `x` is or holds a tensor (searched through containers and plain objects, as state is)."""
    if isinstance(x, torch.Tensor):
        return True
    if depth > DEPTH or isinstance(x, (torch.nn.Module, *VALUE_TYPES)):
        return isinstance(x, torch.nn.Module)
    if isinstance(x, dict):
        return any(_holds_tensors(v, depth + 1) for v in x.values())
    if isinstance(x, (list, tuple, set, frozenset)):
        return any(_holds_tensors(v, depth + 1) for v in x)
    return plain_object(x) and any(_holds_tensors(v, depth + 1) for v in vars(x).values())


def restore(changes: list) -> None:
    for container, before, _ in changes:
        if isinstance(container, dict):
            container.clear()
            container.update(before)
        else:
            container[:] = before


class Program:
    """One traced call: its jaxpr over (every input buffer's array, the rng key), the buffers it overwrites,
    what it returns, and its jitted forms."""

    def __init__(self, name: str, jaxpr, mutated: tuple, outputs: list, new_outputs: int, treedef, checks: list,
                 draws: int, grads: list = (), additions: list = ()):
        self.name = name
        self.jaxpr = jaxpr
        self.mutated = mutated  # slots of the buffers written in place, ascending
        # per output leaf, how a call rebuilds it (`_output`): ("new", dtype) | ("input", position among the input
        # tensors) | ("state", k) | ("value", v) | ("same", k) | ("object", k): a tensor subclass among the inputs |
        # ("subclass", ...): one made in the trace | ("new object", type, attributes): another object made there
        self.outputs = outputs
        self.new_outputs = new_outputs  # the new tensors among them, each an output array of the program
        self.treedef = treedef
        self.checks = checks
        self.draws = draws
        # per gradient leaf whose `.grad` the call set anew: (its position among `Inputs.leaves`, its output as
        # in `outputs`, or None where the call left it unset)
        self.grads = grads
        # entries the call adds to dicts of its state (an optimizer's state for each parameter, made at its first
        # step): (the dict's place in `Inputs.snapshot()`, its key, the value as `_added_value` describes it)
        self.additions = additions
        self.run = jax_core.jaxpr_as_fun(jaxpr)
        call = renamed(f"traced_{name}", self.step)
        self.jitted = {True: jax.jit(call, donate_argnums=(0,)), False: jax.jit(call)}
        self.loop_jitted = None
        self.loop_condition = None  # a while_loop's first condition, traced alone (`direct._first_condition`)
        self.loop_compiling = None  # the loop's XLA compile started ahead (`while_loop(..., run=False)`)
        # `hf_tpu.jit(..., meanwhile=)`: the device's compile per donation, on a thread of its own
        self.device_compiles = {}
        self.launched = False  # a call ran it (its XLA compile is done)
        # its key's name in the disk cache's prefetch entries (`disk_cache.expect`), until its first compile
        self.disk_digest = None

    def step(self, mutated_arrays, other_arrays, rng_base):
        """([the overwritten buffers' new arrays, the new output arrays], the checked values)."""
        flat = self.run(*donation.join(self.mutated, mutated_arrays, other_arrays), rng_base)
        n = len(self.mutated) + self.new_outputs
        return list(flat[:n]), list(flat[n:])

    def results(self, arrays, inputs: Inputs):
        new, made = iter(arrays), []
        leaves = [_rebuild(spec, new, inputs, made) for spec in self.outputs]
        for leaf, output in self.grads:  # after the outputs: their arrays follow the outputs'
            inputs.leaves[leaf].grad = None if output is None else _rebuild(output, new, inputs, made)
        if self.additions:
            containers = [entry[0] for entry in inputs.snapshot()]
            for place, key, value in self.additions:
                containers[place][key] = _rebuild(value, new, inputs, made)
        return pytree.tree_unflatten(leaves, self.treedef)


def renamed(name: str, fn):
    def named(*args):
        return fn(*args)

    named.__name__ = named.__qualname__ = name
    return named


class PythonStateChanged(Untraceable):
    """A trace changed Python state the program cannot replay, and the changes were kept (`trace(keep_changes=
    True)`): `hf_tpu.direct.call` traces once more with them made, and undoes them (`changes`) if it falls back."""

    def __init__(self, message: str, changes: list):
        super().__init__(message)
        self.changes = changes


def trace(name: str, run, inputs: Inputs, arrays: list, keep_changes: bool = False, counted: bool = True) -> Program:
    """Run `run()` once with every input buffer holding a tracer; the program it makes. A change to the Python state
    met (`_python_state_changes`) raises `Untraceable`, the change undone, or, with `keep_changes` and values that
    hold no tensor, `PythonStateChanged` with the change kept. A trace not `counted` is a part of another program
    (a loop's condition), not one of its own in `hf_tpu.metrics()`."""
    # the arrays every buffer holds now, to find those the trace writes; not a tracer an earlier trace left in a
    # buffer that something still holds (a frame of its error's traceback)
    before = {address: buf._array for address, buf in buffer.allocator.live_now().items()
              if not isinstance(buf._array, jax.core.Tracer)}
    # each input buffer's own array, which it holds again after the trace (`arrays` may be copies placed
    # on a sharded model's mesh, for the program only)
    own = [buf._array for buf in inputs.buffers]
    first_new_address = buffer.allocator.next_address
    inputs_by_id = {id(buf) for buf in inputs.buffers}
    python_state = inputs.snapshot()
    grads_before = [t.grad for t in inputs.leaves]
    found = {}

    def traced(input_arrays, rng_base):
        if counted:
            count_trace()
        mode = Tracing(rng_base)
        saved_mode = modes.replace_current(mode)
        compiling, torch.compiler._is_compiling_flag = torch.compiler._is_compiling_flag, True
        for buf, array in zip(inputs.buffers, input_arrays):
            buf.array = array
        failed = True
        try:
            # autograd's engine runs a device's backward on a thread of its own, where this trace is not JAX's
            with torch.set_grad_enabled(inputs.grad_enabled), torch.autograd.set_multithreading_enabled(False), \
                    remat.saved_values_materialized(set(inputs.buffers)), constant_masks.KnownValues():
                out = run()
            leaves, treedef = pytree.tree_flatten(out)
            outputs, new_arrays, made = [], [], {}
            for leaf in leaves:
                outputs.append(_output(leaf, inputs, first_new_address, new_arrays, made))
            grads = [(k, None if t.grad is None else _output(t.grad, inputs, first_new_address, new_arrays, made))
                     for k, (t, before) in enumerate(zip(inputs.leaves, grads_before)) if t.grad is not before]
            additions = _state_additions(python_state, inputs, first_new_address, new_arrays, made)
            finals = [buf._array for buf in inputs.buffers]
            mutated = tuple(i for i, (final, array) in enumerate(zip(finals, input_arrays)) if final is not array)
            _check_nothing_else_written(before, inputs_by_id)
            found.update(mutated=mutated, outputs=outputs, new_outputs=len(new_arrays), treedef=treedef, grads=grads,
                         additions=additions,
                         draws=mode.draws,
                         checks=[(value.dtype, raise_if_bad) for value, raise_if_bad in mode.checks])
            failed = False
            checked = [tensor_views.array_of(value) for value, _ in mode.checks]
            return [finals[i] for i in mutated], new_arrays, checked
        finally:
            torch.compiler._is_compiling_flag = compiling
            modes.replace_current(saved_mode)
            for buf, array in zip(inputs.buffers, own):
                buf.array = array
            for t, grad in zip(inputs.leaves, grads_before):
                t.grad = grad
            added, changes = [], []
            for change in _python_state_changes(python_state):
                (added if _tensors_added(*change[:2]) else changes).append(change)
            restore(added)  # entries added to a dict (`_state_additions`): the program's to add after each call
            if changes:
                message = f"it changes Python state the program cannot replay ({changes[0][2]})"
                if failed or not keep_changes or any(map(_holds_tensors, _new_values(changes))):
                    restore(changes)
                    if not failed:
                        raise Untraceable(message)
                else:
                    raise PythonStateChanged(message, changes)

    traced.__name__ = traced.__qualname__ = f"trace_{name}"
    jaxpr = jax.jit(traced).trace(arrays, rng.example_key()).jaxpr
    _check_no_tensor_escaped(first_new_address)
    return Program(name, jaxpr, found["mutated"], found["outputs"], found["new_outputs"], found["treedef"],
                    found["checks"], found["draws"], found["grads"], found["additions"])


def _output(leaf, inputs: Inputs, first_new_address: int, new_arrays: list, made: dict, depth: int = 0) -> tuple:
    """How a call rebuilds one returned value (`_rebuild`): a new tensor (its array appended to `new_arrays`), an input
    tensor or state object itself, a plain value, or an object made in the trace that holds new tensors. `made` maps
    the id of each new tensor and object met so far to its place among them, so that one met twice is rebuilt once."""
    if id(leaf) in made:
        return ("same", made[id(leaf)])
    if isinstance(leaf, torch.Tensor):
        if type(leaf) not in PLAIN_TENSOR_TYPES and is_traceable_wrapper_subclass(leaf):
            index = inputs.seen.get(id(leaf))
            if index is not None and inputs.objects[index] is leaf:  # one among the inputs: that very object
                return ("object", index)
            # a new tensor subclass (a weight quantized in the trace): its inner tensors are the outputs, and the
            # call returns a new object of its type over them, made with its flattening's context
            names, context = leaf.__tensor_flatten__()
            inner = [_output(getattr(leaf, name), inputs, first_new_address, new_arrays, made, depth)
                     for name in names]
            return ("subclass", (type(leaf), tuple(names), context, leaf.shape, leaf.stride(), inner))
        if id(leaf) in inputs.tensor_index:
            return ("input", inputs.tensor_index[id(leaf)])
        if leaf.requires_grad:
            raise Untraceable("it returns a tensor that requires gradients (its backward would need the trace): "
                               "return it detached, and run its backward inside the function")
        if leaf.device.type == "tpu":
            buf = buffer.buffer_of(leaf)
            if buf.address >= first_new_address:
                made[id(leaf)] = len(made)
                new_arrays.append(tensor_views.array_of(leaf, buf))
                return ("new", leaf.dtype)
        raise Untraceable("it returns a view of an input tensor, or a CPU tensor")
    if id(leaf) in inputs.state_index:
        return ("state", inputs.state_index[id(leaf)])
    if isinstance(leaf, VALUE_TYPES):
        return ("value", leaf)
    arrays_before = len(new_arrays)
    spec = _made_object(leaf, inputs, first_new_address, new_arrays, made, depth)
    if spec is None or len(new_arrays) == arrays_before:  # holds no new tensor: it may be an object of the caller's
        raise Untraceable(f"it returns a {type(leaf).__name__}, which may hold tensors of the trace")
    return spec


def _made_object(x, inputs: Inputs, first_new_address: int, new_arrays: list, made: dict, depth: int):
    """The spec of an object the trace made to hold tensors it made (a Transformers `DynamicCache` in a model's
    output, with its layers): rebuilt at each call as a new object of its type with its attributes, as Dynamo
    rebuilds the objects a graph makes (`object.__new__`, then the attributes), since the traced one holds tracers.
    Lists, tuples and dicts in it are rebuilt too; what holds no new tensor (a class, a config) is kept as it is.
    None for anything else (a container of another type, an object with slots or its own `__new__`)."""
    if depth > DEPTH:
        raise Untraceable("it returns objects nested too deep")
    kind = type(x)
    if kind in (list, tuple, dict):
        items = x.items() if kind is dict else enumerate(x)
        specs = [(k, _output_or_kept(v, inputs, first_new_address, new_arrays, made, depth + 1)) for k, v in items]
        return (kind.__name__, tuple(specs) if kind is dict else tuple(spec for _, spec in specs))
    if not plain_object(x) or kind.__new__ is not object.__new__ or _has_slots(kind):
        return None
    made[id(x)] = len(made)
    attributes = tuple((name, _output_or_kept(value, inputs, first_new_address, new_arrays, made, depth + 1))
                       for name, value in vars(x).items())
    return ("new object", kind, attributes)


def _has_slots(kind: type) -> bool:
    """Whether instances of `kind` keep attributes outside their `__dict__` (slots of a class in its MRO)."""
    slots = [getattr(c, "__slots__", ()) for c in kind.__mro__]
    return any(set([names] if isinstance(names, str) else names) - {"__dict__", "__weakref__"} for names in slots)


def _output_or_kept(x, inputs: Inputs, first_new_address: int, new_arrays: list, made: dict, depth: int) -> tuple:
    """The spec of a value held by an object or container the trace made: rebuilt where it holds new tensors, else
    kept as it is (a value that holds a tensor of the trace without being rebuilt is caught after the trace, a
    tensor made there still holding a tracer: `_check_no_tensor_escaped`)."""
    if isinstance(x, torch.Tensor) or id(x) in made or id(x) in inputs.state_index or isinstance(x, VALUE_TYPES):
        return _output(x, inputs, first_new_address, new_arrays, made, depth)
    made_before, arrays_before = len(made), len(new_arrays)
    spec = _made_object(x, inputs, first_new_address, new_arrays, made, depth)
    if spec is not None and len(new_arrays) > arrays_before:
        return spec
    for k in [k for k, index in made.items() if index >= made_before]:  # objects holding no new tensor: kept
        del made[k]
    return ("value", x)


def _rebuild(spec, new, inputs: Inputs, made: list):
    """The value `spec` (`_output`) describes, for one call: `new` yields the call's new arrays, and `made` gathers
    the new tensors and objects rebuilt so far."""
    kind = spec[0]
    if kind == "input":
        return inputs.tensors[spec[1]][0]
    if kind == "state":
        return inputs.state[spec[1]]
    if kind == "value":
        return spec[1]
    if kind == "same":
        return made[spec[1]]
    if kind == "list":
        return [_rebuild(item, new, inputs, made) for item in spec[1]]
    if kind == "tuple":
        return tuple(_rebuild(item, new, inputs, made) for item in spec[1])
    if kind == "dict":
        return {k: _rebuild(item, new, inputs, made) for k, item in spec[1]}
    if kind == "new":
        array = next(new)
        made.append(buffer.new_tensor(array.shape, spec[1], inputs.device_index, array))
        return made[-1]
    if kind == "object":  # a tensor subclass among the inputs: that very object
        return inputs.objects[spec[1]]
    if kind == "subclass":  # a tensor subclass made in the trace, over its inner tensors
        cls, names, context, size, stride, inner = spec[1]
        tensors = {name: _rebuild(part, new, inputs, made) for name, part in zip(names, inner)}
        return cls.__tensor_unflatten__(tensors, context, size, stride)
    obj = object.__new__(spec[1])  # "new object": its attributes rebuilt after it, as `_made_object` met them
    made.append(obj)
    vars(obj).update((name, _rebuild(item, new, inputs, made)) for name, item in spec[2])
    return obj


def _check_nothing_else_written(before: dict, inputs_by_id: set) -> None:
    """A tensor that is not an input, written in place in the trace, would keep a tracer: put back, and the
    call falls back."""
    written = [buf for address, buf in buffer.allocator.live_now().items()
               if address in before and isinstance(buf._array, jax.core.Tracer) and id(buf) not in inputs_by_id]
    for buf in written:
        buf.array = before[buf.address]
    if written:
        raise Untraceable(f"it writes a tpu tensor that is not among its inputs ({tuple(written[0].shape)} "
                           f"{written[0].dtype}): pass it as an argument or hold it in a state object")


def _check_no_tensor_escaped(first_new_address: int) -> None:
    """A tensor made in the trace and still alive after it (kept in an object that is not state) holds a tracer."""
    def escaped():
        return [buf for address, buf in buffer.allocator.live_now().items()
                if address >= first_new_address and isinstance(buf._array, jax.core.Tracer)]

    if escaped() and (gc.collect() or True) and escaped():
        raise Untraceable("a tensor made in the trace is kept outside it (in an object that is not declared state)")
