"""`hf_tpu::int4_linear`, the product of packed int4 weights (`hf_tpu.ops.quantized`): its XLA lowering against its
CPU reference, the layout it reads, and its errors on both devices."""

import pytest
import torch

from hf_tpu.ops.quantized import dequantized_int4

_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}


def _weight(out_features=16, in_features=64, group_size=32, dtype=torch.float32, packed_dtype=torch.int8):
    torch.manual_seed(0)
    qdata = torch.randint(-128, 128, (out_features, in_features // 2), dtype=torch.int8).view(packed_dtype)
    groups = (in_features // group_size, out_features)
    return qdata, (torch.rand(groups) / 8).to(dtype), (torch.randn(groups) / 8).to(dtype), group_size


def test_the_layout_is_signed_nibbles_low_first_with_grouped_scales():
    qdata = torch.tensor([[0x7F, -0x80 + 0x0F]], dtype=torch.int8)  # bytes 0x7f and 0x8f
    scale = torch.tensor([[2.0]])
    zero_point = torch.tensor([[0.5]])
    weight = dequantized_int4(qdata, scale, zero_point, 4, torch.float32)
    # 0x7f: low -1, high 7; 0x8f: low -1, high -8; each times 2 plus 0.5
    assert weight.tolist() == [[-1.5, 14.5, -1.5, -15.5]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed_dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_lowering_matches_the_reference(dtype, packed_dtype, compiled):
    qdata, scale, zero_point, group_size = _weight(dtype=dtype, packed_dtype=packed_dtype)
    x = torch.randn(2, 3, 64, dtype=dtype)
    expected = torch.ops.hf_tpu.int4_linear(x, qdata, scale, zero_point, group_size)
    assert expected.shape == (2, 3, 16) and expected.dtype == dtype
    torch.testing.assert_close(
        expected, x @ dequantized_int4(qdata, scale, zero_point, group_size, torch.float32).to(dtype).t(),
        **_TOLERANCE[dtype])
    run = torch.ops.hf_tpu.int4_linear
    if compiled:
        run = torch.compile(lambda *a: torch.ops.hf_tpu.int4_linear(*a), backend="tpu")
    actual = run(x.to("tpu"), qdata.to("tpu"), scale.to("tpu"), zero_point.to("tpu"), group_size)
    torch.testing.assert_close(actual.cpu(), expected, **_TOLERANCE[dtype])


@pytest.mark.parametrize("device", ["cpu", "tpu"])
@pytest.mark.parametrize("bad, message", [
    (dict(in_features=48), "has 48 features, the weight 64"),
    (dict(group_size=24), "group_size 24 must be even and divide"),
    (dict(scale_shape=(4, 16)), "must be \\(in_features / group_size, out_features\\)"),
])
def test_bad_shapes_raise_the_same_error_on_both_devices(device, bad, message):
    qdata, scale, zero_point, group_size = _weight()
    group_size = bad.get("group_size", group_size)
    if "scale_shape" in bad:
        scale = torch.ones(bad["scale_shape"])
    x = torch.randn(3, bad.get("in_features", 64))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.hf_tpu.int4_linear(*(t.to(device) for t in (x, qdata, scale, zero_point)), group_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed_dtype", [torch.int8, torch.uint8])
def test_the_grouped_form_matches_the_reference(dtype, packed_dtype):
    """`grouped_products`, the XLA form a TPU takes for a few rows where the kernel cannot serve (a weight split
    over chips, float32 at the "highest" precision): the scales applied to each group's partial product."""
    import jax.numpy as jnp
    import numpy as np

    from hf_tpu.ops.quantized import grouped_products

    qdata, scale, zero_point, group_size = _weight(dtype=dtype, packed_dtype=packed_dtype)
    x = torch.randn(2, 3, 64, dtype=dtype)
    expected = torch.ops.hf_tpu.int4_linear(x, qdata, scale, zero_point, group_size)
    as_jax = lambda t: jnp.asarray(t.view(torch.int16).numpy()).view(jnp.bfloat16) if t.dtype == torch.bfloat16 \
        else jnp.asarray(t.numpy())  # noqa: E731
    actual = grouped_products(*(as_jax(t) for t in (x, qdata, scale, zero_point)), group_size)
    assert actual.shape == (2, 3, 16) and actual.dtype == as_jax(x).dtype
    torch.testing.assert_close(torch.from_numpy(np.asarray(actual, np.float32)), expected.float(),
                               **_TOLERANCE[dtype])
