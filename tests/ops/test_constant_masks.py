"""Attention masks a compiled graph computes from constants: recognised as the causal, sliding-window or
all-visible pattern they spell, and left alone otherwise, without changing any result."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.operator_schemas import normalize_function

import hf_tpu
import hf_tpu.constant_masks
import hf_tpu.direct
from hf_tpu.constant_masks import recognise_constant_masks
from tests.util import assert_same, to_cpu

LENGTH = 6


def causal_bool(device):
    return torch.ones(LENGTH, LENGTH, dtype=torch.bool, device=device).tril()


def causal_additive(device):
    return torch.full((LENGTH, LENGTH), -torch.inf, device=device).triu(1)


def causal_lowest(device):
    """As Transformers' eager masks write it: the dtype's lowest value, expanded over the batch."""
    hidden = torch.ones(LENGTH, LENGTH, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(LENGTH, LENGTH, device=device).masked_fill(hidden, torch.finfo(torch.float32).min).expand(2, 1, -1, -1)


def all_visible(device):
    return torch.ones(2, 1, 1, LENGTH, dtype=torch.bool, device=device)


def sliding_window_of_3(device):
    position = torch.arange(LENGTH, device=device)
    distance = position[:, None] - position[None, :]
    return (distance >= 0) & (distance < 3)


def banded_not_causal(device):
    position = torch.arange(LENGTH, device=device)
    return (position[:, None] - position[None, :]).abs() < 2


def half_scale(device):
    """Not a mask of visible and hidden keys: an additive bias, kept."""
    return torch.full((LENGTH, LENGTH), -0.5, device=device)


def attention_with(make_mask, grouped=False):
    """SDPA (its fused op), or hf_tpu's grouped op, which SDPA calls on tpu with `enable_gqa`."""
    def attend(q, k, v):
        if grouped:
            return torch.ops.hf_tpu.flash_attention(q, k, v, make_mask(q.device))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=make_mask(q.device))
    return attend


def qkv(query_heads=2, kv_heads=2):
    torch.manual_seed(0)
    return (torch.randn(2, query_heads, LENGTH, 8), torch.randn(2, kv_heads, LENGTH, 8),
            torch.randn(2, kv_heads, LENGTH, 8))


def attention_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "attention" in str(n.target)]


# mask factory, and the attention call's arguments once it is recognised (None: it is not)
CASES = {
    "causal_bool": (causal_bool, {"attn_mask": None, "is_causal": True}),
    "causal_additive": (causal_additive, {"attn_mask": None, "is_causal": True}),
    "causal_lowest": (causal_lowest, {"attn_mask": None, "is_causal": True}),
    "all_visible": (all_visible, {"attn_mask": None, "is_causal": False}),
    "sliding_window": (sliding_window_of_3, {"attn_mask": None, "is_causal": True, "sliding_window": 3}),
    "banded": (banded_not_causal, None),
    "bias": (half_scale, None),
}


@pytest.mark.parametrize("grouped", [False, True], ids=["fused", "grouped"])
@pytest.mark.parametrize("case", CASES)
def test_a_constant_mask_becomes_its_pattern_and_the_result_stays(case, grouped):
    make_mask, rewritten = CASES[case]
    q, k, v = qkv(4 if grouped else 2, 2)
    expected = attention_with(make_mask, grouped)(q, k, v)
    gm = make_fx(attention_with(make_mask, grouped))(q, k, v)
    # SDPA's fused op takes no window: a sliding-window mask stays a mask there
    recognised = rewritten is not None and (grouped or "sliding_window" not in rewritten)
    assert recognise_constant_masks(gm) == int(recognised)
    call, = attention_calls(gm)
    arguments = normalize_function(call.target, call.args, call.kwargs, normalize_to_only_use_kwargs=True).kwargs
    if recognised:
        assert {name: arguments[name] for name in rewritten} == rewritten
        # the mask's computation is gone from the graph
        assert not any(n.target in (torch.ops.aten.tril.default, torch.ops.aten.triu.default) for n in gm.graph.nodes)
    else:
        assert isinstance(arguments["attn_mask"], torch.fx.Node)
    assert_same(gm(q, k, v), expected)


def test_a_mask_made_from_an_input_is_left_alone():
    def attend(q, k, v, lengths):
        visible = torch.arange(LENGTH)[None, :] < lengths[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :])

    q, k, v = qkv()
    gm = make_fx(attend)(q, k, v, torch.tensor([LENGTH, LENGTH]))
    assert recognise_constant_masks(gm) == 0


def test_a_mask_of_random_values_is_left_alone():
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.rand(LENGTH, LENGTH) >= 0)

    gm = make_fx(attend)(*qkv())
    assert recognise_constant_masks(gm) == 0


