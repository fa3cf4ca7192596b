"""The compile log: a compile longer than HF_TPU_SLOW_COMPILE_SECONDS is named with its inputs and where its
time went, one still running past it is announced, and short compiles say nothing."""

import logging
import time

import jax
import jax.numpy as jnp
import pytest
import torch

import hf_tpu  # noqa: F401
from hf_tpu import compile_log


@pytest.fixture
def compile_records(caplog):
    caplog.set_level(logging.WARNING, logger="hf_tpu.compile")
    compile_log._slow_kinds.clear()
    yield lambda: [r.getMessage() for r in caplog.records if r.name == "hf_tpu.compile"]
    compile_log._slow_kinds.clear()


def _slow_to_trace(seconds):
    def slow_to_trace(x):
        time.sleep(seconds)
        return x * 2

    return jax.jit(slow_to_trace)


def test_a_slow_compile_is_announced_while_it_runs_then_logged_with_its_phases(compile_records, monkeypatch):
    # the input's own compile (`broadcast_in_dim`) first, under the default threshold: on a loaded machine it
    # once took longer than 0.3 s and was logged before the function's
    x = jnp.ones(3)
    monkeypatch.setenv("HF_TPU_SLOW_COMPILE_SECONDS", "0.3")
    _slow_to_trace(0.8)(x)
    lines = compile_records()
    assert lines[0] == "hf_tpu: compiling `slow_to_trace` (0.3s so far) ..."
    assert lines[1].startswith("hf_tpu: compiled `slow_to_trace` in ") and "trace 0.8s" in lines[1], lines
    assert "lowering" in lines[1] and "XLA" in lines[1] and len(lines) == 2


def test_short_compiles_say_nothing_by_default(compile_records):
    # a process's first Dynamo capture imports Dynamo's machinery (5 s on the v5e's host, and announced): first,
    # and forgotten (on a loaded machine it took longer than the threshold, and the next would be announced)
    torch.compile(lambda x: x - 1, backend="tpu")(torch.randn(3, device="tpu"))
    compile_log._slow_kinds.clear()
    before = len(compile_records())
    compiled = torch.compile(lambda x: torch.sin(x) + 1, backend="tpu")
    compiled(torch.randn(5, device="tpu"))
    torch.randn(7, device="tpu").cos()
    assert compile_records()[before:] == []


def test_a_torch_compile_graph_is_named_with_its_inputs_and_the_next_announced(compile_records, monkeypatch):
    monkeypatch.setenv("HF_TPU_SLOW_COMPILE_SECONDS", "0.000001")
    torch._dynamo.reset()  # Dynamo captures anew in each mode

    def add_one(x, scale):
        return torch.tanh(x) * scale + 1

    compiled = torch.compile(add_one, backend="tpu")
    compiled(torch.randn(2, 3, device="tpu"), torch.randn(3, device="tpu"))
    done = [line for line in compile_records() if line.startswith("hf_tpu: compiled the torch.compile graph")]
    assert len(done) == 1, compile_records()
    assert "`add_one`" in done[0] and "x float32[2, 3], scale float32[3]" in done[0], done[0]
    assert "capture" in done[0] and "trace" in done[0] and "XLA" in done[0]
    compiled(torch.randn(4, 3, device="tpu"), torch.randn(3, device="tpu"))  # new shapes: Dynamo compiles again
    lines = compile_records()
    assert any(line.startswith("hf_tpu: compiling the torch.compile graph of `add_one` (the last one like it took")
               for line in lines), lines
    assert "x float32[4, 3]" in lines[-1] or any("x float32[4, 3]" in line for line in lines)


def test_a_graph_compiled_while_another_compile_is_pending_is_not_timed_from_that_ones_start(compile_records):
    """Dynamo runs its start callbacks only when no other compile is pending: a frame compiled meanwhile has no
    start of its own, and the one noted last (here a minute old) belongs to another frame."""
    from torch._dynamo.callback import CallbackTrigger

    from hf_tpu import compile as tpu_compile

    compiled = torch.compile(lambda x: torch.cos(x) * 3, backend="tpu")
    with torch._dynamo.callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "another frame"):
        tpu_compile._dynamo_started[0] = ("another frame", time.perf_counter() - 60)
        compiled(torch.randn(5, device="tpu"))
    assert compile_records() == []  # nothing slow: not 60 s of capture


def test_a_compile_in_the_background_is_logged_apart_from_one_on_this_thread(compile_records, monkeypatch):
    """A loop compiled ahead (`while_loop(..., run=False)`) compiles on a thread of its own while this thread
    traces and compiles another program: each is logged once, under its own name and inputs."""
    monkeypatch.setenv("HF_TPU_SLOW_COMPILE_SECONDS", "0.000001")

    class Shift(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.ones(4, device="tpu"), requires_grad=False)

    shift = Shift()

    def shift_step(x, i):
        return x + shift.bias, i + 1

    def double_it(x):
        return x * 2 + shift.bias

    def below_three(x, i):
        return i < 3

    hf_tpu.while_loop(below_three, shift_step, (torch.zeros(4, device="tpu"), torch.tensor([0], device="tpu")),
                      state=(shift,), run=False)
    hf_tpu.jit(double_it, state=(shift,))(torch.zeros(2, 4, device="tpu"))
    hf_tpu.while_loop(below_three, shift_step, (torch.zeros(4, device="tpu"), torch.tensor([0], device="tpu")),
                      state=(shift,))
    done = [line for line in compile_records() if line.startswith("hf_tpu: compiled the direct trace")]
    loop = [line for line in done if "while_loop step `shift_step`" in line]
    jitted = [line for line in done if "`double_it`" in line]
    assert len(loop) == 1 and len(jitted) == 1 and len(done) == 2, done
    assert "carried 0 float32[4]" in loop[0] and "XLA" in loop[0]
    assert "argument 0 float32[2, 4]" in jitted[0] and "XLA" in jitted[0]


@pytest.mark.parametrize("value", ["-1", "soon", "inf"])
def test_the_threshold_must_be_a_number_of_seconds(monkeypatch, value):
    from hf_tpu import settings

    monkeypatch.setenv("HF_TPU_SLOW_COMPILE_SECONDS", value)
    with pytest.raises(ValueError, match="HF_TPU_SLOW_COMPILE_SECONDS.*a non-negative number of seconds"):
        settings.get("HF_TPU_SLOW_COMPILE_SECONDS")


def test_a_function_only_traced_is_not_taken_for_a_compile_that_hangs(compile_records, monkeypatch):
    monkeypatch.setenv("HF_TPU_SLOW_COMPILE_SECONDS", "0.2")

    def only_traced(x):  # a name of its own: the eager ops' programs are `<lambda>`s, logged when slow
        return x + 1

    jax.eval_shape(only_traced, jnp.ones(3))  # traced, never lowered nor compiled
    time.sleep(0.5)
    torch.randn(4, device="tpu").sin()
    assert not any("only_traced" in line for line in compile_records()), compile_records()
