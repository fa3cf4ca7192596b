"""The inputs of a call `hf_tpu.jit` traces, and its key: the walk over its arguments, its closure and its state
(modules, optimizers, the objects named as state) that finds every `tpu` tensor the call reads, the buffers behind
them and everything its program depends on (`Inputs`); a tensor subclass keyed by its inner tensors; an optimizer
made to step on the device; each state object's walk kept and replayed while nothing it read changed (`KeptWalk`);
the key as one hashable value (`Key`, `prepare`) and as text the same in every process (`key_text`). What is keyed
and what is not guarded is told in `hf_tpu.direct`."""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import itertools
import operator
import types
import weakref

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import _replay
from .memory import buffer, tensor_views

# values keyed by value; every other non-tensor argument by its hash (identity, unless its type says otherwise)
VALUE_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.device, torch.dtype, torch.Size,
                torch.memory_format, torch.layout, enum.Enum)
PLAIN_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))  # a tensor of any other type may be a subclass
DEPTH = 12  # how deep arguments and state are searched (a deeper structure makes the call fall back)


class Unkeyable(Exception):
    """A call whose inputs cannot be keyed (an unhashable argument, a CPU tensor): it runs the fallback."""


def plain_object(x) -> bool:
    """An object whose attributes are searched for state tensors: not a tensor (an input itself), and not JAX's
    own objects (a sharded cache's device mesh), which hold no tpu tensor and fill caches of their own when
    read."""
    return hasattr(x, "__dict__") and not isinstance(
        x, (torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType, functools.partial, enum.Enum)
    ) and not type(x).__module__.startswith(("jax.", "jaxlib."))


def function_parts(fn) -> tuple:
    """(what identifies `fn`'s code, the values it carries besides its arguments: closure, defaults, self)."""
    if isinstance(fn, types.MethodType):
        code, parts = function_parts(fn.__func__)
        return code, (fn.__self__, parts)
    if isinstance(fn, functools.partial):
        code, parts = function_parts(fn.func)
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


