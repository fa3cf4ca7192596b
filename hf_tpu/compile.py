"""The `torch.compile` backend named `tpu`.

Dynamo captures a graph, AOT autograd turns it into functional ATen graphs (forward, and backward
when training; input mutations such as a static KV cache written by `index_copy_` become outputs
that are copied back, which on `tpu` only rebinds a buffer to the new array, and the old array is
donated to the program so XLA writes the update in place). Each ATen graph is then
traced once into a `jax.jit` function by running it on `tpu` tensors whose buffers hold JAX tracers:
every node goes through the same dispatch and lowering table as eager execution. A graph that
cannot be traced (an op without a lowering, a host read) runs in the eager mode in force instead.
"""

from __future__ import annotations

import contextlib
import logging
import time

import jax
import jax.numpy as jnp
import torch

from . import compile_log, constant_masks, loop_chunks, modes, platform
from .device_state import current, rng
from .dispatch import _entry
from .memory import buffer, donation, host_transfers, placement, tensor_views
from .modes import device_errors
from .loop_chunks import loop_chunk
from .tracing import UNTRACEABLE, Tracing, count_trace, donatable, finish_call, launching

log = logging.getLogger("hf_tpu.compile")


class LoopRequest:
    """What a compiled step needs to run as a loop (`looping`): the carried tensors (to find among the graph's
    inputs) and `cond_fn` of them (whether the first iteration runs); `taken` once a graph ran the loop."""

    def __init__(self, carried: tuple, keep_going: torch.Tensor):
        self.carried = carried
        self.keep_going = keep_going
        self.taken = False


# the loop request for the next compiled graph call; set only within `looping`
_requested: list = [None]


@contextlib.contextmanager
def looping(carried: tuple, keep_going: torch.Tensor):
    """Within: the next compiled graph called (the step `hf_tpu.while_loop` compiles with `torch.compile`) runs the
    whole loop over `carried`, in chunks (`loop_chunks.run_in_chunks`), rather than one iteration, or raises
    `loop_chunks.NotLoopable` before any iteration ran. Yields the `LoopRequest`, `taken` once a graph took it (a
    step without a tensor op makes no graph: its call ran it once)."""
    request = _requested[0] = LoopRequest(carried, keep_going)
    try:
        yield request
    finally:
        _requested[0] = None


