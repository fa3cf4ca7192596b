"""Execution modes: the API, deferred fusion and its sync points, the disk cache, torch.compile."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hf_tpu
from hf_tpu import modes
from tests.util import cpu_process_env, on_tpu

Mode = torch.tpu.EagerMode


def test_mode_api():
    assert torch.tpu.eager_mode == Mode.DEFER_NEVER
    with torch.tpu.use_eager_mode(Mode.DEFER_AND_FUSE):
        assert torch.tpu.eager_mode == Mode.DEFER_AND_FUSE
    torch.tpu.set_eager_mode("DEFER_NEVER_AND_LAUNCH_BLOCKING")
    assert torch.tpu.eager_mode == Mode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    torch.tpu.eager_mode = Mode.DEFER_NEVER
    assert torch.tpu.eager_mode == Mode.DEFER_NEVER
    with pytest.raises(ValueError):
        torch.tpu.set_eager_mode("SOMETIMES")


def _chain(x, w, n=10):
    for _ in range(n):
        x = torch.tanh(x @ w) * 0.5 + x
    return x


def test_deferred_fuses_a_chain_into_one_cached_program():
    x = torch.randn(16, 16, device="tpu")
    w = torch.randn(16, 16, device="tpu") * 0.1
    expected = _chain(x, w).cpu()
    with torch.tpu.use_eager_mode(Mode.DEFER_AND_FUSE):
        _chain(x, w).cpu()  # warm-up: the fused graph compiles once
        hf_tpu.reset_metrics()
        for _ in range(20):
            actual = _chain(x, w).cpu()
        m = hf_tpu.metrics()
    assert torch.allclose(actual, expected, atol=1e-6)
    assert m["compiles"] == 0 and m["compile_cache_hits_by_mode"]["DEFER_AND_FUSE"] == 20
    assert m["host_syncs"] == 20


def test_deferred_cuts_fall_on_the_same_ops_every_iteration(monkeypatch):
    """A graph runs early at content-defined cut points, so the device computes while Python records.
    A cut depends on the ops before it, not on a count since the last sync: a loop that never syncs is
    cut the same way every iteration, and its pieces compile once."""
    from hf_tpu.modes import deferred

    # one window in two is a cut: many cuts; the chain repeats every 4 ops, under any longer minimum
    monkeypatch.setattr(deferred, "_cut", deferred.CutPolicy(min_ops=1, bits=1))
    x = torch.randn(16, 16, device="tpu")
    w = torch.randn(16, 16, device="tpu") * 0.1
    expected = x
    for _ in range(5):
        expected = _chain(expected, w, n=7)
    with torch.tpu.use_eager_mode(Mode.DEFER_AND_FUSE):
        y = _chain(_chain(x, w, n=7), w, n=7)  # warm-up, no sync
        hf_tpu.reset_metrics()
        for _ in range(3):
            y = _chain(y, w, n=7)
        m = hf_tpu.metrics()
        actual = y.cpu()
    assert m["host_syncs"] == 0 and m["compile_cache_hits_by_mode"]["DEFER_AND_FUSE"] >= 3  # pieces ran
    assert m["compiles"] == 0
    torch.testing.assert_close(actual, expected.cpu(), atol=1e-5, rtol=1e-5)


def test_pieces_are_longer_where_a_launch_costs_more(monkeypatch):
    """The shortest piece an early flush cuts is the platform's (a TPU's launch costs several times the
    CPU's), or HF_TPU_EARLY_FLUSH_MIN_OPS; it decides how many launches a chain of ops takes."""
    from hf_tpu import platform
    from hf_tpu.modes import deferred

    monkeypatch.delenv("HF_TPU_EARLY_FLUSH_MIN_OPS", raising=False)
    monkeypatch.setattr(deferred, "_cut", None)
    monkeypatch.setattr(platform, "name", lambda: "tpu")
    assert deferred.cut_policy() == deferred.CutPolicy(min_ops=128, bits=6)
    monkeypatch.setattr(deferred, "_cut", None)
    monkeypatch.setattr(platform, "name", lambda: "cpu")
    assert deferred.cut_policy() == deferred.CutPolicy(min_ops=8, bits=4)
    monkeypatch.setenv("HF_TPU_EARLY_FLUSH_MIN_OPS", "64")
    monkeypatch.setattr(deferred, "_cut", None)
    assert deferred.cut_policy() == deferred.CutPolicy(min_ops=64, bits=5)

    x = torch.randn(16, 16, device="tpu")
    w = torch.randn(16, 16, device="tpu") * 0.1
    launches = {}
    for min_ops in (8, 128):
        # every window a cut point (one in 2**0): the minimum alone decides where pieces end
        monkeypatch.setattr(deferred, "_cut", deferred.CutPolicy(min_ops, bits=0))
        with torch.tpu.use_eager_mode(Mode.DEFER_AND_FUSE):
            _chain(x, w, n=25).cpu()  # 100 ops
            hf_tpu.reset_metrics()
            _chain(x, w, n=25).cpu()
        m = hf_tpu.metrics()
        assert m["compiles"] == 0
        launches[min_ops] = m["compile_cache_hits_by_mode"]["DEFER_AND_FUSE"]
    assert launches == {8: 13, 128: 1}


