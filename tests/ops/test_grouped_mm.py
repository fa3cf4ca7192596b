"""aten::_grouped_mm on tpu (jax.lax.ragged_dot) against a per-group torch.mm loop, in the input
shapes MoE layers use: tokens x experts' weights with offsets, the weight gradient's 2-D x 2-D, and
batched 3-D x 3-D."""

import pytest
import torch

import hf_tpu

OFFSETS = torch.tensor([3, 3, 8, 13], dtype=torch.int32)  # an empty group, and rows past the last offset


def per_group_mm(a, b, offs):
    """The loop _grouped_mm replaces; rows (or groups) past the last offset stay zero."""
    starts = [0, *offs.tolist()[:-1]]
    if a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for group, (start, end) in enumerate(zip(starts, offs.tolist())):
            out[start:end] = a[start:end] @ b[group]
        return out
    out = a.new_zeros(len(starts), a.shape[0], b.shape[-1])  # 2-D x 2-D: groups split the shared dimension
    for group, (start, end) in enumerate(zip(starts, offs.tolist())):
        out[group] = a[:, start:end] @ b[start:end]
    return out


def operands(*shapes):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=generator).to(torch.bfloat16) for shape in shapes]


@pytest.mark.parametrize("shapes", [((16, 8), (4, 8, 16)), ((8, 16), (16, 8))], ids=["2dx3d", "2dx2d"])
def test_grouped_matches_per_group_loop(shapes):
    a, b = operands(*shapes)
    actual = torch._grouped_mm(a.to("tpu"), b.to("tpu"), offs=OFFSETS.to("tpu")).cpu()
    expected = per_group_mm(a.float(), b.float(), OFFSETS).to(torch.bfloat16)
    used = slice(0, int(OFFSETS[-1])) if a.dim() == 2 and b.dim() == 3 else slice(None)
    torch.testing.assert_close(actual[used], expected[used], atol=1e-2, rtol=1e-2)
    assert hf_tpu.metrics()["cpu_fallbacks"] == {}


def test_batched_matches_bmm():
    a, b = operands((4, 8, 16), (4, 16, 8))
    actual = torch.nn.functional.grouped_mm(a.to("tpu"), b.to("tpu")).cpu()
    torch.testing.assert_close(actual, torch.bmm(a.float(), b.float()).to(torch.bfloat16), atol=1e-2, rtol=1e-2)


def test_gradients_match_cpu():
    a, b = operands((16, 8), (4, 8, 16))
    grad_out = operands((16, 16))[0]
    grad_out[int(OFFSETS[-1]):] = 0  # rows past the last offset are undefined on CPU
    grads = {}
    for device in ("cpu", "tpu"):
        leaves = [a.to(device).detach().requires_grad_(), b.to(device).detach().requires_grad_()]
        torch._grouped_mm(*leaves, offs=OFFSETS.to(device)).backward(grad_out.to(device))
        grads[device] = [leaf.grad.cpu().float() for leaf in leaves]
    used = int(OFFSETS[-1])
    torch.testing.assert_close(grads["tpu"][0][:used], grads["cpu"][0][:used], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grads["tpu"][1], grads["cpu"][1], atol=2e-2, rtol=2e-2)
    assert hf_tpu.metrics()["cpu_fallbacks"] == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shapes", [((13, 16), (4, 16, 8)), ((16, 13), (13, 8)), ((4, 5, 16), (4, 16, 8))],
                         ids=["2d-3d", "2d-2d", "3d-3d"])
def test_torch_compile_traces_grouped_mm_in_every_float_dtype(dtype, shapes):
    """PyTorch's meta kernel (which torch.compile's fake tensors run) accepts only bfloat16."""
    a, b = (x.to(dtype).to("tpu") for x in operands(*shapes))
    offs = OFFSETS.to("tpu")
    compiled = torch.compile(lambda a, b, offs: torch._grouped_mm(a, b, offs) + 1, backend="tpu", fullgraph=True)
    expected = torch._grouped_mm(a, b, offs) + 1
    actual = compiled(a, b, offs)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.cpu(), expected.cpu())


@pytest.mark.parametrize("dtype, precision", [("bfloat16", None), ("float32", "HIGHEST")])
def test_ragged_dot_asks_for_a_precision_only_for_float32_operands(dtype, precision):
    """On a TPU ragged_dot lowers through Pallas, and Mosaic refuses bfloat16 operands with float32 contract
    precision ("Bad lhs type", v5e); XLA:CPU accepts both, so the traced precision is what can be checked here."""
    import jax
    import jax.numpy as jnp

    from hf_tpu.ops import products

    lhs, rhs = jnp.ones((4, 8), dtype), jnp.ones((2, 8, 16), dtype)
    jaxpr = jax.make_jaxpr(lambda a, b: products._ragged_dot(a, b, jnp.array([1, 3], jnp.int32), 0, [0],
                                                          ((1,), (1,))))(lhs, rhs)
    (equation,) = [e for e in jaxpr.eqns if "ragged_dot" in e.primitive.name]
    traced = equation.params["precision"]
    names = {getattr(p, "name", str(p)) for p in (traced if isinstance(traced, tuple) else (traced,))} - {"None"}
    assert names == ({precision} if precision else set()) or (precision is None and names <= {"DEFAULT"})
