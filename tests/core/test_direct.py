"""`hf_tpu.jit` and `hf_tpu.while_loop(state=...)`: a Python function traced straight into one program, against
the same function run eagerly: state tensors as inputs, in-place writes rebound and donated, the cache of
programs and its key, and the eager fallback wherever the trace would not mean the same."""

import itertools
import logging

import pytest
import torch

import hf_tpu
from hf_tpu import direct, trace_inputs, trace_program
from hf_tpu.memory import buffer


@pytest.fixture(autouse=True)
def fresh_programs():
    direct.reset()  # the programs are cached per code: each mode's run of a test traces its own
    yield


class Layer:
    def __init__(self, batch, length, width):
        self.keys = torch.zeros(batch, length, width, device="tpu")
        self.length = torch.zeros((), dtype=torch.long, device="tpu")


class KVCache:
    """A static cache as Transformers keeps one: tensors among an object's attributes, in a list of layers."""

    def __init__(self, batch=2, length=8, width=4, layers=2):
        self.layers = [Layer(batch, length, width) for _ in range(layers)]


def _decoder(model, cache):
    def step(x, position):
        for layer, linear in zip(cache.layers, model):
            x = torch.tanh(linear(x))
            layer.keys.index_copy_(1, position, x[:, None])
            layer.length.add_(1)
        return x.sum(-1), cache.layers[0].keys

    return step


def _traced() -> int:
    """Programs traced since the metrics were reset (defer-and-fuse compiles its flushes besides)."""
    return hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to("tpu")


@pytest.fixture
def fallbacks(caplog):
    caplog.set_level(logging.WARNING, logger="hf_tpu.compile")
    return lambda: [r.getMessage() for r in caplog.records if "runs without hf_tpu.jit's trace" in r.getMessage()]


def test_state_tensors_are_inputs_and_in_place_writes_are_rebound_and_donated(model, fallbacks):
    cache, expected_cache = KVCache(), KVCache()
    traced = hf_tpu.jit(_decoder(model, cache), state=(model, cache))
    eager = _decoder(model, expected_cache)
    with torch.no_grad():
        for position in range(3):
            x = torch.randn(2, 4, device="tpu")
            donated = buffer.buffer_of(cache.layers[1].keys).array
            hf_tpu.reset_metrics()
            total, keys = traced(x, torch.tensor([position], device="tpu"))
            assert _traced() == (1 if position == 0 else 0)
            expected_total, _ = eager(x, torch.tensor([position], device="tpu"))
            torch.testing.assert_close(total.cpu(), expected_total.cpu())
            assert keys is cache.layers[0].keys  # an input tensor returned is that tensor, holding its new value
            if position:  # the first call runs undonated, its arrays still held by the eager comparison
                assert donated.is_deleted()  # XLA wrote the cache in place
    for layer, expected in zip(cache.layers, expected_cache.layers):
        torch.testing.assert_close(layer.keys.cpu(), expected.keys.cpu())
        assert layer.length.item() == 3
    assert fallbacks() == []


# what `_write_through_held` reads: reached through a global, so that only `state=` makes them the program's inputs
_held = {}


def _write_through_held(x, position):
    y = _held["model"](x)
    _held["cache"].index_copy_(0, position, y)  # written in place: an output of the program, rebound
    return y.relu()


def _in_a_module(model, cache):
    holder = torch.nn.Module()
    holder.model = model
    holder.register_buffer("cache", cache)  # the same tensor object, registered
    return holder


# each form of `state=` that `hf_tpu.jit` takes, made of the model and the cache the function reaches
STATE_FORMS = {
    "a module and a tensor": lambda model, cache: (model, cache),
    "a tensor": lambda model, cache: cache,
    "a tuple of a tensor": lambda model, cache: (cache,),
    "a module": _in_a_module,
    "a list": lambda model, cache: [model, cache],
    "a dict": lambda model, cache: {"model": model, "cache": cache},
    "nested": lambda model, cache: (cache, [{"model": model}]),
    "a function of the arguments": lambda model, cache: lambda x, position: (model, cache),
}


@pytest.mark.parametrize("form", STATE_FORMS)
def test_every_form_of_state_is_traced_and_written_back_as_on_the_cpu(form, fallbacks):
    torch.manual_seed(0)
    cpu_model, cpu_cache = torch.nn.Linear(4, 4), torch.zeros(5, 4)
    model, cache = torch.nn.Linear(4, 4).to("tpu"), cpu_cache.to("tpu")
    model.load_state_dict(cpu_model.state_dict())
    traced = hf_tpu.jit(_write_through_held, state=STATE_FORMS[form](model, cache))
    xs = [torch.randn(1, 4) for _ in range(3)]
    with torch.no_grad():
        _held.update(model=model, cache=cache)
        outputs = [traced(x.to("tpu"), torch.tensor([i], device="tpu")).cpu() for i, x in enumerate(xs)]
        _held.update(model=cpu_model, cache=cpu_cache)
        expected = [_write_through_held(x, torch.tensor([i])) for i, x in enumerate(xs)]
    _held.clear()
    assert not fallbacks()
    assert _traced() == 1
    torch.testing.assert_close(outputs, expected)
    torch.testing.assert_close(cache.cpu(), cpu_cache)  # the caller's tensor holds what the calls wrote


