"""The `torch.tpu` module, `torch.accelerator` and device registration, from a plain session."""

import os
import subprocess
import sys

import jax
import pytest
import torch

import hf_tpu
from tests.util import cpu_process_env, on_tpu

# the CPU platform simulates HF_TPU_NUM_DEVICES chips (two under tests/conftest.py); a GPU or TPU has its own
PLATFORM = os.environ["HF_TPU_PLATFORM"]
CHIPS = int(os.environ["HF_TPU_NUM_DEVICES"]) if PLATFORM == "cpu" else len(jax.local_devices(backend=PLATFORM))


def test_device_strings_and_accelerator():
    assert torch.device("tpu").type == "tpu"
    assert torch.device("tpu:0").index == 0
    assert torch.accelerator.current_accelerator().type == "tpu"
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() == torch.tpu.device_count() == CHIPS
    assert torch.accelerator.current_device_index() == 0
    torch.accelerator.synchronize()
    assert torch.accelerator.memory_allocated() == torch.tpu.memory_allocated()


@pytest.mark.requires_chips(2)
def test_accelerator_device_index_is_the_tpu_current_device():
    """A Python backend's device guard holds no current device: `torch.accelerator` set, read and
    switched one that new `tpu` tensors never used."""
    try:
        torch.accelerator.set_device_index(1)
        assert torch.tpu.current_device() == 1 and torch.ones(1, device="tpu").device.index == 1
        torch.tpu.set_device(0)
        assert torch.accelerator.current_device_index() == torch.accelerator.current_device_idx() == 0
        with torch.accelerator.device_index(1):
            assert torch.ones(1, device="tpu").device.index == 1
            assert torch.accelerator.current_stream().device_index == 1
        assert torch.tpu.current_device() == 0
        torch.accelerator.set_stream(torch.accelerator.current_stream(1))
        assert torch.tpu.current_device() == 1
    finally:
        torch.tpu.set_device(0)


def test_pinning_host_memory_for_tpu_copies_and_data_loaders_pin():
    """PyTorch pins for the current accelerator through C++ hooks a Python backend cannot register: with
    `tpu` the accelerator, `pin_memory()` and `DataLoader(pin_memory=True)` raised NotImplementedError."""
    host = torch.arange(6.0).reshape(2, 3).t()
    pinned = host.pin_memory()
    assert torch.equal(pinned, host) and pinned.stride() == host.stride()
    assert pinned.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.arange(8))
    loader = torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True)
    batches = [(x.to("tpu", non_blocking=True), y) for x, y in loader]
    assert torch.equal(torch.cat([x.cpu() for x, _ in batches]), data.tensors[0])


