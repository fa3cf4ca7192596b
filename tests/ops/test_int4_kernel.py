"""The int4 kernel (`hf_tpu.kernels.int4_matmul`), in Pallas interpret mode on the CPU and compiled by Mosaic on a
TPU: its decode form (stacked groups) and its prefill form (a scaled weight tile, several row blocks) against its
jnp reference, against `hf_tpu::int4_linear`'s CPU reference through the op (`HF_TPU_KERNELS=pallas`) and
against torchao's CPU linear; which calls take it (one chip) and which keep the XLA lowering.

Tolerances, as shares of the largest output: float32 at 1e-5 off a TPU (the same products summed in another
order: the kernel scales each group's partial product, the reference each weight) and 2e-3 on one (the matrix
unit's float32 products may pass through bfloat16; the op takes the kernel for float32 only below the "highest"
precision); bfloat16 at 1.5e-2 (the reference rounds each dequantized weight to bfloat16, the kernel scales in
float32, and the output is rounded once; the prefill form rounds each weight as the reference does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_tpu.distributed as dist
from hf_tpu.dispatch.program import PROGRAMS
from hf_tpu.kernels import int4_matmul as kernel
from hf_tpu.kernels import selection
from hf_tpu.ops.quantized import dequantized_int4

SHARE = {jnp.float32: 1e-5 if selection.interpret() else 2e-3, jnp.bfloat16: 1.5e-2}


def _operands(rows, out_features, in_features, group_size, dtype, seed=0):
    x_key, q_key, s_key, z_key = jax.random.split(jax.random.key(seed), 4)
    groups = (in_features // group_size, out_features)
    return (jax.random.normal(x_key, (rows, in_features), jnp.float32).astype(dtype),
            jax.random.randint(q_key, (out_features, in_features // 2), -128, 128, jnp.int32).astype(jnp.int8),
            (jax.random.uniform(s_key, groups) / 8).astype(dtype),
            (jax.random.normal(z_key, groups) / 8).astype(dtype))


def _assert_close(actual, expected, dtype):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert np.abs(actual - expected).max() <= SHARE[dtype] * np.abs(expected).max()


@pytest.mark.parametrize("group_size, groups_per_block, block_n", [
    (32, 8, 128),  # two K blocks of 8 groups, two N blocks
    (64, None, None),  # the block sizes the kernel picks: all 16 groups in one K block
    (128, 2, 128),  # two K blocks of two groups
])
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_the_kernel_matches_its_reference_in_bfloat16(group_size, groups_per_block, block_n, rows):
    operands = _operands(rows, 256, 1024 if group_size == 64 else 512, group_size, jnp.bfloat16)
    actual = kernel.int4_matmul(*operands, group_size, groups_per_block=groups_per_block, block_n=block_n)
    assert actual.shape == (rows, 256) and actual.dtype == jnp.bfloat16
    _assert_close(actual, kernel.reference(*operands, group_size), jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows, group_size, block_m, groups_per_block, block_n", [
    (65, 128, None, None, None),  # one row block of 72 padded rows; the prefill K block: 4 groups, 512 features
    (130, 32, 72, 8, 128),  # two row blocks, two N blocks, two K blocks
    (300, 64, None, 16, None),  # two row blocks of 256 (the last one padded), one K block of every group
])
def test_the_prefill_form_matches_its_reference(dtype, rows, group_size, block_m, groups_per_block, block_n):
    """More than `DECODE_ROWS` rows: the weight tile scaled in VMEM, a row grid axis."""
    operands = _operands(rows, 256, 1024, group_size, dtype, seed=rows)
    actual = kernel.int4_matmul(*operands, group_size, block_m=block_m, groups_per_block=groups_per_block,
                                block_n=block_n)
    assert actual.shape == (rows, 256) and actual.dtype == dtype
    _assert_close(actual, kernel.reference(*operands, group_size), dtype)


@pytest.mark.parametrize("group_size", [32, 128])
def test_the_kernel_matches_its_reference_in_float32_with_leading_dimensions(group_size):
    x, *weight = _operands(6, 128, 512, group_size, jnp.float32)
    x = x.reshape(2, 3, 512)
    actual = kernel.int4_matmul(x, *weight, group_size, groups_per_block=512 // group_size // 2)
    assert actual.shape == (2, 3, 128) and actual.dtype == jnp.float32
    _assert_close(actual, kernel.reference(x, *weight, group_size), jnp.float32)


def test_the_reference_is_the_ops_cpu_reference():
    """The jnp reference computes what the op's CPU kernel does: the dequantized weight, then a product."""
    x, qdata, scale, zero_point = (torch.from_numpy(np.asarray(a.astype(jnp.float32) if a.dtype != jnp.int8 else a))
                                   for a in _operands(3, 128, 256, 64, jnp.float32))
    expected = x @ dequantized_int4(qdata, scale, zero_point, 64, torch.float32).t()
    actual = kernel.reference(*(jnp.asarray(t.numpy()) for t in (x, qdata, scale, zero_point)), 64)
    _assert_close(actual, expected.numpy(), jnp.float32)