def test_a_loop_with_a_tensor_as_its_state_writes_it_back(model):
    cache = torch.zeros(4, 4, device="tpu")
    _held.update(cache=cache)

    def body(x, i):
        _held["cache"].index_copy_(0, i, x[None] * 2)
        return x + 1, i + 1

    start = (torch.ones(4, device="tpu"), torch.tensor([0], device="tpu"))
    with torch.no_grad():
        x, i = hf_tpu.while_loop(lambda x, i: i < 4, body, start, state=cache)
    _held.clear()
    assert _traced() == 1 and int(i) == 4
    torch.testing.assert_close(cache.cpu(), 2 * torch.arange(1.0, 5.0)[:, None].expand(4, 4))


def test_new_weights_or_a_new_cache_of_the_same_shapes_reuse_the_program(model):
    with torch.no_grad():
        x = torch.randn(2, 4, device="tpu")
        first = KVCache()
        hf_tpu.jit(_decoder(model, first), state=(first,))(x, torch.tensor([0], device="tpu"))
        model[0].weight.mul_(2)
        cache = KVCache()
        hf_tpu.reset_metrics()
        # the closure holds the model (a module is state by itself) and the cache (declared)
        total, _ = hf_tpu.jit(_decoder(model, cache), state=(cache,))(x, torch.tensor([0], device="tpu"))
        assert _traced() == 0
        expected_cache = KVCache()
        expected, _ = _decoder(model, expected_cache)(x, torch.tensor([0], device="tpu"))
    torch.testing.assert_close(total.cpu(), expected.cpu())
    torch.testing.assert_close(cache.layers[1].keys.cpu(), expected_cache.layers[1].keys.cpu())


def test_a_new_shape_or_value_traces_anew_and_the_same_does_not():
    def scaled(x, scale: float):
        return x * scale

    traced = hf_tpu.jit(scaled)
    compiles = []
    for shape, scale in (((3,), 2.0), ((3,), 2.0), ((5,), 2.0), ((3,), 3.0), ((5,), 2.0)):
        hf_tpu.reset_metrics()
        out = traced(torch.ones(shape, device="tpu"), scale)
        compiles.append(_traced())
        assert torch.equal(out.cpu(), torch.full(shape, scale))
    assert compiles == [1, 0, 1, 1, 0]


_FRESH_SIZES = itertools.count()


def test_a_trace_runs_an_op_programs_lowering_once_per_input_types(monkeypatch):
    """A model's layers call the same op programs with the same shapes: the trace runs each lowering once and
    calls the traced program for the later ones (`Program.nested`)."""
    from hf_tpu.dispatch import program as program_module

    lowered = []
    original = program_module.lowering_function

    def counting(op, low, args, kwargs):
        lowered.append(op)
        return original(op, low, args, kwargs)

    monkeypatch.setattr(program_module, "lowering_function", counting)

    def layers(a, b, c):
        return a.sin() * 2 + b.sin() * 2 + c.sin() * 2

    # a shape no other test or mode uses: no program of it was traced before in this process
    shape = (3, 13, 100 + next(_FRESH_SIZES))
    a, b, c = (torch.randn(shape) for _ in range(3))
    out = hf_tpu.jit(layers)(a.to("tpu"), b.to("tpu"), c.to("tpu"))
    assert lowered.count(torch.ops.aten.sin.default) == 1
    torch.testing.assert_close(out.cpu(), layers(a, b, c))


def test_a_modules_training_flag_is_keyed():
    dropout = torch.nn.Dropout(0.5).to("tpu")
    traced = hf_tpu.jit(lambda x: dropout(x), state=(dropout,))
    x = torch.ones(1000, device="tpu")
    with torch.no_grad():
        dropout.eval()
        assert torch.equal(traced(x).cpu(), x.cpu())
        dropout.train()
        dropped = traced(x).cpu()
        assert 300 < int((dropped == 0).sum()) < 700
        assert not torch.equal(traced(x).cpu(), dropped)  # each call draws new random numbers


def test_inside_the_trace_torch_compiler_is_compiling():
    hf_tpu.reset_metrics()
    def f(x):
        return x + 1 if torch.compiler.is_compiling() else x - 1

    assert torch.equal(hf_tpu.jit(f)(torch.zeros(2, device="tpu")).cpu(), torch.ones(2))
    assert _traced() == 1 and not torch.compiler.is_compiling()


class Pair:
    """An object a traced function makes to hold tensors it makes (as a model returns a new `DynamicCache`)."""

    def __init__(self, first, second, note=None):
        self.first, self.second, self.note = first, second, note


