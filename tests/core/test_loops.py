"""`hf_tpu.while_loop` against the Python loop it stands for: the same results, in-place updates that
persist, no host read between iterations, and the Python loop wherever the device loop cannot run."""

import pytest
import torch

import hf_tpu
from hf_tpu import compile_log
from tests.util import transcendental_tolerance


def _python_loop(cond_fn, body_fn, carried):
    while bool(cond_fn(*carried)):
        carried = body_fn(*carried)
    return carried


def _counting_to(limit):
    return lambda x, i: i < limit


def test_a_loop_computes_what_the_python_loop_computes():
    weights = {"cpu": torch.randn(8, 8) / 3}
    weights["tpu"] = weights["cpu"].to("tpu")

    def body(x, i):
        return torch.tanh(x @ weights[x.device.type] + 1), i + 1

    cond = _counting_to(6)
    expected, count = _python_loop(cond, body, (torch.ones(2, 8), torch.tensor(0)))
    actual, actual_count = hf_tpu.while_loop(cond, body, (torch.ones(2, 8, device="tpu"), torch.tensor(0, device="tpu")))
    torch.testing.assert_close(actual.cpu(), expected, **transcendental_tolerance(rtol=1e-5, atol=1e-6))
    assert int(actual_count) == int(count) == 6


def test_iterations_make_no_host_read_and_a_second_loop_compiles_nothing():
    def body(x, i):
        return x * 2, i + 1

    carried = (torch.ones(3, device="tpu"), torch.tensor([0], device="tpu"))
    # a bound held in a tensor is an input of the compiled step; a Python number would be compiled in
    bounds = [torch.tensor(n, device="tpu") for n in (3, 3, 10)]  # twice: a deferred flush sees new ops first
    for bound in bounds:
        hf_tpu.reset_metrics()
        x, i = hf_tpu.while_loop(_counting_to(bound), body, carried)
    assert hf_tpu.metrics()["compiles"] == 0 and hf_tpu.metrics()["host_syncs"] == 0
    assert torch.equal(x.cpu(), torch.full((3,), 1024.0)) and i.item() == 10


@pytest.mark.parametrize("traced", ["torch.compile", "hf_tpu.jit"])
def test_a_loop_of_several_chunks_compiles_once(traced):
    """Each chunk starts from the iteration count the chunk before reached: were that count the device
    array the chunk returned, its placement (unlike the first chunk's host number) would key a second XLA
    compile of the same loop."""
    from jax._src import monitoring

    loop_compiles = []

    def on_duration(event, seconds, **kwargs):
        if event.endswith("backend_compile_duration") and "loop" in kwargs.get("fun_name", ""):
            loop_compiles.append(kwargs["fun_name"])

    class Counter(torch.nn.Module):  # state for the traced loop: its step reads the weight
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.tensor([1.0], device="tpu"), requires_grad=False)

    counter = Counter()
    iterations = 3 * hf_tpu.loop_chunks.ChunkSizes.FIRST  # three chunks at least
    monitoring.register_event_duration_secs_listener(on_duration)
    try:
        x, i = hf_tpu.while_loop(_counting_to(iterations), lambda x, i: (x + counter.weight, i + 1),
                                 (torch.zeros(1, device="tpu"), torch.tensor([0], device="tpu")),
                                 state=(counter,) if traced == "hf_tpu.jit" else None)
    finally:
        monitoring.unregister_event_duration_listener(on_duration)
    assert i.item() == iterations and x.item() == iterations
    assert len(loop_compiles) == 1, loop_compiles


