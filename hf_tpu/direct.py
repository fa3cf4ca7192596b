"""`hf_tpu.jit`: a Python function traced straight into one XLA program, without Dynamo or AOT autograd.

`torch.compile(backend="tpu")` pays Dynamo's bytecode analysis and AOT autograd's functionalization before
`hf_tpu.compile` traces the ATen graph they produce; for a model's forward that capture costs several times
the trace itself, and no disk cache keeps it. Here the Python function runs once, as it is, on `tpu`
tensors whose buffers hold JAX tracers, under the mode `hf_tpu.compile._Tracing` (every op goes through the
same dispatch and lowering table as eager execution and `torch.compile`'s graphs), and what it computed
becomes one `jax.jit` program. The function's inputs are every `tpu` tensor it is given or declared to use:

- its arguments (nested in tuples, lists and dicts) and the tensors its closure holds;
- the tensors of its *state*: objects the caller names (`state=`), and every module and optimizer among the
  arguments, the closure and the globals the function's code names. A module's state is its parameters,
  buffers and tensor attributes (of every submodule); another object's is the tensors among its attributes,
  found through lists, tuples, dicts and the objects held there (a static KV cache: its layers' `keys`,
  `values`, `cumulative_length`; an optimizer: its moments and step counts per parameter);
- the `.grad` of each input that is a leaf requiring gradients (a parameter).

The unit of input is the buffer (a storage): views of one buffer are one input, read through their view
inside the program. A buffer the function writes in place (a KV cache's `index_copy_`) is an output of the
program too: its array is donated (XLA writes the update in place) and the buffer holds the new array
after the call, so every view of it sees the update, as after the eager call.

Autograd runs inside the trace as it would outside it (with gradients enabled or not, as at the call): a
whole training step, `loss.backward()` and `optimizer.step()` included, becomes one program. PyTorch's
engine runs the backward on the calling thread there (`set_multithreading_enabled(False)`: JAX's trace
is the thread's). A gradient the call sets (`.grad` of a parameter that had none) is an output the call
sets on the parameter; one it adds to in place is an input the program overwrites (donated); one it sets
to None (`zero_grad()`) is None after the call. A checkpointed block (`torch.utils.checkpoint`, a model's
`gradient_checkpointing_enable()`) recomputes its forward in the program's backward behind an
optimization barrier (`hf_tpu.remat`). An optimizer among the state steps on the device: its step counts
made `capturable` and its learning rates tpu tensors (`_traceable_optimizer`), so a schedule's new rate is
an input's new value. The state an optimizer makes at its first step (entries added to a dict of the
state) is an output the call adds; the next call, whose state then holds it, traces its own program.

A call that cannot be traced runs the `fallback` instead (by default the function itself, eagerly), with a
log line saying why, and every later call with the same key does too: a host read (`.item()`, `bool(t)`),
an op without a lowering, a tensor outside the inputs written in place, a tensor made in the trace kept
outside it, an output that is neither a new tensor (one that does not require gradients: its backward
would need the trace), an input tensor itself, a state object nor a plain value, or a change to Python
state other than entries added to a dict (an attribute of a state object, a module or an argument's list
or dict replaced or removed: the trace would not replay it).
Inside the trace `torch.compiler.is_compiling()` is True (as under non-strict `torch.export`), so code
written for compilation takes its traceable branches.

Programs are cached per function code and key: the argument tensors' shapes, dtypes, devices and views,
the values of non-tensor arguments and closure contents (hashable ones: a number, a string, a tuple; an
object with identity hashing is keyed by identity; an unhashable one makes the call fall back), the state
tensors' shapes, dtypes, views and whether they require gradients (and have a `.grad`), each module's
type and `training` flag, a non-module state object's type and its attributes of plain value types
(numbers, strings, devices, dtypes), the default dtype and autocast's state. Finding those takes a walk
over every submodule, parameter and buffer; each state object's walk is kept and replayed by later calls
while everything it read is unchanged (`_KeptWalk`; not one that met a `.grad`, which it would keep
alive). NOT guarded, as with `jax.jit`: globals the function reads other than modules and optimizers,
attributes of modules other than `training` and their tensors (a `config` object's fields, a module's
Python-number attributes, the checkpoint function `gradient_checkpointing_enable()` sets), the objects
such attributes hold, and the content of a tensor that is not an input (a `tpu` tensor reached only
through a global or an unlisted object is read as a constant of the program). Change such a thing and the
next call runs the program traced before it.
"""

from __future__ import annotations

import concurrent.futures
import enum
import functools
import gc
import inspect
import itertools
import logging
import operator
import time
import types
import weakref

import jax
import torch
from jax.extend import core as jax_core
from torch.utils import _pytree as pytree

from . import _replay, compile_log, disk_cache, loops, modes, remat
from .compile import UNTRACEABLE, _Tracing, _Untraceable, count_trace, donatable, finish_call, launching, loop_chunk
from .device import rng
from .memory import buffer, donation

log = logging.getLogger("hf_tpu.compile")

# values keyed by value; every other non-tensor argument by its hash (identity, unless its type says otherwise)
_VALUE_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.device, torch.dtype, torch.Size,
                torch.memory_format, torch.layout, enum.Enum)
_DEPTH = 12  # how deep arguments and state are searched (a deeper structure makes the call fall back)
_PROGRAMS_PER_SITE = 64  # programs one function code may trace; then new keys fall back, as Dynamo's limit does


class _Unkeyable(Exception):
    """A call whose inputs cannot be keyed (an unhashable argument, a CPU tensor): it runs the fallback."""


_NOT_TRACEABLE = object()  # the cache's entry for a key whose trace failed
_programs: dict = {}  # (site, key) -> _Program or _NOT_TRACEABLE
_site_counts: dict = {}  # site -> programs traced for it


def reset() -> None:
    """Forget every traced program (and which calls could not be traced), as `torch.compiler.reset()` makes
    Dynamo forget its graphs."""
    _programs.clear()
    _site_counts.clear()
    _host_seconds.clear()
    _trace_seconds.clear()


def _plain_object(x) -> bool:
    """An object whose attributes are searched for state tensors: not a tensor (an input itself), and not JAX's
    own objects (a sharded cache's device mesh), which hold no tpu tensor and fill caches of their own when
    read."""
    return hasattr(x, "__dict__") and not isinstance(
        x, (torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType, functools.partial, enum.Enum)
    ) and not type(x).__module__.startswith(("jax.", "jaxlib."))


def _function_parts(fn) -> tuple:
    """(what identifies `fn`'s code, the values it carries besides its arguments: closure, defaults, self)."""
    if isinstance(fn, types.MethodType):
        code, parts = _function_parts(fn.__func__)
        return code, (fn.__self__, parts)
    if isinstance(fn, functools.partial):
        code, parts = _function_parts(fn.func)
        return code, (parts, fn.args, fn.keywords)
    if isinstance(fn, types.FunctionType):
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                cells.append(None)
        return fn.__code__, (tuple(cells), fn.__defaults__, fn.__kwdefaults__, _global_state(fn))
    return type(fn), (fn,)  # a callable object (a module): an argument of its own