def test_objects_made_in_the_trace_are_rebuilt_at_each_call(model, fallbacks):
    shared_note = object()

    def f(x):
        y = model(x)
        pair = Pair(y, [y * 2, {"z": y + 1}], shared_note)
        return {"pair": pair, "again": pair, "y": y, "x": x}

    traced = hf_tpu.jit(f)
    with torch.no_grad():
        results = [traced(torch.full((2, 4), float(k), device="tpu")) for k in range(3)]
        for k, out in enumerate(results):
            expected = f(torch.full((2, 4), float(k), device="tpu"))
            pair = out["pair"]
            assert type(pair) is Pair and out["again"] is pair and pair.note is shared_note
            assert pair.first is out["y"]  # one tensor met twice is one tensor
            torch.testing.assert_close(pair.first.cpu(), expected["y"].cpu())
            torch.testing.assert_close(pair.second[0].cpu(), expected["pair"].second[0].cpu())
            torch.testing.assert_close(pair.second[1]["z"].cpu(), expected["pair"].second[1]["z"].cpu())
    assert results[0]["pair"] is not results[1]["pair"] and _traced() == 1 and not fallbacks()


def test_an_object_returned_that_holds_no_new_tensor_falls_back(fallbacks):
    kept = Pair(None, None)
    traced = hf_tpu.jit(lambda x: (x + 1, kept))
    out = traced(torch.zeros(2, device="tpu"))
    assert out[1] is kept and len(fallbacks()) == 1 and "returns a Pair" in fallbacks()[0]


def test_the_float32_matmul_precision_is_keyed():
    x = torch.randn(8, 8, device="tpu")
    traced = hf_tpu.jit(lambda a: a @ a)
    before = torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "medium", "highest"):
            torch.set_float32_matmul_precision(precision)
            traced(x)
    finally:
        torch.set_float32_matmul_precision(before)
    assert _traced() == 2


def test_a_host_read_falls_back_to_the_eager_function_with_its_result(fallbacks):
    def clipped(x):
        return x * 2 if x.sum().item() > 0 else -x  # a branch on a device value

    traced = hf_tpu.jit(clipped)
    for sign in (1, -1, 1):
        x = torch.full((3,), float(sign), device="tpu")
        assert torch.equal(traced(x).cpu(), clipped(x).cpu())
    assert len(fallbacks()) == 1 and "Untraceable" in fallbacks()[0]  # later calls know without tracing


def test_a_tracer_an_earlier_failed_trace_left_behind_is_not_taken_for_a_write(fallbacks):
    kept = []

    def leaky(x):
        y = x + 1
        kept.append(y)  # kept past the trace, which then fails: `kept` holds a tensor with a stale tracer
        return y * (y.sum().item() > 0)

    hf_tpu.jit(leaky)(torch.ones(2, device="tpu"))
    torch.testing.assert_close(hf_tpu.jit(lambda x: x * 3)(torch.ones(2, device="tpu")).cpu(), torch.full((2,), 3.0))
    assert len(fallbacks()) == 1 and "Untraceable" in fallbacks()[0]


def test_the_fallback_runs_with_no_error_of_the_trace_in_flight():
    import sys

    def fallback(x):  # Dynamo's errors would chain to one, and keep its traceback's tracers alive
        return torch.full((1,), float(sys.exc_info()[0] is None), device="tpu")

    traced = hf_tpu.jit(lambda x: x + x.sum().item(), fallback=fallback)
    assert traced(torch.ones(2, device="tpu")).item() == 1.0


def test_a_python_state_change_made_once_is_traced_again_with_it_made(model, fallbacks):
    class Lazy:
        def __init__(self):
            self.ready = False
            self.scale = torch.full((4,), 2.0, device="tpu")

    lazy = Lazy()

    def f(x):
        if not lazy.ready:  # a setting made at the first call (as Transformers installs hooks)
            lazy.ready = True
        return model(x) * lazy.scale

    traced = hf_tpu.jit(f, state=(model, lazy))
    x = torch.randn(2, 4, device="tpu")
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(traced(x).cpu(), (model(x) * 2).cpu())
    assert lazy.ready and _traced() == 2 and not fallbacks()  # the first trace, then the one with the change made


def test_a_fallback_given_runs_instead():
    calls = []

    def fallback(x):
        calls.append(x)
        return x - 1

    traced = hf_tpu.jit(lambda x: x + x.sum().item(), fallback=fallback)
    assert torch.equal(traced(torch.ones(2, device="tpu")).cpu(), torch.zeros(2)) and len(calls) == 1


def test_a_python_state_change_falls_back_and_happens_once(model, fallbacks):
    class Counter:
        def __init__(self):
            self.calls = 0
            self.scale = torch.ones(4, device="tpu")

    counter = Counter()

    def counted(x):
        counter.calls += 1  # a Python side effect a program cannot replay
        return model(x) * counter.scale

    traced = hf_tpu.jit(counted, state=(model, counter))
    x = torch.randn(2, 4, device="tpu")
    with torch.no_grad():
        out = traced(x)
        torch.testing.assert_close(out.cpu(), model(x).cpu())
    assert counter.calls == 1  # the trace's change was undone, then the eager call made it
    assert len(fallbacks()) == 1 and "Python state" in fallbacks()[0]