class Inputs:
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
        if type(t) not in PLAIN_TENSOR_TYPES and is_traceable_wrapper_subclass(t):
            return self._subclass_tensor(t)
        if t.device.type != "tpu":
            raise Unkeyable(f"it is given a {t.device.type} tensor (hf_tpu.jit takes tpu tensors)")
        buf = buffer.buffer_of(t)
        slot = self.slots.get(id(buf))
        if slot is not None and slot < self.walk_start[1]:
            self.reached_back = True
        if slot is None:
            if self.device_index is None:
                self.device_index = buf.device_index
            elif buf.device_index != self.device_index:
                raise Unkeyable("its tensors are on several tpu devices")
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
        if first and t.is_leaf:
            self.leaves.append(t)  # its `.grad` is keyed after every walk (`gradients`)
        return slot, tensor_views.view_of(t, buf), True

    def gradients(self) -> tuple:
        """The key of each leaf's `.grad` (None where it has none), in the order the leaves were met; a gradient's
        buffer becomes an input. Keyed after the walks, not inside them, so that a state object's walk does not
        depend on its parameters' gradients and is kept and replayed whether they have one or not: an accumulating
        micro step and an optimizer's step both meet every parameter with a gradient."""
        keys = []
        for leaf in self.leaves:  # a gradient that is a leaf requiring gradients of its own is appended, and keyed
            keys.append(None if leaf.grad is None else self.tensor(leaf.grad))
        return tuple(keys)

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
            raise Unkeyable("an input requires gradients and gradients are enabled (hf_tpu.jit runs without autograd)")
        self.seen[id(t)] = len(self.objects)
        self.objects.append(t)
        names, context = t.__tensor_flatten__()
        inner = tuple((name, self.tensor(getattr(t, name))) for name in names)
        return ("subclass", type(t), tuple(t.shape), t.stride(), t.dtype, _frozen(context), inner)

    def argument(self, x, depth: int = 0):
        """The key of an argument (or a value a closure holds); its tensors become inputs."""
        if depth > DEPTH:
            raise Unkeyable("its arguments nest too deep")
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
            code, parts = function_parts(x)
            return ("function", code, self.argument(parts, depth + 1))
        if type(x) is tuple or (isinstance(x, tuple) and hasattr(x, "_fields")):
            return (type(x), tuple(self.argument(v, depth + 1) for v in x))
        if isinstance(x, list):
            self.containers.append(x)
            return (type(x), tuple(self.argument(v, depth + 1) for v in x))
        if isinstance(x, dict):
            self.containers.append(x)
            return (type(x), tuple((k, self.argument(v, depth + 1)) for k, v in x.items()))
        if isinstance(x, VALUE_TYPES):
            return (type(x), x)
        try:
            hash(x)
        except TypeError:
            if dataclasses.is_dataclass(x) and not isinstance(x, type):  # settings (torchao's): keyed by value
                return ("dataclass", _frozen(x))
            raise Unkeyable(f"it is given an unhashable {type(x).__name__} that is not declared as state") from None
        return ("object", x)

    def state_object(self, x, depth: int = 0):
        """The key of a state object: its tensors become inputs, its plain-valued attributes are keyed."""
        if isinstance(x, torch.Tensor):
            return self.tensor(x)
        if id(x) in self.seen:
            return self._seen_key(x)
        if depth > DEPTH:
            raise Unkeyable("its state nests too deep")
        if isinstance(x, torch.nn.Module):
            return self._root_module(x)
        if isinstance(x, (list, tuple)):
            if isinstance(x, list):
                self.containers.append(x)
            return (type(x), tuple(self.state_object(v, depth + 1) for v in x))
        if isinstance(x, dict):
            self.containers.append(x)
            return (type(x), tuple((self._dict_key(k), self.state_object(v, depth + 1)) for k, v in x.items()))
        if not plain_object(x):
            return (type(x), x) if isinstance(x, VALUE_TYPES) else None
        if isinstance(x, torch.optim.Optimizer):  # one another object holds (Accelerate's AcceleratedOptimizer)
            _traceable_optimizer(x)
        self.seen[id(x)] = len(self.objects)
        self.objects.append(x)
        items = []
        for name, value in vars(x).items():
            if isinstance(value, (torch.Tensor, torch.nn.Module, list, tuple, dict)) or plain_object(value):
                items.append((name, self.state_object(value, depth + 1)))
            elif isinstance(value, VALUE_TYPES):
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
        object's walk (`state_object`) is kept on the side (`KeptWalk`) and replayed by the next call that starts
        it where this one did (after as many objects, buffers, tensors and containers found) and finds nothing it
        read changed."""
        if isinstance(x, torch.optim.Optimizer) and id(x) not in self.seen:
            _traceable_optimizer(x)
        if id(x) in self.seen or not (isinstance(x, torch.nn.Module) or plain_object(x)):
            return self.state_object(x)
        start = self.position()
        for walk in _kept_walks_of(x):
            if walk.start == start and walk.inputs_type is type(self) and walk.replay(self, x):
                return walk.key
        self.walk_start, self.reached_back = start[:2], False
        key = self.state_object(x)
        if not self.reached_back:
            _keep_walk(x, KeptWalk(self, x, key, start))
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
        # `training` as an attribute: `torch.compile`'s `OptimizedModule` holds none, its property reads the mode
        # of the module it wraps (`_orig_mod`, a submodule of it, walked with it)
        return (type(m), m.training, tuple(tensors))

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
    their type and fields; `Unkeyable` for anything else that is unhashable."""
    if isinstance(context, (list, tuple)):
        return (type(context), tuple(map(_frozen, context)))
    if isinstance(context, dict):
        return (dict, tuple((k, _frozen(v)) for k, v in context.items()))
    if dataclasses.is_dataclass(context) and not isinstance(context, type):
        return (type(context), tuple((f.name, _frozen(getattr(context, f.name))) for f in dataclasses.fields(context)))
    try:
        hash(context)
    except TypeError:
        raise Unkeyable(f"a tensor subclass's flattening holds an unhashable {type(context).__name__}") from None
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