class _CompiledGraph:
    """One ATen graph as one jitted JAX function over its tensor inputs."""

    def __init__(self, gm: torch.fx.GraphModule, overwritten: tuple = (), loopable: bool = False,
                 description: str = "a torch.compile graph", input_names: tuple = ()):
        self.gm = gm
        self.overwritten = overwritten
        self.description = description  # what the compile log calls it
        self.input_names = input_names  # the user's name of each input (None for parameters and buffers)
        # the compile Dynamo began for this graph (`hf_tpu.compile_log`), until a first call in a loop says
        # which JAX function compiles
        self.pending_compile = None
        # outputs PyTorch computes on the CPU (from CPU inputs, e.g. a non-capturable optimizer's step
        # count): computed on the device with the rest, then read back, as the graph's users expect them
        outputs = gm.graph.find_nodes(op="output")[0].args[0]
        self.host_outputs = frozenset(
            k for k, node in enumerate(outputs if isinstance(outputs, (list, tuple)) else (outputs,))
            if isinstance(node, torch.fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)
            and node.meta["val"].device.type == "cpu"
        )
        # keyed by whether the overwritten inputs are donated (see _donatable). The graph's non-tensor
        # inputs (sizes, under dynamic shapes) are static: each set of values traces anew, as each new set
        # of input shapes does, so the sizes the graph returns are Python numbers.
        self.jitted = {True: jax.jit(self._trace, donate_argnums=(0,), static_argnums=(2,)),
                       False: jax.jit(self._trace, static_argnums=(2,))}
        self.loop_jitted = {True: jax.jit(self._loop, donate_argnums=(0,), static_argnums=(2, 4)),
                            False: jax.jit(self._loop, static_argnums=(2, 4))}
        self.loopable = loopable
        self.eager = False
        # per set of non-tensor inputs (sizes, under dynamic shapes): the graph traced for them (`_graph_for`)
        self.graphs_by_sizes = {}
        # per (input shapes, non-tensor inputs): each output's (dtype, device) or value, each check's
        # (dtype, raise_if_bad), and how many random ops the graph has (the offsets a call takes)
        self.out_meta = {}
        self.traced_checks = []  # each check's (dtype, raise_if_bad) of the latest trace: a loop step's (`_loop`)

    def _trace(self, overwritten_arrays, other_arrays, values, rng_base):
        count_trace()
        arrays = donation.join(self.overwritten, overwritten_arrays, other_arrays)
        compile_log.describe(self.description, "torch.compile", lambda: _inputs_text(self.input_names, arrays))
        inputs = []
        for spec, array, value in zip(self.in_specs, arrays, values):
            if spec is None:
                inputs.append(value)
            else:
                inputs.append(buffer.new_tensor(array.shape, spec[0], spec[1], array))
        tracer = Tracing(rng_base)
        saved = modes.replace_current(tracer)
        try:
            with torch.no_grad():
                outputs = self._graph_for(values)(*inputs)
        finally:
            modes.replace_current(saved)
        if not isinstance(outputs, (list, tuple)):
            outputs = (outputs,)
        # A CPU tensor made inside the graph depends on no input (every input is on tpu here): a
        # constant, as AOT autograd's effect token (an empty tensor ordering `_assert_async` and the
        # linalg checks) is
        constant = [isinstance(o, torch.Tensor) and o.is_cpu for o in outputs]
        self.traced_checks = [(value.dtype, raise_if_bad) for value, raise_if_bad in tracer.checks]
        self.out_meta[_meta_key(arrays, values)] = (
            [(o.dtype, None if k in self.host_outputs else o.device.index)
             if isinstance(o, torch.Tensor) and not constant[k] else o for k, o in enumerate(outputs)],
            self.traced_checks,
            tracer.draws,
        )
        # the values the graph checks (a linalg `info`, an assert's condition) are outputs too, checked
        # after the call as eager ops check them, so such a graph still runs compiled
        return ([tensor_views.array_of(o) if isinstance(o, torch.Tensor) and not constant[k] else None
                 for k, o in enumerate(outputs)],
                [tensor_views.array_of(value) for value, _ in tracer.checks])

    def _graph_for(self, values: tuple) -> torch.fx.GraphModule:
        """The graph to trace for these non-tensor inputs. Under dynamic shapes they are the sizes, and an
        attention mask computed from sizes alone is a constant once they are known: a copy of the graph with
        them written in, where `constant_masks` recognised such a mask; else the graph itself."""
        sizes = {k: v for k, v in enumerate(values) if type(v) is int}
        if not sizes:
            return self.gm
        if values not in self.graphs_by_sizes:
            self.graphs_by_sizes[values] = constant_masks.with_sizes(self.gm, sizes) or self.gm
        return self.graphs_by_sizes[values]

    def __call__(self, *args):
        request = _requested[0]
        if request is not None:
            _requested[0], request.taken = None, True
            return self._run_loop(args, request)
        if self.eager:
            return self.gm(*args)
        modes.current().sync("a compiled graph runs")
        arrays, values, device_index = self._read_inputs(args)
        overwritten, others = donation.split(arrays, self.overwritten)
        jitted = self.jitted[self._donatable(args, overwritten)]
        try:
            # the graph's random ops take the device's next offsets, the ones eager ops would take;
            # how many is known once it is traced (a graph without random ops takes none, as in PyTorch)
            with launching(device_index, f"a compiled graph of {len(self.gm.graph.nodes)} nodes"):
                results, checked = jitted(overwritten, others, values, rng.current_key(device_index))
        except UNTRACEABLE as e:
            compile_log.end()
            self.eager = True
            log.warning("hf_tpu: a compiled graph runs in the eager mode instead (%s: %s)", type(e).__name__, e)
            return self.gm(*args)
        metas, checks, draws = self._meta(arrays, values)
        finish_call(device_index, draws, checks, checked)
        return self._outputs(metas, results)

    def _read_inputs(self, args) -> tuple:
        """(arrays, non-tensor values, device index) of a call's inputs; notes their specs for tracing. The common
        case, every input a whole buffer on one chip (a model's parameters and its token ids), is read in C
        (`_entry.whole_arrays`): a 16-layer Llama's 149 inputs took 0.24 ms a call in the loop below on the
        development CPU."""
        whole = _entry.whole_arrays(args)
        if whole is not None:
            arrays, self.in_specs, device_index = whole
            if buffer.sharded_arrays_exist:
                arrays = placement.place_together(arrays)
            return arrays, (None,) * len(args), device_index
        in_specs, arrays, values = [], [], []
        device_index = None
        host = []  # positions of CPU tensors: uploaded once the call's device is known
        for a in args:  # one pass: this runs before every call of the graph (each decoded token)
            if isinstance(a, torch.Tensor):
                if a.is_cpu:
                    host.append(len(arrays))
                    in_specs.append(None)
                    arrays.append(None)
                    values.append(None)
                    continue
                buf = buffer.buffer_of(a)
                if device_index is None:
                    device_index = buf.device_index
                in_specs.append((a.dtype, buf.device_index))
                arrays.append(tensor_views.array_of(a, buf))
                values.append(None)
            else:
                in_specs.append(None)
                arrays.append(None)
                values.append(a)
        if device_index is None:
            device_index = current.current_device_index()
        for i in host:
            in_specs[i] = (args[i].dtype, device_index)
            arrays[i] = host_transfers.from_host(args[i], device_index)
        self.in_specs, values = in_specs, tuple(values)
        if buffer.sharded_arrays_exist:  # a sharded model meets single-chip inputs (the token ids)
            arrays = placement.place_together(arrays)
        return arrays, values, device_index

    def _meta(self, arrays, values) -> tuple:
        """(each output's meta, each check's dtype and raise_if_bad, the number of random ops) noted when
        these inputs were traced."""
        # with one entry (static shapes, the common case) it is that one, and 40-odd input shapes need
        # not be hashed on every call
        if len(self.out_meta) == 1:
            return next(iter(self.out_meta.values()))
        return self.out_meta[_meta_key(arrays, values)]

    def _outputs(self, metas, results) -> list:
        outs = []
        for meta, array in zip(metas, results):
            if array is None:
                outs.append(meta.clone() if isinstance(meta, torch.Tensor) else meta)
            elif meta[1] is None:
                modes.host_read("a compiled graph returns a CPU tensor")
                outs.append(host_transfers.to_host(array, meta[0]))
            else:
                outs.append(buffer.new_tensor(array.shape, meta[0], meta[1], array))
        return outs

    # --- hf_tpu.while_loop: this graph is one iteration, returning the mutated inputs' new values, then
    # the new carried tensors, then whether to go on

    def _refuse_loop(self, reason: str):
        """The step runs as the Python loop: the compile begun for this graph, still open when this is its
        first call, ends unfinished (left open, it would stand for every compile after it)."""
        if self.pending_compile is not None:
            compile_log.end(self.pending_compile, finished=False)
            self.pending_compile = None
        raise loop_chunks.NotLoopable(reason)

    def _run_loop(self, args, request):
        if self.eager or not self.loopable:
            self._refuse_loop("the step's graph cannot be traced, or it mutates an input that it cannot carry")
        if any(isinstance(a, torch.Tensor) and a.device.type != "tpu" for a in args):
            self._refuse_loop("the step reads a tensor that is not on tpu")
        slots = []  # each carried tensor's position among the non-overwritten inputs (None: not an input)
        for t in request.carried:
            position = next((i for i, a in enumerate(args) if a is t), None)
            if position in self.overwritten:
                self._refuse_loop("the step updates a carried tensor in place")
            slots.append(None if position is None else position - sum(p < position for p in self.overwritten))
        modes.current().sync("a compiled loop runs")
        arrays, values, device_index = self._read_inputs(args)
        overwritten, others = donation.split(arrays, self.overwritten)
        carried = [*(tensor_views.array_of(t) for t in request.carried), device_errors.no_errors(device_index)]
        keep_going = tensor_views.array_of(request.keep_going)
        if buffer.sharded_arrays_exist:  # a sharded model's loop carries single-chip tokens
            *carried, keep_going = placement.place_together([*arrays, *carried, keep_going])[len(arrays):]
        # a chunk's results are the next chunk's inputs: donated when the loop's first inputs are
        jitted = self.loop_jitted[self._donatable(args, overwritten)]
        if self.pending_compile is not None:  # the first call is a loop's: `_loop` compiles, not `_trace`
            self.pending_compile.function, self.pending_compile = "_loop", None
        key = rng.current_key(device_index)

        def launch(state, steps):
            return jitted(state[0], others, values, key, tuple(slots), state[1], state[2], state[3], steps)

        def started():  # the first chunk is traced: iteration j draws from offsets + j * 2**32
            rng.advance(device_index, self._meta(arrays, values)[2])

        try:
            with launching(device_index, f"a compiled loop of {len(self.gm.graph.nodes)} nodes"):
                state = loop_chunks.run_in_chunks(launch, (overwritten, carried, keep_going), started,
                                                  lambda state: self._keep_interrupted_state(args, state[0]))
        except (*UNTRACEABLE, ValueError) as e:
            compile_log.end()
            raise loop_chunks.NotLoopable(f"{type(e).__name__}: {e}") from e
        overwritten, (*carried, record), keep_going, _ = state
        metas, checks, _ = self._meta(arrays, values)
        sites = device_errors.loop_sites(checks)
        if sites is not None:
            modes.merge_index_record(record, device_index, sites)
        return self._outputs(metas, [*overwritten, *carried, keep_going])

    def _keep_interrupted_state(self, args, overwritten_arrays) -> None:
        """A loop stopped by Ctrl-C leaves the inputs it updates (a KV cache) with the values of its last
        chunk launched: the arrays they held were donated to the chunks."""
        for i, array in zip(self.overwritten, overwritten_arrays):
            buf = buffer.buffer_of(args[i])
            if tensor_views.view_of(args[i], buf) is None and not array.is_deleted():
                buf.array = array

    def _loop(self, overwritten_arrays, other_arrays, values, rng_base, slots, carried, keep_going, count, steps):
        """One chunk of the loop, with this graph as its step."""
        def step(overwritten, others, key):
            return (*self._trace(overwritten, others, values, key), self.traced_checks)

        return loop_chunk(step, overwritten_arrays, other_arrays, rng_base, slots, carried, keep_going, count, steps)

    def _donatable(self, args, overwritten_arrays) -> bool:
        """A donated array is gone after the call: only whole buffers that no other live buffer
        shares and that are passed once may be given to XLA."""
        return donatable(overwritten_arrays) and all(
            tensor_views.view_of(args[i], buffer.buffer_of(args[i])) is None for i in self.overwritten)