def _global_state(fn: types.FunctionType) -> tuple:
    """The modules and optimizers among the globals `fn`'s code names (a training step written at a script's top
    level reads its model and optimizer there): state, as if closed over."""
    found = []
    namespace = fn.__globals__
    for name in _global_names(fn.__code__):
        value = namespace.get(name)
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
            found.append(value)
    return tuple(found)


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple:
    """The names `code` and the functions defined in it read as globals (or attributes: a superset)."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return tuple(dict.fromkeys(names))


class _Inputs:
    """The tensors, buffers and key of one call, found by walking its arguments and its state."""

    def __init__(self, state: tuple):
        self.state_index = {id(o): k for k, o in enumerate(state)}
        self.state = list(state)
        self.buffers = []  # distinct buffers, in the order met: the program's inputs
        self.slots = {}  # id(buffer) -> its position in `buffers`
        self.users = []  # per buffer: how many input tensors read it
        self.tensors = []  # (tensor, its buffer's slot) of every input tensor, in the order met
        self.tensor_index = {}  # id(tensor) -> its first position in `tensors`
        self.leaves = []  # input tensors that autograd may give a `.grad` (leaves that require gradients)
        # Python state the call must not change, copied only when a trace runs (`snapshot`): the lists and
        # dicts met, and the attributes of the state objects and modules met
        self.containers = []
        self.objects = []
        self.seen = {}  # id(object) -> its index in `objects`
        self.buffer_keys = []
        self.device_index = None
        self.grad_enabled = torch.is_grad_enabled()
        # where the walk of the current state object started (`root`), and whether it met an object or buffer
        # found before that start: its key then refers to them, and the walk cannot be replayed on its own
        self.walk_start = (0, 0)
        self.reached_back = False

    def position(self) -> tuple:
        """How much the walks so far found: the objects, buffers, tensors and containers met."""
        return len(self.objects), len(self.buffers), len(self.tensors), len(self.containers)

    def _seen_key(self, x) -> tuple:
        index = self.seen[id(x)]
        if index < self.walk_start[0]:
            self.reached_back = True
        return ("seen", index)

    def tensor(self, t: torch.Tensor):
        if t.device.type != "tpu":
            raise _Unkeyable(f"it is given a {t.device.type} tensor (hf_tpu.jit takes tpu tensors)")
        buf = buffer.buffer_of(t)
        slot = self.slots.get(id(buf))
        if slot is not None and slot < self.walk_start[1]:
            self.reached_back = True
        if slot is None:
            if self.device_index is None:
                self.device_index = buf.device_index
            elif buf.device_index != self.device_index:
                raise _Unkeyable("its tensors are on several tpu devices")
            slot = self.slots[id(buf)] = len(self.buffers)
            self.buffers.append(buf)
            self.users.append(0)
            self.buffer_keys.append((buf.shape, buf.dtype, buf.device_index))
        self.users[slot] += 1
        first = id(t) not in self.tensor_index
        self.tensor_index.setdefault(id(t), len(self.tensors))
        self.tensors.append((t, slot))
        if not t.requires_grad:
            return slot, buffer.view_of(t, buf)
        grad = None
        if t.is_leaf:
            if first:
                self.leaves.append(t)
            if t.grad is not None:
                grad = self.tensor(t.grad)
        return slot, buffer.view_of(t, buf), True, grad

    def argument(self, x, depth: int = 0):
        """The key of an argument (or a value a closure holds); its tensors become inputs."""
        if depth > _DEPTH:
            raise _Unkeyable("its arguments nest too deep")
        if isinstance(x, torch.Tensor):
            return self.tensor(x)
        k = self.state_index.get(id(x))
        if k is not None:
            return ("state", k)
        # a module or an optimizer given as an argument is state: its weights, its moments are inputs
        if isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
            self.state_index[id(x)] = len(self.state)
            self.state.append(x)
            return ("state", len(self.state) - 1, self.root(x))
        if isinstance(x, (types.FunctionType, types.MethodType, functools.partial)):
            code, parts = _function_parts(x)
            return ("function", code, self.argument(parts, depth + 1))
        if type(x) is tuple or (isinstance(x, tuple) and hasattr(x, "_fields")):
            return (type(x), tuple(self.argument(v, depth + 1) for v in x))
        if isinstance(x, list):
            self.containers.append(x)
            return (type(x), tuple(self.argument(v, depth + 1) for v in x))
        if isinstance(x, dict):
            self.containers.append(x)
            return (type(x), tuple((k, self.argument(v, depth + 1)) for k, v in x.items()))
        if isinstance(x, _VALUE_TYPES):
            return (type(x), x)
        try:
            hash(x)
        except TypeError:
            raise _Unkeyable(f"it is given an unhashable {type(x).__name__} that is not declared as state") from None
        return ("object", x)

    def state_object(self, x, depth: int = 0):
        """The key of a state object: its tensors become inputs, its plain-valued attributes are keyed."""
        if isinstance(x, torch.Tensor):
            return self.tensor(x)
        if id(x) in self.seen:
            return self._seen_key(x)
        if depth > _DEPTH:
            raise _Unkeyable("its state nests too deep")
        if isinstance(x, torch.nn.Module):
            return self._root_module(x)
        if isinstance(x, (list, tuple)):
            if isinstance(x, list):
                self.containers.append(x)
            return (type(x), tuple(self.state_object(v, depth + 1) for v in x))
        if isinstance(x, dict):
            self.containers.append(x)
            return (type(x), tuple((self._dict_key(k), self.state_object(v, depth + 1)) for k, v in x.items()))
        if not _plain_object(x):
            return (type(x), x) if isinstance(x, _VALUE_TYPES) else None
        self.seen[id(x)] = len(self.objects)
        self.objects.append(x)
        items = []
        for name, value in vars(x).items():
            if isinstance(value, (torch.Tensor, torch.nn.Module, list, tuple, dict)) or _plain_object(value):
                items.append((name, self.state_object(value, depth + 1)))
            elif isinstance(value, _VALUE_TYPES):
                items.append((name, type(value), value))
        return (type(x), tuple(items))

    def _dict_key(self, k):
        """A key of a state dict: a tensor (an optimizer's state is keyed by parameter) by its place among the
        inputs, anything else as it is."""
        if not isinstance(k, torch.Tensor):
            return k
        self.tensor(k)
        return ("tensor", self.tensor_index[id(k)])

    def root(self, x):
        """The key of a state object (named by `state=`, or a module among the arguments): a module's or another
        object's walk (`state_object`) is kept on the side (`_KeptWalk`) and replayed by the next call that starts
        it where this one did (after as many objects, buffers, tensors and containers found) and finds nothing it
        read changed."""
        if isinstance(x, torch.optim.Optimizer) and id(x) not in self.seen:
            _traceable_optimizer(x)
        if id(x) in self.seen or not (isinstance(x, torch.nn.Module) or _plain_object(x)):
            return self.state_object(x)
        start = self.position()
        for walk in _kept_walks_of(x):
            if walk.start == start and walk.replay(self, x):
                return walk.key
        self.walk_start, self.reached_back = start[:2], False
        key = self.state_object(x)
        if not self.reached_back:
            _keep_walk(x, _KeptWalk(self, x, key, start))
        self.walk_start = (0, 0)
        return key

    def _root_module(self, root: torch.nn.Module):
        """The key of a module and its submodules."""
        return ("module", tuple(self._module(m) for m in root.modules()))

    def _module(self, m: torch.nn.Module):
        if id(m) in self.seen:
            return self._seen_key(m)
        self.seen[id(m)] = len(self.objects)
        self.objects.append(m)
        attributes = m.__dict__
        parameters, buffers = attributes["_parameters"], attributes["_buffers"]
        self.containers += (parameters, buffers, attributes["_modules"])
        tensors = [(name, self.tensor(t)) for name, t in parameters.items() if t is not None]
        if buffers:
            tensors += [(name, self.tensor(t)) for name, t in buffers.items() if t is not None]
        # tensors held as plain attributes (not registered as buffers): inputs too
        tensors += [(name, self.tensor(v)) for name, v in attributes.items()
                    if type(v) is torch.Tensor and name[0] != "_"]
        return (type(m), attributes["training"], tuple(tensors))

    def snapshot(self) -> list:
        """A copy of the Python state met, to compare with after a trace (`python_state_changes`)."""
        return ([(vars(obj), dict(vars(obj)), f"an attribute of a {type(obj).__name__}") for obj in self.objects]
                + [(c, c.copy(), f"the contents of a {type(c).__name__}") for c in self.containers])


def _traceable_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer of tpu parameters made to step inside a program, as Dynamo makes one it compiles: its step
    counts on the device (`capturable`, where it has the option: else each step reads them on the host) and its
    learning rates tpu tensors where it takes them (capturable or fused), so a schedule's new rate is a new value
    of an input, not a new program (a schedule fills the tensor in place)."""
    for group in optimizer.param_groups:
        params = group.get("params", [])
        if not params or any(p.device.type != "tpu" for p in params):
            continue
        if group.get("capturable") is False and not group.get("fused"):
            group["capturable"] = True
            for p in params:  # a step made before: its counts move to the device
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device.type != "tpu":
                    optimizer.state[p]["step"] = step.to(p.device)
        if type(group.get("lr")) is float and (group.get("capturable") or group.get("fused")):
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device=params[0].device)
        _make_state(optimizer, group)
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        # a learning-rate schedule's mark that the optimizer has stepped, which the first step sets: set before
        # it, the first step's key is every later step's (only `scheduler.step()`'s order warning reads it)
        optimizer._opt_called = True


