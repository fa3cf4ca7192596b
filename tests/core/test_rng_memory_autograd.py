"""RNG reproducibility and state, memory statistics, and autograd's checks on tpu."""

import pytest
import torch

from tests.util import on_tpu


def test_manual_seed_makes_random_ops_reproducible():
    def draw():
        return [torch.rand(4, device="tpu"), torch.randn(3, device="tpu"),
                torch.randint(0, 100, (5,), device="tpu"), torch.empty(6, device="tpu").uniform_(-1, 1),
                torch.empty(3, device="tpu").normal_(), torch.bernoulli(torch.full((8,), 0.5, device="tpu"))]

    torch.manual_seed(123)
    first = [t.cpu() for t in draw()]
    torch.manual_seed(123)
    second = [t.cpu() for t in draw()]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], torch.rand(4, device="tpu").cpu())
    assert torch.tpu.initial_seed() == 123


def _two_draws(x):
    return x + torch.randn(4, device=x.device), x * torch.rand(4, device=x.device)


def test_compiled_random_ops_draw_what_eager_ops_draw():
    """A compiled graph's random ops take the device's next offsets, as many as it has, so consecutive
    calls never repeat each other's numbers (dropout masks stay independent from step to step), and the
    same seed gives the same numbers compiled and eager, the first call (which traces) included."""
    compiled = torch.compile(_two_draws, backend="tpu")
    x = torch.ones(4, device="tpu")
    runs = {}
    for name, fn in (("eager", _two_draws), ("compiled", compiled)):
        torch.manual_seed(3)
        draws = [t.cpu() for _ in range(3) for t in fn(x)]
        runs[name] = draws + [torch.randn(4, device="tpu").cpu()]
    # fused, the arithmetic may round apart: by an ulp or so on XLA:CPU; a TPU's float32 transcendentals (the
    # log and square root of the normal draw) are approximations that round apart by a few ulps more
    tolerance = dict(rtol=1e-5, atol=1e-5) if on_tpu() else dict(rtol=1e-6, atol=1e-6)
    for eager, compiled_draw in zip(runs["eager"], runs["compiled"]):
        torch.testing.assert_close(compiled_draw, eager, **tolerance)
    assert len({tuple(t.tolist()) for t in runs["compiled"]}) == 7


def test_a_compiled_graph_without_random_ops_leaves_the_generator_alone():
    compiled = torch.compile(lambda x: x * 2 + 1, backend="tpu")
    x = torch.ones(4, device="tpu")
    torch.manual_seed(5)
    expected = torch.rand(4, device="tpu").cpu()
    torch.manual_seed(5)
    compiled(x)
    compiled(x)
    assert torch.equal(torch.rand(4, device="tpu").cpu(), expected)


@pytest.mark.parametrize("generator_device", ["cpu", "tpu"])
def test_a_compiled_function_honours_the_generator_it_is_given(generator_device):
    """As on CUDA, a random op given a generator breaks the graph and draws from that generator."""
    def noisy(x, generator):
        return x * 2 + torch.randn(4, device=x.device, generator=generator)

    compiled = torch.compile(noisy, backend="tpu")
    x = torch.ones(4, device="tpu")
    expected = noisy(x, torch.Generator(generator_device).manual_seed(1)).cpu()
    got = compiled(x, torch.Generator(generator_device).manual_seed(1)).cpu()
    torch.testing.assert_close(got, expected)