@pytest.mark.parametrize("shape, group_size, reason", [
    ((1, 512), 64, None),
    ((1024, 512), 64, None),  # prefill rows: the prefill form, up to PREFILL_ROWS
    ((8192, 512), 64, "more than 1024"),  # past it, a dequantized copy costs less than unpacking every row block
    ((1, 96), 32, None),  # 3 groups of 16 bytes: one K block of the whole K (a full dimension)
    # 5 groups of 16 bytes, 64 rows: 5 x 64 stacked rows are too many, one group's 16 bytes fill no lanes
    ((64, 160), 32, "no K block of whole groups"),
])
def test_unsupported_names_the_rule_broken(shape, group_size, reason):
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    qdata = jax.ShapeDtypeStruct((128, shape[1] // 2), jnp.int8)
    groups = jax.ShapeDtypeStruct((shape[1] // group_size, 128), jnp.bfloat16)
    why = kernel.unsupported(x, qdata, groups, groups, group_size)
    assert (why is None) if reason is None else (reason in why)
    if reason == "no K block of whole groups":  # the kernel called anyway says the same
        with pytest.raises(ValueError, match=reason):
            kernel.int4_matmul(*(jnp.zeros(a.shape, a.dtype) for a in (x, qdata, groups, groups)), group_size)


# --- through the op: which calls take the kernel


@pytest.fixture
def kernel_calls(monkeypatch):
    """HF_TPU_KERNELS set per test (programs traced under another choice dropped) and the kernel's calls counted."""
    calls = []
    original = kernel.int4_matmul

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel, "int4_matmul", counted)

    def use(mode):
        monkeypatch.setenv("HF_TPU_KERNELS", mode)
        PROGRAMS.clear()

    yield use, calls
    PROGRAMS.clear()


def _torch_operands(rows, dtype=torch.bfloat16):
    x, qdata, scale, zero_point = _operands(rows, 256, 512, 64, jnp.float32, seed=1)
    as_torch = lambda a: torch.from_numpy(np.asarray(a))  # noqa: E731
    return as_torch(x).to(dtype), as_torch(qdata), as_torch(scale).to(dtype), as_torch(zero_point).to(dtype), 64


@pytest.fixture
def float32_precision():
    """Sets `torch.set_float32_matmul_precision` for one test."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [3, 80])
def test_the_op_takes_the_kernel_for_decode_and_prefill_rows_and_matches_the_cpu(kernel_calls, float32_precision,
                                                                                 dtype, rows):
    """float32 takes it below the "highest" precision (PyTorch's default keeps the XLA lowering, as the other
    kernels do: the kernel's products are not guaranteed full float32 precision on the chip)."""
    use, calls = kernel_calls
    use("pallas")
    float32_precision("high")
    x, qdata, scale, zero_point, group_size = _torch_operands(rows, dtype)
    expected = torch.ops.hf_tpu.int4_linear(x, qdata, scale, zero_point, group_size)
    actual = torch.ops.hf_tpu.int4_linear(x.to("tpu"), qdata.to("tpu"), scale.to("tpu"), zero_point.to("tpu"),
                                          group_size)
    assert calls == [(rows, 512)]
    _assert_close(actual.cpu().float().numpy(), expected.float().numpy(), jnp.bfloat16 if dtype == torch.bfloat16
                  else jnp.float32)


def test_a_torchao_int4_linear_takes_the_kernel_for_a_prompt_and_gives_the_cpus_result(kernel_calls):
    """A linear layer quantized by torchao's `Int4WeightOnlyConfig` (the adapter's quantizer and `F.linear`):
    a prompt of 2 x 40 rows through the prefill form, against the same layer on the CPU."""
    pytest.importorskip("torchao", reason="the int4 layer is torchao's (pip install torchao)")
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    use, calls = kernel_calls
    use("pallas")
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16)
    quantize_(layer, Int4WeightOnlyConfig(group_size=64))
    x = torch.randn(2, 40, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        actual = layer.to("tpu")(x.to("tpu")).cpu()
    assert calls == [(2, 40, 256)]
    _assert_close(actual.float().numpy(), expected.float().numpy(), jnp.bfloat16)


def test_highest_float32_and_xla_mode_keep_the_xla_lowering(kernel_calls):
    use, calls = kernel_calls
    use("pallas")
    x, *weight, group_size = _torch_operands(80)
    assert torch.get_float32_matmul_precision() == "highest"
    torch.ops.hf_tpu.int4_linear(x[:2].float().to("tpu"), *(w.float().to("tpu") if w.is_floating_point()
                                                           else w.to("tpu") for w in weight), group_size).cpu()
    use("xla")
    torch.ops.hf_tpu.int4_linear(x[:2].to("tpu"), *(w.to("tpu") for w in weight), group_size).cpu()
    assert calls == []


@pytest.mark.requires_chips(2)
def test_a_weight_split_over_chips_keeps_the_xla_lowering(kernel_calls):
    """XLA's partitioner cannot split a Mosaic kernel's call: a tensor-parallel layer keeps the XLA form."""
    use, calls = kernel_calls
    use("pallas")
    x, qdata, scale, zero_point, group_size = _torch_operands(2)
    expected = torch.ops.hf_tpu.int4_linear(x, qdata, scale, zero_point, group_size)
    mesh = dist.mesh(2, "tp")
    actual = torch.ops.hf_tpu.int4_linear(dist.replicate(x.to("tpu"), mesh), dist.shard(qdata, mesh, ("tp",)),
                                          dist.shard(scale, mesh, (None, "tp")),
                                          dist.shard(zero_point, mesh, (None, "tp")), group_size)
    assert calls == []
    _assert_close(actual.cpu().float().numpy(), expected.float().numpy(), jnp.bfloat16)