class KeptWalk:
    """One state object's walk (`Inputs.root`): its key and what it added to the inputs, kept to be replayed. A
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

    # what a walk adds to `Inputs`, replayed, with the count of `Inputs.position()` each is indexed by: lists
    # (the part from the walk's start on), and dicts of positions (the entries from it on); `buffers` and `slots`
    # are found again
    ADDED_LISTS = {"objects": 0, "users": 1, "buffer_keys": 1, "tensors": 2, "containers": 3}
    ADDED_POSITIONS = {"seen": 0, "tensor_index": 2}

    def __init__(self, inputs: "Inputs", root, key: tuple, start: tuple):
        """The walk of `root` that just filled `inputs` from `start` (`Inputs.position()`), whose key is `key`."""
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
        self.added = {name: getattr(inputs, name)[start[count]:] for name, count in KeptWalk.ADDED_LISTS.items()}
        self.added.update({name: {k: v for k, v in getattr(inputs, name).items() if v >= start[count]}
                           for name, count in KeptWalk.ADDED_POSITIONS.items()})
        del self.added["objects"][0]  # the root, appended again at a replay
        self.added["leaves"] = [t for t in inputs.leaves if inputs.tensor_index[id(t)] >= tensors_start]
        self.device_index = inputs.device_index
        self.inputs_type = type(inputs)  # a walk of another kind (`hf_tpu.direct.call(inputs_type=)`) keys other things

    def holds(self, x) -> bool:
        """Whether the walk holds `x` (kept under `x`, it would keep it alive)."""
        return any(value is x for value in itertools.chain(self.values, *self.items))

    def replay(self, inputs: "Inputs", root) -> bool:
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
        if not all(same_value(now, before) or (_unkeyed(now) and _unkeyed(before)) for now, before in changed):
            return False
        if _layouts(self.tensors) != self.layouts or list(map(_requires_grad, self.tensors)) != self.requires_grad:
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


# state object -> its last kept walks (`KeptWalk`), the latest first, dropped with the object. Two: a static
# cache is walked by the prefill, whose layers then hold functions of its own (`_attending_to_the_prompt_only` in
# the Transformers adapter), and by the decode loop, whose layers do not: `generate()` alternates the two.
kept_walks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_WALKS_KEPT = 2


def _kept_walks_of(x) -> tuple:
    try:
        return kept_walks.get(x, ())
    except TypeError:  # an object without identity hashing: its walks are not kept
        return ()


def _keep_walk(x, walk: KeptWalk) -> None:
    if walk.holds(x):
        return
    try:
        kept_walks[x] = (walk, *kept_walks.get(x, ()))[:_WALKS_KEPT]
    except TypeError:  # not weakly referable, or unhashable
        pass


def _unkeyed(x) -> bool:
    """A value no walk keys (a function, a class, a JAX object): one replaced by another changes no key."""
    return not isinstance(x, (torch.Tensor, torch.nn.Module, list, tuple, dict) + VALUE_TYPES) and not plain_object(x)


def same_value(a, b) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, VALUE_TYPES) and a == b)


def _call_key(inputs: Inputs, functions, args, kwargs) -> tuple:
    """The key of one call, besides its site; fills `inputs`."""
    # state first: a module found among the arguments then keys by its place among the state objects
    state = tuple(inputs.root(o) for o in tuple(inputs.state))
    arguments = inputs.argument((tuple(function_parts(f)[1] for f in functions), args, kwargs))
    gradients = inputs.gradients()
    return (state, arguments, gradients, tuple(inputs.buffer_keys), torch.get_default_dtype(),
            torch.is_autocast_enabled("tpu"), torch.get_autocast_dtype("tpu"), torch.get_float32_matmul_precision())


def key_text(key) -> str:
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
    elif isinstance(x, VALUE_TYPES):
        parts.append(repr(x))
    elif isinstance(x, type):
        parts.append(f"{x.__module__}.{x.__qualname__}")
    elif isinstance(x, types.CodeType):
        parts.append(f"{x.co_filename}:{x.co_qualname}:{x.co_firstlineno}")
    else:
        parts.append(f"<{type(x).__module__}.{type(x).__qualname__}>")


class Key(tuple):
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


def prepare(site, functions, args, kwargs, state, inputs_type=Inputs) -> tuple:
    """(inputs, key) of a call, or raises `Unkeyable`."""
    inputs = inputs_type(_state_objects(state))
    return inputs, Key((site, _call_key(inputs, functions, args, kwargs)))