def _make_state(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """The state a `torch.optim` optimizer makes for a group's parameters at its first step (`_init_group`: Adam's
    step counts and moments, zeros), made now, as Dynamo makes it before tracing a compiled step: the first traced
    step is then the program of every step after it, not one of its own that makes the state (a second trace and
    compile). What `_init_group` makes is what the step reads, so the step's result is the same. It makes state for
    the parameters that have a gradient: one without gets a zero one for the while (a broadcast scalar). An
    optimizer that makes its state in the step itself (SGD's momentum) makes it in the first trace, which adds it."""
    init_group = getattr(optimizer, "_init_group", None)
    missing = [p for p in group["params"] if p.requires_grad and p not in optimizer.state]
    if init_group is None or not missing:
        return
    lists = len(inspect.signature(init_group).parameters) - 1  # the group, then the lists it fills
    without = [p for p in missing if p.grad is None]
    for p in without:
        p.grad = torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p)
    try:
        with torch.no_grad():
            init_group(group, *[[] for _ in range(lists)])
    finally:
        for p in without:
            p.grad = None


def _layouts(tensors: list) -> list:
    """What a tensor's place among the inputs depends on besides its buffer's shape and dtype: its storage and
    offset, shape, strides and dtype (`.data =`, `set_` or `resize_` change them on the same tensor object).
    The storage and offset are one number, the data pointer: the allocator hands out no address twice, and a
    storage's span is longer than its bytes, so a pointer lies within one storage's span only."""
    return list(zip(map(torch.Tensor.data_ptr, tensors), map(torch.Tensor.size, tensors),
                    map(torch.Tensor.stride, tensors), map(_dtype_of, tensors)))


_dtype_of = operator.attrgetter("dtype")


_requires_grad = operator.attrgetter("requires_grad")


class _KeptWalk:
    """One state object's walk (`_Inputs.root`): its key and what it added to the inputs, kept to be replayed. A
    large model's walk runs Python over every submodule, parameter and buffer (a 16-layer Llama's: about 1 ms on
    the development CPU, where a replay takes 0.2 ms; the v5e's host runs such Python several times slower), and
    a static cache's over every layer (0.15 ms for 16 layers), on every call of a traced prefill or decode loop.

    The key depends only on the dicts and lists the walk reads (a module's: each submodule's `__dict__`,
    `_parameters`, `_buffers` and `_modules`; another object's: its attributes, and the lists and dicts found
    there), on each tensor's storage and layout and its buffer's shape and dtype, and on where the walk starts
    among the inputs (the key counts objects and buffers from the call's first). `replay` checks that it starts
    where the kept walk did, that the dicts hold the same keys and the very same objects or equal plain values
    (one pass in C: `hf_tpu/_replay.c`) and the lists the same items, apart from values no walk keys replaced by
    others (a function set on a cache layer at each call), that each tensor's storage and layout are unchanged
    and each storage's buffer has its shape and dtype, and that none of its objects and buffers were met before
    it; it then adds the kept inputs again, with the buffers as they are now. Anything else takes the full walk,
    and keeps it. A walk that met objects or buffers found before it (a cache holding one of the model's
    tensors) is not kept.

    What is held: the dicts and lists and what they hold (as the object does), not the object itself (the walk
    is kept in a WeakKeyDictionary under it) and not the buffers (found again by their storage's address)."""

    # what a walk adds to `_Inputs`, replayed, with the count of `_Inputs.position()` each is indexed by: lists
    # (the part from the walk's start on), and dicts of positions (the entries from it on); `buffers` and `slots`
    # are found again
    ADDED_LISTS = {"objects": 0, "users": 1, "buffer_keys": 1, "tensors": 2, "containers": 3}
    ADDED_POSITIONS = {"seen": 0, "tensor_index": 2}

    def __init__(self, inputs: "_Inputs", root, key: tuple, start: tuple):
        """The walk of `root` that just filled `inputs` from `start` (`_Inputs.position()`), whose key is `key`."""
        self.key = key
        self.start = start
        self.root_id = id(root)
        objects_start, buffers_start, tensors_start, containers_start = start
        objects = inputs.objects[objects_start:]
        modules = [obj.__dict__ for obj in objects if isinstance(obj, torch.nn.Module)]
        self.dicts = (modules + [d[name] for d in modules for name in ("_parameters", "_buffers", "_modules")]
                      + [vars(obj) for obj in objects if not isinstance(obj, torch.nn.Module)])
        containers = inputs.containers[containers_start:]
        read = set(map(id, self.dicts))
        self.dicts += [c for c in containers if isinstance(c, dict) and id(c) not in read]
        self.keys = list(itertools.chain.from_iterable(self.dicts))
        self.values = list(itertools.chain.from_iterable(map(dict.values, self.dicts)))
        self.lists = [c for c in containers if isinstance(c, list)]
        self.items = [list(c) for c in self.lists]
        self.tensors = [t for t, _ in inputs.tensors[tensors_start:]]
        self.layouts = _layouts(self.tensors)
        self.requires_grad = list(map(_requires_grad, self.tensors))
        self.storages = [buf.address for buf in inputs.buffers[buffers_start:]]
        self.added = {name: getattr(inputs, name)[start[count]:] for name, count in _KeptWalk.ADDED_LISTS.items()}
        self.added.update({name: {k: v for k, v in getattr(inputs, name).items() if v >= start[count]}
                           for name, count in _KeptWalk.ADDED_POSITIONS.items()})
        del self.added["objects"][0]  # the root, appended again at a replay
        self.added["leaves"] = [t for t in inputs.leaves if inputs.tensor_index[id(t)] >= tensors_start]
        self.device_index = inputs.device_index

    def keepable(self) -> bool:
        """Whether the walk may be kept: not where it met a gradient (kept, it would keep a step's gradients alive
        after `zero_grad()`; a training step's walk is a small part of its call)."""
        return all(t.grad is None for t in self.added["leaves"])

    def holds(self, x) -> bool:
        """Whether the walk holds `x` (kept under `x`, it would keep it alive)."""
        return any(value is x for value in itertools.chain(self.values, *self.items))

    def replay(self, inputs: "_Inputs", root) -> bool:
        """Add the kept walk of `root` to `inputs` (as far as the kept walk's start) if nothing it read changed;
        False if something did."""
        if id(root) != self.root_id:  # an equal object, not the same (a WeakKeyDictionary compares by ==)
            return False
        changed = _replay.changed_entries(self.dicts, self.keys, self.values)
        if changed is None or any(len(now) != len(before) for now, before in zip(self.lists, self.items)):
            return False
        changed += [(a, b) for now, before in zip(self.lists, self.items) for a, b in zip(now, before) if a is not b]
        # the very same objects, or equal plain values: a model attribute set again each call to an equal int
        # (Transformers' `_previous_max_cache_length`, 1152) is another int object past CPython's small ones
        if not all(_same(now, before) or (_unkeyed(now) and _unkeyed(before)) for now, before in changed):
            return False
        if (_layouts(self.tensors) != self.layouts or list(map(_requires_grad, self.tensors)) != self.requires_grad
                or any(t.grad is not None for t in self.added["leaves"])):
            return False
        added = self.added
        live = buffer.allocator.live
        buffers = [live.get(address) for address in self.storages]
        # the buffer at an address is the one the walk met, but its shape and dtype may have changed since: a
        # whole-buffer view of another dtype, read, re-expresses it in that layout (`buffer._adopt_layout`)
        if (any(buf is None for buf in buffers)
                or [(buf.shape, buf.dtype, buf.device_index) for buf in buffers] != added["buffer_keys"]):
            return False
        # met before this walk (another state object now holds them): the full walk keys them as met
        found_before = inputs.seen or inputs.slots
        if found_before and (any(id(buf) in inputs.slots for buf in buffers) or id(root) in inputs.seen
                             or not inputs.seen.keys().isdisjoint(added["seen"])):
            return False
        if inputs.device_index is not None and buffers and inputs.device_index != self.device_index:
            return False
        slots_start = len(inputs.buffers)
        inputs.buffers.extend(buffers)
        inputs.slots.update({id(buf): slots_start + k for k, buf in enumerate(buffers)})
        inputs.objects.append(root)
        for name, value in added.items():
            getattr(inputs, name).extend(value) if isinstance(value, list) else getattr(inputs, name).update(value)
        if inputs.device_index is None:
            inputs.device_index = self.device_index
        return True