def _meta_key(arrays, values) -> tuple:
    return tuple(None if a is None else a.shape for a in arrays), values


def _inputs_text(names, arrays, most: int = 6) -> str:
    """The graph's inputs other than parameters and buffers, as `input_ids int64[1, 128]`, for the compile log."""
    from . import dtypes

    if len(names) != len(arrays):
        names = [f"input {k}" for k in range(len(arrays))]
    shown = [f"{name} {str(dtypes.to_torch(a.dtype)).removeprefix('torch.')}{list(a.shape)}"
             for name, a in zip(names, arrays) if name is not None and a is not None]
    more = f" and {len(shown) - most} more" if len(shown) > most else ""
    return ", ".join(shown[:most]) + more


def _input_names(gm: torch.fx.GraphModule) -> tuple:
    """Each of Dynamo's graph inputs by the name the user's code gives it (`l_kwargs_input_ids_`: input_ids),
    None for the module's parameters and buffers."""
    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        name = node.name
        if "_parameters_" in name or "_buffers_" in name:
            names.append(None)
            continue
        name = name.removeprefix("l_").removesuffix("_")
        for prefix in ("kwargs_", "args_", "inputs_", "self_"):
            name = name.removeprefix(prefix)
        names.append(name)
    return tuple(names)


def _frame_name() -> str:
    """The function Dynamo is compiling (`LlamaForCausalLM.forward`), for the compile log."""
    context = torch._guards.TracingContext.try_get()
    code = next(iter(getattr(context, "traced_code", None) or ()), None)
    name = getattr(code, "co_qualname", None) or getattr(code, "co_name", None) or "a function"
    return name.rsplit("<locals>.", 1)[-1]


