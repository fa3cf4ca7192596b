"""Transformers' own generation tests that failed on `tpu` and passed on the CPU, restated here on tiny models built
from a config (as Transformers' model testers build them), so that CI runs them without Transformers' test tree
(its wheel ships no tests; docs/conformance.md runs the whole suite by hand): `GenerationTesterMixin`'s
`test_static_cache_no_recompile_with_smaller_length` for the decoder models that compile their whole forward, and
Whisper's `test_generate_continue_from_past_key_values` and `test_longform_generate_multi_batch_cond_prev`.
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


# --- Whisper, as Transformers' `WhisperModelTester` builds it: 2 layers, width 16, 30 encoder positions (60 feature
# frames a window), 40 decoder positions, a vocabulary of 200 whose last 20 tokens are timestamps here

_WHISPER_TIMESTAMPS = 20


@pytest.fixture(scope="module")
def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=200, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=16, decoder_ffn_dim=16, num_mel_bins=80,
                           max_source_positions=30, max_target_positions=40, bos_token_id=98, eos_token_id=98,
                           pad_token_id=0, decoder_start_token_id=85, init_std=0.5)
    torch.manual_seed(0)
    cpu = WhisperForConditionalGeneration(config).eval()
    tpu = WhisperForConditionalGeneration(config).eval()
    tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu.to("tpu")


def _on(device, value):
    return {k: _on(device, v) for k, v in value.items()} if isinstance(value, dict) else (
        value.to(device) if isinstance(value, torch.Tensor) else value)


def test_whisper_continues_from_the_cache_generate_returned_as_on_cpu(whisper):
    """Three tokens, then one more from the returned cache and the longer decoder ids, give the four tokens of one
    call and the cache the CPU holds (`test_generate_continue_from_past_key_values`). The returned cache counts
    the tokens it holds: the adapter's static cache, returned through Whisper's own `generate()` (which rebuilds
    it from each layer's tensors), held 128 positions, and the continuation fed none."""
    torch.manual_seed(1)
    inputs = dict(input_features=torch.randn(3, 80, 60), decoder_input_ids=torch.full((3, 1), 85))
    kwargs = dict(eos_token_id=-1, do_sample=False, use_cache=True, return_dict_in_generate=True, output_scores=True)
    results = {}
    for device, model in zip(("cpu", "tpu"), whisper):
        at_once = model.generate(**_on(device, inputs), max_new_tokens=4, **kwargs)
        first = model.generate(**_on(device, inputs), max_new_tokens=3, **kwargs)
        assert first.cache.get_seq_length() == 3
        continued = model.generate(**_on(device, dict(inputs, decoder_input_ids=first.sequences)), cache=first.cache,
                                   max_new_tokens=1, **kwargs)
        assert torch.equal(continued.sequences.cpu(), at_once.sequences.cpu())
        torch.testing.assert_close(continued.scores[0].cpu(), at_once.scores[3].cpu(), rtol=1e-5, atol=1e-5)
        results[device] = continued
    assert torch.equal(results["tpu"].sequences.cpu(), results["cpu"].sequences)
    assert len(set(results["cpu"].sequences[:, 1:].flatten().tolist())) > 1  # tokens that tell a wrong cache apart
    for name in ("self_attention_cache", "cross_attention_cache"):
        layers = (getattr(results[device].cache, name).layers for device in ("cpu", "tpu"))
        for on_cpu, on_tpu in zip(*layers):
            torch.testing.assert_close(on_tpu.keys.cpu(), on_cpu.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(on_tpu.values.cpu(), on_cpu.values, rtol=1e-5, atol=1e-5)


class _SegmentedTimestamps:
    """A logits processor that gives a random Whisper the timestamp structure of speech: a window's first segment
    opens with the first timestamp; each segment holds up to `text` tokens the model picks (timestamps hidden),
    fewer where the decoder's ids (prompt included) reach `longest`, and closes with a pair of equal timestamps
    `jump` steps above its opening one, where Whisper's long-form `generate()` cuts it. Row by row, from the ids
    Whisper gives it, so a row gets the same tokens in any batch: what it sees of the prompt is its length."""

    def __init__(self, vocab_size: int, text: int = 5, longest: int = 22, jump: int = _WHISPER_TIMESTAMPS - 1):
        self.first_timestamp, self.last_token = vocab_size - _WHISPER_TIMESTAMPS, vocab_size - 1
        self.text, self.longest, self.jump, self.begin_index = text, longest, jump, 0

    def set_begin_index(self, begin_index: int):
        self.begin_index = begin_index

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.begin_index:].tolist()):
            stamps = [i for i, token in enumerate(ids) if token >= self.first_timestamp]
            if not stamps:
                forced = self.first_timestamp
            elif stamps[-1] == len(ids) - 1 and len(stamps) > 1 and stamps[-2] < len(ids) - 2:
                forced = ids[-1]  # the second of the closing pair
            elif len(ids) - 1 - stamps[-1] >= self.text or (
                    input_ids.shape[-1] >= self.longest and stamps[-1] < len(ids) - 1):
                forced = min(ids[stamps[-1]] + self.jump, self.last_token)
            else:
                scores[row, self.first_timestamp:] = -float("inf")
                continue
            scores[row] = -float("inf")
            scores[row, forced] = 0.0
        return scores