# state object -> its last kept walks (`_KeptWalk`), the latest first, dropped with the object. Two: a static
# cache is walked by the prefill, whose layers then hold functions of its own (`_attending_to_the_prompt_only` in
# the Transformers adapter), and by the decode loop, whose layers do not: `generate()` alternates the two.
_kept_walks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_WALKS_KEPT = 2


def _kept_walks_of(x) -> tuple:
    try:
        return _kept_walks.get(x, ())
    except TypeError:  # an object without identity hashing: its walks are not kept
        return ()


def _keep_walk(x, walk: _KeptWalk) -> None:
    if walk.holds(x) or not walk.keepable():
        return
    try:
        _kept_walks[x] = (walk, *_kept_walks.get(x, ()))[:_WALKS_KEPT]
    except TypeError:  # not weakly referable, or unhashable
        pass


def _unkeyed(x) -> bool:
    """A value no walk keys (a function, a class, a JAX object): one replaced by another changes no key."""
    return not isinstance(x, (torch.Tensor, torch.nn.Module, list, tuple, dict) + _VALUE_TYPES) and not _plain_object(x)


def _python_state_changes(snapshot: list) -> list:
    """What a trace changed in the Python state it could see (attributes, list and dict contents)."""
    return [entry for entry in snapshot if not _same_contents(entry[0], entry[1])]


def _state_additions(snapshot: list, inputs: _Inputs, first_new_address: int, new_arrays: list) -> list:
    """The entries a trace added to the dicts of its Python state, as outputs of the program: (the dict's place
    in `snapshot`, the key, the value as `_added_value` describes it). An optimizer makes its state at its first
    step (`opt.state[p]`, a dict of new tensors); the call adds those with the program's arrays. Any other change
    to the Python state (an entry replaced or removed, a list changed) is untraceable."""
    additions = []
    for place, (container, before, what) in enumerate(snapshot):
        if _same_contents(container, before):
            continue
        if not isinstance(container, dict) or any(k not in container or not _same(container[k], v)
                                                  for k, v in before.items()):
            raise _Untraceable(f"it changes Python state the program cannot replay ({what})")
        for key, value in container.items():
            if key not in before:
                additions.append((place, key, _added_value(value, inputs, first_new_address, new_arrays, what)))
    return additions


def _added_value(value, inputs: _Inputs, first_new_address: int, new_arrays: list, what: str, depth: int = 0):
    """(kind, contents) of a value a trace added to its state: a tensor as `_output` gives it, a dict, list or tuple
    of such values, or a plain value."""
    if isinstance(value, torch.Tensor):
        return _output(value, inputs, first_new_address, new_arrays)
    if type(value) in (dict, list, tuple) and depth < _DEPTH:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return (type(value), [(k, _added_value(v, inputs, first_new_address, new_arrays, what, depth + 1))
                              for k, v in items])
    if isinstance(value, _VALUE_TYPES):
        return ("value", value)
    raise _Untraceable(f"it adds a {type(value).__name__} to its Python state ({what}), which the program cannot "
                       "replay")


def _added_new_tensors(value) -> int:
    kind, contents = value
    if kind in (dict, list, tuple):
        return sum(_added_new_tensors(v) for _, v in contents)
    return kind == "new"


def _same_contents(now, before) -> bool:
    if len(now) != len(before):
        return False
    if isinstance(now, dict):
        return all(k in now and _same(now[k], v) for k, v in before.items())
    return all(_same(a, b) for a, b in zip(now, before))


def _same(a, b) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, _VALUE_TYPES) and a == b)


def _restore(changes: list) -> None:
    for container, before, _ in changes:
        if isinstance(container, dict):
            container.clear()
            container.update(before)
        else:
            container[:] = before


def _call_key(inputs: _Inputs, functions, args, kwargs) -> tuple:
    """The key of one call, besides its site; fills `inputs`."""
    # state first: a module found among the arguments then keys by its place among the state objects
    state = tuple(inputs.root(o) for o in tuple(inputs.state))
    arguments = inputs.argument((tuple(_function_parts(f)[1] for f in functions), args, kwargs))
    return (state, arguments, tuple(inputs.buffer_keys), torch.get_default_dtype(),
            torch.is_autocast_enabled("tpu"), torch.get_autocast_dtype("tpu"))