def test_a_tensor_attribute_rebound_falls_back(fallbacks):
    state = type("State", (), {})()
    state.total = torch.zeros(3, device="tpu")

    def accumulate(x):
        state.total = state.total + x  # a new tensor object, not an in-place write
        return state.total

    traced = hf_tpu.jit(accumulate, state=(state,))
    for _ in range(2):
        out = traced(torch.ones(3, device="tpu"))
    assert torch.equal(out.cpu(), torch.full((3,), 2.0)) and out is state.total
    assert len(fallbacks()) == 1


def test_a_tensor_written_that_is_not_an_input_falls_back(fallbacks):
    hidden = {"total": torch.zeros(3, device="tpu")}
    hidden_object = type("Hidden", (), {})()
    hidden_object.dict = hidden

    def accumulate(x, holder):
        holder.dict["total"].add_(x)  # reached through an object that is not declared state
        return x * 2

    traced = hf_tpu.jit(accumulate)
    for _ in range(2):
        out = traced(torch.ones(3, device="tpu"), hidden_object)
    assert torch.equal(out.cpu(), torch.full((3,), 2.0)) and torch.equal(hidden["total"].cpu(), torch.full((3,), 2.0))
    assert len(fallbacks()) == 1 and "not among its inputs" in fallbacks()[0]


def test_unhashable_arguments_and_gradients_fall_back(model, fallbacks):
    def f(x, options):
        return model(x) * options["scale"]

    x = torch.randn(2, 4, device="tpu")
    with torch.no_grad():
        hf_tpu.jit(f)(x, {"scale": 2.0, "more": {1, 2}})
    assert "unhashable set" in fallbacks()[-1]
    out = hf_tpu.jit(f)(x, {"scale": 2.0})
    out.sum().backward()  # with gradients on, the eager function runs: its result has a graph
    assert model[0].weight.grad is not None and "requires gradients" in fallbacks()[-1]


# --- hf_tpu.while_loop(state=...)


def test_a_loop_with_state_runs_as_one_program_without_dynamo(model):
    import torch._dynamo.utils

    cache, expected_cache = KVCache(length=6), KVCache(length=6)

    def loop(cache, state):
        def body(x, i):
            for layer, linear in zip(cache.layers, model):
                x = torch.tanh(linear(x))
                layer.keys.index_copy_(1, i, x[:, None])
            return x, i + 1

        return hf_tpu.while_loop(lambda x, i: i < 6, body, (torch.ones(2, 4, device="tpu"),
                                                             torch.tensor([0], device="tpu")), state=state)

    with torch.no_grad():
        expected, _ = loop(expected_cache, state=None)
        torch._dynamo.utils.counters.clear()
        for attempt in range(2):
            hf_tpu.reset_metrics()
            x, i = loop(cache, state=(model, cache))
            assert hf_tpu.metrics()["host_syncs"] == 0
        assert _traced() == 0  # a second loop with a new closure compiles nothing
    assert not torch._dynamo.utils.counters["frames"]
    assert int(i) == 6
    torch.testing.assert_close(x.cpu(), expected.cpu())
    for layer, expected_layer in zip(cache.layers, expected_cache.layers):
        torch.testing.assert_close(layer.keys.cpu(), expected_layer.keys.cpu())


def test_a_loop_with_state_that_cannot_be_traced_still_computes_the_python_loop(caplog):
    caplog.set_level(logging.WARNING, logger="hf_tpu.loops")
    seen = {"host reads": 0}

    def body(x, i):
        seen["host reads"] += int(x.sum().item() > 0)  # a host read and a Python side effect
        return x * 3, i + 1

    x, i = hf_tpu.while_loop(lambda x, i: i < 4, body, (torch.ones(2, device="tpu"), torch.tensor(0, device="tpu")),
                             state=())
    assert torch.equal(x.cpu(), torch.full((2,), 81.0)) and int(i) == 4 and seen["host reads"] == 4
    assert any("compiles its step with torch.compile instead" in r.getMessage() for r in caplog.records)


def test_a_jax_object_in_the_state_is_not_searched(model, fallbacks):
    """A tensor-parallel cache holds its device mesh; JAX's mesh fills caches of its own when read, which the
    trace took for a Python state change (and fell back)."""
    import hf_tpu.distributed as dist

    class Holder:
        def __init__(self):
            self.mesh = dist.mesh((1,), ("tp",)).jax_mesh  # one chip: every platform has it
            self.scale = torch.ones(4, device="tpu")

    holder = Holder()
    assert not trace_inputs.plain_object(holder.mesh)
    traced = hf_tpu.jit(lambda x: model(x) * holder.scale, state=(model, holder))
    x = torch.ones(2, 4, device="tpu")
    with torch.no_grad():
        torch.testing.assert_close(traced(x).cpu(), (model(x) * holder.scale).cpu())
    assert fallbacks() == []


def _forward(model, x):
    return model(x) * getattr(model[0], "scale", 1)