def test_graph_size_cap_flushes_between_an_op_and_its_pending_operands(monkeypatch):
    """The cap's flush runs while an op is being recorded: the operands it had read as pending results
    of the flushed graph become that flush's arrays."""
    from hf_tpu.modes import deferred

    monkeypatch.setattr(deferred, "MAX_GRAPH_OPS", 3)
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    expected = x
    for _ in range(10):
        expected = (expected @ x).tanh() + expected * 0.5
    with torch.tpu.use_eager_mode(Mode.DEFER_AND_FUSE):
        actual = y = x.to("tpu")
        for _ in range(10):
            actual = (actual @ y).tanh() + actual * 0.5
        actual = actual.cpu()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "sync",
    [
        lambda t: t.sum().item(),
        lambda t: t.tolist(),
        lambda t: t.cpu(),
        lambda t: print(t),
        lambda t: bool(t.sum() > 0),
        lambda t: torch.nonzero(t > 0),
        lambda t: t[t > 0],
        lambda t: torch.tpu.synchronize(),
    ],
)
def test_sync_points_compute_pending_work_and_are_counted(sync, capsys):
    with torch.tpu.use_eager_mode(Mode.DEFER_AND_FUSE):
        t = torch.arange(-3.0, 5.0, device="tpu") * 2
        from hf_tpu.memory import buffer

        assert type(buffer.buffer_of(t).array) is buffer.Lazy
        hf_tpu.reset_metrics()
        sync(t)
        assert type(buffer.buffer_of(t).array) is not buffer.Lazy
        if sync.__code__.co_names[-1:] != ("synchronize",):
            assert hf_tpu.metrics()["host_syncs"] >= 1


@pytest.mark.parametrize("cast", [lambda t: t.float(), lambda t: t.to(t.device, torch.int32, copy=True),
                                  lambda t: t.t().double()])
def test_casts_on_the_device_are_deferred_not_sync_points(cast):
    """Llama's rotary embedding casts its position ids with `.float()`: that cut every deferred forward
    in two when a tpu-to-tpu `_to_copy` read its operand's value."""
    from hf_tpu.memory import buffer

    x = torch.arange(6, device="tpu").reshape(2, 3)
    with torch.tpu.use_eager_mode(Mode.DEFER_AND_FUSE):
        pending = x * 2
        result = cast(pending)
        assert type(buffer.buffer_of(pending).array) is buffer.Lazy
        assert type(buffer.buffer_of(result).array) is buffer.Lazy
        assert torch.equal(result.cpu(), cast((torch.arange(6).reshape(2, 3) * 2)))