class _Program:
    """One traced call: its jaxpr over (every input buffer's array, the rng key), the buffers it overwrites,
    what it returns, and its jitted forms."""

    def __init__(self, name: str, jaxpr, mutated: tuple, outputs: list, treedef, checks: list, draws: int,
                 grads: list = (), additions: list = ()):
        self.name = name
        self.jaxpr = jaxpr
        self.mutated = mutated  # slots of the buffers written in place, ascending
        # per output leaf: ("new", dtype) | ("input", position among the input tensors) | ("state", k) | ("value", v)
        self.outputs = outputs
        self.treedef = treedef
        self.checks = checks
        self.draws = draws
        # per gradient leaf whose `.grad` the call set anew: (its position among `_Inputs.leaves`, its output as
        # in `outputs`, or None where the call left it unset)
        self.grads = grads
        # entries the call adds to dicts of its state (an optimizer's state for each parameter, made at its first
        # step): (the dict's place in `_Inputs.snapshot()`, its key, the value as `_added_value` describes it)
        self.additions = additions
        self.new_outputs = sum(kind == "new" for kind, _ in [*outputs, *(g for _, g in grads if g is not None)])
        self.new_outputs += sum(_added_new_tensors(value) for _, _, value in additions)
        self.run = jax_core.jaxpr_as_fun(jaxpr)
        call = _named(f"traced_{name}", self.step)
        self.jitted = {True: jax.jit(call, donate_argnums=(0,)), False: jax.jit(call)}
        self.loop_jitted = None
        self.loop_compiling = None  # the loop's XLA compile started ahead (`while_loop(..., run=False)`)
        # `hf_tpu.jit(..., meanwhile=)`: the device's compile per donation, on a thread of its own
        self.device_compiles = {}
        # its key's name in the disk cache's prefetch entries (`disk_cache.expect`), until its first compile
        self.disk_digest = None

    def step(self, mutated_arrays, other_arrays, rng_base):
        """([the overwritten buffers' new arrays, the new output arrays], the checked values)."""
        flat = self.run(*donation.join(self.mutated, mutated_arrays, other_arrays), rng_base)
        n = len(self.mutated) + self.new_outputs
        return list(flat[:n]), list(flat[n:])

    def results(self, arrays, inputs: _Inputs):
        new = iter(arrays)
        leaves = [self._result(kind, value, new, inputs) for kind, value in self.outputs]
        for leaf, output in self.grads:  # after the outputs: their arrays follow the outputs'
            inputs.leaves[leaf].grad = None if output is None else self._result(*output, new, inputs)
        if self.additions:
            containers = [entry[0] for entry in inputs.snapshot()]
            for place, key, value in self.additions:
                containers[place][key] = self._added(value, new, inputs)
        return pytree.tree_unflatten(leaves, self.treedef)

    def _added(self, value, new, inputs: _Inputs):
        kind, contents = value
        if kind in (dict, list, tuple):
            items = [(k, self._added(v, new, inputs)) for k, v in contents]
            return dict(items) if kind is dict else kind(v for _, v in items)
        return self._result(kind, contents, new, inputs)

    @staticmethod
    def _result(kind, value, new, inputs: _Inputs):
        if kind == "new":
            array = next(new)
            return buffer.new_tensor(array.shape, value, inputs.device_index, array)
        if kind == "input":
            return inputs.tensors[value][0]
        if kind == "state":
            return inputs.state[value]
        return value


def _named(name: str, fn):
    def named(*args):
        return fn(*args)

    named.__name__ = named.__qualname__ = name
    return named


def _name_of(fn) -> str:
    fn = getattr(fn, "__func__", fn)
    fn = getattr(fn, "func", fn)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return name.rsplit("<locals>.", 1)[-1]


def _arguments_text(args, kwargs, state, positional: str = "argument", most: int = 6) -> str:
    """The tensors among the arguments, as `input_ids int64[1, 128]`, then the state's types, for the compile
    log; a positional argument is named `positional` and its position."""
    shown = []
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            last = path[-1]
            name = str(last.key) if hasattr(last, "key") else f"{positional} {path[1].idx}"
            shown.append(f"{name} {str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}")
    more = f" and {len(shown) - most} more" if len(shown) > most else ""
    kinds = ", ".join(dict.fromkeys(type(o).__name__ for o in state))
    return ", ".join(shown[:most]) + more + (f", with the state of {kinds}" if kinds else "")


def _trace(name: str, run, inputs: _Inputs, arrays: list) -> _Program:
    """Run `run()` once with every input buffer holding a tracer; the program it makes."""
    live = buffer.allocator.live
    before = {address: buf._array for address, buf in list(live.items())}
    # each input buffer's own array, which it holds again after the trace (`arrays` may be copies placed
    # on a sharded model's mesh, for the program only)
    own = [buf._array for buf in inputs.buffers]
    first_new_address = buffer.allocator.next_address
    inputs_by_id = {id(buf) for buf in inputs.buffers}
    python_state = inputs.snapshot()
    grads_before = [t.grad for t in inputs.leaves]
    found = {}

    def traced(input_arrays, rng_base):
        count_trace()
        mode = _Tracing(rng_base)
        saved_mode = modes.replace_current(mode)
        compiling, torch.compiler._is_compiling_flag = torch.compiler._is_compiling_flag, True
        for buf, array in zip(inputs.buffers, input_arrays):
            buf.array = array
        failed = True
        try:
            # autograd's engine runs a device's backward on a thread of its own, where this trace is not JAX's
            with torch.set_grad_enabled(inputs.grad_enabled), torch.autograd.set_multithreading_enabled(False), \
                    remat.saved_values_materialized(set(inputs.buffers)):
                out = run()
            leaves, treedef = pytree.tree_flatten(out)
            outputs, new_arrays = [], []
            for leaf in leaves:
                outputs.append(_output(leaf, inputs, first_new_address, new_arrays))
            grads = [(k, None if t.grad is None else _output(t.grad, inputs, first_new_address, new_arrays))
                     for k, (t, before) in enumerate(zip(inputs.leaves, grads_before)) if t.grad is not before]
            additions = _state_additions(python_state, inputs, first_new_address, new_arrays)
            finals = [buf._array for buf in inputs.buffers]
            mutated = tuple(i for i, (final, array) in enumerate(zip(finals, input_arrays)) if final is not array)
            _check_nothing_else_written(live, before, inputs_by_id)
            found.update(mutated=mutated, outputs=outputs, treedef=treedef, grads=grads, additions=additions,
                         draws=mode.draws,
                         checks=[(value.dtype, raise_if_bad) for value, raise_if_bad in mode.checks])
            failed = False
            return ([finals[i] for i in mutated], new_arrays, [buffer.array_of(value) for value, _ in mode.checks])
        finally:
            torch.compiler._is_compiling_flag = compiling
            modes.replace_current(saved_mode)
            for buf, array in zip(inputs.buffers, own):
                buf.array = array
            for t, grad in zip(inputs.leaves, grads_before):
                t.grad = grad
            # put back: the entries it added (`_state_additions`) are the program's to add after each call
            _restore(_python_state_changes(python_state))

    traced.__name__ = traced.__qualname__ = f"trace_{name}"
    jaxpr = jax.jit(traced).trace(arrays, rng.example_key()).jaxpr
    _check_no_tensor_escaped(live, first_new_address)
    return _Program(name, jaxpr, found["mutated"], found["outputs"], found["treedef"], found["checks"], found["draws"],
                    found["grads"], found["additions"])


