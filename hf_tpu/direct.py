"""`hf_tpu.jit`: a Python function traced straight into one XLA program, without Dynamo or AOT autograd.

`torch.compile(backend="tpu")` pays Dynamo's bytecode analysis and AOT autograd's functionalization before
`hf_tpu.compile` traces the ATen graph they produce; for a model's forward that capture costs several times
the trace itself, and no disk cache keeps it. Here the Python function runs once, as it is, on `tpu`
tensors whose buffers hold JAX tracers, under the mode `hf_tpu.tracing.Tracing` (every op goes through the
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
made `capturable` and its learning rates tpu tensors (`trace_inputs._traceable_optimizer`), so a schedule's
new rate is an input's new value. The state an optimizer makes at its first step (entries added to a dict of
the state) is an output the call adds; the next call, whose state then holds it, traces its own program.

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
(`trace_inputs.KeptWalk`; the parameters' `.grad`s are keyed after the walks, each call). NOT guarded, as with
`jax.jit`: globals the function reads other than modules and optimizers, attributes of modules other than
`training` and their tensors (a `config` object's fields, a module's Python-number attributes, the checkpoint
function `gradient_checkpointing_enable()` sets), the objects such attributes hold, and the content of a tensor
that is not an input (a `tpu` tensor reached only through a global or an unlisted object is read as a constant
of the program). Change such a thing and the next call runs the program traced before it.

The call's inputs and key are found by `hf_tpu.trace_inputs`, its trace made by `hf_tpu.trace_program`; this
module keeps the programs by key, launches them (compiled meanwhile, where `jit(meanwhile=)` asks) and runs
`hf_tpu.while_loop`'s traced step.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time

import jax
import torch
from torch.utils import _pytree as pytree

from . import compile_log, disk_cache, loop_chunks, modes, remat
# torch.compile's backend: its patches to Dynamo (a tpu optimizer made capturable, a tpu generator taken as a CPU
# one) are in place before a call that falls back to Dynamo (`hf_tpu.compiled_modules`) has Dynamo trace anything
from . import compile as dynamo_backend  # noqa: F401
from .device_state import rng
from .loop_chunks import loop_chunk
from .memory import buffer, donation, placement, tensor_views
from .modes import device_errors
from .trace_inputs import Inputs, Unkeyable, function_parts, key_text, prepare
from .trace_program import Program, PythonStateChanged, renamed, restore, trace
from .tracing import UNTRACEABLE, Untraceable, count_launch, donatable, finish_call, launching

log = logging.getLogger("hf_tpu.compile")

_PROGRAMS_PER_SITE = 64  # programs one function code may trace; then new keys fall back, as Dynamo's limit does


_NOT_TRACEABLE = object()  # the cache's entry for a key whose trace failed
_programs: dict = {}  # (site, key) -> Program or _NOT_TRACEABLE
_site_counts: dict = {}  # site -> programs traced for it


def reset() -> None:
    """Forget every traced program (and which calls could not be traced), as `torch.compiler.reset()` makes
    Dynamo forget its graphs."""
    _programs.clear()
    _site_counts.clear()
    _host_seconds.clear()
    _trace_seconds.clear()


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


def _expect_from_disk(key, device_index: int) -> str | None:
    """For a key new to this process: the name its program has in the disk cache, its load from there started beside
    the trace where a process before named one (`disk_cache.expect`); None where the disk cache is off."""
    return disk_cache.expect(key_text(key), device_index) if disk_cache.enabled() else None


def _traced_program(key, name: str, run, inputs: Inputs, arrays: list, description: str, inputs_text,
                    function: str, disk_digest: str | None, keep_changes: bool = False):
    """The program cached for `key`, traced now if there is none (its first compile then named `disk_digest` in
    the disk cache); raises what a failed trace raised (and every later call with this key gets `Untraceable` at
    once, unless the trace raised `PythonStateChanged`: `keep_changes`, see `trace`). Every trace counts towards
    the site's limit, a failed one too."""
    program = _programs.get(key)
    if program is _NOT_TRACEABLE:
        raise Untraceable("an earlier call with these inputs could not be traced")
    if program is not None:
        return program
    site = key[0]
    if _site_counts.get(site, 0) >= _PROGRAMS_PER_SITE:
        raise Untraceable(f"{_PROGRAMS_PER_SITE} programs were traced for it already")
    started = time.perf_counter()
    pending = compile_log.begin(description, "hf_tpu.jit", function, started, captured=True,
                                capture="Python trace")
    compile_log.describe(description, "hf_tpu.jit", inputs_text)
    _site_counts[site] = _site_counts.get(site, 0) + 1
    try:
        program = trace(name, run, inputs, arrays, keep_changes)
    except UNTRACEABLE as e:
        compile_log.end(pending, finished=False)
        if not isinstance(e, PythonStateChanged):
            _programs[key] = _NOT_TRACEABLE
        raise
    program.disk_digest = disk_digest
    _programs[key] = program
    _trace_seconds[site] = time.perf_counter() - started
    _host_seconds.pop(key, None)
    return program