class _TiedLM(torch.nn.Module):
    """An embedding and an output projection sharing one weight (GPT-2's and T5's tying)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def _train_step(model, optimizer, ids):
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    optimizer.step()
    return loss.item()


def test_moving_a_module_keeps_its_parameter_objects_like_cuda():
    """PyTorch moves parameters in place (`param.data = ...`) only between its built-in backends; to tpu
    it made new Parameters, which untied tied weights and left an optimizer built before the move
    updating the old CPU tensors."""
    torch.manual_seed(0)
    cpu_model, ids = _TiedLM(), torch.randint(0, 10, (2, 5))
    model = _TiedLM()
    model.load_state_dict(cpu_model.state_dict())
    weight = model.embed.weight
    weight.note = "set by a library"
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)  # built before the move, as on CUDA
    model.to("tpu")
    assert model.head.weight is model.embed.weight is weight
    assert weight.device.type == "tpu" and weight.note == "set by a library"
    # a real TPU's float32 exp, log and rsqrt differ from the CPU's in the last bits, and three AdamW
    # steps at lr 0.1 carry that to about 1e-5 (seen there: 1.2e-5 in the third loss)
    rtol, atol = (1e-4, 1e-5) if on_tpu() else (1e-5, 1e-6)
    for _ in range(3):
        assert _train_step(model, opt, ids.to("tpu")) == pytest.approx(_train_step(cpu_model, cpu_opt, ids), rel=rtol)
    torch.testing.assert_close(weight.cpu(), cpu_model.embed.weight.detach(), rtol=rtol, atol=atol)
    model.cpu()
    assert weight.device.type == "cpu" and weight.grad.device.type == "cpu" and model.head.weight is weight
    model.to_empty(device="tpu")
    assert model.head.weight is weight and weight.device.type == "tpu"


def test_to_cpu_copies_many_tensors_with_one_host_read(monkeypatch):
    """`hf_tpu.to_cpu(tensors)` is `[t.detach().cpu() for t in tensors]` (every dtype bit for bit, views, CPU
    tensors), counted as one host read, and the tpu arrays' transfers are started before the first is read."""
    from hf_tpu.memory import tensor_views

    model = torch.nn.Linear(3, 5).to(torch.bfloat16)
    mask = torch.tensor([True, False, True])
    big = torch.randn(64, 512)  # past the uploads kept on the host: read from the device
    on_tpu = [p.to("tpu") for p in model.parameters()] + [mask.to("tpu"), big.to("tpu")]
    view = on_tpu[0].t()[1:]
    started = []
    monkeypatch.setattr(type(tensor_views.array_of(on_tpu[-1])), "copy_to_host_async",
                        lambda array: started.append(array.shape), raising=False)
    hf_tpu.reset_metrics()
    copies = hf_tpu.to_cpu([*on_tpu, view, big])
    assert hf_tpu.metrics()["host_syncs"] == 1 and (64, 512) in started
    expected = [*model.parameters(), mask, big, model.weight.t()[1:], big]
    for copy, want in zip(copies, expected):
        assert copy.device.type == "cpu" and copy.dtype == want.dtype and not copy.requires_grad
        assert torch.equal(copy, want.detach())
    assert copies[-1] is not big and copies[-1].data_ptr() == big.data_ptr()  # a CPU tensor: detached, not copied


def test_prefetch_to_cpu_starts_the_transfers_a_later_copy_reads(monkeypatch):
    """`hf_tpu.prefetch_to_cpu(tensors)` starts transfers and waits for none (no host read is counted); a later
    `.cpu()` reads the same array. A view that is its buffer under another shape (`logits[:, -1]`) is copied as
    its buffer, reshaped on the host, with no device program; a view of part of a buffer, a CPU tensor and a
    deferred value (which a transfer would compute) are left alone."""
    from hf_tpu.memory import buffer, host_transfers, tensor_views

    logits = torch.randn(2, 1, 700).to("tpu") * 2  # computed on the device, not an upload kept on the host
    part = (torch.randn(4, 700).to("tpu") * 2)[1:]
    started = []
    monkeypatch.setattr(type(tensor_views.array_of(logits)), "copy_to_host_async",
                        lambda array: started.append(array), raising=False)
    hf_tpu.reset_metrics()
    hf_tpu.prefetch_to_cpu([logits[:, -1], part, torch.ones(2)])
    assert hf_tpu.metrics()["host_syncs"] == 0
    assert len(started) == 1 and started[0] is buffer.buffer_of(logits).array
    expected = logits.cpu()[:, -1]

    def no_device_copy(*args):
        raise AssertionError("the whole buffer is read, not a copy the device makes of the view")

    monkeypatch.setattr(host_transfers, "array_of", no_device_copy)
    assert torch.equal(logits[:, -1].cpu(), expected)
    monkeypatch.undo()
    with torch.tpu.use_eager_mode("DEFER_AND_FUSE"):
        deferred = logits * 3
        hf_tpu.prefetch_to_cpu([deferred])
        assert type(buffer.buffer_of(deferred).array) is buffer.Lazy
        assert torch.equal(deferred.cpu(), logits.cpu() * 3)