def _output(leaf, inputs: _Inputs, first_new_address: int, new_arrays: list) -> tuple:
    if isinstance(leaf, torch.Tensor):
        if id(leaf) in inputs.tensor_index:
            return ("input", inputs.tensor_index[id(leaf)])
        if leaf.requires_grad:
            raise _Untraceable("it returns a tensor that requires gradients (its backward would need the trace): "
                               "return it detached, and run its backward inside the function")
        if leaf.device.type == "tpu":
            buf = buffer.buffer_of(leaf)
            if buf.address >= first_new_address:
                new_arrays.append(buffer.array_of(leaf, buf))
                return ("new", leaf.dtype)
        raise _Untraceable("it returns a view of an input tensor, or a CPU tensor")
    if id(leaf) in inputs.state_index:
        return ("state", inputs.state_index[id(leaf)])
    if isinstance(leaf, _VALUE_TYPES):
        return ("value", leaf)
    raise _Untraceable(f"it returns a {type(leaf).__name__}, which may hold tensors of the trace")


def _check_nothing_else_written(live: dict, before: dict, inputs_by_id: set) -> None:
    """A tensor that is not an input, written in place in the trace, would keep a tracer: put back, and the
    call falls back."""
    written = [buf for address, buf in list(live.items())
               if address in before and isinstance(buf._array, jax.core.Tracer) and id(buf) not in inputs_by_id]
    for buf in written:
        buf.array = before[buf.address]
    if written:
        raise _Untraceable(f"it writes a tpu tensor that is not among its inputs ({tuple(written[0].shape)} "
                           f"{written[0].dtype}): pass it as an argument or hold it in a state object")


def _check_no_tensor_escaped(live: dict, first_new_address: int) -> None:
    """A tensor made in the trace and still alive after it (kept in an object that is not state) holds a tracer."""
    def escaped():
        return [buf for address, buf in list(live.items())
                if address >= first_new_address and isinstance(buf._array, jax.core.Tracer)]

    if escaped() and (gc.collect() or True) and escaped():
        raise _Untraceable("a tensor made in the trace is kept outside it (in an object that is not declared state)")


def _key_text(key) -> str:
    """`key` as text that is the same in every process, by which the disk cache names its program
    (`disk_cache.expect`): code by file, name and line, types by module and name, plain values by repr, and an
    object keyed by identity by its type alone."""
    parts = []
    _describe(key, parts)
    return "\x1f".join(parts)


def _describe(x, parts: list) -> None:
    if isinstance(x, (tuple, list)):
        parts.append("(")
        for item in x:
            _describe(item, parts)
        parts.append(")")
    elif isinstance(x, _VALUE_TYPES):
        parts.append(repr(x))
    elif isinstance(x, type):
        parts.append(f"{x.__module__}.{x.__qualname__}")
    elif isinstance(x, types.CodeType):
        parts.append(f"{x.co_filename}:{x.co_qualname}:{x.co_firstlineno}")
    else:
        parts.append(f"<{type(x).__module__}.{type(x).__qualname__}>")


def _expect_from_disk(key, device_index: int) -> str | None:
    """For a key new to this process: the name its program has in the disk cache, its load from there started beside
    the trace where a process before named one (`disk_cache.expect`); None where the disk cache is off."""
    return disk_cache.expect(_key_text(key), device_index) if disk_cache.enabled() else None


class _Key(tuple):
    """A call's key, hashed once: a tuple hashes all of its elements again at every dict lookup, and a call looks
    its key up twice or more (a 1.1B Llama's prefill key holds 3618 elements, 13 us a hash on the development
    CPU). Raises `TypeError` for an unhashable part, as `hash` of the tuple does."""

    def __new__(cls, parts: tuple):
        key = super().__new__(cls, parts)
        key._hash = tuple.__hash__(key)
        return key

    def __hash__(self):
        return self._hash


def _state_objects(state) -> tuple:
    """The state objects `state` names: the items of a tuple or list, or `state` itself (a module, a tensor, a
    dict, a cache); a tuple, list or dict among them is searched as a whole."""
    return tuple(state) if isinstance(state, (tuple, list)) else (state,)


def _prepare(site, functions, args, kwargs, state) -> tuple:
    """(inputs, key) of a call, or raises `_Unkeyable`."""
    inputs = _Inputs(_state_objects(state))
    return inputs, _Key((site, _call_key(inputs, functions, args, kwargs)))


def _traced_program(key, name: str, run, inputs: _Inputs, arrays: list, description: str, inputs_text,
                    function: str, disk_digest: str | None):
    """The program cached for `key`, traced now if there is none (its first compile then named `disk_digest` in
    the disk cache); raises what a failed trace raised (and every later call with this key gets `_Untraceable` at
    once)."""
    program = _programs.get(key)
    if program is _NOT_TRACEABLE:
        raise _Untraceable("an earlier call with these inputs could not be traced")
    if program is not None:
        return program
    site = key[0]
    if _site_counts.get(site, 0) >= _PROGRAMS_PER_SITE:
        raise _Untraceable(f"{_PROGRAMS_PER_SITE} programs were traced for it already")
    started = time.perf_counter()
    pending = compile_log.begin(description, "hf_tpu.jit", function, started, captured=True,
                                capture="Python trace")
    compile_log.describe(description, "hf_tpu.jit", inputs_text)
    try:
        program = _trace(name, run, inputs, arrays)
    except UNTRACEABLE:
        compile_log.end(pending, finished=False)
        _programs[key] = _NOT_TRACEABLE
        raise
    program.disk_digest = disk_digest
    _programs[key] = program
    _site_counts[site] = _site_counts.get(site, 0) + 1
    _trace_seconds[site] = time.perf_counter() - started
    _host_seconds.pop(key, None)
    return program


def _arrays(inputs: _Inputs) -> list:
    modes.current().sync("a traced function runs")
    arrays = [buf.value() for buf in inputs.buffers]
    return buffer.place_together(arrays) if buffer.sharded_arrays_exist else arrays


def call(fn, args: tuple, kwargs: dict, state=(), fallback=None, meanwhile=None, trace_after: float = 0.0):
    """`fn(*args, **kwargs)` as one traced program (see the module's docstring); `fallback(*args, **kwargs)`
    where it cannot be. With `meanwhile`, a call whose program the device has not compiled yet returns
    `meanwhile(*args, **kwargs)` instead (see `jit`)."""
    fallback = fn if fallback is None else fallback
    name = _name_of(fn)
    description = f"the direct trace of `{name}`"
    try:
        inputs, key = _prepare(_function_parts(fn)[0], (fn,), args, kwargs, state)
    except (_Unkeyable, TypeError) as e:
        _log_fallback(name, e)
        return fallback(*args, **kwargs)
    program = _programs.get(key)
    if program is _NOT_TRACEABLE or inputs.device_index is None:  # untraceable, or no tpu tensor to trace for
        return fallback(*args, **kwargs)
    declined = False  # `meanwhile` returned NotImplemented: asked once per call
    if meanwhile is not None and program is None and not _trace_is_due(key, trace_after):
        started = _clock()
        result = meanwhile(*args, **kwargs)
        if result is not NotImplemented:
            _spent_on_the_host(key, _clock() - started)
            return result
        declined = True
    # a key new to this process: its program's load from the disk cache starts now, beside the trace
    disk_digest = _expect_from_disk(key, inputs.device_index) if program is None else None
    arrays = _arrays(inputs)
    try:
        program = _traced_program(key, name, lambda: fn(*args, **kwargs), inputs, arrays, description,
                                  lambda: _arguments_text(args, kwargs, inputs.state), f"traced_{name}", disk_digest)
        _own_arrays(inputs, program.mutated, arrays)
        mutated, others = donation.split(arrays, program.mutated)
        donate, key_data = donatable(mutated), rng.current_key(inputs.device_index)
        compiling = None if meanwhile is None else _device_compile(key, program, donate, mutated, others, key_data)
    except UNTRACEABLE as e:
        return _untraceable(key, name, e, fallback, args, kwargs)
    if compiling is not None and not compiling.done():
        result = NotImplemented if declined else meanwhile(*args, **kwargs)
        if result is not NotImplemented:
            return result
        concurrent.futures.wait([compiling])  # the launch then finds the program compiled
    try:
        with launching(inputs.device_index, description), disk_cache.compiling(program.disk_digest):
            new, checked = program.jitted[donate](mutated, others, key_data)
    except UNTRACEABLE as e:
        return _untraceable(key, name, e, fallback, args, kwargs)
    program.disk_digest = None  # compiled: another donation's program is not the one named
    for slot, array in zip(program.mutated, new):
        inputs.buffers[slot].array = array
    finish_call(inputs.device_index, program.draws, program.checks, checked)
    return program.results(new[len(program.mutated):], inputs)


