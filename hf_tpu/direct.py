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

What the function returns is rebuilt at each call: new tensors from the program's outputs, an input tensor or
state object as itself, plain values as they were in the trace, and an object the trace made to hold new tensors
(a model's new `DynamicCache`) as a new object of its type with its attributes rebuilt, as Dynamo rebuilds the
objects a graph makes.

A call that cannot be traced runs the `fallback` instead (by default the function itself, eagerly), with a
log line saying why, and every later call with the same key does too: a host read (`.item()`, `bool(t)`),
an op without a lowering, a tensor outside the inputs written in place, a tensor made in the trace kept
outside it, an output that is none of the above (a tensor that requires gradients: its backward would need the
trace; a view of an input, an object that holds no new tensor, one with slots or a `__new__` of its own; a
tensor subclass made in the trace is returned over new tensors), or a change to Python state other than entries
added to a dict (an attribute of a state object, a module or an argument's list or dict set, replaced or removed:
the trace would not replay it) made by a second trace too: a first trace that changes only values holding no
tensor (a setting made at a first call) keeps its change and is made again (see `call`). Inside the trace
`torch.compiler.is_compiling()` is True (as under non-strict `torch.export`), so code written for compilation
takes its traceable branches, and a tensor computed from constants alone has its value known on the host, where
an attention call reads its mask's pattern (`constant_masks.KnownValues`).

Programs are cached per function code and key: the argument tensors' shapes, dtypes, devices and views, the
values of non-tensor arguments and closure contents (hashable ones: a number, a string, a tuple; an object
with identity hashing is keyed by identity, an unhashable dataclass by its fields; another unhashable one
makes the call fall back), the state tensors' shapes, dtypes, views and whether they require gradients (and
have a `.grad`), each module's type and `training` flag, a non-module state object's type and its attributes
of plain value types (numbers, strings, devices, dtypes), the default dtype, autocast's state and the float32
matmul precision (which the lowerings read). Finding those takes a walk over every submodule, parameter and
buffer; each state object's walk is kept and replayed by later calls while everything it read is unchanged
(`_KeptWalk`; not one that met a `.grad`, which it would keep alive). NOT guarded, as with `jax.jit`: globals
the function reads other than modules and optimizers, attributes of modules other than `training` and their
tensors (a `config` object's fields, a module's Python-number attributes, the checkpoint function
`gradient_checkpointing_enable()` sets), the objects such attributes hold, and the content of a tensor that is
not an input (a `tpu` tensor reached only through a global or an unlisted object is read as a constant of the
program). Change such a thing and the next call runs the program traced before it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
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
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import _replay, compile_log, constant_masks, disk_cache, loops, modes, remat
from .compile import UNTRACEABLE, _Tracing, _Untraceable, count_trace, donatable, finish_call, launching, loop_chunk
from .device_state import rng
from .memory import buffer, donation, placement, tensor_views
from .modes import device_errors

log = logging.getLogger("hf_tpu.compile")

# values keyed by value; every other non-tensor argument by its hash (identity, unless its type says otherwise)
_VALUE_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.device, torch.dtype, torch.Size,
                torch.memory_format, torch.layout, enum.Enum)
