"""Transformers models on tpu with attn_implementation="tpu" (hf_tpu.flash_attention) and MoE experts
through grouped_mm, against the same checkpoints on cpu."""

import pytest
import torch
import torch._dynamo.utils
from torch.utils._python_dispatch import TorchDispatchMode

import hf_tpu
import hf_tpu.constant_masks
from hf_tpu.integrations import attention

PROMPTS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [0, 0, 0, 26, 43, 38, 32, 79, 50, 28]])
PADDING = (PROMPTS != 0).long()  # the second prompt is left-padded


def tiny_config(model_type):
    from transformers import AutoConfig

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64, pad_token_id=0,
                  initializer_range=0.3)  # large enough weights that scores reach the soft-cap
    extra = {
        "llama": {},
        # windows shorter than the prompts, so they bind; Gemma 2 alternates sliding and global layers
        "gemma2": dict(sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                       query_pre_attn_scalar=16),
        "mistral": dict(sliding_window=4),
    }[model_type]
    return AutoConfig.for_model(model_type, **common, **extra)


def save_tiny(model_type, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(f"tiny-{model_type}")
    AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["llama", "gemma2", "mistral"])
def checkpoint(request, tmp_path_factory):
    return save_tiny(request.param, tmp_path_factory)


def load_pair(path):
    from transformers import AutoModelForCausalLM

    attention.register()
    cpu = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    tpu = AutoModelForCausalLM.from_pretrained(path, device_map="tpu", attn_implementation="tpu")
    assert tpu.config._attn_implementation == "tpu"
    return cpu, tpu


class CountFlashAttention(TorchDispatchMode):
    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # the op, or the form of it a call that records a gradient runs (parameters that require one)
        self.calls += func in (torch.ops.hf_tpu.flash_attention.default,
                               torch.ops.hf_tpu.flash_attention_with_logsumexp.default)
        return func(*args, **(kwargs or {}))


def test_padded_batch_logits_match_cpu_eager(checkpoint):
    cpu, tpu = load_pair(checkpoint)
    expected = cpu(PROMPTS, attention_mask=PADDING).logits
    with CountFlashAttention() as counter:
        actual = tpu(PROMPTS.to("tpu"), attention_mask=PADDING.to("tpu")).logits
    assert counter.calls == tpu.config.num_hidden_layers
    real = PADDING.bool()  # padded positions attend to nothing real; their logits are not compared
    torch.testing.assert_close(actual.cpu()[real], expected[real], atol=1e-4, rtol=1e-4)
    assert hf_tpu.metrics()["cpu_fallbacks"] == {}


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_compiled_forward_attends_without_a_materialised_mask(model_type, tmp_path_factory, monkeypatch):
    """Under torch.compile through Dynamo, a forward without a cache builds Transformers' causal (or
    sliding-window) mask in the graph from constants; the compiled graph runs attention on the pattern instead,
    with CPU's logits."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_TPU_COMPILE_DIRECT", "0")
    path = save_tiny(model_type, tmp_path_factory)
    graphs = []
    recognise = hf_tpu.constant_masks.recognise_constant_masks
    monkeypatch.setattr(hf_tpu.constant_masks, "recognise_constant_masks", lambda gm: graphs.append(gm) or recognise(gm))
    cpu = AutoModelForCausalLM.from_pretrained(path)
    tpu = AutoModelForCausalLM.from_pretrained(path, device_map="tpu")
    expected = cpu(PROMPTS, use_cache=False).logits
    # Transformers' forward wrappers are shared by every model class: after the 8 graphs (Dynamo's recompile
    # limit) that tests before this one compiled in the same process, Dynamo would run this forward eagerly
    torch._dynamo.reset()
    with torch.no_grad():
        actual = torch.compile(tpu, backend="tpu", dynamic=False)(PROMPTS.to("tpu"), use_cache=False).logits
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)
    calls = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.hf_tpu.flash_attention.default]
    assert len(calls) == tpu.config.num_hidden_layers
    for call in calls:  # (query, key, value, attn_mask, scale, is_causal, sliding_window)
        assert call.args[3] is None and call.args[5] is True
        assert call.args[6] == (4 if model_type == "mistral" else 0)


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_a_forward_traced_directly_attends_without_a_materialised_mask(model_type, tmp_path_factory, monkeypatch):
    """The same forward traced straight from Python (`torch.compile` of the module, through `hf_tpu.jit`): the mask
    Transformers builds from constants is known on the host while tracing (`constant_masks.KnownValues`), and the
    attention runs on its pattern, with CPU's logits."""
    from transformers import AutoModelForCausalLM

    path = save_tiny(model_type, tmp_path_factory)
    patterns = []
    on_pattern = hf_tpu.constant_masks.KnownValues._attention_on_pattern

    def noted(self, *args):
        rewritten = on_pattern(self, *args)
        patterns.append(None if rewritten is None else (rewritten[2]["is_causal"], rewritten[2].get("sliding_window")))
        return rewritten

    monkeypatch.setattr(hf_tpu.constant_masks.KnownValues, "_attention_on_pattern", noted)
    cpu = AutoModelForCausalLM.from_pretrained(path)
    tpu = AutoModelForCausalLM.from_pretrained(path, device_map="tpu")
    expected = cpu(PROMPTS, use_cache=False).logits
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        actual = torch.compile(tpu, backend="tpu")(PROMPTS.to("tpu"), use_cache=False).logits
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)
    assert not torch._dynamo.utils.counters["frames"]
    assert patterns == [(True, 4 if model_type == "mistral" else None)] * tpu.config.num_hidden_layers


def assert_generates_cpu_tokens(checkpoint, mode):
    cpu, tpu = load_pair(checkpoint)
    expected = cpu.generate(PROMPTS, attention_mask=PADDING, max_new_tokens=4, do_sample=False)
    with torch.tpu.use_eager_mode(mode):
        actual = tpu.generate(PROMPTS.to("tpu"), attention_mask=PADDING.to("tpu"), max_new_tokens=4,
                              do_sample=False)
    assert torch.equal(actual.cpu(), expected)


def test_greedy_generation_matches_cpu_eager(checkpoint):
    assert_generates_cpu_tokens(checkpoint, "DEFER_NEVER")


def test_greedy_generation_in_deferred_mode(tmp_path_factory):
    """Gemma 2 uses every option of the op (grouped heads, soft-cap, sliding-window masks)."""
    assert_generates_cpu_tokens(save_tiny("gemma2", tmp_path_factory), "DEFER_AND_FUSE")


def test_register_is_idempotent():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    attention.register()
    attention.register()
    assert AttentionInterface._global_mapping["tpu"] is attention.tpu_attention_forward
    assert "tpu" in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


# --- Mixture of experts: transformers' grouped_mm experts on tpu.


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                           max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-mixtral")
    MixtralForCausalLM(config).save_pretrained(path)
    return path


def moe_logits(path, dtype):
    from transformers import AutoModelForCausalLM

    cpu = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tpu = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map="tpu")
    assert tpu.config._experts_implementation == "grouped_mm"
    hf_tpu.reset_metrics()
    actual = tpu(PROMPTS[:1].to("tpu")).logits
    assert hf_tpu.metrics()["cpu_fallbacks"] == {}
    return actual.cpu().float(), cpu(PROMPTS[:1]).logits.float()


def test_moe_grouped_mm_logits_match_cpu_bfloat16(moe_checkpoint):
    actual, expected = moe_logits(moe_checkpoint, torch.bfloat16)
    torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)


def test_moe_grouped_mm_logits_match_cpu_float32(moe_checkpoint):
    actual, expected = moe_logits(moe_checkpoint, torch.float32)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
