"""Defer-and-fuse: ops are recorded, and at a sync point the pending ones run as one XLA program.

Each op arrives as the same `Program` strict eager would jit; here it becomes a node of a graph whose
edges are `buffer.Lazy` values. A flush replays the nodes inside one `jax.jit`, returning only the
results some live buffer still holds: an intermediate nobody references is never an output, so it
never occupies device memory. The fused program is cached by the graph's structure (each node's
program, one per dispatch key, and its wiring; which results are outputs; the input shapes and
dtypes), and the arrays a graph overwrote in place are donated to it when a result of the same shape
and dtype can take their memory.

A graph also runs early, without waiting for its results, at content-defined cut points (as rsync cuts
files into chunks): after an op whose last `_WINDOW` ops hash into one value in 2**`CutPolicy.bits`, once
it has `CutPolicy.min_ops` ops. The device then computes the first part while Python records the rest,
as strict eager overlaps them op by op. Because a cut depends on the ops before it and not on a count
since the last sync, a loop is cut at the same ops every iteration, synced or not, and its pieces
compile once. (Where cut points lie closer than `min_ops`, which of them cuts depends on the previous
cut, and the pieces settle after a few iterations.) How long a piece must be depends on what a launch
costs on the platform (`cut_policy`); `HF_TPU_EARLY_FLUSH=0` turns the cuts off.
"""

from __future__ import annotations

import collections
import logging
import math
import typing

import jax
import jax.numpy as jnp

from .. import counters, platform
from ..memory import buffer, donation, out_of_memory
from ..memory.out_of_memory import check_results, raise_out_of_memory
from .kinds import ModeKind
from .scalars import on_device

Lazy = buffer.Lazy

_counters = counters.counters
log = logging.getLogger("hf_tpu.compile")

from hf_tpu import settings as _settings  # noqa: E402

MAX_GRAPH_OPS = _settings.get("HF_TPU_MAX_GRAPH_OPS")
EARLY_FLUSH = _settings.get("HF_TPU_EARLY_FLUSH")
_WINDOW = 4  # ops whose content decides a cut
# each op's 32-bit hash enters at the bottom and the older ones move 8 bits up: the mask drops the oldest
_WINDOW_MASK = (1 << (8 * (_WINDOW - 1) + 32)) - 1


class CutPolicy(typing.NamedTuple):
    """Where early flushes cut a graph: no piece shorter than `min_ops` ops, and after that at an op
    whose window hashes into one value in 2**`bits`."""

    min_ops: int
    bits: int


# The shortest piece per platform, where it is not the default's 8 (docs/design/execution-modes.md).
# A cut buys overlap (the device computes a piece while Python records the next) and costs a launch.
# On the CPU a fused launch takes 0.1-0.2 ms of host time and a small model's ops take about as long
# to compute as to record (60-110 us), so short pieces pay. On a TPU v5e a fused launch takes
# 0.3-0.6 ms of host time while a small model's ops compute in microseconds: a piece must be long for
# its launch to be a small share of the host's work (128 ops take about 9 ms to record there).
_MIN_CUT_OPS = {"tpu": 128}
_DEFAULT_MIN_CUT_OPS = 8


def policy_for(min_ops: int) -> CutPolicy:
    """Cut points one window in 16, or for long pieces one in min_ops / 2: candidates stay sparse
    beyond the minimum, so where a piece ends still depends on its content more than on where the
    previous piece ended (a tiny Llama's decoder layer of 47 ops is cut once on the CPU)."""
    return CutPolicy(min_ops, max(4, min_ops.bit_length() - 2))


def cut_policy() -> CutPolicy:
    """The policy in force: `HF_TPU_EARLY_FLUSH_MIN_OPS`, else the platform's; read at the first
    deferred op of the process (a policy that changed meanwhile would cut known work anew)."""
    global _cut
    if _cut is None:
        min_ops = _settings.get("HF_TPU_EARLY_FLUSH_MIN_OPS") \
            or _MIN_CUT_OPS.get(platform.name(), _DEFAULT_MIN_CUT_OPS)
        _cut = policy_for(min_ops)
    return _cut


_cut: CutPolicy | None = None

# A number for each (program, wiring) a node has had: a graph's structure is the tuple of its nodes'
# numbers, cheap to hash and compare at every flush. A program is built once per call key and compares
# as itself, so equal numbers mean the same op on the same operands. It grows as the programs and the
# fused graphs do, with the distinct work a process runs.
_NODE_CONTENTS: dict = {}

# the reasons of the flushes a graph makes itself, as `metrics()["flushes_by_reason"]` counts them
CUT_POINT = "a cut point"
GRAPH_SIZE_CAP = "the graph reached HF_TPU_MAX_GRAPH_OPS"