def lower(fn, args: tuple, kwargs: dict, state=(), device=None):
    """The program `call` would run for these inputs (traced now if it has not been), as JAX's `Lowered`: its
    `.compile().memory_analysis()` gives the device memory it takes, `.as_text()` its StableHLO. Raises what
    makes the call fall back. With `device` (a JAX device, such as one of a TPU topology's that
    `jax.experimental.topologies` describes without the chip), lowered for that device from the inputs' shapes
    alone: what the program would take there, found without running it."""
    name = _name_of(fn)
    inputs, key = _prepare(_function_parts(fn)[0], (fn,), args, kwargs, state)
    if inputs.device_index is None:
        raise _Unkeyable("no tpu tensor among its inputs")
    arrays = _arrays(inputs)
    program = _traced_program(key, name, lambda: fn(*args, **kwargs), inputs, arrays, f"the direct trace of `{name}`",
                              lambda: _arguments_text(args, kwargs, inputs.state), f"traced_{name}", None)
    _own_arrays(inputs, program.mutated, arrays)
    mutated, others = donation.split(arrays, program.mutated)
    key_data, donate = rng.current_key(inputs.device_index), donatable(mutated)
    if device is not None:
        sharding = jax.sharding.SingleDeviceSharding(device)
        mutated, others, key_data = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), (mutated, others, key_data))
    return program.jitted[donate].lower(mutated, others, key_data)


def _own_arrays(inputs: _Inputs, slots: tuple, arrays: list) -> None:
    """Each array the program overwrites (at `slots` of `arrays`) made its buffer's alone, so the program can take it
    (donated: XLA writes the new value in its memory). Small equal values share one uploaded array (the norms'
    weights of a model, all ones), and a whole-tensor `copy_` shares its source's: such an array is copied for
    the buffer that the program overwrites, once, and the program's result is its own from then on. One shared
    array would make the call run a program that donates nothing: compiled a second time beside the donating
    one, and holding every parameter and moment twice."""
    for slot in slots:
        array = arrays[slot]
        if buffer.allocator.holders(array) > 1:
            copy = jax.device_put(array, may_alias=False)
            if inputs.buffers[slot]._array is array:
                inputs.buffers[slot].array = copy
            arrays[slot] = copy


def _untraceable(key, name: str, error: Exception, fallback, args: tuple, kwargs: dict):
    """A call whose trace or launch failed: its key marked, and the fallback's result."""
    compile_log.end()
    _programs[key] = _NOT_TRACEABLE
    _log_fallback(name, error)
    return fallback(*args, **kwargs)


# `jit(meanwhile=)`'s rule for when to trace a key: (site, key) -> the seconds `meanwhile` has spent on the key's
# calls, until its trace; site -> the seconds its last trace took (the Python trace, and the lowering for the
# device on the compile's thread)
_host_seconds: dict = {}
_trace_seconds: dict = {}
_clock = time.perf_counter


def _trace_is_due(key, trace_after: float) -> bool:
    """Whether `meanwhile` has run `key`'s calls for as long as a trace of its site takes (see `jit`)."""
    return _host_seconds.get(key, 0.0) >= _trace_seconds.get(key[0], trace_after)


def _spent_on_the_host(key, seconds: float) -> None:
    if len(_host_seconds) >= 4096:  # keys of shapes seen a few times, never traced: forgotten, not kept for good
        _host_seconds.clear()
    _host_seconds[key] = _host_seconds.get(key, 0.0) + seconds


def _device_compile(key, program: _Program, donate: bool, mutated: list, others: list, key_data):
    """The future of the device's compile of `program` (donating or not), started at its first call on a thread
    of its own: an XLA compile for a TPU, or its load from the disk cache, takes seconds. Its lowering counts
    as part of the trace of `key`'s site (`_trace_seconds`): it takes the host's Python as the trace does."""
    compiling = program.device_compiles.get(donate)
    if compiling is None:
        jitted, site, disk_digest = program.jitted[donate], key[0], program.disk_digest

        def lower_and_compile():
            started = time.perf_counter()
            lowered = jitted.lower(mutated, others, key_data)
            _trace_seconds[site] = _trace_seconds.get(site, 0.0) + time.perf_counter() - started
            with disk_cache.compiling(disk_digest):
                return lowered.compile()

        compiling = program.device_compiles[donate] = compile_log.in_background(lower_and_compile)
    return compiling


def _log_fallback(name: str, error: Exception) -> None:
    log.warning("hf_tpu: `%s` runs without hf_tpu.jit's trace (%s: %s)", name, type(error).__name__, error)


class Jitted:
    """What `hf_tpu.jit` returns: the function, called as one traced program."""

    def __init__(self, fn, state, fallback, meanwhile, trace_after):
        self.fn = fn
        self.state = state
        self.fallback = fallback
        self.meanwhile = meanwhile
        self.trace_after = trace_after
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        state = self.state
        if callable(state) and not isinstance(state, torch.nn.Module):  # a function of the call's arguments
            state = state(*args, **kwargs)
        return call(self.fn, args, kwargs, state, self.fallback, self.meanwhile, self.trace_after)

    def lower(self, *args, **kwargs):
        """The program a call with these arguments runs, as JAX's `Lowered` (see `hf_tpu.direct.lower`)."""
        state = self.state(*args, **kwargs) if callable(self.state) else self.state
        return lower(self.fn, args, kwargs, state)