def test_a_traced_loops_first_condition_is_computed_in_its_program():
    """With `state`, the loop's condition on the carried values it starts from is computed inside the loop's program
    (`loop_chunks.loop_chunk`'s `condition`): evaluated before it, each of its ops (here a sum, a comparison and an
    `&` for shapes no op met before) was an XLA program of its own, compiled at every process's first loop. A
    condition false from the start runs no iteration, as the Python loop runs none."""
    from jax._src import monitoring

    compiled = []

    def on_duration(event, seconds, **kwargs):
        if event.endswith("backend_compile_duration"):
            compiled.append(kwargs.get("fun_name"))

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((5, 7), 0.25, device="tpu"), requires_grad=False)

    step, bound = Step(), torch.tensor([3], device="tpu")

    def cond(x, i):
        return (i < bound) & (x.sum() < 1e9)

    def body(x, i):
        return x + step.weight, i + 1

    start = (torch.zeros(5, 7, device="tpu"), torch.tensor([0], device="tpu"))
    torch.tpu.synchronize()  # the ops deferred so far (defer-and-fuse) run now, as a program of their own
    monitoring.register_event_duration_secs_listener(on_duration)
    try:
        with torch.no_grad():
            x, i = hf_tpu.while_loop(cond, body, start, state=(step,))
    finally:
        monitoring.unregister_event_duration_listener(on_duration)
    assert len(compiled) == 1 and "loop" in compiled[0], compiled
    assert i.item() == 3 and torch.equal(x.cpu(), torch.full((5, 7), 0.75))
    bound.fill_(0)
    with torch.no_grad():
        x, i = hf_tpu.while_loop(cond, body, (x, i), state=(step,))
    assert i.item() == 3 and torch.equal(x.cpu(), torch.full((5, 7), 0.75))


def test_a_loop_compiled_ahead_is_run_later_without_another_compile():
    """`while_loop(..., run=False)` traces the step and compiles the loop on a thread of its own while this
    thread goes on (here: compiling an op); the call that runs it, with other values of the same shapes, waits
    for that compile and compiles nothing more. Asking again compiles nothing either."""
    import threading

    from jax._src import monitoring

    loop_compiles = []

    def on_duration(event, seconds, **kwargs):
        if event.endswith("backend_compile_duration") and "loop" in kwargs.get("fun_name", ""):
            loop_compiles.append(threading.current_thread().name)

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.tensor([0.5], device="tpu"), requires_grad=False)

    scale = Scale()

    def halve_and_add_one(x, i):
        return x * scale.weight + 1, i + 1

    cond = _counting_to(5)
    monitoring.register_event_duration_secs_listener(on_duration)
    try:
        assert hf_tpu.while_loop(cond, halve_and_add_one, (torch.zeros(3, device="tpu"), torch.tensor([0], device="tpu")),
                                 state=(scale,), run=False) is None
        (torch.arange(7, device="tpu") * 3).cpu()  # this thread compiles meanwhile
        x, i = hf_tpu.while_loop(cond, halve_and_add_one, (torch.full((3,), 4.0, device="tpu"),
                                                           torch.tensor([0], device="tpu")), state=(scale,))
        hf_tpu.while_loop(cond, halve_and_add_one, (torch.zeros(3, device="tpu"), torch.tensor([0], device="tpu")),
                          state=(scale,), run=False)
    finally:
        monitoring.unregister_event_duration_listener(on_duration)
    expected, _ = _python_loop(cond, lambda x, i: (x * 0.5 + 1, i + 1), (torch.full((3,), 4.0), torch.tensor([0])))
    torch.testing.assert_close(x.cpu(), expected)
    assert i.item() == 5
    assert loop_compiles == ["hf_tpu background compile"], loop_compiles


def test_a_loop_lowered_for_a_device_is_returned_and_runs_nothing():
    """`direct.while_loop(..., lower_for=device)` returns the loop's first chunk lowered for that device from the
    inputs' shapes (what `benchmarks.quant_hlo --decode` compiles for a v5e): a while loop over the step, whose
    compiled program reads the state's weight; the state keeps its values."""
    import jax

    from hf_tpu import direct

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((4, 4), 0.5, device="tpu"), requires_grad=False)

    scale = Scale()

    def project(x, i):
        return x @ scale.weight, i + 1

    cond = _counting_to(5)
    carried = (torch.ones(4, device="tpu"), torch.tensor([0], device="tpu"))
    with torch.no_grad():
        lowered = direct.while_loop(cond, project, carried, (scale,), run=False,
                                    lower_for=jax.devices("cpu")[0])
    text = lowered.compile().as_text()
    assert " while(" in text and "f32[4,4]" in text
    torch.testing.assert_close(carried[0].cpu(), torch.ones(4))
    torch.testing.assert_close(scale.weight.cpu(), torch.full((4, 4), 0.5))