def _full_walk_key(model, x):
    """The key of `_forward(model, x)` walked in full, the kept walks forgotten."""
    trace_inputs.kept_walks.clear()
    return trace_inputs.prepare("site", (_forward,), (model, x), {}, ())[1]


def _assert_same_inputs(inputs, full_inputs):
    """The inputs a replay gave are those of the full walk: the same objects, buffers, tensors and containers,
    in the same order, with the same positions."""
    for name in ("buffers", "objects", "containers"):
        assert list(map(id, getattr(inputs, name))) == list(map(id, getattr(full_inputs, name))), name
    for name in ("users", "buffer_keys", "device_index", "slots", "tensor_index", "seen"):
        assert getattr(inputs, name) == getattr(full_inputs, name), name
    assert [(id(t), slot) for t, slot in inputs.tensors] == [(id(t), slot) for t, slot in full_inputs.tensors]


# the keyword arguments of the calls whose inputs are compared: one dict, as the call's containers are compared
_NO_KWARGS = {}


def _assert_keyed_as_walked_in_full(model, x, state, inputs=None, key=None):
    """A call's key and inputs (by default those of a call made now) are the full walk's, the kept walks
    forgotten."""
    if inputs is None:
        inputs, key = trace_inputs.prepare("site", (_forward,), (model, x), _NO_KWARGS, state)
    trace_inputs.kept_walks.clear()
    full_inputs, full_key = trace_inputs.prepare("site", (_forward,), (model, x), _NO_KWARGS, state)
    assert key == full_key
    _assert_same_inputs(inputs, full_inputs)


def _walks_counted(monkeypatch) -> list:
    """The modules and state objects walked from now on (a replay walks none)."""
    walked, module, state_object = [], trace_inputs.Inputs._module, trace_inputs.Inputs.state_object
    monkeypatch.setattr(trace_inputs.Inputs, "_module", lambda self, m: walked.append(m) or module(self, m))
    monkeypatch.setattr(trace_inputs.Inputs, "state_object",
                        lambda self, x, depth=0: walked.append(x) or state_object(self, x, depth))
    return walked


@pytest.mark.parametrize("order", ["model, cache", "cache, model"])
@torch.no_grad()
def test_replayed_state_walks_give_the_full_walks_key_and_inputs(model, monkeypatch, order):
    """Each state object's walk, a module's and a static cache's, is kept and replayed by the next call: the same
    key and the same inputs, in the same order, without walking the submodules or the cache's layers again."""
    cache = KVCache()
    state = (model, cache) if order == "model, cache" else (cache, model)
    x = torch.randn(2, 4, device="tpu")
    full_inputs, full_key = trace_inputs.prepare("site", (_forward,), (model, x), _NO_KWARGS, state)
    walked = _walks_counted(monkeypatch)
    inputs, key = trace_inputs.prepare("site", (_forward,), (model, x), _NO_KWARGS, state)
    assert not walked and key == full_key
    _assert_same_inputs(inputs, full_inputs)


@pytest.mark.parametrize("change", ["tensor replaced", "layer appended", "layer replaced", "int attribute",
                                    "new tensor attribute", "resized in place", "function set", "nothing"])
@torch.no_grad()
def test_a_change_to_a_state_object_after_its_walk_was_kept_is_seen(model, monkeypatch, change):
    """A change the key depends on makes a static cache's kept walk fail to replay: the call after it keys and
    finds its inputs as a full walk would. A function set on a layer (as the Transformers adapter sets one for
    each prefill) is not among them: no walk keys a function."""
    cache = KVCache()
    cache.window = 4
    x = torch.randn(2, 4, device="tpu")
    trace_inputs.prepare("site", (_forward,), (model, x), _NO_KWARGS, (model, cache))
    layer = cache.layers[0]
    layer.update = lambda: None
    trace_inputs.prepare("site", (_forward,), (model, x), _NO_KWARGS, (model, cache))  # kept with the function
    if change == "tensor replaced":
        layer.keys = torch.ones_like(layer.keys)
    elif change == "layer appended":
        cache.layers.append(Layer(2, 8, 4))
    elif change == "layer replaced":
        cache.layers[1] = Layer(2, 8, 4)
    elif change == "int attribute":
        cache.window = 8
    elif change == "new tensor attribute":
        layer.scale = torch.ones(4, device="tpu")
    elif change == "resized in place":
        layer.keys.resize_(2, 4, 4)
    elif change == "function set":
        layer.update = lambda: None
    walked = _walks_counted(monkeypatch)
    inputs, key = trace_inputs.prepare("site", (_forward,), (model, x), _NO_KWARGS, (model, cache))
    assert (cache in walked) == (change not in ("function set", "nothing"))
    assert model not in walked  # the model's walk, before the cache's, replays
    monkeypatch.undo()
    _assert_keyed_as_walked_in_full(model, x, (model, cache), inputs, key)