def test_same_values_is_known_without_the_device_for_one_array_read_whole():
    """`hf_tpu.same_values(a, b)`: True for tensors reading one computed array whole (a tensor and its detached
    alias, two uploads of the same small values); False where it is not known without the device: other values,
    another shape or dtype, a view of part, a value written in place since, a deferred value, a CPU tensor."""
    ids = torch.arange(128).reshape(1, 128)
    first, second = ids.to("tpu"), ids.clone().to("tpu")
    assert hf_tpu.same_values(first, second) and hf_tpu.same_values(first, first.detach())
    assert not hf_tpu.same_values(first, (ids + 1).to("tpu"))
    assert not hf_tpu.same_values(first, first.reshape(128)) and not hf_tpu.same_values(first, first.int())
    assert not hf_tpu.same_values(first[:, 1:], second[:, 1:])
    assert not hf_tpu.same_values(first, ids) and not hf_tpu.same_values(ids, ids)
    written = second.clone()
    alias = written.detach()
    assert hf_tpu.same_values(written, alias)
    written.add_(0)  # a new array in the buffer (computed at the sync): both tensors still read it
    torch.tpu.synchronize()
    assert hf_tpu.same_values(written, alias) and not hf_tpu.same_values(written, second)
    with torch.tpu.use_eager_mode("DEFER_AND_FUSE"):
        deferred = first * 1
        assert not hf_tpu.same_values(deferred, deferred.detach())
        assert torch.equal(deferred.cpu(), ids)


def test_storages_move_and_say_where_they_are():
    host = torch.arange(3.0).untyped_storage()
    moved = host.tpu()
    assert moved.is_tpu and not host.is_tpu and moved.device == torch.device("tpu", 0)
    assert torch.tensor([], device="tpu").set_(moved).cpu().tolist() == [0.0, 1.0, 2.0]


def test_a_parameter_that_cannot_be_swapped_still_moves():
    """PyTorch refuses to swap a parameter something holds a weak reference to (or that a pending
    autograd graph uses): such a module moves PyTorch's default way, with new objects."""
    import weakref

    linear = torch.nn.Linear(3, 2)
    held = weakref.ref(linear.weight)
    linear.to("tpu")
    assert linear.weight.device.type == "tpu" and linear.bias.device.type == "tpu"
    assert held() is not linear.weight
    torch.manual_seed(0)
    model = _TiedLM()
    loss = model(torch.randint(0, 10, (2, 5))).sum()  # its graph holds the weight until backward
    model.to("tpu")
    assert model.embed.weight.device.type == "tpu" and model.head.weight.device.type == "tpu"
    loss.backward()


def test_transformers_sees_the_accelerator():
    from transformers.utils import is_torch_tpu_available

    assert is_torch_tpu_available()


def test_module_functions():
    tpu = torch.tpu
    assert tpu.is_available() and tpu.device_count() == CHIPS
    tpu.init()
    assert tpu.is_initialized()
    assert tpu.current_device() == 0
    assert "TPU" in tpu.get_device_name() or tpu.get_device_name()
    props = tpu.get_device_properties(0)
    assert props.total_memory > 0 and props.index == 0
    assert torch.bfloat16 in tpu.get_amp_supported_dtype()
    free, total = tpu.mem_get_info()
    assert 0 < free <= total
    tpu.empty_cache()
    tpu.synchronize()
    stats = tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == tpu.memory_allocated()


@pytest.mark.requires_chips(2)
def test_synchronize_waits_on_every_computed_array_of_its_chip(monkeypatch):
    from hf_tpu.memory import buffer, tensor_views

    on_chip0 = torch.ones(4, device="tpu:0") * 3
    on_chip1 = torch.ones(4, device="tpu:1") * 3
    uninitialised = torch.empty(4, device="tpu:0")
    waited = []
    monkeypatch.setattr(jax, "block_until_ready", lambda arrays: waited.append(arrays) or arrays)
    torch.tpu.synchronize(0)
    ids = {id(a) for a in waited[0]}
    assert id(tensor_views.array_of(on_chip0)) in ids
    assert id(buffer.buffer_of(on_chip1)._array) not in ids
    assert buffer.buffer_of(uninitialised)._array is None and None not in waited[0]
    assert all(a.devices() == {hf_tpu.platform.jax_device(0)} for a in waited[0])