def test_compiled_attention_with_a_causal_mask_built_in_the_graph(monkeypatch):
    """On tpu, through torch.compile: the forward and backward graphs run unmasked causal attention and
    give CPU's values and gradients."""
    rewrites = []
    recognise = hf_tpu.constant_masks.recognise_constant_masks
    monkeypatch.setattr(hf_tpu.constant_masks, "recognise_constant_masks",
                        lambda gm: rewrites.append(recognise(gm)) or rewrites[-1])
    q, k, v = (t.requires_grad_() for t in qkv())
    expected = attention_with(causal_bool)(q, k, v)
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    tq, tk, tv = (t.detach().to("tpu").requires_grad_() for t in (q, k, v))
    out = torch.compile(attention_with(causal_bool), backend="tpu", fullgraph=True)(tq, tk, tv)
    grads = torch.autograd.grad(out.square().sum(), (tq, tk, tv))
    assert rewrites[0] == 1  # the forward graph's mask
    assert_same((to_cpu(out), *map(to_cpu, grads)), (expected, *expected_grads))


def test_under_dynamic_shapes_the_mask_is_recognised_for_each_length(monkeypatch):
    """A graph traced with symbolic lengths computes its mask from a size input: each call's sizes make it a
    constant, and the graph traced for them attends without it."""
    specialized = []
    with_sizes = hf_tpu.constant_masks.with_sizes
    monkeypatch.setattr(hf_tpu.constant_masks, "with_sizes",
                        lambda gm, sizes: specialized.append(with_sizes(gm, sizes)) or specialized[-1])

    def attend(q, k, v):
        length = q.shape[-2]
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    compiled = torch.compile(attend, backend="tpu", dynamic=True, fullgraph=True)
    for length in (5, 7):
        torch.manual_seed(length)
        q, k, v = (torch.randn(2, 2, length, 8) for _ in range(3))
        assert_same(compiled(*(t.to("tpu") for t in (q, k, v))), attend(q, k, v))
    assert len(specialized) == 2 and all(gm is not None for gm in specialized)
    for gm in specialized:
        call, = attention_calls(gm)
        assert call.kwargs.get("attn_mask") is None and call.args[4] is True  # (q, k, v, dropout_p, is_causal)


# --- in a function traced directly (`hf_tpu.jit`): masks known on the host while tracing


@pytest.fixture
def traced_patterns(monkeypatch):
    """The pattern each attention call of a direct trace ran on (None: its mask), noted as the trace makes it."""
    patterns = []
    on_pattern = hf_tpu.constant_masks.KnownValues._attention_on_pattern

    def noted(self, *args):
        rewritten = on_pattern(self, *args)
        patterns.append(None if rewritten is None else
                        {name: rewritten[2][name] for name in ("attn_mask", "is_causal", "sliding_window")
                         if name in rewritten[2]})
        return rewritten

    monkeypatch.setattr(hf_tpu.constant_masks.KnownValues, "_attention_on_pattern", noted)
    hf_tpu.direct.reset()
    return patterns


@pytest.mark.parametrize("grouped", [False, True], ids=["sdpa", "grouped"])
@pytest.mark.parametrize("case", CASES)
def test_in_a_direct_trace_a_constant_mask_becomes_its_pattern(case, grouped, traced_patterns):
    make_mask, rewritten = CASES[case]
    q, k, v = qkv(4 if grouped else 2, 2)
    attend = attention_with(make_mask, grouped)
    expected = attend(q, k, v)
    out = hf_tpu.jit(attend)(q.to("tpu"), k.to("tpu"), v.to("tpu"))
    # SDPA on a sliding window runs hf_tpu's op, which takes one
    assert traced_patterns == [rewritten]
    assert_same(to_cpu(out), expected)


def test_in_a_direct_trace_a_mask_written_or_made_from_an_input_is_left_alone(traced_patterns):
    def attend(q, k, v, lengths):
        written = causal_bool(q.device)
        written[-1, 0] = True  # written after it was made: not causal any more
        first = F.scaled_dot_product_attention(q, k, v, attn_mask=written)
        visible = torch.arange(LENGTH, device=q.device)[None, :] < lengths[:, None]
        return first + F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :])

    q, k, v = qkv()
    lengths = torch.tensor([LENGTH, LENGTH - 2])
    out = hf_tpu.jit(attend)(q.to("tpu"), k.to("tpu"), v.to("tpu"), lengths.to("tpu"))
    assert traced_patterns == [None, None]
    assert_same(to_cpu(out), attend(q, k, v, lengths))


def test_in_a_direct_trace_under_inference_mode_masks_are_left_alone(traced_patterns):
    """An inference tensor keeps no version counter, so a write to it would not show: its value is not kept."""
    q, k, v = qkv()
    with torch.inference_mode():
        out = hf_tpu.jit(attention_with(causal_bool))(q.to("tpu"), k.to("tpu"), v.to("tpu"))
    assert traced_patterns == [None]
    assert_same(to_cpu(out), attention_with(causal_bool)(q, k, v))