@torch.no_grad()
def test_a_state_walk_is_replayed_only_where_it_started(model, monkeypatch):
    """A walk's key counts objects and buffers from the call's first: the cache's walk kept after the model's
    is not replayed for a call that walks the cache first, nor for one whose model shares a tensor with it."""
    cache = KVCache()
    x = torch.randn(2, 4, device="tpu")
    trace_inputs.prepare("site", (_forward,), (model, x), _NO_KWARGS, (model, cache))  # kept, after the model's
    _assert_keyed_as_walked_in_full(model, x, (cache,))
    # the model now holds one of the cache's tensors in place of a buffer of its own: the cache's walk starts where
    # it did, and its replay would add that buffer a second time
    trace_inputs.prepare("site", (_forward,), (model, x), _NO_KWARGS, (model, cache))
    model[0].bias = None
    model[0].register_buffer("keys", cache.layers[0].keys)
    after_the_model = trace_inputs.Inputs((model, cache))
    after_the_model.root(model)
    assert after_the_model.position() == trace_inputs.kept_walks[cache][0].start
    walked = _walks_counted(monkeypatch)
    trace_inputs.prepare("site", (_forward,), (model, x), _NO_KWARGS, (model, cache))
    assert cache in walked
    monkeypatch.undo()
    _assert_keyed_as_walked_in_full(model, x, (model, cache))
    # a walk that met what an earlier one found is not kept: its key names those
    assert cache not in trace_inputs.kept_walks


def _step_of(opt):
    opt.step()


@pytest.mark.parametrize("walked_object", ["model", "optimizer"])
def test_walks_are_replayed_while_the_parameters_have_gradients(model, monkeypatch, walked_object):
    """An accumulating micro step meets every parameter of its model with a `.grad`, and an optimizer's step every
    parameter of its optimizer. The gradients are keyed after the walks, so the model's and the optimizer's walks
    are kept and replayed then too (walked in full, they took 6 ms of each micro step's call and 14 ms of the
    optimizer step's for a 24-layer Llama on the development CPU), and the key tells a call with gradients from one
    without, as the full walk does."""
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(2, 4, device="tpu")
    function, args = (_forward, (model, x)) if walked_object == "model" else (_step_of, (opt,))
    for p in model.parameters():
        p.grad = torch.ones_like(p)

    def keyed():
        return trace_inputs.prepare("site", (function,), args, _NO_KWARGS, ())

    def full_walk():
        trace_inputs.kept_walks.clear()
        return keyed()

    keyed()  # walked, and kept
    walked = _walks_counted(monkeypatch)
    inputs, key = keyed()
    assert not walked
    monkeypatch.undo()
    full_inputs, full_key = full_walk()
    assert key == full_key
    _assert_same_inputs(inputs, full_inputs)
    assert all(id(p.grad) in inputs.tensor_index for p in model.parameters())  # each gradient an input
    model[0].weight.grad = None
    walked = _walks_counted(monkeypatch)
    inputs, without = keyed()
    assert not walked and without != key
    monkeypatch.undo()
    full_inputs, full_key = full_walk()
    assert without == full_key
    _assert_same_inputs(inputs, full_inputs)


@torch.no_grad()
def test_a_module_attribute_set_again_to_an_equal_value_keeps_the_walk_replayed(model, monkeypatch):
    """Transformers sets `_previous_max_cache_length` on the model at every `generate()`: an int past CPython's
    small ones is a new object each time, which made every replay fail for a 1024-token prompt (its cache 1152
    long) and walk a 1.1B Llama's 215 modules again, 4.7 ms of the prefill's dispatch on a TPU v5e host."""
    x = torch.randn(2, 4, device="tpu")
    model.length = int("1152")
    trace_inputs.prepare("site", (_forward,), (model, x), {}, ())  # walked, and kept
    walked = _walks_counted(monkeypatch)
    model.length = int("1152")  # equal, another object
    trace_inputs.prepare("site", (_forward,), (model, x), {}, ())
    assert not walked
    model.length = 1153
    trace_inputs.prepare("site", (_forward,), (model, x), {}, ())
    assert walked


@pytest.mark.parametrize("change", ["new parameter", "parameter .data", "tensor attribute", "new buffer",
                                    "train", "new submodule", "resized parameter", "transposed in place",
                                    "read as another dtype"])