def _arrays(inputs: Inputs) -> list:
    modes.current().sync("a traced function runs")
    arrays = [buf.value() for buf in inputs.buffers]
    return placement.place_together(arrays) if buffer.sharded_arrays_exist else arrays


def call(fn, args: tuple, kwargs: dict, state=(), fallback=None, meanwhile=None, trace_after: float = 0.0,
         inputs_type=Inputs, changed_before: tuple | None = None):
    """`fn(*args, **kwargs)` as one traced program (see the module's docstring); `fallback(*args, **kwargs)`
    where it cannot be. With `meanwhile`, a call whose program the device has not compiled yet returns
    `meanwhile(*args, **kwargs)` instead (see `jit`). `inputs_type` is the class that walks the call's inputs and
    keys them (`Inputs`, or a subclass that keys more: `hf_tpu.compiled_modules`).

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
        inputs, key = prepare(function_parts(fn)[0], (fn,), args, kwargs, state, inputs_type)
    except (Unkeyable, TypeError) as e:
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
    except PythonStateChanged as e:
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
    count_launch(arrays)
    for slot, array in zip(program.mutated, new):
        inputs.buffers[slot].array = array
    finish_call(inputs.device_index, program.draws, program.checks, checked)
    return program.results(new[len(program.mutated):], inputs)


def lower(fn, args: tuple, kwargs: dict, state=(), device=None, platform: str | None = None):
    """The program `call` would run for these inputs (traced now if it has not been), as JAX's `Lowered`: its
    `.compile().memory_analysis()` gives the device memory it takes, `.as_text()` its StableHLO. Raises what
    makes the call fall back. With `device` (a JAX device, such as one of a TPU topology's that
    `jax.experimental.topologies` describes without the chip), lowered for that device from the inputs' shapes
    alone: what the program would take there, found without running it. With `platform` (`"tpu"`), the StableHLO
    JAX gives that platform's compiler, found without its compiler (not to be compiled here)."""
    name = _name_of(fn)
    inputs, key = prepare(function_parts(fn)[0], (fn,), args, kwargs, state)
    if inputs.device_index is None:
        raise Unkeyable("no tpu tensor among its inputs")
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
    if platform is not None:
        return program.jitted[donate].trace(mutated, others, key_data).lower(lowering_platforms=(platform,))
    return program.jitted[donate].lower(mutated, others, key_data)


def _own_arrays(inputs: Inputs, slots: tuple, arrays: list) -> None:
    """Each array the program overwrites (at `slots` of `arrays`) made its buffer's alone, so the program can take it
    (donated: XLA writes the new value in its memory), and committed to its device, as the program's results that
    replace it are. Small equal values share one uploaded array (the norms' weights of a model, all ones), and a
    whole-tensor `copy_` shares its source's: such an array is copied for the buffer that the program overwrites,
    once, and the program's result is its own from then on. One shared array would make the call run a program
    that donates nothing: compiled a second time beside the donating one, and holding every parameter and moment
    twice. An array a factory made (`torch.zeros`: an optimizer's moments and step counts), or a program that reads
    no committed input (the Trainer's zero gradients), is not committed to its device, and JAX keys a jitted function
    by that: the second call, over the first call's committed results, lowered and compiled the whole step again.
    Such an array, its buffer's alone, is committed where it lies (`jax.device_put` to its own sharding makes a
    committed array over the same memory): copied, it was a second write and read of every zero gradient of each
    accumulation window (the 0.44B's float32 gradients: 3.7 GB a step). Each kind is one `jax.device_put` of a list:
    one call per array took 85 us of the host's time on the development CPU, 19 ms for a 24-layer Llama's gradients."""
    copied, committed = [], []
    for slot in slots:
        array = arrays[slot]
        if inputs.buffers[slot]._array is not array and buffer.allocator.holders(array) == 0:
            # a single-chip array placed on the mesh of a sharded call (`_arrays`) for the program: the buffer
            # takes that copy, as it takes the program's result on the mesh after it. Kept apart, the first call
            # donated nothing, held its state twice, and the next one compiled the program again, donating
            inputs.buffers[slot].array = array
            continue
        if buffer.allocator.holders(array) > 1:
            copied.append(slot)
        elif not array.committed:
            committed.append(slot)
    for chosen, may_alias in ((copied, False), (committed, None)):
        if not chosen:
            continue
        chosen_arrays = [arrays[slot] for slot in chosen]
        owned = jax.device_put(chosen_arrays, [a.sharding for a in chosen_arrays], may_alias=may_alias)
        for slot, array, own in zip(chosen, chosen_arrays, owned):
            if inputs.buffers[slot]._array is array:
                inputs.buffers[slot].array = own
            arrays[slot] = own