def test_dead_intermediates_never_take_device_memory():
    def step(x):
        for _ in range(8):
            x = x * 1.5 + 1.0  # each intermediate: 4 MiB
        return x

    peaks = {}
    for mode in (Mode.DEFER_NEVER, Mode.DEFER_AND_FUSE):
        with torch.tpu.use_eager_mode(mode):
            x = torch.ones(1024, 1024, device="tpu")
            torch.tpu.synchronize()
            torch.tpu.reset_peak_memory_stats()
            y = step(x)
            torch.tpu.synchronize()
            peaks[mode] = torch.tpu.max_memory_allocated() - torch.tpu.memory_allocated() + y.numel() * 4
            del x, y
    assert peaks[Mode.DEFER_AND_FUSE] < peaks[Mode.DEFER_NEVER]


def test_launch_blocking_completes_each_op():
    with torch.tpu.use_eager_mode(Mode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        y = torch.ones(4, device="tpu") + 1
        from hf_tpu.memory import buffer

        assert buffer.buffer_of(y).array.is_ready()


def test_data_dependent_python_control_flow_syncs_and_logs_where(caplog, monkeypatch):
    monkeypatch.setenv("HF_TPU_LOG_COMPILES", "1")
    with torch.tpu.use_eager_mode(Mode.DEFER_AND_FUSE):
        x = torch.arange(5.0, device="tpu")
        if (x.sum() > 3).item():  # a host read decides the control flow
            x = x * 2
        assert x.cpu().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert any("sync" in r.message and "test_modes.py" in r.message for r in caplog.records)


def test_out_of_memory_becomes_torch_error():
    import jax

    error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1099511627776 bytes")
    with pytest.raises(torch.OutOfMemoryError, match="tpu:0 ran out of memory running a test"):
        modes.raise_out_of_memory(error, 0, "a test")
    modes.raise_out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: something else"), 0, "a test")


def _run(code, cache_dir, **env):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=cpu_process_env(HF_TPU_CACHE_DIR=str(cache_dir), **env), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


_DISK_CACHE_WORK = """
    import torch, hf_tpu
    # with cut points (3 pieces): the same ops in every process
    hf_tpu.modes.deferred._cut = hf_tpu.modes.deferred.CutPolicy(min_ops=1, bits=1)
    x = torch.arange(64.0).reshape(8, 8).to("tpu") / 64
    with torch.tpu.use_eager_mode("DEFER_AND_FUSE"):
        for _ in range(8):
            x = torch.sigmoid(torch.tanh(x @ x) + 1) * 2
        value = x.sum().item()
    m = hf_tpu.metrics()
    assert m["compiles_by_mode"]["DEFER_AND_FUSE"] > 1
    print(value, m["xla_compiles"], m["disk_cache_hits"])
"""


def test_second_process_starts_warm_from_the_disk_cache(tmp_path):
    first = _run(_DISK_CACHE_WORK, tmp_path).split()
    second = _run(_DISK_CACHE_WORK, tmp_path).split()
    assert first[0] == second[0]
    assert int(first[1]) > 0 and int(second[1]) == 0 and int(second[2]) > 0


def test_corrupt_cache_entries_are_rebuilt(tmp_path):
    _run(_DISK_CACHE_WORK, tmp_path)
    for root, _, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"not an executable")
    out = _run(_DISK_CACHE_WORK, tmp_path).split()
    assert int(out[1]) > 0


def test_torch_compile_matches_eager_and_stops_compiling():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    x = torch.randn(4, 8)
    expected = model(x)
    expected.sum().backward()
    grad = model[0].weight.grad.clone()
    model.zero_grad()
    model.to("tpu")
    compiled = torch.compile(model, backend="tpu")
    out = compiled(x.to("tpu"))
    out.sum().backward()
    assert torch.allclose(out.cpu(), expected, atol=1e-5)
    assert torch.allclose(model[0].weight.grad.cpu(), grad, atol=1e-5)
    for _ in range(2):
        model.zero_grad()
        compiled(x.to("tpu")).sum().backward()
    hf_tpu.reset_metrics()
    for _ in range(5):
        model.zero_grad()
        compiled(x.to("tpu")).sum().backward()
    assert hf_tpu.metrics()["compiles"] == 0