# (compile id, time) of the frame compile Dynamo last started: the compile log counts a graph's capture from there
_dynamo_started = [None]


def _note_dynamo_start(args) -> None:
    _dynamo_started[0] = (args.compile_id, time.perf_counter())


def _capture_started() -> float:
    """When Dynamo began compiling the frame whose graph the backend is given; now where that is not known.
    Dynamo runs its start callbacks only when no other compile is pending, so a frame compiled while one is
    (or after one that never closed) has no start of its own: the last one noted belongs to another frame,
    possibly minutes old (a 6-node graph was logged as 74 s of capture)."""
    noted = _dynamo_started[0]
    if noted is not None and noted[0] == str(torch._guards.CompileContext.current_compile_id()):
        return noted[1]
    return time.perf_counter()


def _mutated_inputs(gm: torch.fx.GraphModule, example_inputs) -> tuple:
    """(positions of the `tpu` inputs the graph overwrites whole, whether it can be a `while_loop` step).

    AOT autograd returns the overwritten inputs' new values as its first outputs (e.g. a static KV cache
    written by `index_copy_`): donated to XLA, their update is written in place instead of into a copy
    of the whole buffer on every call. A loop carries them from one iteration to the next, so it needs
    every mutated input among them and the graph's own outputs to be new tensors, not views."""
    from torch._functorch._aot_autograd.schemas import OutputType

    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None or len(meta.input_info) != len(example_inputs):  # e.g. synthetic bases of aliased inputs
        return (), False
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    positions = []
    for k, i in enumerate(meta.mutated_inp_runtime_indices):
        info, example, new = meta.input_info[i], example_inputs[i], outputs[k].meta.get("val")
        if (info.mutates_data and not info.mutates_metadata and isinstance(example, torch.Tensor)
                and example.device.type == "tpu" and isinstance(new, torch.Tensor)
                and new.shape == example.shape and new.dtype == example.dtype):
            positions.append(i)
    loopable = (len(positions) == len(meta.mutated_inp_runtime_indices) and not meta.num_intermediate_bases
                and all(out.output_type == OutputType.non_alias for out in meta.output_info))
    return tuple(sorted(positions)), loopable