_PLAIN_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))  # a tensor of any other type may be a subclass
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
        if type(t) not in _PLAIN_TENSOR_TYPES and is_traceable_wrapper_subclass(t):
            return self._subclass_tensor(t)
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
            return slot, tensor_views.view_of(t, buf)
        grad = None
        if t.is_leaf:
            if first:
                self.leaves.append(t)
            if t.grad is not None:
                grad = self.tensor(t.grad)
        return slot, tensor_views.view_of(t, buf), True, grad

    def _subclass_tensor(self, t: torch.Tensor):
        """The key of a tensor subclass that keeps its data in tensors of its own (PyTorch's `__tensor_flatten__`
        protocol: torchao's quantized weights, an int8 tensor and its scales): those inner tensors are the inputs,
        and its type, outer shape, strides and dtype and the context of its flattening (a block size, an
        activation's quantization settings) are keyed. The object itself runs in the trace: its ops reach its inner
        tensors, whose buffers hold tracers, through its `__torch_dispatch__`. Its attributes are Python state, as a
        state object's are: the trace must not change them, and a kept walk rereads them."""
        if id(t) in self.seen:
            return self._seen_key(t)
        if t.requires_grad and self.grad_enabled:
            raise _Unkeyable("an input requires gradients and gradients are enabled (hf_tpu.jit runs without autograd)")
        self.seen[id(t)] = len(self.objects)
        self.objects.append(t)
        names, context = t.__tensor_flatten__()
        inner = tuple((name, self.tensor(getattr(t, name))) for name in names)
        return ("subclass", type(t), tuple(t.shape), t.stride(), t.dtype, _frozen(context), inner)

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
            if dataclasses.is_dataclass(x) and not isinstance(x, type):  # settings (torchao's): keyed by value
                return ("dataclass", _frozen(x))
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
        if isinstance(x, torch.optim.Optimizer):  # one another object holds (Accelerate's AcceleratedOptimizer)
            _traceable_optimizer(x)
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
            if walk.start == start and walk.inputs_type is type(self) and walk.replay(self, x):
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
    of an input, not a new program (a schedule fills the tensor in place). A group without parameters (the Trainer's
    group of parameters without weight decay, under LoRA) gets a tensor rate too: a schedule sets its rate at every
    step, and a float rate is keyed by its value."""
    device = next((p.device for group in optimizer.param_groups for p in group.get("params", [])), None)
    if device is None or device.type != "tpu":
        return
    for group in optimizer.param_groups:
        params = group.get("params", [])
        if any(p.device.type != "tpu" for p in params):
            continue
        if group.get("capturable") is False and not group.get("fused"):
            group["capturable"] = True
            for p in params:  # a step made before: its counts move to the device
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device.type != "tpu":
                    optimizer.state[p]["step"] = step.to(p.device)
        if type(group.get("lr")) is float and (group.get("capturable") or group.get("fused")):
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device=device)
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


def _frozen(context):
    """A tensor subclass's flattening context as a key: lists as tuples, dataclasses (torchao's settings objects) as
    their type and fields; `_Unkeyable` for anything else that is unhashable."""
    if isinstance(context, (list, tuple)):
        return (type(context), tuple(map(_frozen, context)))
    if isinstance(context, dict):
        return (dict, tuple((k, _frozen(v)) for k, v in context.items()))
    if dataclasses.is_dataclass(context) and not isinstance(context, type):
        return (type(context), tuple((f.name, _frozen(getattr(context, f.name))) for f in dataclasses.fields(context)))
    try:
        hash(context)
    except TypeError:
        raise _Unkeyable(f"a tensor subclass's flattening holds an unhashable {type(context).__name__}") from None
    return context


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
        self.inputs_type = type(inputs)  # a walk of another kind (`call(inputs_type=)`) keys other things

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
        # whole-buffer view of another dtype, read, re-expresses it in that layout (`tensor_views._adopt_layout`)
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


def _state_additions(snapshot: list, inputs: _Inputs, first_new_address: int, new_arrays: list, made: dict) -> list:
    """The entries a trace added to the dicts of its Python state, as outputs of the program: (the dict's place
    in `snapshot`, the key, how `_rebuild` makes the value). An optimizer makes its state at its first step
    (`opt.state[p]`, a dict of new tensors); the call adds those with the program's arrays. Any other change to the
    Python state (an entry replaced or removed, a list changed, entries that hold no tensor) is left to `_trace`."""
    additions = []
    for place, (container, before, what) in enumerate(snapshot):
        if _tensors_added(container, before):
            additions += [(place, key, _added_value(value, inputs, first_new_address, new_arrays, made, what))
                          for key, value in container.items() if key not in before]
    return additions


def _tensors_added(container, before) -> bool:
    """Whether a dict of the Python state changed by entries added to it alone, tensors among them (an optimizer's
    state); a change that adds no tensor (a hook installed at a first call) is one `_trace` may keep."""
    return (isinstance(container, dict) and len(container) > len(before)
            and all(k in container and _same(container[k], v) for k, v in before.items())
            and any(_holds_tensors(v) for k, v in container.items() if k not in before))


def _added_value(value, inputs: _Inputs, first_new_address: int, new_arrays: list, made: dict, what: str,
                 depth: int = 0):
    """How a call rebuilds a value a trace added to its state (`_rebuild`): a tensor as `_output` gives it, a dict,
    list or tuple of such values, or a plain value."""
    if isinstance(value, torch.Tensor):
        return _output(value, inputs, first_new_address, new_arrays, made)
    kind = type(value)
    if kind in (dict, list, tuple) and depth < _DEPTH:
        items = value.items() if kind is dict else enumerate(value)
        specs = [(k, _added_value(v, inputs, first_new_address, new_arrays, made, what, depth + 1)) for k, v in items]
        return (kind.__name__, tuple(specs) if kind is dict else tuple(spec for _, spec in specs))
    if isinstance(value, _VALUE_TYPES):
        return ("value", value)
    raise _Untraceable(f"it adds a {type(value).__name__} to its Python state ({what}), which the program cannot "
                       "replay")


def _same_contents(now, before) -> bool:
    if len(now) != len(before):
        return False
    if isinstance(now, dict):
        return all(k in now and _same(now[k], v) for k, v in before.items())
    return all(_same(a, b) for a, b in zip(now, before))


def _same(a, b) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, _VALUE_TYPES) and a == b)


def _new_values(changes: list):
    """The values a change to the Python state (`_python_state_changes`) put in place."""
    for container, before, _ in changes:
        if isinstance(container, dict):
            yield from (value for k, value in container.items() if k not in before or not _same(value, before[k]))
        else:
            yield from container


def _holds_tensors(x, depth: int = 0) -> bool:
    """Whether `x` is or holds a tensor (searched through containers and plain objects, as state is)."""
    if isinstance(x, torch.Tensor):
        return True
    if depth > _DEPTH or isinstance(x, (torch.nn.Module, *_VALUE_TYPES)):
        return isinstance(x, torch.nn.Module)
    if isinstance(x, dict):
        return any(_holds_tensors(v, depth + 1) for v in x.values())
    if isinstance(x, (list, tuple, set, frozenset)):
        return any(_holds_tensors(v, depth + 1) for v in x)
    return _plain_object(x) and any(_holds_tensors(v, depth + 1) for v in vars(x).values())


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
            torch.is_autocast_enabled("tpu"), torch.get_autocast_dtype("tpu"), torch.get_float32_matmul_precision())


class _Program:
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
        # per gradient leaf whose `.grad` the call set anew: (its position among `_Inputs.leaves`, its output as
        # in `outputs`, or None where the call left it unset)
        self.grads = grads
        # entries the call adds to dicts of its state (an optimizer's state for each parameter, made at its first
        # step): (the dict's place in `_Inputs.snapshot()`, its key, the value as `_added_value` describes it)
        self.additions = additions
        self.run = jax_core.jaxpr_as_fun(jaxpr)
        call = _named(f"traced_{name}", self.step)
        self.jitted = {True: jax.jit(call, donate_argnums=(0,)), False: jax.jit(call)}
        self.loop_jitted = None
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

    def results(self, arrays, inputs: _Inputs):
        new, made = iter(arrays), []
        leaves = [_rebuild(spec, new, inputs, made) for spec in self.outputs]
        for leaf, output in self.grads:  # after the outputs: their arrays follow the outputs'
            inputs.leaves[leaf].grad = None if output is None else _rebuild(output, new, inputs, made)
        if self.additions:
            containers = [entry[0] for entry in inputs.snapshot()]
            for place, key, value in self.additions:
                containers[place][key] = _rebuild(value, new, inputs, made)
        return pytree.tree_unflatten(leaves, self.treedef)


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


class _PythonStateChanged(_Untraceable):
    """A trace changed Python state the program cannot replay, and the changes were kept (`_trace(keep_changes=
    True)`): `call` traces once more with them made, and undoes them (`changes`) if it falls back."""

    def __init__(self, message: str, changes: list):
        super().__init__(message)
        self.changes = changes


def _trace(name: str, run, inputs: _Inputs, arrays: list, keep_changes: bool = False) -> _Program:
    """Run `run()` once with every input buffer holding a tracer; the program it makes. A change to the Python state
    met (`_python_state_changes`) raises `_Untraceable`, the change undone, or, with `keep_changes` and values that
    hold no tensor, `_PythonStateChanged` with the change kept."""
    live = buffer.allocator.live
    # the arrays every buffer holds now, to find those the trace writes; not a tracer an earlier trace left in a
    # buffer that something still holds (a frame of its error's traceback)
    before = {address: buf._array for address, buf in list(live.items()) if not isinstance(buf._array, jax.core.Tracer)}
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
            _check_nothing_else_written(live, before, inputs_by_id)
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
            _restore(added)  # entries added to a dict (`_state_additions`): the program's to add after each call
            if changes:
                message = f"it changes Python state the program cannot replay ({changes[0][2]})"
                if failed or not keep_changes or any(map(_holds_tensors, _new_values(changes))):
                    _restore(changes)
                    if not failed:
                        raise _Untraceable(message)
                else:
                    raise _PythonStateChanged(message, changes)

    traced.__name__ = traced.__qualname__ = f"trace_{name}"
    jaxpr = jax.jit(traced).trace(arrays, rng.example_key()).jaxpr
    _check_no_tensor_escaped(live, first_new_address)
    return _Program(name, jaxpr, found["mutated"], found["outputs"], found["new_outputs"], found["treedef"],
                    found["checks"], found["draws"], found["grads"], found["additions"])


def _output(leaf, inputs: _Inputs, first_new_address: int, new_arrays: list, made: dict, depth: int = 0) -> tuple:
    """How a call rebuilds one returned value (`_rebuild`): a new tensor (its array appended to `new_arrays`), an input
    tensor or state object itself, a plain value, or an object made in the trace that holds new tensors. `made` maps
    the id of each new tensor and object met so far to its place among them, so that one met twice is rebuilt once."""
    if id(leaf) in made:
        return ("same", made[id(leaf)])
    if isinstance(leaf, torch.Tensor):
        if type(leaf) not in _PLAIN_TENSOR_TYPES and is_traceable_wrapper_subclass(leaf):
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
            raise _Untraceable("it returns a tensor that requires gradients (its backward would need the trace): "
                               "return it detached, and run its backward inside the function")
        if leaf.device.type == "tpu":
            buf = buffer.buffer_of(leaf)
            if buf.address >= first_new_address:
                made[id(leaf)] = len(made)
                new_arrays.append(tensor_views.array_of(leaf, buf))
                return ("new", leaf.dtype)
        raise _Untraceable("it returns a view of an input tensor, or a CPU tensor")
    if id(leaf) in inputs.state_index:
        return ("state", inputs.state_index[id(leaf)])
    if isinstance(leaf, _VALUE_TYPES):
        return ("value", leaf)
    arrays_before = len(new_arrays)
    spec = _made_object(leaf, inputs, first_new_address, new_arrays, made, depth)
    if spec is None or len(new_arrays) == arrays_before:  # holds no new tensor: it may be an object of the caller's
        raise _Untraceable(f"it returns a {type(leaf).__name__}, which may hold tensors of the trace")
    return spec


def _made_object(x, inputs: _Inputs, first_new_address: int, new_arrays: list, made: dict, depth: int):
    """The spec of an object the trace made to hold tensors it made (a Transformers `DynamicCache` in a model's
    output, with its layers): rebuilt at each call as a new object of its type with its attributes, as Dynamo
    rebuilds the objects a graph makes (`object.__new__`, then the attributes), since the traced one holds tracers.
    Lists, tuples and dicts in it are rebuilt too; what holds no new tensor (a class, a config) is kept as it is.
    None for anything else (a container of another type, an object with slots or its own `__new__`)."""
    if depth > _DEPTH:
        raise _Untraceable("it returns objects nested too deep")
    kind = type(x)
    if kind in (list, tuple, dict):
        items = x.items() if kind is dict else enumerate(x)
        specs = [(k, _output_or_kept(v, inputs, first_new_address, new_arrays, made, depth + 1)) for k, v in items]
        return (kind.__name__, tuple(specs) if kind is dict else tuple(spec for _, spec in specs))
    if not _plain_object(x) or kind.__new__ is not object.__new__ or _has_slots(kind):
        return None
    made[id(x)] = len(made)
    attributes = tuple((name, _output_or_kept(value, inputs, first_new_address, new_arrays, made, depth + 1))
                       for name, value in vars(x).items())
    return ("new object", kind, attributes)


def _has_slots(kind: type) -> bool:
    """Whether instances of `kind` keep attributes outside their `__dict__` (slots of a class in its MRO)."""
    slots = [getattr(c, "__slots__", ()) for c in kind.__mro__]
    return any(set([names] if isinstance(names, str) else names) - {"__dict__", "__weakref__"} for names in slots)


def _output_or_kept(x, inputs: _Inputs, first_new_address: int, new_arrays: list, made: dict, depth: int) -> tuple:
    """The spec of a value held by an object or container the trace made: rebuilt where it holds new tensors, else
    kept as it is (a value that holds a tensor of the trace without being rebuilt is caught after the trace, a
    tensor made there still holding a tracer: `_check_no_tensor_escaped`)."""
    if isinstance(x, torch.Tensor) or id(x) in made or id(x) in inputs.state_index or isinstance(x, _VALUE_TYPES):
        return _output(x, inputs, first_new_address, new_arrays, made, depth)
    made_before, arrays_before = len(made), len(new_arrays)
    spec = _made_object(x, inputs, first_new_address, new_arrays, made, depth)
    if spec is not None and len(new_arrays) > arrays_before:
        return spec
    for k in [k for k, index in made.items() if index >= made_before]:  # objects holding no new tensor: kept
        del made[k]
    return ("value", x)


def _rebuild(spec, new, inputs: _Inputs, made: list):
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


def _prepare(site, functions, args, kwargs, state, inputs_type=_Inputs) -> tuple:
    """(inputs, key) of a call, or raises `_Unkeyable`."""
    inputs = inputs_type(_state_objects(state))
    return inputs, _Key((site, _call_key(inputs, functions, args, kwargs)))


def _traced_program(key, name: str, run, inputs: _Inputs, arrays: list, description: str, inputs_text,
                    function: str, disk_digest: str | None, keep_changes: bool = False):
    """The program cached for `key`, traced now if there is none (its first compile then named `disk_digest` in
    the disk cache); raises what a failed trace raised (and every later call with this key gets `_Untraceable` at
    once, unless the trace raised `_PythonStateChanged`: `keep_changes`, see `_trace`). Every trace counts towards
    the site's limit, a failed one too."""
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
    _site_counts[site] = _site_counts.get(site, 0) + 1
    try:
        program = _trace(name, run, inputs, arrays, keep_changes)
    except UNTRACEABLE as e:
        compile_log.end(pending, finished=False)
        if not isinstance(e, _PythonStateChanged):
            _programs[key] = _NOT_TRACEABLE
        raise
    program.disk_digest = disk_digest
    _programs[key] = program
    _trace_seconds[site] = time.perf_counter() - started
    _host_seconds.pop(key, None)
    return program


