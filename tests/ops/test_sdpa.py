"""F.scaled_dot_product_attention on tpu: one fused op where PyTorch's CPU takes its fused kernel, PyTorch's
math decomposition elsewhere, both against CPU, forward and backward, eager and compiled."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import hf_tpu
from tests.util import assert_same, to_cpu

FUSED = "ScaledDotProductFlashAttentionForCpuBackward0"
GROUPED = "GeneratedBackwardFor_hf_tpu_flash_attention_with_logsumexp_defaultBackward"


def qkv(*shapes, dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(shape, dtype=dtype, requires_grad=True) for shape in shapes]


def on_tpu(tensors):
    return [t.detach().to("tpu").requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in tensors]


def attend_and_grads(q, k, v, mask=None, **options):
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **options)
    wrt = [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor) and t.requires_grad]
    return out, torch.autograd.grad((out * out).sum(), wrt)


# name: (query, key, value shapes; mask factory; options; the op computing it on tpu: FUSED, GROUPED (grouped
# query heads, hf_tpu's op, which does not repeat the key/value heads) or None (the math path))
CASES = {
    "plain": (((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)), None, {}, FUSED),
    "causal_top_left": (((2, 3, 4, 8), (2, 3, 6, 8), (2, 3, 6, 8)), None, {"is_causal": True}, FUSED),
    "scale": (((1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4)), None, {"scale": 0.3}, FUSED),
    "additive_mask": (((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)), lambda: torch.randn(5, 7), {}, FUSED),
    "bool_mask_broadcast": (((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)), lambda: torch.rand(2, 1, 1, 7) > 0.3, {},
                            FUSED),
    # rows with every key masked out give 0, as PyTorch's math path does
    "fully_masked_rows": (((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)),
                          lambda: torch.tensor([[True] * 5, [False] * 5, [True, False] * 2 + [True]]), {}, FUSED),
    # CPU takes the pair (its fused kernel); the math path would refuse it
    "mask_with_causal": (((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8)), lambda: torch.randn(5, 5), {"is_causal": True},
                         FUSED),
    "three_dims": (((4, 3, 8), (4, 6, 8), (4, 6, 8)), None, {}, None),
    "value_head_dim_differs": (((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 4)), None, {}, None),
    "grouped_query_heads": (((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)), None, {"enable_gqa": True}, GROUPED),
    "grouped_query_heads_causal": (((2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8)), None,
                                   {"enable_gqa": True, "is_causal": True}, GROUPED),
    # causal with other lengths: SDPA's top-left pattern, which hf_tpu's grouped op does not take
    "grouped_query_heads_causal_top_left": (((2, 4, 3, 8), (2, 2, 6, 8), (2, 2, 6, 8)), None,
                                            {"enable_gqa": True, "is_causal": True}, None),
    # a decode step over a cache: one query, a mask hiding the unwritten positions
    "grouped_query_heads_one_query_masked": (((3, 8, 1, 8), (3, 2, 9, 8), (3, 2, 9, 8)),
                                             lambda: torch.arange(9) < torch.tensor([4, 9, 1]).view(3, 1, 1, 1),
                                             {"enable_gqa": True}, GROUPED),
    "grouped_query_heads_additive_mask": (((2, 4, 5, 8), (2, 1, 7, 8), (2, 1, 7, 8)), lambda: torch.randn(2, 4, 5, 7),
                                          {"enable_gqa": True}, GROUPED),
    # PyTorch's fused kernel has no gradient for the mask; the math path gives one
    "mask_requiring_grad": (((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)),
                            lambda: torch.randn(5, 7, requires_grad=True), {}, None),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_cpu_forward_and_backward_on_the_path_cpu_would_take(case):
    shapes, mask, options, op = CASES[case]
    q, k, v = qkv(*shapes)
    mask = mask() if mask else None
    expected = attend_and_grads(q, k, v, mask, **options)
    tq, tk, tv, tmask = on_tpu([q, k, v, mask])
    hf_tpu.reset_metrics()
    out, grads = attend_and_grads(tq, tk, tv, tmask, **options)
    assert type(out.grad_fn).__name__ == op if op else type(out.grad_fn).__name__ not in (FUSED, GROUPED)
    assert_same((out, grads), expected)
    assert not hf_tpu.metrics()["cpu_fallbacks"]


def test_fused_path_is_one_op_in_inference_mode_and_bfloat16():
    q, k, v = qkv((2, 2, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8), dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        tq, tk, tv = on_tpu([q.detach(), k.detach(), v.detach()])
        hf_tpu.reset_metrics()
        out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        assert hf_tpu.metrics()["ops_dispatched"] == 1
    assert_same(out, expected)


def test_sdpa_kernel_math_backend_is_respected():
    tq, tk, tv = on_tpu(qkv((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8)))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(tq, tk, tv)
    assert type(out.grad_fn).__name__ != FUSED


def test_dropout_takes_the_math_path():
    tq, tk, tv = on_tpu([torch.ones(1, 1, 64, 8), torch.ones(1, 1, 64, 8), torch.ones(1, 1, 64, 8)])
    out = F.scaled_dot_product_attention(tq, tk, tv, dropout_p=0.5)
    assert type(out.grad_fn).__name__ != FUSED
    # without dropout every output is 1 (a mean of ones); dropped and rescaled weights move most of them
    assert (to_cpu(out) != 1).float().mean() > 0.5


def test_bad_input_raises_what_cpu_raises():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    for args in [(q, k.double(), v), (q, k[..., :4], v), (q, k, v, torch.ones(3, 5))]:
        with pytest.raises(RuntimeError) as cpu_error:
            F.scaled_dot_product_attention(*args)
        with pytest.raises(type(cpu_error.value)):
            F.scaled_dot_product_attention(*on_tpu(list(args)))


def test_compiled_attention_over_transposed_projections():
    """Models project to (batch, seq, heads, dim) and transpose: the fused op's meta strides follow such a
    query, and the compiled graph's later views must still see PyTorch's contiguous result."""

    def attention_block(x, weight):
        q, k, v = (x @ weight).unflatten(-1, (3, 2, 4)).unbind(2)  # (batch, seq, heads, dim) each
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2).reshape(x.shape[0], x.shape[1], 8)

    torch.manual_seed(0)
    x, weight = torch.randn(2, 6, 8), torch.randn(8, 24, requires_grad=True)
    expected = attention_block(x, weight)
    expected_grad, = torch.autograd.grad(expected.sum(), weight)
    tx, tweight = on_tpu([x, weight])
    compiled = torch.compile(attention_block, backend="tpu", fullgraph=True)
    out = compiled(tx, tweight)
    grad, = torch.autograd.grad(out.sum(), tweight)
    assert_same((out, grad), (expected, expected_grad))


def _dot_precisions(jaxpr) -> list:
    """The precision of every dot_general in a jaxpr, nested ones (a ClosedJaxpr's `.jaxpr`) included."""
    found = []
    for equation in jaxpr.eqns:
        if equation.primitive.name == "dot_general":
            found.append(equation.params["precision"])
        for param in equation.params.values():
            for inner in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found += _dot_precisions(inner)
    return found


@pytest.mark.parametrize("precision, expected", [("highest", "HIGHEST"), ("medium", "DEFAULT")])
def test_float32_attention_products_take_the_float32_matmul_precision(precision, expected):
    """XLA:CPU computes float32 products in full whatever the precision asked; a TPU computes a product that
    asks for none in one bfloat16 pass, so the difference from the CPU only shows there (4.7e-4 in
    all-MiniLM-L6-v2's embeddings on a v5e): what the lowering asks for is checked here."""
    import jax
    import jax.numpy as jnp

    from hf_tpu.ops import attention

    q, k, v = (jnp.ones((1, 2, 8, 4), jnp.float32) for _ in range(3))
    mask = jnp.ones((1, 1, 8, 8), jnp.bool_)
    default = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        jaxpr = jax.make_jaxpr(lambda q, k, v, m: attention._attention(q, k, v, m, False, None))(q, k, v, mask)
    finally:
        torch.set_float32_matmul_precision(default)
    precisions = _dot_precisions(jaxpr.jaxpr)
    assert len(precisions) == 2
    assert all(p is not None and {getattr(x, "name", str(x)) for x in p} == {expected} for p in precisions), precisions