def _views_as_reshapes(gm: torch.fx.GraphModule) -> None:
    """AOT autograd writes a `reshape` as `view` where the traced tensor's strides allow one, and those
    strides are the meta kernels': `_scaled_dot_product_flash_attention_for_cpu_backward` gives its
    gradients the query's transposed strides, so the backward of `x.view(b, s, h, d).transpose(1, 2)`
    views them back. Every tpu result is contiguous, and such a view fails. In a functionalized graph
    nothing writes through a view, so `reshape`, which views where it can and copies otherwise, means
    the same there."""
    views = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default)
    for node in views:
        node.target = torch.ops.aten.reshape.default
    if views:
        gm.recompile()


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, overwritten: tuple = (), loopable: bool = False,
                   description: str = "a torch.compile graph", input_names: tuple = ()):
    from hf_tpu import settings

    if settings.get("HF_TPU_LOG_COMPILES"):
        log.warning("hf_tpu: compiling a torch.compile graph of %d nodes", len(gm.graph.nodes))
    _views_as_reshapes(gm)
    constant_masks.recognise_constant_masks(gm)
    return _CompiledGraph(gm, overwritten, loopable, description, input_names)


def _touches_tpu(gm: torch.fx.GraphModule, example_inputs) -> bool:
    """Whether a tensor of the graph (an input, or a value Dynamo recorded) is on `tpu`."""
    recorded = [node.meta.get("example_value") for node in gm.graph.nodes]
    return any(isinstance(v, torch.Tensor) and v.device.type == "tpu"
               for v in torch.utils._pytree.tree_leaves([list(example_inputs), recorded]))


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """`torch.compile(model, backend="tpu")`."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    if not _touches_tpu(gm, example_inputs):
        # A graph of CPU tensors only (a model compiled for tpu, then moved back to the CPU) runs on
        # the CPU, as the `eager` backend runs it: its ATen graph has the CPU kernels' strides baked in
        # (a view of CPU attention's output), which the same ops on tpu would not give.
        return gm.forward

    frame = _frame_name()
    names = _input_names(gm)
    # from Dynamo's start to the end of the forward graph's first XLA compile, at its first call
    started = _capture_started()
    pending = compile_log.begin(f"the torch.compile graph of `{frame}`", "torch.compile", "_trace", started,
                                captured=True)

    def forward_compiler(graph, inputs):
        compiled = _compile_graph(graph, inputs, *_mutated_inputs(graph, inputs),
                                  description=f"the torch.compile graph of `{frame}` ({len(graph.graph.nodes)} nodes)",
                                  input_names=names if len(names) == len(inputs) else ())
        compiled.pending_compile = pending
        return make_boxed_func(compiled)

    def backward_compiler(graph, inputs):
        return make_boxed_func(_compile_graph(
            graph, inputs, description=f"the backward torch.compile graph of `{frame}` ({len(graph.graph.nodes)} nodes)"))

    try:
        return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)(gm, example_inputs)
    except BaseException:
        compile_log.end(pending)
        raise


def _capturable_on_tpu() -> None:
    """Dynamo makes a compiled optimizer `capturable` when its parameters are on CUDA or XPU and its
    state is still empty, so the step counts live on the device. It does the same here for `tpu`:
    otherwise each compiled `opt.step()` ends by reading its step counts back to the host."""
    from torch._dynamo.variables.optimizer import OptimizerVariable

    original = OptimizerVariable._set_capturable
    if getattr(original, "_hf_tpu_original", None) is not None:
        return

    def _set_capturable(self, tx):
        for group in self.value.param_groups:
            params = group.get("params", [])
            if "capturable" in group and params and all(
                    p.device.type == "tpu" and p not in self.value.state for p in params):
                group["capturable"] = True
        return original(self, tx)

    _set_capturable._hf_tpu_original = original
    OptimizerVariable._set_capturable = _set_capturable


def _tpu_generators_as_cpu_ones() -> None:
    """Dynamo treats an object of exactly `torch._C.Generator`'s type as a plain object, so a random op
    given one breaks the graph and runs eagerly, as on CUDA; any other generator type it takes for an
    opaque TorchScript object, and tracing `torch.randn(..., generator=torch.Generator("tpu"))`
    failed outright. A `tpu` generator (a subclass, `rng.TpuGenerator`) takes the CPU one's path."""
    from torch._dynamo.variables.builder import VariableBuilder

    original = VariableBuilder._wrap
    if getattr(original, "_hf_tpu_original", None) is not None:
        return

    def _wrap(self, value):
        if type(value) is rng.TpuGenerator:
            return self.wrap_user_defined(value)
        return original(self, value)

    _wrap._hf_tpu_original = original
    VariableBuilder._wrap = _wrap