def jit(fn, *, state=(), fallback=None, meanwhile=None, trace_after: float = 0.0) -> Jitted:
    """`fn` run as one XLA program over its `tpu` tensors, traced from Python without Dynamo.

    `state` names the objects whose tensors the function reads or writes besides its arguments: a module (its
    parameters, buffers and tensor attributes), a tensor, another object (a KV cache: the tensors among its
    attributes), or a tuple, list or dict of them, nested; or a function of the call's arguments that returns
    such state. Tensors written in place become outputs of the program, donated to XLA and rebound after the
    call: the caller's tensor objects hold the new values, as after the eager call. `fallback` (by default
    `fn`, run eagerly) runs any call that cannot be traced. See `hf_tpu.direct` for what is keyed and what is
    not guarded.

    `meanwhile`: a function of the same arguments whose result a call returns while the device has not
    compiled the call's program: the device's compile runs on a thread of its own, and the calls after it
    has ended run the program. For a small model called with a few new shapes (an embedding model's length
    buckets), whose first calls would each wait seconds for the chip's compile where the host's CPU computes
    them in a fraction of one: `meanwhile` runs the model there, in PyTorch. It must compute what `fn` does
    (its in-place writes included), or return `NotImplemented`, and the call then waits for the compile.

    With `meanwhile`, a new key (the shapes and values above) is traced, and its compile started, once its calls
    have spent in `meanwhile` as long as a trace takes: as long as the function's last trace took (the Python
    trace and the lowering, which hold the host's Python), or `trace_after` seconds before its first. Until
    then its calls return `meanwhile`'s result and trace nothing. A trace is bought once the host has paid
    its price in rent (the rent-or-buy rule): work that ends before then (a short pass over a dataset) costs
    what the host's own run costs, a shape met once or twice (a pass's last, smaller batch) is not traced,
    and work that goes on pays at most twice the trace it could not avoid."""
    if isinstance(trace_after, bool) or not isinstance(trace_after, (int, float)) or not trace_after >= 0:
        raise ValueError(f"hf_tpu.jit: trace_after must be a number of seconds of at least 0, not {trace_after!r}")
    return Jitted(fn, state, fallback, meanwhile, float(trace_after))


# --- hf_tpu.while_loop(..., state=...): the step traced directly, its iterations in one XLA while loop


def _loop_step(cond_fn, body_fn):
    def step(*carried):
        new = body_fn(*carried)
        new = tuple(new) if isinstance(new, (tuple, list)) else (new,)
        # each carried value an output of its own, even one returned unchanged; XLA drops the copy
        new = tuple(t.clone() for t in new)
        return (*new, cond_fn(*new))

    return step


def while_loop(cond_fn, body_fn, carried: tuple, keep_going: torch.Tensor, state, run: bool = True) -> tuple | None:
    """`hf_tpu.while_loop` with its step traced straight into a program; raises `loops.NotLoopable` where it
    cannot be (before any iteration ran). With `run=False`, the loop's XLA compile starts on a thread of its
    own (`compile_log.in_background`) and nothing runs: the first call that runs the program waits for it."""
    name = _name_of(body_fn)
    description = f"the direct trace of the while_loop step `{name}`"
    site = ("while_loop", _function_parts(body_fn)[0], _function_parts(cond_fn)[0])
    step = _loop_step(cond_fn, body_fn)
    try:
        inputs, key = _prepare(site, (body_fn, cond_fn), carried, {}, state)
    except (_Unkeyable, TypeError) as e:
        raise loops.NotLoopable(f"{type(e).__name__}: {e}") from e
    disk_digest = _expect_from_disk(key, inputs.device_index) if _programs.get(key) is None else None
    carried_slots = [inputs.tensors[inputs.tensor_index[id(t)]][1] for t in carried]
    for t, slot in zip(carried, carried_slots):
        if inputs.users[slot] != 1 or buffer.view_of(t, inputs.buffers[slot]) is not None:
            raise loops.NotLoopable("a carried tensor shares its storage with another input")
    arrays = _arrays(inputs)
    try:
        program = _traced_program(key, name, lambda: step(*carried), inputs, arrays, description,
                                  lambda: _arguments_text(carried, {}, inputs.state, "carried"), f"loop_{name}",
                                  disk_digest)
        _check_loopable(program, carried, carried_slots)
    except UNTRACEABLE as e:
        compile_log.end(finished=False)
        _programs[key] = _NOT_TRACEABLE
        raise loops.NotLoopable(f"{type(e).__name__}: {e}") from e
    _own_arrays(inputs, program.mutated, arrays)
    mutated, others = donation.split(arrays, program.mutated)
    slots = tuple(slot - sum(m < slot for m in program.mutated) for slot in carried_slots)
    keep_going = buffer.array_of(keep_going)
    carried_arrays = [buffer.array_of(t) for t in carried]
    if buffer.sharded_arrays_exist:  # a sharded model's loop carries single-chip tokens
        *carried_arrays, keep_going = buffer.place_together([*arrays, *carried_arrays, keep_going])[len(arrays):]
    compiled_before = program.loop_jitted is not None
    if not compiled_before:
        chunk = _named(f"loop_{name}", functools.partial(loop_chunk, program.step))
        program.loop_jitted = {True: jax.jit(chunk, donate_argnums=(0,), static_argnums=(3,)),
                               False: jax.jit(chunk, static_argnums=(3,))}
    jitted = program.loop_jitted[donatable(mutated)]
    key_data = rng.current_key(inputs.device_index)

    disk_digest, program.disk_digest = program.disk_digest, None  # the loop's first compile is the one named

    def launch(loop_state, steps):
        with disk_cache.compiling(disk_digest):
            return jitted(loop_state[0], others, key_data, slots, *loop_state[1:], steps)

    if not run:
        if not compiled_before:  # lowered as the first chunk's launch will be: the compile serves it
            first = loops.first_chunk(mutated, carried_arrays, keep_going)

            def compile_ahead():
                lowered = jitted.lower(first[0], others, key_data, slots, *first[1:])
                with disk_cache.compiling(disk_digest):
                    return lowered.compile()

            program.loop_compiling = compile_log.in_background(compile_ahead)
        return None
    _wait_for_compile_ahead(program)

    def interrupted(loop_state):  # the arrays the buffers held were donated to the chunks
        for slot, array in zip(program.mutated, loop_state[0]):
            if not array.is_deleted():
                inputs.buffers[slot].array = array

    try:
        with launching(inputs.device_index, description):
            final = loops.run_in_chunks(launch, (mutated, carried_arrays, keep_going),
                                        lambda: rng.advance(inputs.device_index, program.draws), interrupted)
    except (*UNTRACEABLE, ValueError) as e:
        compile_log.end()
        _programs[key] = _NOT_TRACEABLE
        raise loops.NotLoopable(f"{type(e).__name__}: {e}") from e
    for slot, array in zip(program.mutated, final[0]):
        inputs.buffers[slot].array = array
    return tuple(buffer.new_tensor(a.shape, t.dtype, inputs.device_index, a) for t, a in zip(carried, final[1]))


def _wait_for_compile_ahead(program: _Program) -> None:
    """Wait for the loop's compile started ahead, whose program JAX then finds in its cache for the launch. One
    that failed is left to the launch, which compiles again and raises what the compile raises."""
    compiling, program.loop_compiling = program.loop_compiling, None
    if compiling is not None:
        try:
            compiling.result()
        except Exception as e:  # noqa: BLE001 - raised again by the launch's own compile
            log.info("hf_tpu: the loop's compile started ahead failed (%s: %s)", type(e).__name__, e)


def _check_loopable(program: _Program, carried: tuple, carried_slots: list) -> None:
    if set(carried_slots) & set(program.mutated):
        raise _Untraceable("the step updates a carried tensor in place")
    if program.checks:
        raise _Untraceable("a while_loop step cannot check device values (a linalg error, an assert)")
    kinds = [kind for kind, _ in program.outputs]
    if len(kinds) != len(carried) + 1 or any(kind != "new" for kind in kinds):
        raise _Untraceable("a while_loop step must return as many tensors as it carries")
    for t, (_, dtype) in zip(carried, program.outputs):
        if dtype != t.dtype:
            raise _Untraceable("a while_loop step must return tensors of the carried dtypes")


remat.install()