class _Graph:
    """The pending ops of one device."""

    def __init__(self, device_index: int):
        self.device_index = device_index
        self.nodes = []  # (program, wiring, scalars, rng)
        self.contents = []  # each node's number in `_NODE_CONTENTS`
        self.inputs = []  # concrete arrays read by the graph
        self.input_ids = {}  # id(array) -> input position
        self.window = 0  # the last _WINDOW ops' content hashes, overlapping
        self.cut_due = False
        cut = _cut or cut_policy()
        self.min_cut_ops, self.cut_shift = cut.min_ops, 32 - cut.bits

    def wire(self, array):
        """Where an op's operand comes from: ("n", node, index) for a result of this graph's node,
        ("i", position) for an input, ("u",) for an uninitialised buffer."""
        if type(array) is buffer.Lazy:
            if array.graph is self:
                return array.edge
            if array.concrete is None:  # a result pending on another device's graph
                buffer.flush("an op used a result pending on another device")
            # computed by a flush since the op read its operands (another device's, or the size cap's)
            array = array.concrete
        elif array is None:  # an uninitialised buffer: the program makes it
            return ("u",)
        position = self.input_ids.get(id(array))
        if position is None:
            position = self.input_ids[id(array)] = len(self.inputs)
            self.inputs.append(array)
        return ("i", position)


# Eager ops round each result to its dtype, and a fused program must too: XLA on a TPU may keep a value cast
# to a narrower float at the wider precision when it is cast back within one program (its excess-precision
# rewrite; v5e, 2026-12-05: floats cast to float16 or float8 and on to another dtype in one fused program came
# out as if never rounded). `torch.compile` and `hf_tpu.jit` programs keep XLA's default, as Inductor keeps
# float32 between fused ops by default (`emulate_precision_casts`).
_EAGER_ROUNDING = {"xla_allow_excess_precision": False}


class _Fused:
    """The one jitted function replaying a graph structure."""

    def __init__(self, nodes, outputs, donated, large_result_bytes: int):
        self.programs = [node[0] for node in nodes]
        self.wirings = [node[1] for node in nodes]
        self.outputs = outputs
        self.donated = donated
        self.large_result_bytes = large_result_bytes  # checked against the device's free memory before each launch
        self.jitted = jax.jit(self._run, donate_argnums=(0,) if donated else (), compiler_options=_EAGER_ROUNDING)

    def __call__(self, inputs, scalars, rngs):
        return self.jitted(*donation.split(inputs, self.donated), scalars, rngs)

    def _run(self, donated, kept, scalars, rngs):
        _counters["compiles"] += 1
        _counters["compiles_by_mode"][ModeKind.DEFER_AND_FUSE.value] += 1
        inputs = donation.join(self.donated, donated, kept)
        env = {}
        for n, (program, wiring) in enumerate(zip(self.programs, self.wirings)):
            args = [inputs[w[1]] if w[0] == "i" else env[(w[1], w[2])] if w[0] == "n" else None for w in wiring]
            for j, out in enumerate(program.fn(args, scalars[n], rngs[n])):
                env[(n, j)] = out
        return [env[o] for o in self.outputs]


def _large_result_bytes(graph: _Graph, holders, donated: tuple) -> int:
    """The bytes of device memory a graph's results take beyond the donated inputs they reuse, where they are a
    large share of the device's (`out_of_memory.is_large`: checked against what it has left before each launch
    of the fused program), else 0. Each op's own results were checked at the op (`dispatch.run`) against the
    memory of the tensors computed; pending results count only here."""
    made = sum(math.prod(value.shape) * jnp.dtype(value.dtype).itemsize for value, _ in holders)
    reused = sum(math.prod(graph.inputs[i].shape) * graph.inputs[i].dtype.itemsize for i in donated)
    nbytes = made - reused
    return nbytes if out_of_memory.is_large(nbytes, graph.device_index) else 0