def _long_form(model, device, features, **kwargs):
    from transformers import LogitsProcessorList

    config = model.generation_config
    first_timestamp = model.config.vocab_size - _WHISPER_TIMESTAMPS
    config.no_timestamps_token_id = first_timestamp - 1
    config.prev_sot_token_id = first_timestamp - 3
    config.max_initial_timestamp_index = 0
    config.eos_token_id = model.config.eos_token_id = None
    processor = _SegmentedTimestamps(model.config.vocab_size, text=5)
    return model.generate(features.to(device), logits_processor=LogitsProcessorList([processor]),
                          return_segments=True, max_new_tokens=12, **_on(device, kwargs))


def _long_features(batch: int):
    torch.manual_seed(2)
    features = torch.randn(batch, 80, 60)
    return torch.cat([features, features[:, :, :30]], dim=-1)  # 90 frames: a window and a half


def test_whisper_long_form_batch_conditioned_on_previous_text_gives_the_cpu_tokens_and_segments(whisper):
    """Long-form transcription of two rows of different lengths (a mask ends the first at frame 70), with
    timestamps, each window conditioned on the previous segments' text (`test_longform_generate_multi_batch_cond_prev`)
    and each segment generated twice through the temperature fallback (a log-probability threshold no segment
    meets; greedy at both temperatures, so that the tokens can be compared): the tpu gives the CPU's tokens and
    segments. Each window's prompt is the text before it, left-padded to the batch's longest; with the adapter's
    static cache visible as `cache_implementation="static"`, Whisper padded it to a fixed length instead, and a
    processor reading the ids' length saw other ids than on the CPU."""
    features = _long_features(2)
    mask = torch.ones(2, features.shape[-1])
    mask[0, 70:] = 0
    kwargs = dict(attention_mask=mask, condition_on_prev_tokens=True, return_timestamps=True, temperature=(0.0, 0.0),
                  logprob_threshold=0.0)
    expected, actual = (_long_form(model, device, features, **kwargs) for device, model in zip(("cpu", "tpu"), whisper))
    assert torch.equal(actual["sequences"].cpu(), expected["sequences"])
    for row in range(2):
        assert len(expected["segments"][row]) >= 2  # a window conditioned on the text before it
        assert [(s["start"].item(), s["end"].item(), s["tokens"].tolist()) for s in actual["segments"][row]] == \
            [(s["start"].item(), s["end"].item(), s["tokens"].tolist()) for s in expected["segments"][row]]
