"""An out-of-memory is `torch.OutOfMemoryError` with the sizes, raised once at the call that asks for
the memory, and the device stays usable. Nothing here allocates much: the capacity is made small, or
the launch is made to fail as XLA fails when it runs out of memory."""

import itertools

import jax
import pytest
import torch

import hf_tpu
from hf_tpu import modes
from hf_tpu.memory import out_of_memory

_SMALL = 1 << 20  # a device of 1 MiB
_fresh = itertools.count(1013)  # sizes no other test uses, so each launch test builds a new program


@pytest.fixture
def small_device(monkeypatch):
    """The device has 1 MiB left beyond what live tensors hold."""
    torch.tpu.synchronize()
    total = torch.tpu.memory_allocated() + _SMALL
    monkeypatch.setattr(out_of_memory, "capacity", lambda index: total, raising=False)


@pytest.mark.parametrize("make", [
    lambda n: torch.empty(n, device="tpu"),
    lambda n: torch.empty_strided((n,), (1,), device="tpu"),
    lambda n: torch.ones(2, device="tpu").new_empty(n),
    lambda n: torch.zeros(n, device="tpu"),
    lambda n: torch.randn(n, device="tpu"),
], ids=["empty", "empty_strided", "new_empty", "zeros", "randn"])
def test_allocation_beyond_capacity_raises_at_the_call(small_device, make):
    torch.tpu.synchronize()
    before = torch.tpu.memory_allocated()
    expected = r"tpu:0 is out of memory: .* asks for 4\.00 MiB \(4194304 bytes\).*in all"
    with pytest.raises(torch.OutOfMemoryError, match=expected):
        make(1 << 20)  # 4 MiB of float32
    assert torch.tpu.memory_allocated() == before
    y = torch.ones(3, device="tpu") + 1
    assert y.cpu().tolist() == [2.0, 2.0, 2.0]


def test_allocation_within_capacity_works(small_device):
    t = torch.empty(1000, device="tpu")
    assert t.shape == (1000,)


def test_a_result_beyond_the_device_raises_at_the_op(eager_mode):
    """The product of two vectors of 2**20 is a matrix of 4 TiB: refused at the op, before its launch (which
    returned at once, the next read failing in XLA, and every allocation check counting its bytes meanwhile)."""
    x = torch.ones(1, device="tpu")
    a, b = x.new_ones(2**20, 1), x.new_ones(1, 2**20)
    expected = r"tpu:0 is out of memory: aten::mm of \(1048576, 1048576\) torch.float32 asks for 4096\.00 GiB"
    for _ in range(2):  # the second call finds its program
        with pytest.raises(torch.OutOfMemoryError, match=expected):
            a @ b
    assert torch.empty(0, device="tpu").shape == (0,)  # the device stays usable
    assert (x + 1).cpu().item() == 2.0 and (a[:2] @ b[:, :3]).cpu().tolist() == [[1.0] * 3] * 2


def test_a_large_result_is_checked_at_every_launch(monkeypatch, eager_mode):
    """A program whose result is a large share of the device (here every program, `LARGE_SHARE` made huge) is
    checked before each launch, not only its first: its later calls do not take the C entry's launch, which
    checks nothing."""
    x = torch.ones(next(_fresh), 64, device="tpu")
    torch.tpu.synchronize()
    total = torch.tpu.memory_allocated() + x.nbytes  # room for one result like x, not for more
    monkeypatch.setattr(out_of_memory, "capacity", lambda index: total, raising=False)
    monkeypatch.setattr(out_of_memory, "LARGE_SHARE", 1 << 40)
    first = x + x
    torch.tpu.synchronize()  # a deferred result counts once computed
    with pytest.raises(torch.OutOfMemoryError, match=r"aten::add.Tensor of \(\d+, 64\) torch.float32 asks for"):
        x + x
    del first
    assert (x + x).cpu()[0, 0].item() == 2.0


def test_deferred_results_that_fit_alone_but_not_together_raise_at_the_flush(monkeypatch, eager_mode):
    """Each op's result is checked at the op against the tensors computed; the results a flush is to compute are
    checked together before it launches, and lost as in a flush XLA fails (the device stays usable)."""
    if eager_mode != "DEFER_AND_FUSE":
        pytest.skip("only deferred results are computed together")
    x = torch.ones(next(_fresh), 64, device="tpu")
    torch.tpu.synchronize()
    total = torch.tpu.memory_allocated() + x.nbytes  # room for one result like x, not for more
    monkeypatch.setattr(out_of_memory, "capacity", lambda index: total, raising=False)
    monkeypatch.setattr(out_of_memory, "LARGE_SHARE", 1 << 40)
    first, second = x + x, x * 3
    with pytest.raises(torch.OutOfMemoryError, match=r"tpu:0 is out of memory: a fused graph of 2 ops asks for"):
        second.cpu()
    with pytest.raises(RuntimeError, match="has no value: the deferred work that computes it failed"):
        first.cpu()
    assert (x - 1).cpu()[0, 0].item() == 0.0