def test_a_loop_asked_ahead_without_state_compiles_nothing():
    carried = (torch.zeros(2, device="tpu"), torch.tensor([0], device="tpu"))
    hf_tpu.reset_metrics()
    assert hf_tpu.while_loop(_counting_to(3), lambda x, i: (x + 1, i + 1), carried, run=False) is None
    assert hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0) == 0


def test_tensors_updated_in_place_keep_their_final_values():
    cache = torch.zeros(4, 6, device="tpu")
    total = torch.zeros((), device="tpu")

    def body(x, i):
        cache.index_copy_(1, i, x[:, None])  # a KV cache written at the step's position
        total.add_(x.sum())
        return x + 1, i + 1

    x, i = hf_tpu.while_loop(_counting_to(6), body, (torch.arange(4.0, device="tpu"), torch.tensor([0], device="tpu")))
    expected = torch.arange(4.0)[:, None] + torch.arange(6.0)
    assert torch.equal(cache.cpu(), expected)
    assert total.item() == expected.sum().item()
    assert torch.equal(x.cpu(), torch.arange(4.0) + 6)


def test_a_false_condition_runs_no_iteration():
    seen = torch.zeros((), device="tpu")

    def body(x):
        seen.add_(1)
        return x + 1

    (x,) = hf_tpu.while_loop(lambda x: x.sum() > 100, body, (torch.ones(2, device="tpu"),))
    assert torch.equal(x.cpu(), torch.ones(2)) and seen.item() == 0


def test_the_condition_can_stop_on_data():
    def body(x, n):
        return torch.where(x == 1, x, torch.where(x % 2 == 0, x // 2, 3 * x + 1)), n + 1

    (x, steps) = hf_tpu.while_loop(lambda x, n: (x != 1).any(), body,
                                   (torch.tensor([27, 7], device="tpu"), torch.tensor(0, device="tpu")))
    assert x.tolist() == [1, 1] and steps.item() == 111  # Collatz: 27 takes 111 steps, 7 fewer


def test_each_iteration_draws_new_random_numbers():
    draws = torch.zeros(5, 3, device="tpu")

    def body(i):
        draws.index_copy_(0, i, torch.rand(1, 3, device="tpu"))
        return i + 1

    torch.manual_seed(0)
    hf_tpu.while_loop(lambda i: i < 5, body, (torch.tensor([0], device="tpu"),))
    rows = draws.cpu()
    assert len({tuple(row.tolist()) for row in rows}) == 5 and bool((rows > 0).all())
    # the ops after the loop, and a second loop, draw numbers of their own
    later = torch.rand(1, 3, device="tpu").cpu()
    hf_tpu.while_loop(lambda i: i < 5, body, (torch.tensor([0], device="tpu"),))
    every = torch.cat([rows, later, draws.cpu()])
    assert len({tuple(row.tolist()) for row in every}) == 11


@pytest.mark.parametrize("case", ["host read in the body", "cpu tensor carried", "cpu tensor read", "needs gradients"])
def test_what_the_device_loop_cannot_take_runs_as_the_python_loop(case):
    device = "cpu" if case == "cpu tensor carried" else "tpu"

    three = torch.tensor(3.0)

    def body(x, i):
        if case == "host read in the body" and x.sum().item() > 1e9:  # a graph break
            x = x * 0
        if case == "cpu tensor read":
            return x * three.to(x.device), i + 1
        return x * 3, i + 1

    x0 = torch.ones(2, device=device, requires_grad=case == "needs gradients")
    x, i = hf_tpu.while_loop(_counting_to(4), body, (x0, torch.tensor(0, device=device)))
    assert torch.equal(x.detach().cpu(), torch.full((2,), 81.0)) and int(i) == 4
    # the compile begun for a step that then could not loop is closed: left open, it stood for every later one
    assert compile_log._current[0] is None or compile_log._current[0].idle
    if case == "needs gradients":
        x.sum().backward()
        assert torch.equal(x0.grad.cpu(), torch.full((2,), 81.0))