def _array(t):
    """`t`'s array and its address, before an in-place op."""
    array = hf_tpu.memory.buffer.buffer_of(t).value()
    return array, array.unsafe_buffer_pointer()


def _assert_overwritten_in_place(t, before):
    """The in-place op handed XLA `t`'s array from `before` (JAX deletes a donated array), and on XLA:CPU the
    result took its memory: the new array has the old address. On a TPU v5e the result's address was seen
    to differ from the donated array's, so there the donation alone is checked."""
    array, address = before
    assert array.is_deleted()
    if not on_tpu():
        assert _array(t)[1] == address


def test_torch_compile_updates_a_mutated_input_in_place():
    cache = torch.zeros(4, 8, device="tpu")
    view = cache[1:3]

    @torch.compile(backend="tpu")
    def write(cache, pos, val):
        cache.index_copy_(0, pos, val)
        return cache.sum()

    before = _array(cache)
    with torch.no_grad():
        total = write(cache, torch.tensor([2], device="tpu"), torch.ones(1, 8, device="tpu"))
        assert total.item() == 8.0
        assert cache[2].sum().item() == 8.0 and cache.sum().item() == 8.0 and view[1].sum().item() == 8.0
        _assert_overwritten_in_place(cache, before)  # the old array was donated: XLA wrote the row in place
        alias = torch.empty_like(cache).copy_(cache)  # may share the array: no donation then
        write(cache, torch.tensor([0], device="tpu"), torch.full((1, 8), 2.0, device="tpu"))
    assert alias.sum().item() == 8.0 and cache.sum().item() == 24.0


def test_deferred_flush_reuses_memory_of_arrays_overwritten_in_place():
    with torch.tpu.use_eager_mode(Mode.DEFER_AND_FUSE):
        x = torch.ones(256, 256, device="tpu")
        torch.tpu.synchronize()
        before = _array(x)
        x.mul_(2.0).add_(1.0)
        torch.tpu.synchronize()
        _assert_overwritten_in_place(x, before)
        assert x.sum().item() == 3.0 * 256 * 256


def test_strict_in_place_ops_reuse_memory_unless_the_array_is_shared():
    """An in-place op gives XLA the array it overwrites when only that buffer holds it; an array another
    tensor shares (clone and copy_ share until one is written) is read, never donated."""
    x = torch.ones(256, 256, device="tpu")
    before = _array(x)
    x.mul_(2.0)
    _assert_overwritten_in_place(x, before)
    before = _array(x)
    torch._foreach_add_([x], [torch.ones_like(x)])
    _assert_overwritten_in_place(x, before)
    shared = x.clone()
    x.add_(1.0)
    x.add_(x)  # read twice: not donated either
    assert shared.sum().item() == 3.0 * 256 * 256
    assert x.sum().item() == 8.0 * 256 * 256


@pytest.mark.parametrize("write", ["strict", "deferred", "compiled"])
def test_a_recurring_tiny_upload_is_shared_and_never_donated(write):
    """Equal tiny values uploaded twice (a scheduler's timestep every step) share one kept array;
    an in-place write to one tensor, however it runs, gives that tensor a new array and leaves the
    kept one, and so the next upload, intact."""
    first, second = torch.tensor([7.0, 9.0]).to("tpu"), torch.tensor([7.0, 9.0]).to("tpu")
    kept = hf_tpu.memory.buffer.buffer_of(first).array
    assert hf_tpu.memory.buffer.buffer_of(second).array is kept
    assert hf_tpu.memory.buffer.buffer_of(torch.tensor([7.0, 8.0]).to("tpu")).array is not kept
    del second
    if write == "compiled":
        torch.compile(lambda t: t.mul_(3.0), backend="tpu")(first)
    else:
        with torch.tpu.use_eager_mode(Mode.DEFER_NEVER if write == "strict" else Mode.DEFER_AND_FUSE):
            first.mul_(3.0)
            torch.tpu.synchronize()
    assert first.tolist() == [21.0, 27.0]
    assert not kept.is_deleted()
    again = torch.tensor([7.0, 9.0]).to("tpu")
    assert hf_tpu.memory.buffer.buffer_of(again).array is kept and again.tolist() == [7.0, 9.0]