def _rng_state_ops_on_tpu() -> None:
    """Activation checkpointing in a compiled graph (`torch.utils.checkpoint`, or the Trainer's
    `gradient_checkpointing` with `torch_compile`) recomputes random ops in the backward graph: the
    forward graph saves the RNG state before each (`run_and_save_rng_state`) and the backward graph
    replays it (`run_with_rng_state`). PyTorch implements the two for CPU, CUDA, HPU and XPU only,
    and raised "Backend not supported for tpu". Here the state is the key data the op draws with,
    as an int64 tpu tensor, so it stays on the device between the two graphs."""
    from torch._C import DispatchKey
    from torch._prims import rng_prims

    # where the recomputed op's own arguments start: after the op, or after the saved state and the op
    for hop, tpu_kernel, tensors_from in ((rng_prims.run_and_save_rng_state, _run_and_save_rng_state, 1),
                                          (rng_prims.run_with_rng_state, _run_with_rng_state, 2)):
        original = hop.py_kernels[DispatchKey.BackendSelect]
        if getattr(original, "_hf_tpu_original", None) is not None:
            continue

        def backend_select(*args, _original=original, _tpu_kernel=tpu_kernel, _start=tensors_from,
                           **kwargs):
            if rng_prims.get_device(args[_start:], kwargs) == "tpu":
                return _tpu_kernel(*args, **kwargs)
            return _original(*args, **kwargs)

        backend_select._hf_tpu_original = original
        hop.py_kernels[DispatchKey.BackendSelect] = backend_select
        hop._dispatch_cache.clear()


def _device_index_of(args, kwargs) -> int:
    device = kwargs.get("device")
    if device is not None:
        return current.current_index_for(torch.device(device))
    return next(a.device.index for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor))


def _run_and_save_rng_state(op, *args, **kwargs):
    index = _device_index_of(args, kwargs)
    mode = modes.current()
    if mode.kind is modes.ModeKind.TRACE:
        state = mode.next_key()
    else:  # a graph run eagerly (`_CompiledGraph.eager`): the device's next offset
        state = jax.device_put(rng.current_key(index), platform.jax_device(index))
    return buffer.new_tensor((4,), torch.int64, index, state.astype(jnp.int64)), op(*args, **kwargs)


def _run_with_rng_state(rng_state, op, *args, **kwargs):
    mode = modes.current()
    if mode.kind is modes.ModeKind.TRACE:
        saved, mode.replayed = mode.replayed, (tensor_views.array_of(rng_state).astype(jnp.uint32), 0)
        try:
            return op(*args, **kwargs)
        finally:
            mode.replayed = saved
    index = rng_state.device.index
    current = rng.get_state(index)
    rng.set_key_state(rng_state.cpu().numpy(), index)
    try:
        return op(*args, **kwargs)
    finally:
        rng.set_state(current, index)


_capturable_on_tpu()
torch._dynamo.callback_handler.register_start_callback(_note_dynamo_start)
_tpu_generators_as_cpu_ones()
_rng_state_ops_on_tpu()