@pytest.mark.requires_chips(2)
def test_set_device_and_context_manager():
    with torch.tpu.device(1):
        assert torch.tpu.current_device() == 1
        x = torch.ones(3, device="tpu")
        assert x.device == torch.device("tpu:1")
    assert torch.tpu.current_device() == 0
    torch.tpu.set_device("tpu:1")
    try:
        assert torch.zeros(1, device="tpu").device.index == 1
    finally:
        torch.tpu.set_device(0)
    assert (torch.ones(2, device="tpu:1") + 1).device.index == 1


@pytest.mark.requires_chips(2)
def test_tensors_on_two_chips_do_not_mix():
    a = torch.ones(2, device="tpu:0")
    b = torch.ones(2, device="tpu:1")
    with pytest.raises(RuntimeError, match="same device"):
        a + b
    assert (a + b.to("tpu:0")).cpu().tolist() == [2.0, 2.0]


def test_streams_and_events():
    s = torch.tpu.current_stream()
    assert s == torch.tpu.default_stream()
    s.synchronize()
    s.wait_stream(torch.tpu.Stream())
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    start.record()
    (torch.ones(64, 64, device="tpu") * 2).sum()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0
    with pytest.raises(RuntimeError):
        torch.tpu.Event().elapsed_time(torch.tpu.Event())


def test_metrics_counters():
    x = torch.ones(4, device="tpu")
    x.cpu()  # materialised, so the same work follows in every mode
    hf_tpu.reset_metrics()
    (x + 1).cpu()
    m = hf_tpu.metrics()
    for key in ("ops_dispatched", "compiles", "compile_cache_hits", "host_syncs", "cpu_fallbacks"):
        assert key in m
    assert m["ops_dispatched"] >= 1 and m["host_syncs"] >= 1
    (x + 1).cpu()
    assert hf_tpu.metrics()["compile_cache_hits"] > m["compile_cache_hits"]


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cpu_process_env(**env),
                          timeout=300)


def test_one_chip_platform_rejects_tpu7_clearly():
    r = _python(
        "import torch, hf_tpu\n"
        "try:\n    torch.zeros(2, device='tpu:7')\nexcept RuntimeError as e:\n    print('ERR', e)\n",
        HF_TPU_NUM_DEVICES="1",
    )
    assert r.returncode == 0, r.stderr
    assert "ERR Invalid device tpu:7" in r.stdout and "1 tpu device" in r.stdout


def test_platform_override_and_simulated_chips():
    r = _python("import torch, hf_tpu; print(hf_tpu.platform_name(), torch.tpu.device_count())",
                HF_TPU_PLATFORM="cpu", HF_TPU_NUM_DEVICES="4")
    assert r.stdout.split() == ["cpu", "4"], r.stderr


def test_another_owner_of_privateuse1_is_reported():
    r = _python("import torch\ntorch.utils.rename_privateuse1_backend('jax')\nimport hf_tpu")
    assert r.returncode != 0
    assert "already taken as 'jax'" in r.stderr and "torchax" in r.stderr


def test_hf_tpu_env_reports_platform_devices_versions_mode_and_settings(capsys, monkeypatch):
    from hf_tpu import cli, settings

    monkeypatch.setenv("HF_TPU_LOG_COMPILES", "on")
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for needle in (f"platform      {PLATFORM}", f"devices       {CHIPS}", "torch ", "jax ", "transformers ", "diffusers ",
                   "accelerate ", "eager mode"):
        assert needle in out, needle
    for name in settings.SETTINGS:  # the core's variables and the Transformers adapter's
        assert f"  {name} " in out, name
    assert "HF_TPU_DEVICE_LOOP" in out
    assert [line.split() for line in out.splitlines() if "HF_TPU_LOG_COMPILES" in line] == [
        ["HF_TPU_LOG_COMPILES", "True", "env"]]