def test_rng_state_round_trips():
    torch.manual_seed(7)
    torch.rand(3, device="tpu")
    state = torch.tpu.get_rng_state()
    assert state.dtype == torch.uint8
    a = torch.rand(5, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    b = torch.rand(5, device="tpu").cpu()
    assert torch.equal(a, b)
    states = torch.tpu.get_rng_state_all()
    assert len(states) == torch.tpu.device_count()
    torch.tpu.set_rng_state_all(states)
    with pytest.raises(RuntimeError):
        torch.tpu.set_rng_state(torch.zeros(3))


def test_tpu_generator_seeds_ops_as_a_cuda_generator_does():
    """`torch.Generator("tpu")`: reproducible per seed, its own stream (not the device's), every
    generator still a `torch.Generator`, and copies and pickles keep device and state."""
    import copy
    import pickle

    def draw(generator):
        return [torch.randn(4, generator=generator, device="tpu"),
                torch.empty(3, device="tpu").normal_(generator=generator),
                torch.randperm(6, generator=generator, device="tpu"),
                torch.multinomial(torch.ones(5, device="tpu"), 3, generator=generator)]

    generator = torch.Generator(device="tpu").manual_seed(0)
    assert generator.device == torch.device("tpu:0")
    assert isinstance(generator, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
    assert type(torch.Generator()) is torch._C.Generator and torch.Generator("cpu").device.type == "cpu"
    first = [t.cpu() for t in draw(generator)]
    torch.manual_seed(5)  # the device's own RNG state does not move a generator's stream
    for a, b in zip(first, draw(torch.Generator("tpu").manual_seed(0))):
        assert torch.equal(a, b.cpu())
    assert not torch.equal(first[0], torch.randn(4, generator=torch.Generator("tpu").manual_seed(1), device="tpu").cpu())
    for twin in (copy.deepcopy(generator), pickle.loads(pickle.dumps(generator))):
        assert twin.device == generator.device
        assert torch.equal(torch.randn(3, generator=twin, device="tpu").cpu(),
                           torch.randn(3, generator=copy.deepcopy(generator), device="tpu").cpu())
    with pytest.raises(RuntimeError, match="tpu:7"):
        torch.Generator("tpu:7")

    class Seeded(torch.Generator):
        """A user's subclass: its instances stay its own."""

    assert type(Seeded()) is Seeded and Seeded().device.type == "cpu"


def test_seed_gives_a_new_initial_seed():
    torch.tpu.seed()
    s = torch.tpu.initial_seed()
    torch.tpu.seed()
    assert torch.tpu.initial_seed() != s


def test_memory_counts_live_buffers_and_peak():
    import gc

    gc.collect()  # tensors held by earlier tests' reference cycles would be freed mid-measurement
    torch.tpu.synchronize()
    base = torch.tpu.memory_allocated()
    torch.tpu.reset_peak_memory_stats()
    a = torch.zeros(1024, device="tpu")
    assert torch.tpu.memory_allocated() == base + 4096
    b = torch.zeros(2048, device="tpu")
    assert torch.tpu.memory_allocated() == base + 4096 + 8192
    del a, b
    assert torch.tpu.memory_allocated() == base
    assert torch.tpu.max_memory_allocated() >= base + 4096 + 8192
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == base


def test_storage_freed_while_an_exception_propagates_keeps_the_exception():
    """The storage's deleter (C, `memory/_capsule.c`) calls back into Python while the frame that held the
    tensor unwinds: the user's exception must arrive as it was, and the memory be released."""
    import gc

    gc.collect()
    base = torch.tpu.memory_allocated()

    def fails():
        x = torch.ones(1024, device="tpu")  # noqa: F841 - dies as the ValueError leaves this frame
        raise ValueError("the user's error")

    with pytest.raises(ValueError, match="the user's error"):
        fails()
    assert torch.tpu.memory_allocated() == base


def test_storage_freed_on_another_thread_is_released():
    import threading

    base = torch.tpu.memory_allocated()
    held = [torch.ones(2048, device="tpu")]
    thread = threading.Thread(target=held.clear)
    thread.start()
    thread.join()
    assert not held and torch.tpu.memory_allocated() == base


def test_views_do_not_allocate():
    x = torch.zeros(256, device="tpu")
    before = torch.tpu.memory_allocated()
    v = x.view(16, 16).t()[::2]
    assert torch.tpu.memory_allocated() == before and v.shape == (8, 16)


def test_leaf_in_place_error_still_fires():
    w = torch.ones(3, device="tpu", requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place operation"):
        w.add_(1)


def test_modified_by_inplace_error_still_fires():
    a = torch.ones(3, device="tpu", requires_grad=True)
    b = a * 2
    c = b * b  # saves b
    b.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c.sum().backward()


def test_version_counters_bump_as_on_cpu():
    for device in ("cpu", "tpu"):
        x = torch.ones(4, 4, device=device)
        v = x[1:]
        versions = [x._version]
        x.add_(1)
        versions.append(x._version)
        v.mul_(2)
        versions.append(x._version)
        x.t().zero_()
        versions.append(v._version)
        if device == "cpu":
            expected = versions
        else:
            assert versions == expected


def test_backward_through_views_and_in_place():
    def run(device):
        w = torch.arange(6.0, device=device).reshape(2, 3).requires_grad_()
        y = w * 1
        y[:, 1].mul_(3)
        y.t()[0].add_(1)
        (y * y).sum().backward()
        return w.grad

    cpu, tpu = run("cpu"), run("tpu")
    assert torch.allclose(tpu.cpu(), cpu)
