"""`torch.compile(module, backend="tpu")` served by the direct trace (`hf_tpu.compiled_modules`), against the same
module run eagerly on the CPU: the results, what a compiled module must see change between calls (an in-place
update, `train()`/`eval()`, an attribute, a config field, a hook), and Dynamo wherever the trace cannot mean the
same."""

import copy
import time

import pytest
import torch
import torch._dynamo.utils

import hf_tpu
from hf_tpu import direct


@pytest.fixture(autouse=True)
def fresh():
    direct.reset()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield


def _traced() -> int:
    return hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0)


def _captured() -> int:
    """Frames Dynamo captured since the test began."""
    return torch._dynamo.utils.counters["frames"]["ok"]


class Block(torch.nn.Module):
    """A forward that reads a Python attribute, a config object's field and its training flag."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.linear = torch.nn.Linear(4, 4)
        self.scale = 2.0

    def forward(self, x, shift=None):
        y = self.linear(x) * self.scale
        if self.config.squash:
            y = torch.tanh(y)
        if self.training:
            y = y + 1
        return y if shift is None else y + shift


class Config:
    def __init__(self):
        self.squash = False


def _pair():
    torch.manual_seed(0)
    cpu = Block(Config()).eval()
    return cpu, copy.deepcopy(cpu).to("tpu")


def _check(compiled, cpu, *args, **kwargs):
    with torch.no_grad():
        expected = cpu(*args, **kwargs)
        actual = compiled(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args],
                          **{k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    torch.testing.assert_close(actual.cpu(), expected)


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile", "forward"])
def test_a_compiled_module_is_traced_directly_without_dynamo(how):
    cpu, module = _pair()
    if how == "torch.compile":
        compiled = torch.compile(module, backend="tpu")
    elif how == "Module.compile":
        module.compile(backend="tpu")
        compiled = module
    else:
        compiled = torch.compile(module.forward, backend="tpu")
    x = torch.randn(3, 4)
    for _ in range(2):
        _check(compiled, cpu, x)
    _check(compiled, cpu, torch.randn(5, 4))  # a new shape: a new trace
    assert _traced() == 2 and _captured() == 0


def test_what_the_eager_module_would_see_change_is_seen():
    cpu, module = _pair()
    compiled = torch.compile(module, backend="tpu")
    x = torch.randn(3, 4)
    _check(compiled, cpu, x)
    with torch.no_grad():  # an optimizer's in-place update: read at the next call, no new trace
        for p in (*cpu.parameters(), *module.parameters()):
            p.mul_(0.5)
    _check(compiled, cpu, x)
    assert _traced() == 1
    for m in (cpu, module):
        m.scale = 3.0  # a Python attribute the forward reads
    _check(compiled, cpu, x)
    for m in (cpu, module):
        m.config.squash = True  # a field of an object a module holds
    _check(compiled, cpu, x)
    for m in (cpu, module):
        m.train()
    _check(compiled, cpu, x)
    assert _traced() == 4
    module.linear.weight = torch.nn.Parameter(torch.ones(4, 4, device="tpu"))  # a parameter replaced: an input of
    cpu.linear.weight = torch.nn.Parameter(torch.ones(4, 4))  # the same program
    _check(compiled, cpu, x)
    module.linear.bias = torch.nn.Parameter(torch.ones(2, device="tpu")[:1].expand(4))  # a view: a new program
    cpu.linear.bias = torch.nn.Parameter(torch.ones(4))
    _check(compiled, cpu, x)
    assert _traced() == 5 and _captured() == 0


def test_the_modules_own_hooks_run_at_every_call_and_a_submodules_send_it_to_dynamo():
    cpu, module = _pair()
    compiled = torch.compile(module, backend="tpu")
    calls = []

    def pre_hook(m, args):
        calls.append("pre")
        return (args[0] * 2,)

    def hook(m, args, output):
        calls.append("post")
        return output - 1

    for m in (cpu, module):
        m.register_forward_pre_hook(pre_hook)
        m.register_forward_hook(hook)
    x = torch.randn(3, 4)
    for _ in range(2):
        _check(compiled, cpu, x)
    assert calls == ["pre", "post"] * 4 and _traced() == 1 and _captured() == 0
    inner_calls = []
    for m in (cpu, module):
        m.linear.register_forward_hook(lambda m, args, output: inner_calls.append(1))
    _check(compiled, cpu, x)  # a hook inside the forward: Dynamo's
    _check(compiled, cpu, x)
    assert len(inner_calls) == 4 and _captured() >= 1


def test_a_hook_known_to_act_within_the_call_is_traced(monkeypatch):
    cpu, module = _pair()
    compiled = torch.compile(module, backend="tpu")

    def doubling(m, args, output):
        return output * 2

    for m in (cpu, module):
        m.linear.register_forward_hook(doubling)
    from hf_tpu import compiled_modules

    monkeypatch.setattr(compiled_modules, "HOOKS_WITHIN_THE_CALL", {doubling.__code__})
    _check(compiled, cpu, torch.randn(3, 4))
    assert _traced() == 1 and _captured() == 0


def test_gradients_and_untraceable_forwards_run_through_dynamo(caplog):
    cpu, module = _pair()
    compiled = torch.compile(module, backend="tpu")
    x = torch.randn(3, 4)
    for _ in range(2):
        compiled(x.to("tpu")).sum().backward()  # with gradients: Dynamo's graph has a backward
    for _ in range(2):
        cpu(x).sum().backward()
    torch.testing.assert_close(module.linear.weight.grad.cpu(), cpu.linear.weight.grad)
    assert _captured() == 1
    assert not [r for r in caplog.records if "without hf_tpu.jit's trace" in r.getMessage()]  # no word a step

    class Branching(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else -x  # a host read

    compiled = torch.compile(Branching(), backend="tpu")
    for sign in (1.0, -1.0):
        x = torch.full((3,), sign, device="tpu")
        torch.testing.assert_close(compiled(x).cpu(), Branching()(x.cpu()))


def test_a_python_side_effect_runs_at_every_call_through_dynamo():
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x + self.calls

    module = Counting()
    compiled = torch.compile(module, backend="tpu")
    x = torch.zeros(2, device="tpu")
    outs = [compiled(x).cpu() for _ in range(3)]
    assert module.calls == 3 and [o[0].item() for o in outs] == [1.0, 2.0, 3.0]


def test_an_object_argument_is_state_and_a_compiled_submodule_is_traced_within_its_caller():
    cpu, module = _pair()
    module.linear.compile(backend="tpu")  # compiled on its own, called inside a module traced directly
    compiled = torch.compile(module, backend="tpu")

    class Shift:
        def __init__(self, value):
            self.value = value

    x = torch.randn(3, 4)
    for value in (1.0, 2.0):
        shift_cpu, shift_tpu = Shift(torch.full((4,), value)), Shift(torch.full((4,), value, device="tpu"))
        with torch.no_grad():
            expected = cpu(x, shift_cpu.value)
            actual = compiled(x.to("tpu"), shift_tpu.value)
            torch.testing.assert_close(actual.cpu(), expected)
    assert _traced() == 1 and _captured() == 0


def test_a_compiled_module_given_to_a_traced_function_is_traced_within_its_program():
    """`hf_tpu.jit` given the module `torch.compile` returns (an `OptimizedModule`, with no `training` of its own: its
    property reads the wrapped module's) traces the module's forward and backward into the function's program, the
    CPU's loss and gradients; `train()`/`eval()` of the wrapper is a new key, as of the module."""
    cpu, module = _pair()
    compiled = torch.compile(module, backend="tpu")

    def step(model, x):
        loss = model(x).sum()
        loss.backward()
        return loss.detach()

    traced = hf_tpu.jit(step)
    x = torch.randn(3, 4)
    for training in (False, True):
        cpu.train(training), compiled.train(training)
        cpu.zero_grad(), module.zero_grad()
        torch.testing.assert_close(traced(compiled, x.to("tpu")).cpu(), step(cpu, x))
        torch.testing.assert_close(module.linear.weight.grad.cpu(), cpu.linear.weight.grad)
    assert _traced() == 2 and _captured() == 0


def test_turned_off_every_call_is_dynamos(monkeypatch):
    monkeypatch.setenv("HF_TPU_COMPILE_DIRECT", "0")
    cpu, module = _pair()
    compiled = torch.compile(module, backend="tpu")
    _check(compiled, cpu, torch.randn(3, 4))
    assert _captured() == 1


def test_a_transformers_model_with_its_cache_output_against_the_cpu():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=128)
    cpu = transformers.LlamaForCausalLM(config).eval()
    compiled = torch.compile(copy.deepcopy(cpu).to("tpu"), backend="tpu")
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        expected, actual = cpu(ids), compiled(ids.to("tpu"))
        hidden = compiled(ids.to("tpu"), output_hidden_states=True, use_cache=False)
    torch.testing.assert_close(actual.logits.cpu(), expected.logits, atol=1e-5, rtol=1e-4)
    assert type(actual.past_key_values) is type(expected.past_key_values)
    for layer, expected_layer in zip(actual.past_key_values.layers, expected.past_key_values.layers):
        torch.testing.assert_close(layer.keys.cpu(), expected_layer.keys, atol=1e-5, rtol=1e-4)
    assert len(hidden.hidden_states) == 3 and hidden.past_key_values is None
    assert _captured() <= 1  # Transformers installs its output-capturing hooks in the first such call