def ready(fn, args: tuple, kwargs: dict, state=(), inputs_type=Inputs) -> bool:
    """Whether `call` of `fn` with these arguments would launch a program compiled already (traces nothing, waits for
    no compile)."""
    try:
        _, key = prepare(function_parts(fn)[0], (fn,), args, kwargs, state, inputs_type)
    except (Unkeyable, TypeError):
        return False
    program = _programs.get(key)
    return isinstance(program, Program) and (program.launched or any(
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
        restore(changes)
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


def _device_compile(key, program: Program, donate: bool, mutated: list, others: list, key_data):
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


def while_loop(cond_fn, body_fn, carried: tuple, state, run: bool = True, lower_for=None):
    """`hf_tpu.while_loop` with its step traced straight into a program; raises `loop_chunks.NotLoopable` where it
    cannot be (before any iteration ran). The loop's first condition is traced too (`_first_condition`) and
    computed inside the loop's program. With `run=False`, the loop's XLA compile starts on a thread of its
    own (`compile_log.in_background`) and nothing runs: the first call that runs the program waits for it.
    With `lower_for` (a JAX device, as `lower`'s `device`), nothing runs or compiles either: the loop's first
    chunk, lowered for that device from the inputs' shapes alone, is returned as JAX's `Lowered` (what XLA makes
    of the decode loop on a TPU, read on a machine without one: `benchmarks.quant_hlo --decode`)."""
    name = _name_of(body_fn)
    description = f"the direct trace of the while_loop step `{name}`"
    site = ("while_loop", function_parts(body_fn)[0], function_parts(cond_fn)[0])
    step = _loop_step(cond_fn, body_fn)
    try:
        inputs, key = prepare(site, (body_fn, cond_fn), carried, {}, state)
    except (Unkeyable, TypeError) as e:
        raise loop_chunks.NotLoopable(f"{type(e).__name__}: {e}") from e
    disk_digest = _expect_from_disk(key, inputs.device_index) if _programs.get(key) is None else None
    carried_slots = [inputs.tensors[inputs.tensor_index[id(t)]][1] for t in carried]
    for t, slot in zip(carried, carried_slots):
        if inputs.users[slot] != 1 or tensor_views.view_of(t, inputs.buffers[slot]) is not None:
            raise loop_chunks.NotLoopable("a carried tensor shares its storage with another input")
    arrays = _arrays(inputs)
    try:
        program = _traced_program(key, name, lambda: step(*carried), inputs, arrays, description,
                                  lambda: _arguments_text(carried, {}, inputs.state, "carried"), f"loop_{name}",
                                  disk_digest)
        _check_loopable(program, carried, carried_slots)
        if program.loop_condition is None:
            program.loop_condition = _first_condition(name, cond_fn, carried, inputs, arrays)
    except UNTRACEABLE as e:
        compile_log.end(finished=False)
        _programs[key] = _NOT_TRACEABLE
        raise loop_chunks.NotLoopable(f"{type(e).__name__}: {e}") from e
    _own_arrays(inputs, program.mutated, arrays)
    mutated, others = donation.split(arrays, program.mutated)
    slots = tuple(slot - sum(m < slot for m in program.mutated) for slot in carried_slots)
    # the loop's record of out-of-range indices rides last among the carried values (`loop_chunk`)
    carried_arrays = [*(tensor_views.array_of(t) for t in carried), device_errors.no_errors(inputs.device_index)]
    if buffer.sharded_arrays_exist:  # a sharded model's loop carries single-chip tokens
        carried_arrays = placement.place_together([*arrays, *carried_arrays])[len(arrays):]
    compiled_before = program.loop_jitted is not None
    if not compiled_before:
        condition, overwritten_slots = program.loop_condition, program.mutated

        def first_condition(overwritten, others, rng_base):
            return condition.step([], donation.join(overwritten_slots, overwritten, others), rng_base)[0][0]

        chunk = renamed(f"loop_{name}", functools.partial(loop_chunk, lambda *a: (*program.step(*a), program.checks),
                                                          condition=first_condition))
        program.loop_jitted = {True: jax.jit(chunk, donate_argnums=(0,), static_argnums=(3,)),
                               False: jax.jit(chunk, static_argnums=(3,))}
    jitted = program.loop_jitted[donatable(mutated)]
    key_data = rng.current_key(inputs.device_index)

    disk_digest, program.disk_digest = program.disk_digest, None  # the loop's first compile is the one named

    def launch(loop_state, steps):  # each chunk computes whether to go on from its first state: none is passed
        overwritten, carried_state, _, count = loop_state
        arguments = [*overwritten, *others, *carried_state]  # before the launch donates the overwritten ones
        with disk_cache.compiling(disk_digest):
            launched = jitted(overwritten, others, key_data, slots, carried_state, None, count, steps)
        count_launch(arguments)
        return launched

    if lower_for is not None:
        sharding = jax.sharding.SingleDeviceSharding(lower_for)
        first = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                             (loop_chunks.first_chunk(mutated, carried_arrays, None), others, key_data))
        (overwritten, *rest), others_shapes, key_shape = first
        return jitted.lower(overwritten, others_shapes, key_shape, slots, *rest)
    if not run:
        if not compiled_before:  # lowered as the first chunk's launch will be: the compile serves it
            first = loop_chunks.first_chunk(mutated, carried_arrays, None)

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
            final = loop_chunks.run_in_chunks(launch, (mutated, carried_arrays, None),
                                              lambda: rng.advance(inputs.device_index, program.draws), interrupted)
    except (*UNTRACEABLE, ValueError) as e:
        compile_log.end()
        _programs[key] = _NOT_TRACEABLE
        raise loop_chunks.NotLoopable(f"{type(e).__name__}: {e}") from e
    for slot, array in zip(program.mutated, final[0]):
        inputs.buffers[slot].array = array
    *final_carried, record = final[1]
    sites = device_errors.loop_sites(program.checks)
    if sites is not None:
        modes.merge_index_record(record, inputs.device_index, sites)
    return tuple(buffer.new_tensor(a.shape, t.dtype, inputs.device_index, a) for t, a in zip(carried, final_carried))


def _first_condition(name: str, cond_fn, carried: tuple, inputs: Inputs, arrays: list) -> Program:
    """`cond_fn(*carried)` traced alone over the loop's inputs, for its chunks to compute the loop's first condition
    inside their program (`loop_chunk`'s `condition`): evaluated eagerly, its few ops (a comparison, a reduction)
    were each an XLA program of its own, compiled at every process's first loop. It may only read."""
    condition = trace(f"{name}_condition", lambda: cond_fn(*carried), inputs, arrays, counted=False)
    if condition.mutated or condition.checks or condition.draws or condition.grads or condition.additions:
        raise Untraceable("a while_loop condition may only read its inputs (no write, check or random draw)")
    if len(condition.outputs) != 1 or condition.outputs[0][0] != "new":
        raise Untraceable("a while_loop condition must return a tensor it makes")
    return condition


def _wait_for_compile_ahead(program: Program) -> None:
    """Wait for the loop's compile started ahead, whose program JAX then finds in its cache for the launch. One
    that failed is left to the launch, which compiles again and raises what the compile raises."""
    compiling, program.loop_compiling = program.loop_compiling, None
    if compiling is not None:
        try:
            compiling.result()
        except Exception as e:  # noqa: BLE001 - raised again by the launch's own compile
            log.info("hf_tpu: the loop's compile started ahead failed (%s: %s)", type(e).__name__, e)


def _check_loopable(program: Program, carried: tuple, carried_slots: list) -> None:
    if set(carried_slots) & set(program.mutated):
        raise Untraceable("the step updates a carried tensor in place")
    if not device_errors.loop_can_fold(program.checks):  # a record of out-of-range indices rides along
        raise Untraceable("a while_loop step cannot check device values (a linalg error, an assert)")
    kinds = [spec[0] for spec in program.outputs]
    if len(kinds) != len(carried) + 1 or any(kind != "new" for kind in kinds):
        raise Untraceable("a while_loop step must return as many tensors as it carries")
    for t, (_, dtype) in zip(carried, program.outputs):  # each ("new", dtype)
        if dtype != t.dtype:
            raise Untraceable("a while_loop step must return tensors of the carried dtypes")


remat.install()
