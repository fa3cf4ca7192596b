"""Pinned host memory with `tpu` the accelerator: PyTorch asks the accelerator's C++ hooks for a pinned
allocator, which a backend written in Python cannot register, so every `pin_memory=True` factory raised
NotImplementedError once hf_tpu was imported (hf_tpu/memory/pinned.py)."""

import gc

import pytest
import torch

import hf_tpu  # noqa: F401

_FACTORIES = {
    "empty": lambda **kw: torch.empty(2, 3, **kw).fill_(1),
    "zeros": lambda **kw: torch.zeros(2, 3, **kw),
    "ones": lambda **kw: torch.ones(4, dtype=torch.bfloat16, **kw),
    "full": lambda **kw: torch.full((3,), 7, **kw),
    "arange": lambda **kw: torch.arange(5, **kw),
    "empty_strided": lambda **kw: torch.empty_strided((2, 3), (1, 2), **kw).fill_(2),
    "zeros_like": lambda **kw: torch.zeros_like(torch.ones(2, 2), **kw),
    "new_zeros": lambda **kw: torch.ones(1).new_zeros(3, **kw),
    "new_tensor": lambda **kw: torch.ones(1).new_tensor([5.0, 6.0], **kw),
}


@pytest.mark.parametrize("name", list(_FACTORIES))
def test_factories_with_pin_memory_make_pinned_host_tensors(name):
    expected = _FACTORIES[name]()
    pinned = _FACTORIES[name](pin_memory=True)
    assert pinned.device.type == "cpu" and pinned.is_pinned()
    assert pinned.dtype == expected.dtype and pinned.stride() == expected.stride()
    torch.testing.assert_close(pinned, expected)
    moved = pinned.to("tpu", non_blocking=True)
    assert moved.device.type == "tpu"
    torch.testing.assert_close(moved.cpu(), expected)
    assert not _FACTORIES[name]().is_pinned()


def test_pin_memory_copies_once_and_is_pinned_follows_the_storage():
    host = torch.arange(6.0).reshape(2, 3).t()
    assert not host.is_pinned()
    pinned = host.pin_memory()
    assert pinned.is_pinned() and torch.equal(pinned, host) and pinned.stride() == host.stride()
    assert pinned.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    assert pinned.pin_memory() is pinned  # PyTorch returns a pinned tensor as it is
    assert pinned[1:].is_pinned()  # a view of pinned memory is pinned
    address = pinned.untyped_storage().data_ptr()
    del pinned
    gc.collect()
    from hf_tpu.memory import pinned as pinned_memory
    assert address not in pinned_memory._pinned  # forgotten once freed: the address can be reused


def test_pinned_buffers_reused_for_copies_keep_their_values():
    """The pattern of offloading: copy device values into a pinned buffer, read them back later."""
    staging = torch.empty(4, pin_memory=True)
    for step in range(3):
        on_tpu = torch.arange(4.0, device="tpu") * step
        staging.copy_(on_tpu, non_blocking=True)
        torch.tpu.synchronize()
        assert staging.tolist() == [i * step for i in range(4)]
        assert torch.equal(staging.to("tpu", non_blocking=True).cpu(), on_tpu.cpu())


def test_pinning_is_for_host_memory_only():
    with pytest.raises(RuntimeError, match="Only dense CPU tensors can be pinned"):
        torch.empty(3, device="tpu", pin_memory=True)


def test_data_loader_pins_its_batches():
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.arange(8))
    loader = torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True)
    batches = list(loader)
    assert all(x.is_pinned() and y.is_pinned() for x, y in batches)
    moved = torch.cat([x.to("tpu", non_blocking=True) for x, _ in batches])
    assert torch.equal(moved.cpu(), data.tensors[0])


def test_torchscript_and_dynamo_still_see_the_factories_as_aten_ops(tmp_path):
    source = tmp_path / "scripted.py"
    source.write_text("import torch\n\n\ndef f(x: torch.Tensor):\n"
                      "    return x + torch.zeros(3) + torch.arange(3) + torch.full((3,), 2.0)\n")
    import importlib.util
    spec = importlib.util.spec_from_file_location("scripted", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert torch.jit.script(module.f)(torch.ones(3)).tolist() == [3.0, 4.0, 5.0]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(module.f, backend=backend, fullgraph=True)
    assert compiled(torch.ones(3)).tolist() == [3.0, 4.0, 5.0] and len(graphs) == 1