class Deferred:
    """The DEFER_AND_FUSE execution mode."""

    kind = ModeKind.DEFER_AND_FUSE
    counter_key = kind.value  # its key in the per-mode metrics

    def __init__(self, mode):
        self.mode = mode
        self.graphs: dict[int, _Graph] = {}
        self.cache: dict = {}
        self.seen_structures: set = set()

    def execute(self, program, key, arrays, scalars, rng, device_index):
        graph = self.graphs.get(device_index)
        if graph is None:
            graph = self.graphs[device_index] = _Graph(device_index)
        elif graph.cut_due or len(graph.nodes) >= MAX_GRAPH_OPS:
            self.sync(CUT_POINT if graph.cut_due else GRAPH_SIZE_CAP)
            graph = self.graphs[device_index] = _Graph(device_index)
        wire = graph.wire
        wiring = tuple([a.edge if type(a) is Lazy and a.graph is graph else wire(a) for a in arrays])
        n = len(graph.nodes)
        graph.nodes.append((program, wiring, tuple(scalars), rng))
        content = _NODE_CONTENTS.get((program, wiring))
        if content is None:
            content = _NODE_CONTENTS[(program, wiring)] = len(_NODE_CONTENTS)
        graph.contents.append(content)
        if EARLY_FLUSH:
            graph.window = ((graph.window << 8) ^ program.content_hash) & _WINDOW_MASK
            # Knuth's multiplicative hash spreads the window over the top bits, which decide the cut
            spread = (graph.window * 0x9E3779B1) & 0xFFFFFFFF
            graph.cut_due = n + 1 >= graph.min_cut_ops and spread >> graph.cut_shift == 0
        return [Lazy(shape, dtype, graph, n, j) for j, (shape, dtype) in enumerate(program.result_layouts)]

    def sync(self, reason: str) -> None:
        graphs, self.graphs = self.graphs, {}
        if not any(g.nodes for g in graphs.values()):
            return
        holders = {}
        running = graphs.values()
        seen = set()
        pending = buffer.take_pending()
        for buf in pending:
            value = buf._array
            # a buffer is listed each time it took a result; one released since holds None
            if type(value) is Lazy and value.graph in running and id(buf) not in seen:
                seen.add(id(buf))
                holders.setdefault(id(value), (value, []))[1].append(buf)
        for graph in graphs.values():
            if graph.nodes:
                # a deterministic output order, so the same work finds the same cached program
                mine = sorted((h for h in holders.values() if h[0].graph is graph),
                              key=lambda h: (h[0].node, h[0].index))
                self._run(graph, mine, reason)

    def _run(self, graph: _Graph, holders, reason: str):
        # counted without what a reason names in parentheses (a value's shape), so that reasons add up
        _counters["flushes_by_reason"][reason.split(" (", 1)[0]] += 1
        outputs = tuple((value.node, value.index) for value, _ in holders)
        donated = self._donatable(graph, [value for value, _ in holders])
        structure = (tuple(graph.contents), outputs, donated)
        key = (structure, tuple((a.shape, a.dtype) for a in graph.inputs))
        fused = self.cache.get(key)
        if fused is None:
            large = _large_result_bytes(graph, holders, donated)
            fused = self.cache[key] = _Fused(graph.nodes, outputs, donated, large)
            if _settings.get("HF_TPU_LOG_COMPILES"):
                why = "new input shapes" if structure in self.seen_structures else "new graph"
                log.warning("hf_tpu: compiling a fused graph of %d ops (%s), flushed because %s",
                            len(graph.nodes), why, reason)
            self.seen_structures.add(structure)
        else:
            _counters["compile_cache_hits"] += 1
            _counters["compile_cache_hits_by_mode"][self.counter_key] += 1
        if buffer.sharded_arrays_exist:  # a sharded tensor (hf_tpu.distributed) may meet single-chip ones
            graph.inputs = buffer.place_together(graph.inputs)
        if fused.large_result_bytes:  # each op's result was checked alone; together they may not fit
            check_results(fused.large_result_bytes, graph.device_index,
                          buffer.sharded_arrays_exist and any(map(buffer.is_sharded, graph.inputs)),
                          lambda: f"a fused graph of {len(graph.nodes)} ops")
        scalars = on_device([node[2] for node in graph.nodes], graph.device_index)
        rngs = [node[3] for node in graph.nodes]
        try:
            if graph.inputs:
                results = fused(graph.inputs, scalars, rngs)
            else:
                with jax.default_device(platform.jax_device(graph.device_index)):
                    results = fused(graph.inputs, scalars, rngs)
        except jax.errors.JaxRuntimeError as e:
            raise_out_of_memory(e, graph.device_index, f"a fused graph of {len(graph.nodes)} ops")
            raise
        for (value, bufs), array in zip(holders, results):
            value.concrete = array
            for buf in bufs:
                buf.array = array

    @staticmethod
    def _donatable(graph: _Graph, results) -> tuple:
        """Inputs no live buffer holds any more (overwritten in place) whose memory a result of the same
        shape and dtype can take over; XLA cannot use any other donation and warns about it."""
        wanted = collections.Counter((tuple(r.shape), jnp.dtype(r.dtype)) for r in results)
        donated = []
        for i, array in enumerate(graph.inputs):
            kind = (tuple(array.shape), array.dtype)
            if wanted[kind] and not buffer.allocator.holders(array) and isinstance(array, jax.Array):  # not a host value
                wanted[kind] -= 1
                donated.append(i)
        return tuple(donated)
