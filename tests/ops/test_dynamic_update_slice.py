"""`hf_tpu::dynamic_update_slice` (and its in-place form) on tpu against its CPU reference, `index_copy` at
contiguous positions: eager, traced (`hf_tpu.jit`) and under `torch.compile`, with one program for every
start, and PyTorch's errors for what `index_copy_` rejects."""

import pytest
import torch

import hf_tpu


@pytest.fixture(autouse=True)
def no_cpu_fallback(monkeypatch):
    monkeypatch.setenv("HF_TPU_CPU_FALLBACK", "0")


def _expected(cache, dim, start, source):
    positions = torch.arange(source.shape[dim]) + int(start)
    return cache.index_copy(dim, positions, source)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
@pytest.mark.parametrize("dim, start", [(2, 0), (2, 5), (-2, 3), (0, 1)])
def test_writes_where_index_copy_at_contiguous_positions_writes(dtype, dim, start):
    torch.manual_seed(0)
    cache = (torch.randn(3, 2, 8, 4) * 4).to(dtype)
    shape = list(cache.shape)
    shape[dim] = 2
    source = (torch.randn(shape) * 4).to(dtype)
    expected = _expected(cache, dim, start, source)
    start_tensor = torch.tensor([start])
    assert torch.equal(torch.ops.hf_tpu.dynamic_update_slice(cache, dim, start_tensor, source), expected)
    on_tpu = cache.to("tpu")
    torch.ops.hf_tpu.dynamic_update_slice_(on_tpu, dim, start_tensor.to("tpu"), source.to("tpu"))
    assert torch.equal(on_tpu.cpu(), expected)


def test_traced_and_compiled_writes_serve_every_start_with_one_program():
    cache, source = torch.zeros(1, 2, 16, 4), torch.randn(1, 2, 3, 4)

    def write(cache, start, source):
        torch.ops.hf_tpu.dynamic_update_slice_(cache, 2, start, source)
        return cache * 2

    traced, compiled = hf_tpu.jit(write), torch.compile(write, backend="tpu", dynamic=False)
    for run in (traced, compiled):
        hf_tpu.reset_metrics()
        for start in (0, 7, 13):
            on_tpu = cache.to("tpu")
            result = run(on_tpu, torch.tensor(start).to("tpu"), source.to("tpu"))
            expected = _expected(cache, 2, start, source)
            assert torch.equal(on_tpu.cpu(), expected) and torch.equal(result.cpu(), expected * 2)
        assert hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0) == 1


def test_rejects_what_index_copy_rejects():
    cache = torch.zeros(2, 8, 4)
    on_tpu = cache.to("tpu")
    start = torch.tensor(1)
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.ops.hf_tpu.dynamic_update_slice(on_tpu, 1, start.to("tpu"), torch.zeros(2, 2, 4, dtype=torch.int64).to("tpu"))
    with pytest.raises(IndexError, match="does not fit"):
        torch.ops.hf_tpu.dynamic_update_slice(on_tpu, 1, start.to("tpu"), torch.zeros(2, 2, 5).to("tpu"))
    with pytest.raises(RuntimeError, match="one integer"):
        torch.ops.hf_tpu.dynamic_update_slice(on_tpu, 1, torch.tensor([1.0]).to("tpu"), torch.zeros(2, 2, 4).to("tpu"))
    with pytest.raises(IndexError, match="out of bounds"):  # the CPU reference checks the start's value
        torch.ops.hf_tpu.dynamic_update_slice(cache, 1, torch.tensor(7), torch.zeros(2, 2, 4))
