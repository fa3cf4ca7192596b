"""Transformers' own generation tests that failed on `tpu` and passed on the CPU, restated here on tiny models built
from a config (as Transformers' model testers build them), so that CI runs them without Transformers' test tree
(its wheel ships no tests; docs/conformance.md runs the whole suite by hand): `GenerationTesterMixin`'s
`test_static_cache_no_recompile_with_smaller_length` for the decoder models that compile their whole forward.
Each compares the tpu's tokens with the CPU's."""

import pytest
import torch

import hf_tpu


def _decoder_configs():
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=99, max_position_embeddings=512, pad_token_id=0,
                  eos_token_id=None)
    experts = dict(num_experts_per_tok=2)
    return {
        "llama": lambda: LlamaConfig(**common),
        "qwen2": lambda: Qwen2Config(**common),
        "qwen3": lambda: Qwen3Config(head_dim=8, **common),
        "qwen3_moe": lambda: Qwen3MoeConfig(head_dim=8, num_experts=4, moe_intermediate_size=16, **experts, **common),
        "mixtral": lambda: MixtralConfig(num_local_experts=4, **experts, **common),
    }


@pytest.mark.parametrize("architecture", list(_decoder_configs()))
def test_an_explicit_compile_config_decodes_through_transformers_compiled_call_and_a_shorter_call_compiles_nothing(
        architecture):
    """`generate(compile_config=CompileConfig(), cache_implementation="static")` asks for Transformers' compiled
    decode steps: afterwards the model holds them as `_compiled_call`, as Transformers promises, and a second call
    asking for fewer tokens reuses the first call's static cache length and compiles nothing (no Dynamo capture,
    no XLA program). The prompt has a masked position, as the mixin's random masks do."""
    from transformers import AutoModelForCausalLM, CompileConfig

    torch.manual_seed(0)
    cpu = AutoModelForCausalLM.from_config(_decoder_configs()[architecture]()).eval()
    tpu = AutoModelForCausalLM.from_config(cpu.config).eval()
    tpu.load_state_dict(cpu.state_dict())
    tpu.to("tpu")
    ids = torch.randint(3, 99, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, 2] = 0
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # as the mixin sets it, so that the CPU would compile too
    kwargs = dict(do_sample=False, use_cache=True, compile_config=compile_config, cache_implementation="static")
    torch.compiler.reset()
    first = tpu.generate(ids.to("tpu"), attention_mask=mask.to("tpu"), max_new_tokens=5, **kwargs)
    assert hasattr(tpu, "_compiled_call")
    hf_tpu.reset_metrics()
    second = tpu.generate(ids.to("tpu"), attention_mask=mask.to("tpu"), max_new_tokens=2, **kwargs)
    assert hf_tpu.metrics()["compiles"] == 0
    assert hasattr(tpu, "_compiled_call")
    expected = cpu.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(first.cpu(), expected)
    assert torch.equal(second.cpu(), expected[:, :ids.shape[1] + 2])

