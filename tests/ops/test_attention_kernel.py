"""hf_tpu::flash_attention against a naive attention written here, on cpu (the reference kernel)
and on tpu (the blocked lowering), forward and backward, eager, deferred and compiled."""

import logging
import math
import re

import pytest
import torch

import hf_tpu
from hf_tpu.ops.attention import KV_BLOCK

flash_attention = torch.ops.hf_tpu.flash_attention


def naive_attention(query, key, value, attn_mask=None, scale=None, is_causal=False, sliding_window=0, softcap=0.0):
    """Every score materialised, position rules as triangular matrices, differentiable by autograd."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1).float(), value.repeat_interleave(groups, 1).float()
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", query.float(), key) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    q_len, k_len = scores.shape[-2:]
    allowed = torch.ones(q_len, k_len, dtype=torch.bool)
    if is_causal:
        allowed = allowed.tril(k_len - q_len)
    if sliding_window > 0:
        allowed = allowed.triu(k_len - q_len - sliding_window + 1)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = allowed & attn_mask.cpu()
    elif attn_mask is not None:
        scores = scores + attn_mask.cpu().float()
    scores = scores.masked_fill(~allowed, -math.inf)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # rows with nothing allowed attend to nothing
    return (probs @ value).to(query.dtype)


def padding_mask(batch, q_len, k_len):
    """Bool (batch, 1, q, k): the first sequence sees every key, the others lose their first keys."""
    mask = torch.ones(batch, 1, q_len, k_len, dtype=torch.bool)
    for b in range(1, batch):
        mask[b, ..., : b * 2] = False
    return mask


# (batch, heads, kv_heads, q_len, k_len, head_dim, options)
CASES = {
    "causal": (2, 4, 4, 9, 9, {"is_causal": True}),
    "padding": (3, 2, 2, 6, 6, {"attn_mask": padding_mask(3, 6, 6), "is_causal": True}),
    "additive_mask": (2, 2, 2, 5, 7, {"attn_mask": torch.randn(2, 2, 5, 7, generator=torch.Generator().manual_seed(1))}),
    "gqa": (2, 8, 2, 7, 7, {"is_causal": True, "scale": 0.3}),
    "sliding_window": (1, 4, 2, 11, 11, {"is_causal": True, "sliding_window": 3}),
    "softcap": (2, 4, 2, 8, 8, {"is_causal": True, "softcap": 2.0}),
    "decode": (2, 4, 2, 1, 13, {"is_causal": True, "sliding_window": 5, "attn_mask": padding_mask(2, 1, 13)}),
    "chunked_prefill": (1, 2, 1, 4, 10, {"is_causal": True}),
    "fully_masked_rows": (2, 2, 2, 5, 5, {"attn_mask": padding_mask(2, 5, 5) & torch.tensor([1, 0, 1, 0, 1]).bool()[:, None]}),
    # more scores than one block holds: the keys in blocks (a few queries over as many keys take one block)
    "multi_block": (1, 2, 1, KV_BLOCK + 8, KV_BLOCK + 190,
                    {"is_causal": True, "attn_mask": padding_mask(1, KV_BLOCK + 8, KV_BLOCK + 190)}),
    "one_block_long_keys": (1, 2, 1, 3, KV_BLOCK + 190, {"is_causal": True, "attn_mask": padding_mask(1, 3, KV_BLOCK + 190)}),
}

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def inputs(case, dtype, device, requires_grad=False):
    batch, heads, kv_heads, q_len, k_len, head_dim = *CASES[case][:5], 16
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape):
        t = torch.randn(*shape, generator=generator).to(dtype).to(device)
        return t.requires_grad_(requires_grad)

    options = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in CASES[case][5].items()}
    return tensor(batch, heads, q_len, head_dim), tensor(batch, kv_heads, k_len, head_dim), \
        tensor(batch, kv_heads, k_len, head_dim), options


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", "tpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_naive_attention(case, device, dtype):
    query, key, value, options = inputs(case, dtype, device)
    actual = flash_attention(query, key, value, **options)
    expected = naive_attention(*(t.cpu() for t in (query, key, value)), **options)
    assert actual.device.type == device and actual.dtype == dtype
    torch.testing.assert_close(actual.cpu(), expected, **TOLERANCE[dtype])
    assert hf_tpu.metrics()["cpu_fallbacks"] == {}


@pytest.mark.parametrize("device", ["cpu", "tpu"])
@pytest.mark.parametrize("case", ["padding", "gqa", "sliding_window", "softcap", "decode", "fully_masked_rows",
                                  "multi_block"])
def test_gradients_match_naive_attention(case, device):
    query, key, value, options = inputs(case, torch.float32, device, requires_grad=True)
    grad_out = torch.randn(query.shape[:-1] + value.shape[-1:], generator=torch.Generator().manual_seed(2))
    actual = torch.autograd.grad(flash_attention(query, key, value, **options), (query, key, value),
                                 grad_out.to(device))
    leaves = [t.detach().cpu().requires_grad_() for t in (query, key, value)]
    expected = torch.autograd.grad(naive_attention(*leaves, **options), leaves, grad_out)
    for a, e in zip(actual, expected):
        assert a.device.type == device
        torch.testing.assert_close(a.cpu(), e, atol=1e-4, rtol=1e-4)
    assert hf_tpu.metrics()["cpu_fallbacks"] == {}


def forward_and_backward(query, key, value, options):
    out = flash_attention(query, key, value, **options)
    return (out, *torch.autograd.grad(out.square().sum(), (query, key, value)))


def test_deferred_mode_matches_eager():
    expected = forward_and_backward(*inputs("softcap", torch.float32, "tpu", requires_grad=True))
    with torch.tpu.use_eager_mode("DEFER_AND_FUSE"):
        actual = forward_and_backward(*inputs("softcap", torch.float32, "tpu", requires_grad=True))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e.cpu(), **TOLERANCE[torch.float32])


def test_compiled_matches_eager_and_traces_whole(caplog):
    """Forward and backward graphs (aot_autograd) each trace into one jitted program."""
    case = "decode"
    query, key, value, options = inputs(case, torch.float32, "tpu", requires_grad=True)
    expected = forward_and_backward(query, key, value, options)
    compiled = torch.compile(lambda q, k, v: flash_attention(q, k, v, **options), backend="tpu")
    hf_tpu.reset_metrics()
    with caplog.at_level(logging.WARNING, logger="hf_tpu.compile"):
        out = compiled(query, key, value)
        out.square().sum().backward()
    # the fallback's warning; the compile log's progress line (a compile past a few seconds, as on a loaded
    # machine) shares the logger and is not one
    fallbacks = [r.getMessage() for r in caplog.records
                 if r.name == "hf_tpu.compile" and "in the eager mode instead" in r.getMessage()]
    assert not fallbacks, f"a graph fell back to eager: {fallbacks}"
    assert hf_tpu.metrics()["compiles_by_mode"]["COMPILE"] == 2
    for a, e in zip((out, query.grad, key.grad, value.grad), expected):
        torch.testing.assert_close(a.cpu(), e.cpu(), **TOLERANCE[torch.float32])


def test_bad_shapes_raise_an_actionable_error():
    query, key, value, _ = inputs("gqa", torch.float32, "tpu")
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        flash_attention(query, key[:, :1].expand(-1, 3, -1, -1), value[:, :1].expand(-1, 3, -1, -1))
    with pytest.raises(ValueError, match="does not broadcast"):
        flash_attention(query, key, value, torch.ones(2, 1, 7, 6, dtype=torch.bool, device="tpu"))


def test_mask_requiring_grad_is_refused():
    query, key, value, _ = inputs("additive_mask", torch.float32, "cpu", requires_grad=True)
    bias = torch.zeros(2, 2, 5, 7, requires_grad=True)
    with pytest.raises(NotImplementedError, match="no gradient to attn_mask"):
        flash_attention(query, key, value, bias)


@pytest.mark.parametrize("k_len", [8, 2 * KV_BLOCK], ids=["one_block", "blocks"])
def test_low_precision_probabilities_meet_the_values_in_their_dtype(k_len):
    """The scan's probability-value product takes bfloat16 operands for bfloat16 values (as PyTorch's CPU flash
    attention and splash do), not a float32 product at "highest" precision, which XLA on a TPU computes in
    several bfloat16 passes: more program to compile and more time to run."""
    from hf_tpu import direct

    query = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16).to("tpu")
    key, value = (torch.randn(1, 2, k_len, 16, dtype=torch.bfloat16).to("tpu") for _ in range(2))

    def attend(query, key, value):
        return flash_attention(query, key, value, is_causal=True)

    text = direct.lower(attend, (query, key, value), {}).as_text()
    operands = [re.search(r": \((.*)\) ->", line).group(1) for line in text.splitlines()
                if "stablehlo.dot_general" in line]
    assert len(operands) == 2 and all("f32" not in types for types in operands), operands