@torch.no_grad()
def test_a_change_to_a_module_after_its_walk_was_kept_is_seen(model, change):
    """Each change the key depends on makes the kept walk's replay fail: the call after it keys as a full walk
    would, and computes with the module as it is now."""
    traced = hf_tpu.jit(_forward)
    x = torch.randn(2, 4, device="tpu")
    traced(model, x)
    key = _full_walk_key(model, x)
    traced(model, x)  # the walk kept, and replayed
    first = model[0]
    if change == "new parameter":
        first.weight = torch.nn.Parameter(torch.ones(4, 4, device="tpu"))
    elif change == "parameter .data":
        first.weight.data = torch.full((4, 4), 2.0, device="tpu")
    elif change == "tensor attribute":
        first.scale = torch.tensor(3.0, device="tpu")
    elif change == "new buffer":
        first.register_buffer("offset", torch.ones(4, device="tpu"))
    elif change == "train":
        model.eval()
    elif change == "new submodule":
        model.append(torch.nn.Linear(4, 4).to("tpu"))
    elif change == "transposed in place":
        first.weight.requires_grad_(False).t_()  # the same tensor and buffer, another view of it
    elif change == "read as another dtype":
        # a whole-buffer view of another dtype, read: the buffer takes that view's shape and dtype
        # (`tensor_views._adopt_layout`), which the weight's next reader gives back
        first.weight.detach().view(torch.int32).add(0)
        assert direct.buffer.buffer_of(first.weight).dtype == torch.int32
    else:
        first.weight.requires_grad_(False).resize_(4, 2)  # the same tensor object, with another shape
        first.in_features = 2
        x = torch.randn(2, 2, device="tpu")
    assert torch.allclose(traced(model, x).cpu(), _forward(model, x).cpu())
    replayed = trace_inputs.prepare("site", (_forward,), (model, x), {}, ())[1]
    assert replayed == _full_walk_key(model, x)
    # new weights of the same shapes run the same program (with those weights); the other changes key anew
    assert (replayed == key) == (change in ("new parameter", "parameter .data", "read as another dtype"))


def test_the_replay_check_finds_what_changed_in_the_dicts_a_walk_read():
    """`_replay.changed_entries`: None when the dicts' keys differ from the walk's (one more, one fewer, another
    order), else the (now, before) pairs of the entries holding another object. A key built at run time is the
    same key as the equal string the walk read."""
    from hf_tpu import _replay

    weight, bias = object(), object()
    first, second = {"weight": weight, "length": 256}, {"bias": bias}
    keys, values = list(first) + list(second), [weight, 256, bias]
    assert _replay.changed_entries([first, second], keys, values) == []
    first["length"] = 1152
    assert _replay.changed_entries([first, second], keys, values) == [(1152, 256)]
    first["length"] = 256
    second["scale"] = weight
    assert _replay.changed_entries([first, second], keys, values) is None
    del second["scale"], first["weight"]
    first["weight"] = weight  # the same keys, in another order
    assert _replay.changed_entries([first, second], keys, values) is None
    rebuilt = {"".join(["wei", "ght"]): weight, "length": 256}
    assert _replay.changed_entries([rebuilt, second], keys, values) == []


@torch.no_grad()
def test_a_kept_walk_does_not_keep_its_module_or_cache_alive():
    import gc
    import weakref

    model, cache = torch.nn.Sequential(torch.nn.Linear(4, 4)).to("tpu"), KVCache()
    hf_tpu.jit(_forward, state=(model, cache))(model, torch.randn(2, 4, device="tpu"))
    assert model in trace_inputs.kept_walks and cache in trace_inputs.kept_walks
    alive = weakref.ref(model), weakref.ref(cache)
    del model, cache
    gc.collect()
    assert alive[0]() is None and alive[1]() is None and not len(trace_inputs.kept_walks)


@pytest.fixture
def compile_held_back(monkeypatch):
    """The device's compile that `meanwhile` has start on a thread, held back until `finish()`."""
    import concurrent.futures

    from hf_tpu import compile_log

    started = []

    def in_background(work):
        started.append((work, concurrent.futures.Future()))
        return started[-1][1]

    def finish():
        for work, future in started:
            future.set_result(work())

    monkeypatch.setattr(compile_log, "in_background", in_background)
    return started, finish


def _forward_on_host(calls):
    """`_forward` in PyTorch on the CPU, its result put on tpu; each call counted in `calls`."""
    def forward(model, x):
        calls.append(tuple(x.shape))
        weights = {name: p.detach().cpu() for name, p in model.named_parameters()}
        return torch.func.functional_call(model, weights, (x.cpu(),)).to("tpu")

    return forward


@torch.no_grad()
def test_while_the_device_compiles_a_call_returns_meanwhiles_result_and_then_runs_the_program(
        model, compile_held_back):
    """The first call traces the program and starts the device's compile; until it has ended each call returns
    what `meanwhile` computes; the calls after it run the program, compiled once."""
    started, finish = compile_held_back
    on_host = []
    traced = hf_tpu.jit(_forward, meanwhile=_forward_on_host(on_host))
    x = torch.randn(2, 4, device="tpu")
    for i in range(3):
        if i == 2:
            finish()
        assert torch.allclose(traced(model, x).cpu(), _forward(model, x).cpu())
        assert len(started) == 1 and len(on_host) == min(i + 1, 2)
    (program,) = [p for p in direct._programs.values() if isinstance(p, trace_program.Program)]
    assert started[0][1] is program.device_compiles[False]


