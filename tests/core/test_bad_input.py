"""Bad input gets PyTorch's exception types and messages a user can act on."""

import pytest
import torch

from hf_tpu import dispatch


def test_cpu_and_tpu_tensors_in_one_op():
    with pytest.raises(RuntimeError, match=r"found at least two devices, tpu:0 and cpu"):
        torch.ones(3, device="tpu") + torch.ones(3)


def test_cpu_scalar_tensor_joins_like_on_cuda():
    assert (torch.ones(3, device="tpu") * torch.tensor(2.0)).cpu().tolist() == [2.0, 2.0, 2.0]


def test_shape_mismatch_raises_runtime_error_like_cpu():
    with pytest.raises(RuntimeError, match="must match the size|broadcast"):
        torch.ones(3, device="tpu") + torch.ones(4, device="tpu")


def test_unsupported_op_names_op_dtypes_shapes_and_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_TPU_CPU_FALLBACK", "0")
    sig = dispatch.signature(torch.ops.aten._fft_r2c.default)
    x = torch.ones(8, device="tpu")
    with pytest.raises(NotImplementedError) as info:
        dispatch.run_unlowered(sig, [x, [0], 0, True])
    msg = str(info.value)
    assert "aten::_fft_r2c" in msg and "float32[8]" in msg
    assert "HF_TPU_CPU_FALLBACK" in msg and "docs/compatibility.md" in msg


def test_cpu_fallback_runs_and_is_counted():
    import hf_tpu

    hf_tpu.reset_metrics()
    sig = dispatch.signature(torch.ops.aten._fft_r2c.default)
    x = torch.arange(8.0, device="tpu")
    out = dispatch.cpu_fallback(sig, [x, [0], 0, True])
    assert out.device.type == "tpu"
    assert torch.allclose(out.cpu(), torch.fft.rfft(torch.arange(8.0)))
    assert hf_tpu.metrics()["cpu_fallbacks"]["aten::_fft_r2c"] == 1


def test_in_place_on_expanded_tensor_raises_like_cpu():
    x = torch.zeros(1, 4, device="tpu").expand(3, 4)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        x.add_(1)