def _failing_launch(monkeypatch, mode, message):
    """Every launch from now on fails with `message`, as XLA fails (in strict eager, each new program's
    launch; in defer-and-fuse, each flush); returns the list of launches tried."""
    tried = []

    def fail(*args, **kwargs):
        tried.append(1)
        raise jax.errors.JaxRuntimeError(message)

    if mode == "DEFER_AND_FUSE":
        from hf_tpu.modes import deferred

        monkeypatch.setattr(deferred._Fused, "__call__", fail)
        return tried
    original = modes._Eager._compiled

    def compiled(self, program, donating, scalars, rng):
        original(self, program, donating, scalars, rng)
        program.jitted = fail
        if program.direct_launch is not None:
            program.direct_launch = (fail, *program.direct_launch[1:])
        return fail

    monkeypatch.setattr(modes._Eager, "_compiled", compiled)
    return tried


@pytest.mark.parametrize("message", [
    "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 18.63G. That was not "
    "possible. There are 15.48G free.",
    "INTERNAL: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 18.63G of "
    "15.75G hbm.",
])
def test_launch_out_of_memory_is_one_torch_error(monkeypatch, eager_mode, message):
    x = torch.ones(7, next(_fresh), device="tpu")  # a shape no other test uses: a new program
    torch.tpu.synchronize()
    tried = _failing_launch(monkeypatch, eager_mode, message)
    with pytest.raises(torch.OutOfMemoryError, match=r"tpu:0 ran out of memory running .*(mul|fused)") as info:
        x.mul(3.5).cpu()  # strict eager: at the op; defer-and-fuse: at the read that runs it
    monkeypatch.undo()
    assert "18.63G" in str(info.value)  # XLA's sizes
    assert info.value.__context__ is None or not isinstance(info.value.__context__, torch.OutOfMemoryError)
    assert len(tried) <= 2  # strict eager: the C path's try and the Python path's; one error
    y = x * 3.5  # the device stays usable
    assert y.cpu()[0, 0].item() == 3.5


def test_other_launch_errors_stay_what_they_are(monkeypatch, eager_mode):
    x = torch.ones(7, next(_fresh), device="tpu")
    torch.tpu.synchronize()
    _failing_launch(monkeypatch, eager_mode, "INVALID_ARGUMENT: something else")
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        x.mul(2.5).cpu()


def test_compiled_graph_out_of_memory(monkeypatch):
    from hf_tpu import compile as tpu_compile

    graphs = []
    original_call = tpu_compile._CompiledGraph.__call__

    def spy(self, *args):
        graphs.append(self)
        return original_call(self, *args)

    monkeypatch.setattr(tpu_compile._CompiledGraph, "__call__", spy)

    def f(a):
        return a * 2 + 1

    compiled = torch.compile(f, backend="tpu")
    x = torch.ones(5, 11, device="tpu")
    assert compiled(x).cpu()[0, 0].item() == 3.0
    graph = graphs[-1]

    def fail(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.0G.")

    kept = graph.jitted
    graph.jitted = {True: fail, False: fail}
    try:
        with pytest.raises(torch.OutOfMemoryError, match="tpu:0 ran out of memory running a compiled graph"):
            compiled(x)
    finally:
        graph.jitted = kept
    assert compiled(x).cpu()[0, 0].item() == 3.0


def test_a_result_lost_to_a_failed_flush_says_so(monkeypatch, eager_mode):
    if eager_mode != "DEFER_AND_FUSE":
        pytest.skip("only deferred work can fail after its op returned")
    x = torch.ones(7, next(_fresh), device="tpu")
    torch.tpu.synchronize()
    _failing_launch(monkeypatch, eager_mode, "RESOURCE_EXHAUSTED: Out of memory")
    y = x * 2
    with pytest.raises(torch.OutOfMemoryError):
        y.cpu()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="has no value: the deferred work that computes it failed"):
        y.cpu()
    assert (x + 1).cpu()[0, 0].item() == 2.0