@torch.no_grad()
def test_a_key_traces_once_meanwhile_has_run_it_as_long_as_a_trace_takes(model, compile_held_back, monkeypatch):
    """With `meanwhile`, a key's calls return its result and trace nothing until they have spent there
    `trace_after` seconds (before the function's first trace), then as long as the last trace took: a shape
    met once or twice costs no trace and no compile. Here each host run takes 10 s of a clock of the test's."""
    started, finish = compile_held_back
    now, on_host = [0.0], []
    monkeypatch.setattr(direct, "_clock", lambda: now[0])

    def ten_seconds_on_host(model, x, run=_forward_on_host(on_host)):
        now[0] += 10.0
        return run(model, x)

    traced = hf_tpu.jit(_forward, meanwhile=ten_seconds_on_host, trace_after=15)
    x, y = torch.randn(2, 4, device="tpu"), torch.randn(3, 4, device="tpu")
    for arg in (x, y, x):
        traced(model, arg)
    assert on_host == [(2, 4), (3, 4), (2, 4)] and not started and not direct._programs
    assert torch.allclose(traced(model, x).cpu(), _forward(model, x).cpu())  # 20 s on the host: traced
    assert len(started) == 1 and len(on_host) == 4
    # the trace took far less than the 10 s `y` has spent on the host: its next call traces
    assert direct._trace_seconds[trace_inputs.function_parts(_forward)[0]] < 10
    traced(model, y)
    assert len(started) == 2 and len(on_host) == 5
    finish()
    for arg in (x, y):
        assert torch.allclose(traced(model, arg).cpu(), _forward(model, arg).cpu())
    assert len(on_host) == 5


@torch.no_grad()
def test_a_call_meanwhile_declines_waits_for_the_compile(model, compile_held_back, monkeypatch):
    """`meanwhile` returning NotImplemented: the call waits for the device's compile started for it (not a
    compile of its own) and runs the program."""
    import concurrent.futures

    started, finish = compile_held_back
    declined = []
    traced = hf_tpu.jit(_forward, meanwhile=lambda model, x: declined.append(1) or NotImplemented)
    monkeypatch.setattr(concurrent.futures, "wait", lambda futures: finish())
    x = torch.randn(2, 4, device="tpu")
    assert torch.allclose(traced(model, x).cpu(), _forward(model, x).cpu())
    assert declined == [1] and len(started) == 1 and started[0][1].done()


@pytest.mark.parametrize("trace_after", [-1, "1", None, True, float("nan")])
def test_trace_after_is_a_number_of_seconds(trace_after):
    with pytest.raises(ValueError, match="trace_after"):
        hf_tpu.jit(_forward, trace_after=trace_after)


def test_a_call_key_is_hashed_once():
    """A call looks its key up more than once (the programs, the trace's own lookup): the tuple's hash of all of
    its parts is taken when the key is made, not at each lookup; an unhashable part raises `TypeError` there."""
    from hf_tpu import trace_inputs

    hashes = []

    class Counted:
        def __hash__(self):
            hashes.append(1)
            return 7

    key = trace_inputs.Key(("site", (Counted(), 1)))
    assert len(hashes) == 1
    assert {key: 1}[key] == 1 and hash(key) == hash(("site", (Counted(), 1)))
    assert len(hashes) == 2 and key == ("site", key[1])
    assert trace_inputs.key_text(key) == trace_inputs.key_text(tuple(key))
    with pytest.raises(TypeError):
        trace_inputs.Key(("site", ([],)))


def test_each_launch_of_a_traced_program_is_counted_with_its_arguments_bytes():
    """`hf_tpu.metrics()["programs_launched"]` and `["argument_bytes"]`: what a step launches and gives its programs
    (the parameters, gradients and state they read), counted per call of a traced function and per chunk of a
    device loop, not per trace."""
    weight = torch.ones(64, 32, device="tpu")
    x = torch.ones(8, 64, device="tpu")
    step = hf_tpu.jit(lambda x: x @ weight)
    before = hf_tpu.metrics()
    step(x)
    step(x)
    after = hf_tpu.metrics()
    assert after["programs_launched"] - before["programs_launched"] == 2
    assert after["argument_bytes"] - before["argument_bytes"] == 2 * (x.nbytes + weight.nbytes)

    total = torch.zeros((), device="tpu")
    before = hf_tpu.metrics()
    hf_tpu.while_loop(lambda i: i < 5, lambda i: (i + 1,), (torch.zeros((), dtype=torch.long, device="tpu"),),
                      state=(total,))
    launched = hf_tpu.metrics()["programs_launched"] - before["programs_launched"]
    assert launched == 2, launched  # the next chunk is launched before the first's condition is read


def test_a_traced_calls_first_run_counts_no_memory_for_what_its_trace_makes():
    """The tensors a trace makes hold tracers, in no device memory: counted, the first call of every traced
    function peaked at its intermediates' bytes."""
    x = torch.randn(64, 64, device="tpu")
    traced = hf_tpu.jit(lambda x: x.repeat(16, 16).sum(0)[:64])  # a 4 MiB intermediate, 256 bytes out
    torch.tpu.synchronize()
    before = torch.tpu.memory_allocated()
    torch.tpu.reset_peak_memory_stats()
    out = traced(x)
    assert torch.tpu.max_memory_allocated() - before <= 4 * 64 * 4, torch.tpu.max_memory_allocated() - before
    torch.testing.assert_close(out.cpu(), x.cpu().repeat(16, 16).sum(0)[:64], rtol=1e-4, atol=1e-4)  # 16 terms