def test_recurring_uploads_of_up_to_4_kib_are_shared_and_larger_ones_are_not():
    """A prompt's positions recur at every call of its length: up to 4 KiB a value is uploaded once."""
    buffer_of = hf_tpu.memory.buffer.buffer_of
    positions = torch.arange(512).unsqueeze(0)  # 4 KiB of int64
    first, again = positions.to("tpu"), positions.clone().to("tpu")
    assert buffer_of(again).array is buffer_of(first).array
    larger = torch.arange(513)
    first, again = larger.to("tpu"), larger.to("tpu")
    assert buffer_of(again).array is not buffer_of(first).array
    assert torch.equal(positions.to("tpu").cpu(), positions)


def test_kept_uploads_are_bounded_and_let_go():
    """Only the last few hundred tiny uploads are kept, until `empty_cache`: an evicted value's array
    is held by its tensors alone again, so an in-place op may reuse its memory."""
    oldest = torch.tensor([-1.5]).to("tpu")
    array = hf_tpu.memory.buffer.buffer_of(oldest).array
    assert hf_tpu.memory.buffer.allocator.holders(array) == 2  # the tensor and the kept upload
    for i in range(hf_tpu.memory.host_transfers._RECURRING_KEPT):
        torch.tensor([float(i)]).to("tpu")
    assert hf_tpu.memory.buffer.allocator.holders(array) == 1
    assert hf_tpu.memory.buffer.buffer_of(torch.tensor([-1.5]).to("tpu")).array is not array
    newest = hf_tpu.memory.buffer.buffer_of(torch.tensor([-2.5]).to("tpu")).array
    torch.tpu.empty_cache()  # lets go of every kept upload
    assert hf_tpu.memory.buffer.allocator.holders(newest) == 0


def test_torch_compile_graph_break_runs_tpu_ops_eagerly():
    """A graph break (autograd.grad inside the compiled function) runs its ops eagerly on tpu;
    dynamo must not try to trace the backend's own kernels then."""

    def grad_plus_one(x):
        (grad,) = torch.autograd.grad((x * 2).sum(), x)
        return grad + 1

    x = torch.randn(3, device="tpu", requires_grad=True)
    compiled = torch.compile(grad_plus_one, backend="tpu")
    assert torch.equal(compiled(x).cpu(), torch.full((3,), 3.0))


def test_torch_compile_takes_cpu_tensors_and_returns_them_on_the_cpu():
    """A CPU tensor among a compiled graph's inputs (a step count, a scalar) is read like a CPU scalar in
    eager mode; what PyTorch computes on the CPU comes back on the CPU, mutations included."""

    def scale(x, count):
        count.add_(1)
        return x * count, count * 2

    x = torch.randn(4)
    count = torch.tensor(1.0)
    compiled = torch.compile(scale, backend="tpu")
    for expected_count in (2.0, 3.0):
        scaled, doubled = compiled(x.to("tpu"), count)
        assert scaled.device.type == "tpu" and doubled.device.type == "cpu"
        assert count.item() == expected_count and doubled.item() == 2 * expected_count
        assert torch.allclose(scaled.cpu(), x * expected_count)


def test_torch_compile_of_cpu_tensors_only_runs_on_the_cpu():
    """The ATen graph of CPU tensors has CPU kernels' strides baked in: CPU attention returns its output
    transposed, so `.transpose(1, 2).contiguous().reshape(...)` is recorded as a plain view, which the
    same graph run on tpu (contiguous attention) could not take. Such a graph runs on the CPU."""

    def attention(x):
        q = x.view(1, 16, 2, 8).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return out.transpose(1, 2).contiguous().reshape(1, 16, -1)

    x = torch.randn(1, 16, 16)
    torch._dynamo.reset()
    compiled = torch.compile(attention, backend="tpu")
    assert torch.allclose(compiled(x), attention(x), atol=1e-6)
    assert torch.allclose(compiled(x.to("tpu")).cpu(), attention(x), atol=1e-5)  # recompiled for tpu