def _arrays(inputs: _Inputs) -> list:
    modes.current().sync("a traced function runs")
    arrays = [buf.value() for buf in inputs.buffers]
    return placement.place_together(arrays) if buffer.sharded_arrays_exist else arrays


def call(fn, args: tuple, kwargs: dict, state=(), fallback=None, meanwhile=None, trace_after: float = 0.0,
         inputs_type=_Inputs, changed_before: tuple | None = None):
    """`fn(*args, **kwargs)` as one traced program (see the module's docstring); `fallback(*args, **kwargs)`
    where it cannot be. With `meanwhile`, a call whose program the device has not compiled yet returns
    `meanwhile(*args, **kwargs)` instead (see `jit`). `inputs_type` is the class that walks the call's inputs and
    keys them (`_Inputs`, or a subclass that keys more: `hf_tpu.compiled_modules`).

    A trace that changes Python state (a setting made at a first call: hooks installed, a warning noted) is made
    again with the change kept: the eager call would have made it, and the function then runs as it would at its
    next call. A second trace that changes it too falls back, both changes undone (`changed_before`: the first
    trace's key and changes).

    Called inside another trace (a jitted training step calling a library's jitted optimizer step), `fn` runs as
    part of that trace's program, as a `jax.jit` function called inside another is."""
    if modes.current().kind is modes.ModeKind.TRACE:
        return fn(*args, **kwargs)
    fallback = fn if fallback is None else fallback
    name = _name_of(fn)
    description = f"the direct trace of `{name}`"
    try:
        inputs, key = _prepare(_function_parts(fn)[0], (fn,), args, kwargs, state, inputs_type)
    except (_Unkeyable, TypeError) as e:
        _log_fallback(name, e)
        return _fall_back(changed_before, fallback, args, kwargs)
    program = _programs.get(key)
    if program is _NOT_TRACEABLE or inputs.device_index is None:  # untraceable, or no tpu tensor to trace for
        return _fall_back(changed_before, fallback, args, kwargs)
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
    failed, changed = False, None
    try:
        program = _traced_program(key, name, lambda: fn(*args, **kwargs), inputs, arrays, description,
                                  lambda: _arguments_text(args, kwargs, inputs.state), f"traced_{name}", disk_digest,
                                  keep_changes=changed_before is None)
        _own_arrays(inputs, program.mutated, arrays)
        mutated, others = donation.split(arrays, program.mutated)
        donate, key_data = donatable(mutated), rng.current_key(inputs.device_index)
        compiling = None if meanwhile is None else _device_compile(key, program, donate, mutated, others, key_data)
    except _PythonStateChanged as e:
        log.info("hf_tpu: `%s` is traced again with the Python state its trace changed (%s)", name, e)
        changed = (key, e.changes)
    except UNTRACEABLE as e:
        failed = _untraceable(key, name, e)
    # past the error, whose traceback holds the trace's frames and their tracers: neither the next trace nor the
    # fallback (Dynamo, whose own errors would chain to it) may keep them alive
    if failed:
        return _fall_back(changed_before, fallback, args, kwargs)
    if changed is not None:
        return call(fn, args, kwargs, state, fallback, meanwhile, trace_after, inputs_type, changed)
    if compiling is not None and not compiling.done():
        result = NotImplemented if declined else meanwhile(*args, **kwargs)
        if result is not NotImplemented:
            return result
        concurrent.futures.wait([compiling])  # the launch then finds the program compiled
    try:
        with launching(inputs.device_index, description), disk_cache.compiling(program.disk_digest):
            new, checked = program.jitted[donate](mutated, others, key_data)
    except UNTRACEABLE as e:
        failed = _untraceable(key, name, e)
    if failed:
        return fallback(*args, **kwargs)
    program.disk_digest = None  # compiled: another donation's program is not the one named
    program.launched = True
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
    (donated: XLA writes the new value in its memory), and committed to its device, as the program's results that
    replace it are. Small equal values share one uploaded array (the norms' weights of a model, all ones), and a
    whole-tensor `copy_` shares its source's: such an array is copied for the buffer that the program overwrites,
    once, and the program's result is its own from then on. One shared array would make the call run a program
    that donates nothing: compiled a second time beside the donating one, and holding every parameter and moment
    twice. An array a factory made (`torch.zeros`: an optimizer's moments and step counts) is not committed to its
    device, and JAX keys a jitted function by that: the second call, over the first call's committed results,
    lowered and compiled the whole step again."""
    for slot in slots:
        array = arrays[slot]
        if buffer.allocator.holders(array) > 1 or not array.committed:
            copy = jax.device_put(array, array.sharding, may_alias=False)
            if inputs.buffers[slot]._array is array:
                inputs.buffers[slot].array = copy
            arrays[slot] = copy


def ready(fn, args: tuple, kwargs: dict, state=(), inputs_type=_Inputs) -> bool:
    """Whether `call` of `fn` with these arguments would launch a program compiled already (traces nothing, waits for
    no compile)."""
    try:
        _, key = _prepare(_function_parts(fn)[0], (fn,), args, kwargs, state, inputs_type)
    except (_Unkeyable, TypeError):
        return False
    program = _programs.get(key)
    return isinstance(program, _Program) and (program.launched or any(
        f.done() and f.exception() is None for f in program.device_compiles.values()))


def _untraceable(key, name: str, error: Exception) -> bool:
    """A call whose trace or launch failed: its key marked (and True: the call falls back)."""
    compile_log.end()
    _programs[key] = _NOT_TRACEABLE
    _log_fallback(name, error)
    return True


def _fall_back(changed_before: tuple | None, fallback, args: tuple, kwargs: dict):
    """The fallback's result, after undoing what a first trace changed in the Python state (`call`): the key of that
    trace is marked, since its change would be made again."""
    if changed_before is not None:
        key, changes = changed_before
        _restore(changes)
        _programs[key] = _NOT_TRACEABLE
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
        if inputs.users[slot] != 1 or tensor_views.view_of(t, inputs.buffers[slot]) is not None:
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
    keep_going = tensor_views.array_of(keep_going)
    # the loop's record of out-of-range indices rides last among the carried values (`loop_chunk`)
    carried_arrays = [*(tensor_views.array_of(t) for t in carried), device_errors.no_errors(inputs.device_index)]
    if buffer.sharded_arrays_exist:  # a sharded model's loop carries single-chip tokens
        *carried_arrays, keep_going = placement.place_together([*arrays, *carried_arrays, keep_going])[len(arrays):]
    compiled_before = program.loop_jitted is not None
    if not compiled_before:
        chunk = _named(f"loop_{name}", functools.partial(loop_chunk, lambda *a: (*program.step(*a), program.checks)))
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
    *final_carried, record = final[1]
    sites = device_errors.loop_sites(program.checks)
    if sites is not None:
        modes.merge_index_record(record, inputs.device_index, sites)
    return tuple(buffer.new_tensor(a.shape, t.dtype, inputs.device_index, a) for t, a in zip(carried, final_carried))


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
    if not device_errors.loop_can_fold(program.checks):  # a record of out-of-range indices rides along
        raise _Untraceable("a while_loop step cannot check device values (a linalg error, an assert)")
    kinds = [spec[0] for spec in program.outputs]
    if len(kinds) != len(carried) + 1 or any(kind != "new" for kind in kinds):
        raise _Untraceable("a while_loop step must return as many tensors as it carries")
    for t, (_, dtype) in zip(carried, program.outputs):  # each ("new", dtype)
        if dtype != t.dtype:
            raise _Untraceable("a while_loop step must return tensors of the carried dtypes")


remat.install()