def test_a_torch_nn_module_compiled_is_traced_directly_too():
    """`torch.compile` of a `torch.nn` module (Dynamo calls it through `wrap_inline`) takes the same path."""
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    compiled = torch.compile(copy.deepcopy(cpu).to("tpu"), backend="tpu")
    _check(compiled, cpu, torch.randn(3, 4))
    assert _traced() == 1 and _captured() == 0


# --- buckets: a causal LM compiled, called with new lengths and batch sizes (the Transformers adapter's policy)


@pytest.fixture
def causal_lm():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=128)
    cpu = transformers.LlamaForCausalLM(config).eval()
    return cpu, copy.deepcopy(cpu).to("tpu")


def _same_as_the_cpu(compiled, cpu, ids, **kwargs):
    with torch.no_grad():
        expected = cpu(ids, **kwargs)
        actual = compiled(ids.to("tpu"), **{k: v.to("tpu") if isinstance(v, torch.Tensor) else v
                                             for k, v in kwargs.items()})
    assert actual.logits.shape == expected.logits.shape
    torch.testing.assert_close(actual.logits.cpu(), expected.logits, atol=1e-5, rtol=1e-4)
    if expected.past_key_values is not None:
        for layer, expected_layer in zip(actual.past_key_values.layers, expected.past_key_values.layers):
            torch.testing.assert_close(layer.keys.cpu(), expected_layer.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(layer.values.cpu(), expected_layer.values, atol=1e-5, rtol=1e-4)
    for hidden, expected_hidden in zip(actual.hidden_states or (), expected.hidden_states or ()):
        torch.testing.assert_close(hidden.cpu(), expected_hidden, atol=1e-5, rtol=1e-4)
    return actual


def test_lengths_within_a_bucket_share_its_program_with_the_cpus_results(causal_lm):
    cpu, tpu = causal_lm
    compiled = torch.compile(tpu, backend="tpu")
    for length in (40, 37, 48, 33):  # all padded to 48
        _same_as_the_cpu(compiled, cpu, torch.randint(0, 128, (2, length)))
    mask = torch.ones(2, 35, dtype=torch.long)
    mask[1, :5] = 0  # a left-padded row
    _same_as_the_cpu(compiled, cpu, torch.randint(0, 128, (2, 35)), attention_mask=mask, output_hidden_states=True)
    # the mask and the hidden states make another program of the bucket, traced twice: Transformers installs its
    # output-capturing hooks in the first trace, which is made again with them
    assert _traced() == 3 and _captured() == 0


def test_a_new_bucket_is_served_by_a_compiled_one_until_its_own_is_traced(causal_lm):
    cpu, tpu = causal_lm
    compiled = torch.compile(tpu, backend="tpu")
    _same_as_the_cpu(compiled, cpu, torch.randint(0, 128, (1, 100)))  # bucket 128
    _same_as_the_cpu(compiled, cpu, torch.randint(0, 128, (1, 20)))  # bucket 32: the 128 program runs it
    _same_as_the_cpu(compiled, cpu, torch.randint(0, 128, (3, 20)))  # batch 3: rows in chunks of 1
    _same_as_the_cpu(compiled, cpu, torch.randint(0, 128, (2, 128)))  # chunks of the bucket's length: no padding
    assert _traced() == 1 and _captured() == 0
    direct._trace_seconds.clear()  # a trace costs nothing now: the next call of a new bucket buys its own
    _same_as_the_cpu(compiled, cpu, torch.randint(0, 128, (1, 20)))
    assert _traced() == 2


def test_static_shapes_stay_exact(causal_lm):
    cpu, tpu = causal_lm
    compiled = torch.compile(tpu, backend="tpu", dynamic=False)
    for length in (40, 37):
        _same_as_the_cpu(compiled, cpu, torch.randint(0, 128, (1, length)))
    assert _traced() == 2


def test_a_batch_marked_dynamic_is_padded_to_a_power_of_two(causal_lm):
    cpu, tpu = causal_lm
    compiled = torch.compile(tpu, backend="tpu")
    for batch in (3, 4):
        ids = torch.randint(0, 128, (batch, 16))
        tpu_ids = ids.to("tpu")
        torch._dynamo.mark_dynamic(tpu_ids, 0)
        with torch.no_grad():
            out = compiled(tpu_ids)
        torch.testing.assert_close(out.logits.cpu(), cpu(ids).logits, atol=1e-5, rtol=1e-4)
    assert _traced() == 1


def test_torch_compile_by_the_backends_name_installs_the_direct_trace_in_a_fresh_process():
    """The `tpu` backend's entry point is `hf_tpu.compiled_modules`: `torch.compile(backend="tpu")` loads it, and the
    hook is in place before Dynamo wraps the module."""
    import subprocess
    import sys

    from tests.util import cpu_process_env

    code = ("import torch, torch._dynamo.utils, hf_tpu\n"
            "m = torch.compile(torch.nn.Linear(4, 4).to('tpu'), backend='tpu')\n"
            "with torch.no_grad():\n"
            "    m(torch.randn(2, 4, device='tpu')).cpu()\n"
            "print(hf_tpu.metrics()['compiles_by_mode'].get('COMPILE', 0), "
            "dict(torch._dynamo.utils.counters['frames']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=cpu_process_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[:2] == ["1", "{}"], proc.stdout


@pytest.mark.parametrize("platform, variable, expected", [
    ("tpu", None, "first-calls"), ("cpu", None, "checkpointed"), ("gpu", None, "checkpointed"),
    ("tpu", "off", "off"), ("cpu", "first-calls", "first-calls")])
def test_the_scanned_first_calls_are_the_default_on_a_tpu_alone(platform, variable, expected, monkeypatch):
    """Unset, `HF_TPU_SCAN_LAYERS` is `first-calls` on a TPU (XLA compiles the scanned forward sooner there) and
    `checkpointed` elsewhere (the CPU compiles the unrolled forward in seconds and runs the scanned one slower);
    the variable, when set, decides everywhere."""
    import hf_tpu
    from hf_tpu.integrations.transformers.settings import Settings

    monkeypatch.setattr(hf_tpu, "platform_name", lambda: platform)
    if variable is None:
        monkeypatch.delenv("HF_TPU_SCAN_LAYERS", raising=False)
    else:
        monkeypatch.setenv("HF_TPU_SCAN_LAYERS", variable)
    assert Settings().scan_layers == expected


@pytest.mark.parametrize("dynamic", [None, False])  # padded to its bucket, or its own shape
def test_first_calls_run_the_scanned_layers_until_the_unrolled_program_is_compiled(causal_lm, dynamic):
    """`HF_TPU_SCAN_LAYERS=first-calls`: a compiled model's first call of a shape without a KV cache runs its layers
    scanned (a program XLA compiles sooner), the next call traces the unrolled forward, whose compile runs beside
    the calls, and once it is compiled it serves every call; each call gives the CPU's logits. A call with a KV
    cache, and a model whose layers were not arranged (`scanned_layers.arrange`), compile the forward alone."""
    from hf_tpu.integrations.transformers import configure, scanned_layers
    from hf_tpu.integrations.transformers.settings import settings

    cpu, tpu = causal_lm
    previous = settings.scan_layers
    scanned_layers.arrange(tpu)
    compiled = torch.compile(tpu, backend="tpu", dynamic=dynamic)
    ids = torch.randint(0, 128, (1, 100))
    configure(scan_layers="first-calls")
    try:
        _same_as_the_cpu(compiled, cpu, ids, use_cache=False)
        assert _traced() == 1  # the scanned form alone
        _same_as_the_cpu(compiled, cpu, ids, use_cache=False)
        assert _traced() == 2  # the unrolled form, compiled beside this call
        programs = [p for p in direct._programs.values() if p is not direct._NOT_TRACEABLE]
        for _ in range(50):  # the unrolled form serves once its compile is done
            _same_as_the_cpu(compiled, cpu, ids, use_cache=False)
            unrolled = [p for p in programs if "scan" not in str(p.jaxpr)]
            if unrolled and unrolled[0].launched:
                break
            time.sleep(0.1)
        assert sorted("scan" in str(p.jaxpr) for p in programs) == [False, True]
        assert all(p.launched for p in programs) and _traced() == 2 and _captured() == 0
        _same_as_the_cpu(compiled, cpu, torch.randint(0, 128, (1, 100)))  # a KV cache: the unrolled form alone
        assert _traced() == 3
    finally:
        configure(scan_layers=previous)


_NEW_LENGTHS = iter(range(23, 1000))  # a length no earlier call in this process compiled for


def test_a_first_call_compiles_the_traced_program_and_nothing_else(causal_lm):
    """A cold process's first compiled forward pays XLA for every program it compiles, tiny ones too.
    Transformers' mask functions index position ids made by `arange`, whose index checks the trace decides
    on the host (`index_checks.in_range_on_host`); through JAX each op of such a check was an eager program compiled
    for its shapes, some 40 of them per forward. Only the traced program compiles now (and the device's record of
    index errors, which merges the program's after a call: once per process, not per trace)."""
    from jax._src import monitoring

    compiled_names = []

    def on_duration(event, seconds, **kwargs):
        if event.endswith("backend_compile_duration"):
            compiled_names.append(kwargs.get("fun_name"))

    cpu, tpu = causal_lm
    compiled = torch.compile(tpu, backend="tpu", dynamic=False)  # the call's own shape: one no call compiled
    ids = torch.randint(0, 128, (1, next(_NEW_LENGTHS)))
    monitoring.register_event_duration_secs_listener(on_duration)
    try:
        _same_as_the_cpu(compiled, cpu, ids, use_cache=False)
    finally:
        monitoring.unregister_event_duration_listener(on_duration)
    assert _traced() == 1
    traced = [name for name in compiled_names if name != "jit(_merged)"]
    # the forward's program, or on a TPU its scanned first-calls form (`HF_TPU_SCAN_LAYERS`' default there)
    assert len(traced) == 1 and traced[0] in ("jit(traced_LlamaForCausalLM.forward)", "jit(traced__scanned_forward)"), \
        compiled_names