def test_compiled_backward_through_attention_of_transposed_heads_matches_cpu():
    """GPT-2's, BERT's and ViT's attention layout: the meta kernel of the fused attention's backward
    gives its gradients the query's transposed strides, and AOT autograd viewed them back with a
    `view` that a contiguous tpu result cannot take."""

    def attention(x):
        q = x.view(2, 10, 4, 8).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return out.transpose(1, 2).reshape(2, 10, 32).sum()

    x = torch.randn(2, 10, 32, requires_grad=True)
    attention(x).backward()
    on_tpu = x.detach().to("tpu").requires_grad_()
    torch._dynamo.reset()
    torch.compile(attention, backend="tpu")(on_tpu).backward()
    assert torch.allclose(on_tpu.grad.cpu(), x.grad, atol=1e-5)


def test_a_compiled_checkpoint_recomputes_the_dropout_mask_it_drew():
    """Activation checkpointing in a compiled graph saves the RNG state before each random op it will
    recompute and replays it in the backward graph; PyTorch does that for CPU, CUDA, HPU and XPU only
    ("Backend not supported for tpu")."""
    from torch.utils.checkpoint import checkpoint

    def dropped(x):
        y = checkpoint(lambda t: torch.nn.functional.dropout(t * 2, 0.5, training=True), x, use_reentrant=False)
        return y, y.sum()

    torch._dynamo.reset()
    compiled = torch.compile(dropped, backend="tpu")
    for seed in range(2):
        x = torch.randn(64, device="tpu", requires_grad=True)
        torch.manual_seed(seed)
        y, loss = compiled(x)
        loss.backward()
        assert torch.equal((x.grad * x).detach().cpu(), y.detach().cpu())  # the mask the forward drew
        eager = x.detach().clone().requires_grad_()
        torch.manual_seed(seed)
        dropped(eager)[1].backward()
        assert torch.equal(eager.grad.cpu(), x.grad.cpu())


def test_rng_state_operators_replay_a_draw_outside_a_trace():
    """A compiled graph that falls back to running eagerly calls the same two operators on tpu tensors."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    torch._dynamo.lookup_backend("tpu")  # what installs hf_tpu's compile patches
    state, drawn = run_and_save_rng_state(torch.ops.aten.rand.default, [8], device="tpu")
    following = torch.rand(8, device="tpu")
    assert torch.equal(run_with_rng_state(state, torch.ops.aten.rand.default, [8], device="tpu").cpu(), drawn.cpu())
    assert not torch.equal(torch.rand(8, device="tpu").cpu(), following.cpu())  # the stream went on


def test_compiled_optimizer_step_matches_cpu_and_keeps_its_state_on_tpu():
    """`torch.compile(opt.step)`: Dynamo makes the optimizer capturable on tpu as it does on CUDA, so the
    step counts stay on the device and a step reads nothing back to the host."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    device_model = torch.nn.Sequential(*[torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2)])
    device_model.load_state_dict(model.state_dict())
    device_model.to("tpu")
    cpu_opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    tpu_opt = torch.optim.AdamW(device_model.parameters(), lr=0.05)
    step = torch.compile(tpu_opt.step, backend="tpu")
    x = torch.randn(4, 8)
    for i in range(4):
        model(x).square().sum().backward()
        cpu_opt.step()
        cpu_opt.zero_grad()
        device_model(x.to("tpu")).square().sum().backward()
        if i == 3:
            torch.tpu.synchronize()
            hf_tpu.reset_metrics()
        step()
        tpu_opt.zero_grad()
    assert hf_tpu.metrics()["host_syncs"] == 0 and hf_tpu.metrics()["compiles"] == 0
    for p, q in zip(model.parameters(), device_model.parameters()):
        assert torch.allclose(p, q.cpu(), atol=1e-5)
    assert all(state["step"].device.type == "tpu" for state in tpu_opt.state.values())
