"""generate() on tpu against the same model on CPU: strategies, the static cache that tpu uses by default,
compiled decoding that compiles nothing on a second call, prompt-length buckets, and activation of the
adapter on `import hf_tpu` in either import order."""

import copy
import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

import hf_tpu
from hf_tpu.integrations import transformers as adapter

PROMPT = torch.tensor([[3, 14, 15, 92, 65]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint), AutoModelForCausalLM.from_pretrained(checkpoint, device_map="tpu")


def _both(models, prompt=PROMPT, **kwargs):
    cpu, tpu = models
    expected = cpu.generate(prompt, **kwargs)
    actual = tpu.generate(prompt.to("tpu"), **kwargs)
    return expected, actual.cpu()


@pytest.mark.parametrize("kwargs", [
    dict(do_sample=False),
    dict(do_sample=False, repetition_penalty=1.5),
    dict(do_sample=False, num_beams=3),
    dict(do_sample=False, num_beams=2, num_return_sequences=2),
], ids=["greedy", "repetition_penalty", "beam_search", "beams_returned"])
def test_strategies_generate_the_cpu_tokens(models, kwargs):
    expected, actual = _both(models, max_new_tokens=8, **kwargs)
    assert torch.equal(actual, expected)


def test_left_padded_batch_generates_the_cpu_tokens(models):
    prompt = torch.tensor([[0, 0, 7, 8, 9], [3, 14, 15, 92, 65]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    cpu, tpu = models
    expected = cpu.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False)
    actual = tpu.generate(prompt.to("tpu"), attention_mask=mask.to("tpu"), max_new_tokens=6, do_sample=False)
    assert torch.equal(actual.cpu(), expected)


@pytest.mark.parametrize("kwargs", [dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8, temperature=1.3)],
                         ids=["temperature", "top_k", "top_p"])
def test_sampling_with_a_seed_is_deterministic(models, kwargs):
    _, tpu = models
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        runs.append(tpu.generate(PROMPT.to("tpu"), max_new_tokens=8, do_sample=True, **kwargs).cpu())
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape[1] <= PROMPT.shape[1] + 8 and torch.equal(runs[0][:, :5], PROMPT)
    torch.manual_seed(4321)
    other = tpu.generate(PROMPT.to("tpu"), max_new_tokens=8, do_sample=True, temperature=5.0).cpu()
    assert not torch.equal(other, runs[0])  # the seed matters


def _char_tokenizer():
    """128 tokens: single characters (what stop-string matching needs to spell its probe prefix) and
    longer pieces, decoded by concatenation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = list("abcdefghijklmnopqrstuvwxyz0123456789")
    pieces += [f"<{i}>" for i in range(128 - len(pieces))]
    tokenizer = Tokenizer(models.BPE({piece: i for i, piece in enumerate(pieces)}, [], unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="a")


def test_stop_strings_stop_where_cpu_stops(models):
    cpu, _ = models
    tokenizer = _char_tokenizer()
    free = cpu.generate(PROMPT, max_new_tokens=10, do_sample=False)
    stop = tokenizer.decode(free[0, 7:8])  # the third generated word
    expected, actual = _both(models, max_new_tokens=10, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(actual, expected)
    assert actual.shape[1] <= 8


def _static_caches_made(monkeypatch) -> list:
    """The `StaticCache`s made from now on, in order (the one `generate()` decodes with, where it returns another)."""
    from transformers import StaticCache

    made, init = [], StaticCache.__init__
    monkeypatch.setattr(StaticCache, "__init__", lambda self, *a, **k: made.append(self) or init(self, *a, **k))
    return made


def test_static_cache_by_default_and_no_compiles_on_a_second_call(models, monkeypatch):
    """The static cache the adapter decodes with is its own: a result that holds the cache holds Transformers'
    default, a `DynamicCache` of the tokens cached (`test_a_returned_cache_is_transformers_default_...`)."""
    from transformers import DynamicCache

    cpu, tpu = models
    made = _static_caches_made(monkeypatch)
    out = tpu.generate(PROMPT.to("tpu"), max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert len(made) == 1 and made[0].layers[0].max_cache_len % adapter.settings.cache_length_multiple == 0
    assert isinstance(out.cache, DynamicCache)
    hf_tpu.reset_metrics()
    again = tpu.generate(PROMPT.to("tpu"), max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert hf_tpu.metrics()["compiles"] == 0
    assert torch.equal(again.sequences.cpu(), out.sequences.cpu())
    assert torch.equal(out.sequences.cpu(), cpu.generate(PROMPT, max_new_tokens=8, do_sample=False))


def test_one_new_token_shares_the_prefill_of_longer_calls(checkpoint, monkeypatch):
    """A prompt of a bucket length asking for one token gets the static cache (and the prefill program) of
    calls asking for a few more, so a first one-token call leaves nothing to compile for them but decoding.
    (A fresh model: Transformers reuses a model's earlier cache where it is long enough.)"""
    from transformers import AutoModelForCausalLM

    tpu = AutoModelForCausalLM.from_pretrained(checkpoint, device_map="tpu")
    monkeypatch.setattr(adapter.settings, "cache_length_multiple", 16)
    length = adapter.settings.prompt_buckets[0]
    prompt = torch.randint(3, 128, (1, length)).to("tpu")
    made = _static_caches_made(monkeypatch)
    one = tpu.generate(prompt, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    six = tpu.generate(prompt, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    assert [cache.layers[0].max_cache_len for cache in made] == [-(-(length + 1) // 16) * 16] * 2
    assert torch.equal(six.sequences[:, :length + 1].cpu(), one.sequences.cpu())


def test_sliding_window_models_keep_the_dynamic_cache(tmp_path):
    """A static sliding-window layer counts its length in a Python int that Dynamo guards on: the compiled
    step would recompile for every token up to Dynamo's limit. Such a model keeps Transformers' dynamic
    cache and decodes eagerly, with CPU's tokens and no torch.compile graph."""
    from transformers import AutoModelForCausalLM, DynamicCache, MistralConfig

    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, sliding_window=8)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    cpu = AutoModelForCausalLM.from_pretrained(tmp_path)
    tpu = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu")
    prompt = torch.randint(3, 128, (1, 12))
    hf_tpu.reset_metrics()
    out = tpu.generate(prompt.to("tpu"), max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.cache, DynamicCache)
    assert hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0) == 0
    assert torch.equal(out.sequences.cpu(), cpu.generate(prompt, max_new_tokens=12, do_sample=False))


def test_the_sliding_layer_check_kept_per_config_fields_answers_as_transformers_derives_it():
    """The adapter's check runs at every generate(); its answer is kept per type, layer count and the fields
    Transformers derives the layer types from, and a heterogeneous config (whose layers have fields of their own)
    is asked every time. Each answer equals the one from Transformers' own layer types, also after a field changes."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig
    from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING, StaticSlidingWindowLayer, get_layer_types_and_kwargs

    from hf_tpu.integrations.transformers.cache import _static_cache_has_sliding_layers

    def transformers_says(config):
        kinds, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        return any(issubclass(STATIC_LAYER_TYPE_MAPPING.get(kind, object), StaticSlidingWindowLayer) for kind in kinds)

    mistral = MistralConfig(num_hidden_layers=4, sliding_window=8)
    configs = [LlamaConfig(num_hidden_layers=4), mistral, MistralConfig(num_hidden_layers=4, sliding_window=None),
               Gemma2Config(num_hidden_layers=4),
               MistralConfig(num_hidden_layers=4, sliding_window=None, per_layer_config={1: {"sliding_window": 8}})]
    answers = [(_static_cache_has_sliding_layers(c), _static_cache_has_sliding_layers(c), transformers_says(c))
               for c in configs]
    assert answers == [(False, False, False), (True, True, True), (False, False, False), (True, True, True),
                       (True, True, True)]
    mistral.sliding_window = None
    assert _static_cache_has_sliding_layers(mistral) is transformers_says(mistral) is False


def test_a_new_prompt_in_the_same_bucket_compiles_nothing(models):
    _, tpu = models
    for _ in range(2):  # the second call takes the static cache the first one kept
        tpu.generate(PROMPT.to("tpu"), max_new_tokens=4, do_sample=False)
    hf_tpu.reset_metrics()
    tpu.generate(torch.tensor([[5, 6, 7]]).to("tpu"), max_new_tokens=12, do_sample=False)
    # the decode steps reuse the compiled forward: a different prompt in the same bucket compiles nothing
    assert hf_tpu.metrics()["compiles"] == 0


def _a_token_generated_at(models, prompt, step: int) -> int:
    cpu, _ = models
    free = cpu.generate(prompt, max_new_tokens=step + 1, do_sample=False, eos_token_id=None)
    return int(free[0, prompt.shape[1] + step])


@pytest.mark.parametrize("rows", [1, 2], ids=["all rows stop early", "one row pads after its end"])
def test_end_of_sequence_inside_the_device_loop_stops_where_cpu_stops(models, rows):
    prompt = torch.tensor([[3, 14, 15, 92, 65], [7, 8, 9, 10, 11]])[:rows]
    eos = _a_token_generated_at(models, prompt, step=3)
    expected, actual = _both(models, prompt, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(actual, expected)
    if rows == 1:
        assert actual.shape[1] == prompt.shape[1] + 4


@pytest.mark.parametrize("minimum", ["min_new_tokens", "min_length"])
def test_a_minimum_length_hides_end_of_sequence_inside_the_device_loop(models, minimum, caplog):
    """The end-of-sequence token comes at step 4 unhindered; with a minimum of 6 new tokens CPU decodes on
    and stops later. The loop applies the minimum from its step count, and stays one device loop traced
    without Dynamo (the processor's own end-of-sequence ids are on the CPU, and the loop does not read them)."""
    _, tpu = models
    eos = _a_token_generated_at(models, PROMPT, step=4)
    bound = {"min_new_tokens": 6, "min_length": PROMPT.shape[1] + 6}[minimum]
    common = dict(max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected, actual = _both(models, **common, **{minimum: bound})
    assert torch.equal(actual, expected)
    assert expected.shape[1] > PROMPT.shape[1] + 6  # the minimum changed where CPU stopped
    syncs = []
    caplog.set_level(logging.WARNING, logger="hf_tpu.loops")
    for kwargs in (common, {**common, minimum: bound}):
        hf_tpu.reset_metrics()
        tpu.generate(PROMPT.to("tpu"), **kwargs)
        syncs.append(hf_tpu.metrics()["host_syncs"])
    assert syncs[0] == syncs[1]
    assert not [r.getMessage() for r in caplog.records if "with torch.compile instead" in r.getMessage()]


def test_a_forced_end_of_sequence_token_ends_the_device_loop_as_on_cpu(models):
    """`forced_eos_token_id` leaves only that token at the last step: the loop applies it from its step
    count, and stays one device loop."""
    _, tpu = models
    common = dict(max_new_tokens=9, do_sample=False, eos_token_id=None)
    expected, actual = _both(models, **common, forced_eos_token_id=77)
    assert torch.equal(actual, expected) and int(expected[0, -1]) == 77
    syncs = []
    for kwargs in (common, {**common, "forced_eos_token_id": 77}):
        hf_tpu.reset_metrics()
        tpu.generate(PROMPT.to("tpu"), **kwargs)
        syncs.append(hf_tpu.metrics()["host_syncs"])
    assert syncs[0] == syncs[1]


def test_a_model_without_position_ids_decodes_in_the_device_loop(tmp_path):
    """Bloom (ALiBi) takes no position ids: the loop feeds it none, and gives CPU's tokens."""
    from transformers import AutoModelForCausalLM, BloomConfig, BloomForCausalLM

    config = BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=128, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    torch.manual_seed(0)
    BloomForCausalLM(config).save_pretrained(tmp_path)
    models = (AutoModelForCausalLM.from_pretrained(tmp_path),
              AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu"))
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None)
    expected, actual = _both(models, **kwargs)
    assert torch.equal(actual, expected)
    syncs = []
    for device_loop in (True, False):
        adapter.configure(device_loop=device_loop)
        try:
            hf_tpu.reset_metrics()
            models[1].generate(PROMPT.to("tpu"), **kwargs)
            syncs.append(hf_tpu.metrics()["host_syncs"])
        finally:
            adapter.configure(device_loop=True)
    assert syncs[0] < syncs[1]


def test_tokens_after_the_first_cost_no_host_read_each(models):
    _, tpu = models
    syncs = []
    for new_tokens in (4, 4, 20):
        hf_tpu.reset_metrics()
        tpu.generate(PROMPT.to("tpu"), max_new_tokens=new_tokens, do_sample=False)
        syncs.append(hf_tpu.metrics()["host_syncs"])
    assert syncs[1] == syncs[2]  # a constant per call, whatever the number of tokens


def test_a_token_id_beyond_the_vocabulary_raises_cpus_error_and_the_next_call_generates(models):
    """The traced prefill looks the prompt up on the device: the id out of range is CPU's IndexError at generate's
    first read, naming the embedding, and the kept static cache and programs serve the next call."""
    cpu, tpu = models
    prompt = torch.tensor([[3, 14, cpu.config.vocab_size, 92, 65]])
    with pytest.raises(IndexError, match="index out of range in self"):
        cpu.generate(prompt, max_new_tokens=4, do_sample=False)
    with pytest.raises(IndexError, match=r"index out of range in self \(aten::embedding called at .*in forward"):
        tpu.generate(prompt.to("tpu"), max_new_tokens=4, do_sample=False)
    expected, actual = _both(models, max_new_tokens=4, do_sample=False)
    assert torch.equal(actual, expected)


def test_the_device_loop_generates_what_decoding_token_by_token_generates(models):
    _, tpu = models
    prompt = torch.tensor([[0, 0, 7, 8, 9], [3, 14, 15, 92, 65]]).to("tpu")
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]).to("tpu")
    outputs = []
    for device_loop in (True, False):
        adapter.configure(device_loop=device_loop)
        try:
            outputs.append(tpu.generate(prompt, attention_mask=mask, max_new_tokens=10, do_sample=False).cpu())
        finally:
            adapter.configure(device_loop=True)
    assert torch.equal(outputs[0], outputs[1])


def test_the_compiled_decode_call_is_made_only_when_a_decode_step_calls_it(models, monkeypatch):
    """Transformers' `_sample` asks for its compiled call before the prefill; making it is `torch.compile`,
    whose first use in a process imports Dynamo's backends. On tpu it is made at its first call: never for
    one token or with the device loop, and for token-by-token decoding at the first step, which then
    generates the CPU's tokens."""
    _, tpu = models
    made = []
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: made.append(1) or compile_(*args, **kwargs))
    tpu.__dict__.pop("_compiled_call", None)
    for max_new_tokens in (1, 6):
        _both(models, max_new_tokens=max_new_tokens, do_sample=False)
    assert not made
    adapter.configure(device_loop=False)
    try:
        expected, actual = _both(models, max_new_tokens=6, do_sample=False)
    finally:
        adapter.configure(device_loop=True)
    assert made and torch.equal(expected, actual)


def test_sampling_in_the_device_loop_applies_the_warpers(models):
    """top_k=1 leaves one token to draw: the greedy one, however the random numbers fall."""
    cpu, tpu = models
    expected = cpu.generate(PROMPT, max_new_tokens=10, do_sample=False, eos_token_id=None)
    torch.manual_seed(7)
    actual = tpu.generate(PROMPT.to("tpu"), max_new_tokens=10, do_sample=True, top_k=1, temperature=0.5,
                          eos_token_id=None)
    assert torch.equal(actual.cpu(), expected)


def test_a_cache_the_user_chose_is_kept(models):
    from transformers import DynamicCache

    expected, _ = _both(models, max_new_tokens=6, do_sample=False)
    _, tpu = models
    out = tpu.generate(PROMPT.to("tpu"), max_new_tokens=6, do_sample=False, cache_implementation="dynamic",
                       return_dict_in_generate=True)
    assert isinstance(out.cache, DynamicCache)
    assert torch.equal(out.sequences.cpu(), expected)


def test_a_warm_generate_of_one_token_costs_a_fixed_number_of_device_ops(models, monkeypatch):
    """The fixed cost of generate()'s first token on tpu, counted rather than timed, for a 2-layer model: the
    compiled prefill (which zeroes the static cache the previous call kept), the host reads of the ids and of the
    first token's logits, and the uploads of the padded ids (twice: for the prefill launched ahead, then for
    Transformers' inputs, which find the first's kept array), their mask and positions and of the result. An op
    or a transfer more per layer (Transformers' own cache allocation: 3 ops and an upload a layer) or per call
    shows here."""
    from hf_tpu.memory import host_transfers

    _, tpu = models
    prompt = PROMPT.to("tpu")
    for _ in range(2):  # compiles the prefill, then takes the kept static cache
        tpu.generate(prompt, max_new_tokens=1, do_sample=False)
    uploads = []
    from_host = host_transfers.from_host
    monkeypatch.setattr(host_transfers, "from_host", lambda *args: uploads.append(args) or from_host(*args))
    hf_tpu.reset_metrics()
    tpu.generate(prompt, max_new_tokens=1, do_sample=False)
    metrics = hf_tpu.metrics()
    assert metrics["compiles"] == 0
    assert (metrics["ops_dispatched"], metrics["host_syncs"], len(uploads)) <= (0, 2, 5)


@pytest.mark.parametrize("new_tokens", [1, 5])
def test_a_warm_generate_walks_no_state_and_reads_no_signature_anew(models, monkeypatch, new_tokens):
    """The host's work before a warm call's prefill starts, counted rather than timed: the model's and the static
    cache's walks (`hf_tpu.jit`'s inputs and key) are replayed, for the prefill (whose cache layers hold functions
    of its own) and the decode loop alike, and the signatures Transformers reads are not computed again."""
    import inspect

    from hf_tpu import trace_inputs

    _, tpu = models
    prompt = PROMPT.to("tpu")
    for _ in range(2):
        tpu.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    walked, signatures = [], []
    state_object, module = trace_inputs.Inputs.state_object, trace_inputs.Inputs._module
    monkeypatch.setattr(trace_inputs.Inputs, "state_object",
                        lambda self, x, depth=0: walked.append(x) or state_object(self, x, depth))
    monkeypatch.setattr(trace_inputs.Inputs, "_module", lambda self, m: walked.append(m) or module(self, m))
    from_function = inspect._signature_from_function
    monkeypatch.setattr(inspect, "_signature_from_function",
                        lambda *args, **kwargs: signatures.append(args[1]) or from_function(*args, **kwargs))
    tpu.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    # the decode loop's state also names a list of the warpers it calls (none here), walked each call
    assert not [type(x).__name__ for x in walked if isinstance(x, torch.nn.Module) or trace_inputs.plain_object(x)]
    assert not signatures


def test_a_prefill_gives_each_cache_layer_the_same_functions_at_each_call(models, monkeypatch):
    """The functions a prefill sets on its cache's layers (`_attending_to_the_prompt_only`) are the same objects
    at every call of a prompt length (the prefill launched ahead of a warm call's setup and Transformers' own
    alike), so that the cache's kept walk finds its layers unchanged; another length gets its own."""
    import contextlib

    from hf_tpu.integrations.transformers import prefill

    _, tpu = models
    seen = []
    attending = prefill._attending_to_the_prompt_only

    @contextlib.contextmanager
    def recorded(cache, length):
        with attending(cache, length):
            seen.append([(vars(layer)["update"], vars(layer)["get_mask_sizes"], vars(layer)["get_max_length"])
                         for layer in cache.layers])
            yield

    monkeypatch.setattr(prefill, "_attending_to_the_prompt_only", recorded)
    past_the_bucket = torch.arange(prefill.bucketed_length(PROMPT.shape[1]) + 1).remainder(100)[None] + 3
    seen_by_prompt = []
    for prompt in (PROMPT, PROMPT, past_the_bucket):
        seen.clear()
        tpu.generate(prompt.to("tpu"), max_new_tokens=1, do_sample=False)
        seen_by_prompt.append(list(seen))
    first, *again = [functions for call in seen_by_prompt[:2] for functions in call]
    longer = seen_by_prompt[2]
    assert again and all(a is b for now in again for before, after in zip(first, now) for a, b in zip(before, after))
    assert longer and not any(a is b for now in longer for before, after in zip(first, now)
                              for a, b in zip(before, after))


def test_an_update_set_on_a_cache_layer_is_called_by_the_prefills_own_and_put_back(models, checkpoint,
                                                                                     monkeypatch):
    """A layer whose `update` something else set on it keeps it: the prefill's `update` calls that one where the
    prefill is traced, and it is the layer's again after the call."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from hf_tpu import direct
    from hf_tpu.integrations.transformers import prefill

    calls, own = [], {}
    attending = prefill._attending_to_the_prompt_only

    @contextlib.contextmanager
    def with_own_update(cache, length):
        for layer in cache.layers:
            def update(*args, _write=layer.update, **kwargs):
                calls.append(1)
                return _write(*args, **kwargs)

            layer.update = own[id(layer)] = update
        with attending(cache, length):
            yield
        assert all(vars(layer)["update"] is own[id(layer)] for layer in cache.layers)
        for layer in cache.layers:
            del layer.update

    monkeypatch.setattr(prefill, "_attending_to_the_prompt_only", with_own_update)
    monkeypatch.setattr(direct, "_programs", {})  # the prefill traced anew, not found traced by another test
    monkeypatch.setattr(direct, "_site_counts", {})
    model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map="tpu")
    actual = model.generate(PROMPT.to("tpu"), max_new_tokens=1, do_sample=False)
    assert torch.equal(actual.cpu(), models[0].generate(PROMPT, max_new_tokens=1, do_sample=False))
    assert len(calls) == model.config.num_hidden_layers


def test_the_kept_prefill_functions_keep_no_cache_layer_alive(checkpoint):
    """What `_attending_to_the_prompt_only` keeps per layer reaches the layer weakly: a model and its kept cache
    are freed once dropped."""
    import gc
    import weakref

    from transformers import AutoModelForCausalLM

    from hf_tpu.integrations.transformers import prefill

    model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map="tpu")
    before = set(map(id, prefill._PROMPT_ONLY_FUNCTIONS))
    model.generate(PROMPT.to("tpu"), max_new_tokens=1, do_sample=False)
    layers = [weakref.ref(layer) for layer in prefill._PROMPT_ONLY_FUNCTIONS if id(layer) not in before]
    assert layers
    del model
    gc.collect()
    assert all(layer() is None for layer in layers)


def test_a_second_call_of_the_same_shape_reuses_the_static_cache_zeroed(models, monkeypatch):
    """The static cache of a call whose result does not hold it is zeroed and used by the next call of its shape,
    instead of a new `StaticCache` built and allocated layer by layer; a cache handed out in a dict output is
    never touched again."""
    from transformers import StaticCache

    cpu, tpu = models
    other = torch.tensor([[9, 8, 7, 6, 5]])
    expected, actual = _both(models, max_new_tokens=6, do_sample=False)
    assert torch.equal(actual, expected)
    built = []
    init = StaticCache.__init__
    monkeypatch.setattr(StaticCache, "__init__", lambda self, *a, **k: built.append(self) or init(self, *a, **k))
    expected, actual = _both(models, prompt=other, max_new_tokens=6, do_sample=False)
    assert torch.equal(actual, expected) and not built
    handed_out = tpu.generate(other.to("tpu"), max_new_tokens=6, do_sample=False, return_dict_in_generate=True).cache
    assert len(built) == 1
    keys = [layer.keys.cpu() for layer in handed_out.layers]
    for prompt in (PROMPT, other):
        expected, actual = _both(models, prompt=prompt, max_new_tokens=6, do_sample=False)
        assert torch.equal(actual, expected)
    assert all(torch.equal(layer.keys.cpu(), before) for layer, before in zip(handed_out.layers, keys))


def _prefill_events(monkeypatch) -> list:
    """"launch" at each call of the compiled prefill, "prepared" where Transformers' `_prefill` has prepared its
    inputs (the adapter then looks for a launch made ahead), in their order."""
    from hf_tpu.integrations.transformers import prefill

    events = []
    compiled_prefill, taken_from_ahead = prefill._compiled_prefill, prefill._taken_from_ahead

    def counted(model, compile_config):
        prefill = compiled_prefill(model, compile_config)
        return lambda *args: events.append("launch") or prefill(*args)

    monkeypatch.setattr(prefill, "_compiled_prefill", counted)
    monkeypatch.setattr(prefill, "_taken_from_ahead", lambda *args: events.append("prepared") or
                        taken_from_ahead(*args))
    return events


def test_a_warm_call_of_a_kind_seen_before_takes_the_prefill_launched_ahead(models, monkeypatch):
    """A warm `generate()` with the arguments and prompt shape of the call before launches its prefill before
    Transformers' setup, and Transformers' prefill takes that launch: one launch a call, the CPU's tokens, for new
    prompts and for calls that decode on after the first token. A call of another kind, or one whose prefill runs
    eagerly (no static cache), launches nothing ahead."""
    prompts = [torch.tensor([[3, 14, 15, 92, 65]]), torch.tensor([[9, 8, 7, 6, 5]]), torch.tensor([[4, 4, 2, 7, 1]])]
    for new_tokens in (1, 6):
        _both(models, max_new_tokens=new_tokens, do_sample=False)  # the kind's first call: its inputs are kept
        events = _prefill_events(monkeypatch)
        for prompt in prompts:
            expected, actual = _both(models, prompt=prompt, max_new_tokens=new_tokens, do_sample=False)
            assert torch.equal(actual, expected)
        assert events == ["launch", "prepared"] * len(prompts)
        monkeypatch.undo()
    events = _prefill_events(monkeypatch)
    expected, actual = _both(models, max_new_tokens=2, do_sample=False)  # a kind not seen: its own prefill
    assert torch.equal(actual, expected) and events == ["prepared", "launch"]
    saved = adapter.settings.static_cache
    try:
        adapter.configure(static_cache=False)  # a kind seen, whose prefill now runs eagerly: nothing launched
        events.clear()
        expected, actual = _both(models, max_new_tokens=2, do_sample=False)
        assert torch.equal(actual, expected) and events == []
    finally:
        adapter.configure(static_cache=saved)


def test_a_prefill_launched_ahead_is_not_taken_when_the_cache_was_written_since(models, monkeypatch):
    """A launch ahead whose cache Transformers' setup wrote in place (a `reset()`), or whose compile config the
    call no longer has, is not taken: Transformers' prefill launches its own, the tokens are the CPU's, and that
    kind is not launched ahead again. A model in training mode launches nothing ahead."""
    from transformers import CompileConfig

    from hf_tpu.integrations.transformers.cache import allocated_ahead, spare_static_cache

    cpu, tpu = models
    _both(models, max_new_tokens=3, do_sample=False)
    get_logits_processor = type(tpu)._get_logits_processor

    def resetting(self, *args, **kwargs):  # runs in Transformers' setup, after the launch ahead
        for cache in [spare_static_cache(self), *allocated_ahead]:
            if cache is not None:
                cache.reset()
        return get_logits_processor(self, *args, **kwargs)

    monkeypatch.setattr(type(tpu), "_get_logits_processor", resetting)
    events = _prefill_events(monkeypatch)
    expected, actual = _both(models, max_new_tokens=3, do_sample=False)
    assert torch.equal(actual, expected) and events == ["launch", "prepared", "launch"]
    monkeypatch.setattr(type(tpu), "_get_logits_processor", get_logits_processor)
    events.clear()
    expected, actual = _both(models, max_new_tokens=3, do_sample=False)
    assert torch.equal(actual, expected) and events == ["prepared", "launch"]
    _both(models, max_new_tokens=5, do_sample=False)
    monkeypatch.setattr(tpu.generation_config, "compile_config", CompileConfig(backend="tpu", fullgraph=False))
    events.clear()
    expected, actual = _both(models, max_new_tokens=5, do_sample=False)
    assert torch.equal(actual, expected) and events == ["launch", "prepared", "launch"]
    _both(models, max_new_tokens=4, do_sample=False)
    tpu.train()
    try:
        events.clear()
        expected, actual = _both(models, max_new_tokens=4, do_sample=False)
        assert torch.equal(actual, expected) and events == ["prepared", "launch"]
    finally:
        tpu.eval()


def test_a_kept_static_cache_is_zeroed_for_an_eager_prefill(models):
    """A call that turns the compiled prefill off (`disable_compile`) still takes the static cache the previous call
    kept, and prefills it eagerly: it is zeroed first, as the compiled prefill zeroes it in its program. Left as it
    was, its lengths would place the prompt after the previous call's tokens."""
    _, tpu = models
    other = torch.tensor([[9, 8, 7, 6, 5]])
    tpu.generate(PROMPT.to("tpu"), max_new_tokens=6, do_sample=False)
    expected, actual = _both(models, prompt=other, max_new_tokens=6, do_sample=False, disable_compile=True)
    assert torch.equal(actual, expected)


def test_a_static_cache_allocated_at_once_holds_what_transformers_allocates(models):
    """On tpu, `early_initialization` makes every layer's keys, values and length empty and zeroes them in one
    program; each layer then holds what Transformers' own allocation gives it (the same attributes, tensors
    of the same shapes, values, devices and static-address marks)."""
    from transformers import StaticCache
    from transformers.cache_utils import Cache

    _, tpu = models
    arguments = dict(batch_size=2, num_heads=2, head_dim=16, dtype=torch.bfloat16, device=tpu.device)
    theirs, ours = (StaticCache(config=tpu.config, max_cache_len=32) for _ in range(2))
    Cache.early_initialization._hf_tpu_original(theirs, **arguments)
    hf_tpu.reset_metrics()
    ours.early_initialization(**arguments)
    assert hf_tpu.metrics()["ops_dispatched"] == 1
    for mine, expected in zip(ours.layers, theirs.layers, strict=True):
        assert vars(mine).keys() == vars(expected).keys()
        for name, value in vars(expected).items():
            if not isinstance(value, torch.Tensor):
                assert getattr(mine, name) == value, name
                continue
            tensor = getattr(mine, name)
            assert (tensor.shape, tensor.dtype, tensor.device) == (value.shape, value.dtype, value.device), name
            assert torch.equal(tensor.cpu(), value.cpu()), name
            assert tensor._dynamo_static_input_type == value._dynamo_static_input_type, name


def test_the_prefill_compiles_once_per_bucket_with_the_cpu_tokens(models):
    """The prefill is the compiled forward: a prompt in a new bucket compiles one program (a single new
    token: no decode loop), another length in the same bucket compiles nothing, and the tokens are CPU's."""
    saved = adapter.settings.prompt_buckets, adapter.settings.static_cache
    cpu, tpu = models
    torch.manual_seed(3)
    prompts = [torch.randint(3, 128, (1, length)) for length in (40, 45)]
    try:
        adapter.configure(prompt_buckets=(48,))  # a bucket no other test compiles
        compiles = []
        for prompt in prompts:
            hf_tpu.reset_metrics()
            actual = tpu.generate(prompt.to("tpu"), max_new_tokens=1, do_sample=False).cpu()
            compiles.append(hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0))
            assert torch.equal(actual, cpu.generate(prompt, max_new_tokens=1, do_sample=False))
        assert compiles == [1, 0]
        for prompt in prompts:  # then the decode loop after the compiled prefill
            expected, actual = _both(models, prompt=prompt, max_new_tokens=8, do_sample=False)
            assert torch.equal(actual, expected)
        adapter.configure(static_cache=False)  # eager everywhere
        hf_tpu.reset_metrics()
        expected, actual = _both(models, prompt=prompts[0], max_new_tokens=3, do_sample=False)
        assert torch.equal(actual, expected)
        assert hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0) == 0
    finally:
        adapter.configure(prompt_buckets=saved[0], static_cache=saved[1])


def test_the_prefill_and_the_decode_loop_are_traced_without_dynamo_with_the_cpu_tokens(models):
    """The prefill and the decode loop's step are traced straight from Python (`hf_tpu.jit`): two programs for
    a new bucket, none for the next prompt in it, no frame given to Dynamo; `direct_trace=False` compiles them
    with torch.compile instead, with the same tokens."""
    import torch._dynamo.utils

    from hf_tpu import direct

    saved = adapter.settings.prompt_buckets
    torch.manual_seed(5)
    prompts = [torch.randint(3, 128, (1, length)) for length in (20, 22)]
    outputs = []
    try:
        adapter.configure(prompt_buckets=(24,))  # a bucket no other test compiles
        direct.reset()  # the decode loop's program too
        torch._dynamo.utils.counters.clear()
        compiles = []
        for prompt in prompts:
            hf_tpu.reset_metrics()
            expected, actual = _both(models, prompt=prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
            compiles.append(hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0))
            assert torch.equal(actual, expected)
            outputs.append(actual)
        assert compiles == [2, 0]
        assert not torch._dynamo.utils.counters["frames"], dict(torch._dynamo.utils.counters["frames"])
        adapter.configure(direct_trace=False)
        for prompt, traced in zip(prompts, outputs):
            assert torch.equal(_both(models, prompt=prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)[1],
                               traced)
        assert torch._dynamo.utils.counters["frames"]["total"] > 0
    finally:
        adapter.configure(prompt_buckets=saved, direct_trace=True)


def test_the_prefill_attends_to_the_prompt_not_to_the_whole_static_cache(models, monkeypatch):
    """The prefill of an empty static cache hands the attention the prompt's own keys, and no mask when
    nothing is padded (the causal attention a plain forward runs, the flash kernel on a TPU); the decode
    steps attend to the whole cache. Both padded and unpadded prompts give CPU's tokens."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_tpu import direct

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    calls = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        calls.append((query.shape[2], key.shape[2], attention_mask is None))
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", spy)
    saved = adapter.settings.prompt_buckets
    try:
        adapter.configure(prompt_buckets=(28,))  # a bucket no other test compiles: the prefill is traced here
        direct.reset()
        prompt = torch.randint(3, 128, (1, 28), generator=torch.Generator().manual_seed(7))
        kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
        expected = models[0].generate(prompt, **kwargs)
        calls.clear()
        assert torch.equal(models[1].generate(prompt.to("tpu"), **kwargs).cpu(), expected)
        layers = models[1].config.num_hidden_layers
        # traced once each, the decode loop's step first: it compiles while the prefill traces and compiles
        # (`_compile_loop_ahead`)
        assert [call for call in calls if call[0] == 28] == [(28, 28, True)] * layers
        decode_steps = [call for call in calls if call[0] != 28]
        assert decode_steps and all(query == 1 and keys > 28 and not unmasked  # the whole cache, masked
                                    for query, keys, unmasked in decode_steps)
        assert calls[0][0] == 1
        calls.clear()
        assert torch.equal(models[1].generate(prompt.to("tpu"), **kwargs).cpu(), expected)
        assert calls == []  # a second call traces nothing, ahead or not
        padded = torch.tensor([[0, 0, 0, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
        mask = (padded != 0).long()
        expected, actual = (model.generate(padded.to(model.device), attention_mask=mask.to(model.device),
                                           max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
                            for model in models)
        assert torch.equal(actual.cpu(), expected)
    finally:
        adapter.configure(prompt_buckets=saved)


def test_prompt_lengths_pad_to_buckets(models):
    assert adapter.bucketed_length(5) == 16 and adapter.bucketed_length(16) == 16
    assert adapter.bucketed_length(17) == 32
    saved = adapter.settings.prompt_buckets
    try:
        adapter.configure(prompt_buckets=(8, 24))
        assert adapter.bucketed_length(9) == 24 and adapter.bucketed_length(30) == 48
        cpu, tpu = models
        for length in (6, 3, 7):
            prompt = PROMPT[:, :1].repeat(1, length) + torch.arange(length)
            expected, actual = _both(models, prompt=prompt, max_new_tokens=5, do_sample=False)
            assert torch.equal(actual, expected), length
            if length == 6:
                hf_tpu.reset_metrics()  # lengths 3 and 7 share length 6's bucket and its compiled programs
        assert hf_tpu.metrics()["compiles"] == 0
        adapter.configure(prompt_buckets=())
        assert adapter.bucketed_length(9) == 9
    finally:
        adapter.configure(prompt_buckets=saved)
    with pytest.raises(ValueError, match="positive"):
        adapter.configure(prompt_buckets=(0, 16))


def _prompt_readers(first_token):
    """generate() arguments that see the prompt, each set to notice the adapter's left padding (the
    prompt's first token repeated) if it were there."""
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.tolist())

        def end(self):
            self.chunks.append("end")  # generate() closes the stream once, after the last token

    a, x = int(PROMPT[0, 0]), first_token
    return {
        "streamer": lambda: dict(streamer=Recorder()),
        # a prompt of [a] never holds the word [a, a, x]; a padded one ends in it
        "bad_words_ids": lambda: dict(bad_words_ids=[[a, a, x]]),
        "sequence_bias": lambda: dict(sequence_bias={(a, a, x): -100.0}),
        # forces the token its position among the new tokens names
        "prefix_allowed_tokens_fn": lambda: dict(prefix_allowed_tokens_fn=lambda row, ids: [20 + len(ids) - 1]),
    }


@pytest.mark.parametrize("reader", ["streamer", "bad_words_ids", "sequence_bias", "prefix_allowed_tokens_fn"])
def test_what_reads_the_prompt_reads_it_unpadded(models, reader):
    cpu, tpu = models
    prompt = PROMPT[:, :1]
    first_token = int(cpu(prompt).logits[0, -1].argmax())
    make = _prompt_readers(first_token)[reader]
    expected_kwargs, actual_kwargs = make(), make()
    expected = cpu.generate(prompt, max_new_tokens=3, do_sample=False, **expected_kwargs)
    actual = tpu.generate(prompt.to("tpu"), max_new_tokens=3, do_sample=False, **actual_kwargs)
    assert torch.equal(actual.cpu(), expected)
    if reader == "streamer":
        assert actual_kwargs["streamer"].chunks == expected_kwargs["streamer"].chunks
        assert actual_kwargs["streamer"].chunks[-1] == "end"


def test_classifier_free_guidance_generates_the_cpu_tokens(models):
    """`guidance_scale` runs the model from a logits processor on the ids it is given: they must stay on
    the model's device, not move to the host with the rest of the loop's bookkeeping."""
    expected, actual = _both(models, max_new_tokens=4, do_sample=False, guidance_scale=1.5)
    assert torch.equal(actual, expected)


def test_a_forced_first_token_is_forced_after_a_one_token_prompt(models):
    """`forced_bos_token_id` forces the token where the ids are one token long: not after a padded prompt."""
    expected, actual = _both(models, prompt=PROMPT[:, :1], max_new_tokens=3, do_sample=False, forced_bos_token_id=7)
    assert expected[0, 1] == 7 and torch.equal(actual, expected)


def test_a_users_processor_gets_the_scores_on_the_models_device(models):
    from transformers import LogitsProcessor, LogitsProcessorList

    class Favour(LogitsProcessor):
        def __init__(self, device):
            self.bias = torch.zeros(128, device=device)
            self.bias[9] = 100.0

        def __call__(self, input_ids, scores):
            return scores + self.bias

    cpu, tpu = models
    expected = cpu.generate(PROMPT, max_new_tokens=3, do_sample=False, logits_processor=LogitsProcessorList([Favour("cpu")]))
    actual = tpu.generate(PROMPT.to("tpu"), max_new_tokens=3, do_sample=False,
                          logits_processor=LogitsProcessorList([Favour(tpu.device)]))
    assert expected[0, -3:].tolist() == [9, 9, 9] and torch.equal(actual.cpu(), expected)


def _gpt_neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    return GPTNeoForCausalLM(GPTNeoConfig(hidden_size=32, num_layers=1, num_heads=4, attention_types=[[["global"], 1]],
                                          max_position_embeddings=128, vocab_size=64, bos_token_id=1, eos_token_id=2))


def _mpt():
    from transformers import MptConfig, MptForCausalLM

    return MptForCausalLM(MptConfig(d_model=32, n_layers=1, n_heads=4, max_seq_len=128, vocab_size=64,
                                    bos_token_id=1, eos_token_id=2))


@pytest.mark.parametrize("build", [_gpt_neo, _mpt], ids=["gpt_neo", "mpt"])
def test_a_prompt_is_not_padded_past_the_models_longest_sequence(tmp_path, build):
    """GPT-Neo's causal mask and MPT's ALiBi biases cover 128 positions (`max_position_embeddings`,
    `max_seq_len`): 100 + 20 tokens fit, a prompt padded to the 128 bucket does not."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    build().save_pretrained(tmp_path)
    ids = torch.randint(3, 64, (1, 100))
    expected = AutoModelForCausalLM.from_pretrained(tmp_path).generate(ids, max_new_tokens=20, do_sample=False)
    tpu = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu")
    assert torch.equal(tpu.generate(ids.to("tpu"), max_new_tokens=20, do_sample=False).cpu(), expected)


def test_a_model_that_prepares_its_step_inputs_itself_generates_the_cpu_tokens(tmp_path):
    """XLM builds each step's inputs on the ids' device and does not move them to the model."""
    from transformers import AutoModelForCausalLM, XLMConfig, XLMWithLMHeadModel

    torch.manual_seed(0)
    XLMWithLMHeadModel(XLMConfig(emb_dim=32, n_layers=1, n_heads=4, vocab_size=64)).save_pretrained(tmp_path)
    ids = torch.randint(3, 64, (2, 8))
    common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path).generate(ids, **common)
    tpu = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu")
    actual = tpu.generate(ids.to("tpu"), **{**common, "attention_mask": common["attention_mask"].to("tpu")})
    assert torch.equal(actual.cpu(), expected)


def test_per_token_inputs_besides_the_ids_generate_the_cpu_tokens(tmp_path):
    """`token_type_ids` (a tokenizer's output for GPT-2 and BERT) hold one entry per prompt token: a
    padded prompt would not match them."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    cpu = AutoModelForCausalLM.from_pretrained(tmp_path)
    tpu = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu")
    ids = torch.randint(0, 64, (2, 7))
    kinds = torch.zeros_like(ids)
    kinds[:, 4:] = 1
    common = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    expected = cpu.generate(ids, attention_mask=torch.ones_like(ids), token_type_ids=kinds, **common)
    actual = tpu.generate(ids.to("tpu"), attention_mask=torch.ones_like(ids).to("tpu"),
                          token_type_ids=kinds.to("tpu"), **common)
    assert torch.equal(actual.cpu(), expected)


def test_a_static_cache_the_user_chose_keeps_the_length_transformers_gives_it(models, checkpoint):
    from transformers import AutoModelForCausalLM

    cpu, _ = models
    tpu = AutoModelForCausalLM.from_pretrained(checkpoint, device_map="tpu")  # Transformers reuses a model's
    # static cache while it is long enough: a model that generated with the adapter's keeps that length
    kwargs = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", return_dict_in_generate=True)
    expected = cpu.generate(PROMPT, **kwargs)
    actual = tpu.generate(PROMPT.to("tpu"), **kwargs)
    assert actual.cache.layers[0].keys.shape == expected.cache.layers[0].keys.shape
    assert torch.equal(actual.sequences.cpu(), expected.sequences)


def test_dict_outputs_hold_the_prompt_as_given_and_continue_like_cpu(models):
    """No prompt padding when generate() returns its hidden states and cache: they would hold the padding."""
    cpu, tpu = models
    kwargs = dict(do_sample=False, return_dict_in_generate=True, output_hidden_states=True)
    expected = cpu.generate(PROMPT, max_new_tokens=3, **kwargs)
    actual = tpu.generate(PROMPT.to("tpu"), max_new_tokens=3, **kwargs)
    assert actual.hidden_states[0][0].shape == expected.hidden_states[0][0].shape
    continued = tpu.generate(actual.sequences, cache=actual.cache, max_new_tokens=3, **kwargs)
    assert torch.equal(continued.sequences.cpu(), cpu.generate(PROMPT, max_new_tokens=6, **kwargs).sequences)


def test_a_returned_cache_is_transformers_own_and_continues_past_the_static_length_as_on_cpu(models, monkeypatch):
    """A result that holds the cache holds what Transformers returns (a `DynamicCache` of the tokens cached), and a
    continuation handed it back gives the CPU's scores past the length of the static cache the first call decoded
    with (32 positions here): that static cache, handed back, had its writes past its end clamped onto its last
    position (CPU's `index_copy_` raises there) and gave other scores, silently. The continuation decodes in a
    static cache of its own and leaves the given cache holding every token, as Transformers leaves it, whether the
    result holds it or not."""
    cpu, tpu = models
    monkeypatch.setattr(adapter.settings, "cache_length_multiple", 16)
    kwargs = dict(do_sample=False, eos_token_id=None, return_dict_in_generate=True, output_scores=True)
    expected = cpu.generate(PROMPT, max_new_tokens=20, **kwargs)
    first = tpu.generate(PROMPT.to("tpu"), max_new_tokens=20, **kwargs)
    assert type(first.cache) is type(expected.cache)
    assert first.cache.get_seq_length() == expected.cache.get_seq_length() == PROMPT.shape[1] + 19
    given = first.cache
    expected = cpu.generate(expected.sequences, cache=expected.cache, max_new_tokens=20, **kwargs)
    continued = tpu.generate(first.sequences, cache=given, max_new_tokens=20, **kwargs)
    assert continued.cache is given and given.get_seq_length() == expected.cache.get_seq_length()
    assert torch.equal(continued.sequences.cpu(), expected.sequences)
    for actual_scores, expected_scores in zip(continued.scores, expected.scores):
        torch.testing.assert_close(actual_scores.cpu(), expected_scores, rtol=1e-5, atol=1e-5)
    ids_only = dict(do_sample=False, eos_token_id=None, max_new_tokens=4)
    again = tpu.generate(continued.sequences, cache=given, **ids_only)
    assert torch.equal(again.cpu(), cpu.generate(expected.sequences, cache=expected.cache, **ids_only))
    assert given.get_seq_length() == expected.cache.get_seq_length()
    for on_tpu, on_cpu in zip(given.layers, expected.cache.layers):
        torch.testing.assert_close(on_tpu.keys.cpu(), on_cpu.keys, rtol=1e-5, atol=1e-5)


def test_a_static_cache_too_short_for_the_call_raises_index_error_as_on_cpu(models):
    """The CPU raises at the first write past a given static cache's end; on tpu that write's start would be clamped
    onto the last position, so the call raises before decoding."""
    from transformers import StaticCache

    for model in models:
        cache = StaticCache(config=model.config, max_cache_len=8)
        with pytest.raises(IndexError):
            model.generate(PROMPT.to(model.device), cache=cache, max_new_tokens=10, do_sample=False, eos_token_id=None)


def test_attentions_asked_for_have_the_cpu_shapes(checkpoint):
    """Attentions over the adapter's static cache would be as long as the cache: Transformers' own cache then."""
    from transformers import AutoModelForCausalLM

    cpu = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager")
    tpu = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager", device_map="tpu")
    kwargs = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_attentions=True)
    expected, actual = cpu.generate(PROMPT, **kwargs), tpu.generate(PROMPT.to("tpu"), **kwargs)
    assert [step[0].shape for step in actual.attentions] == [step[0].shape for step in expected.attentions]
    assert torch.equal(actual.sequences.cpu(), expected.sequences)


@pytest.mark.parametrize("kwargs", [
    dict(do_sample=False),
    dict(attention_mask=torch.ones_like(PROMPT), repetition_penalty=1.5),
    dict(return_dict_in_generate=True, output_hidden_states=True),
], ids=["plain", "mask_and_penalty", "dict_output"])
def test_the_generation_config_is_resolved_once_per_call(models, monkeypatch, kwargs):
    """The adapter's wrapper resolves the config (a deepcopy of it and the defaults merged in) and hands it
    on to Transformers' generate(), which would resolve it again."""
    from transformers import GenerationConfig

    cpu, tpu = models
    resolve = type(tpu)._prepare_generation_config
    calls = []

    def counting(self, *args, **kw):
        calls.append(1)
        return resolve(self, *args, **kw)

    config = GenerationConfig(max_new_tokens=4, do_sample=False)
    expected = cpu.generate(PROMPT, generation_config=config, **kwargs)
    monkeypatch.setattr(type(tpu), "_prepare_generation_config", counting)
    on_tpu = {k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    actual = tpu.generate(PROMPT.to("tpu"), generation_config=config, **on_tpu)
    assert len(calls) == 1
    if kwargs.get("return_dict_in_generate"):
        assert len(actual.hidden_states) == len(expected.hidden_states)
        actual, expected = actual.sequences, expected.sequences
    assert torch.equal(actual.cpu(), expected)
    assert "_prepare_generation_config" not in tpu.__dict__


def test_a_resolved_generation_config_is_kept_while_the_models_configs_are_unchanged(models, monkeypatch):
    """Transformers resolves the generation config anew at every call (copies and merges it with the defaults);
    on tpu a call with the same plain arguments gets a copy of the config resolved before, for as long as the
    model's generation config and config hold what they held, and the same tokens."""
    from transformers import GenerationConfig

    cpu, tpu = models
    merges = []
    update = GenerationConfig.update

    def counting(self, *args, **kwargs):
        merges.append(1)
        return update(self, *args, **kwargs)

    monkeypatch.setattr(GenerationConfig, "update", counting)
    mask = torch.ones_like(PROMPT)
    first, first_kwargs = tpu._prepare_generation_config(None, max_new_tokens=3, attention_mask=mask)
    resolved_by_transformers = len(merges)
    assert resolved_by_transformers > 0
    first.suppress_tokens = [5]  # a caller's change to the config it was given
    again, again_kwargs = tpu._prepare_generation_config(None, max_new_tokens=3, attention_mask=mask.clone())
    assert len(merges) == resolved_by_transformers
    assert again is not first and again.suppress_tokens is None and again.max_new_tokens == 3
    assert set(again_kwargs) == set(first_kwargs) and again_kwargs["attention_mask"] is not mask

    monkeypatch.setattr(tpu.generation_config, "max_new_tokens", 5)  # the model's defaults changed
    tpu._prepare_generation_config(None, do_sample=False)
    merged = len(merges)
    assert merged > resolved_by_transformers
    assert tpu._prepare_generation_config(None, do_sample=False)[0].max_new_tokens == 5
    assert len(merges) == merged
    monkeypatch.setattr(tpu.config, "temperature", 0.5, raising=False)  # as Transformers refuses on CPU
    with pytest.raises(ValueError, match="modified the pretrained model configuration"):
        tpu._prepare_generation_config(None, do_sample=False)
    monkeypatch.undo()
    expected, actual = _both(models, max_new_tokens=3, do_sample=False)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("assistance", ["prompt_lookup", "assistant_model"])
def test_assisted_generation_generates_the_cpu_tokens(models, assistance):
    cpu, tpu = models
    expected = cpu.generate(PROMPT, max_new_tokens=6, do_sample=False)
    helper = dict(prompt_lookup_num_tokens=2) if assistance == "prompt_lookup" else dict(assistant_model=tpu)
    actual = tpu.generate(PROMPT.to("tpu"), max_new_tokens=6, do_sample=False, **helper)
    assert torch.equal(actual.cpu(), expected)


def test_a_compile_config_left_at_inductor_compiles_for_tpu(models):
    from transformers import CompileConfig

    expected, _ = _both(models, max_new_tokens=6, do_sample=False)
    _, tpu = models
    # fullgraph=True raises once Dynamo's recompile limit for the model's forward is spent, which the tests
    # before this one in the same process may have done (Transformers' own compile tests reset too)
    torch.compiler.reset()
    with pytest.warns(UserWarning, match="inductor"):
        actual = tpu.generate(PROMPT.to("tpu"), max_new_tokens=6, do_sample=False,
                              compile_config=CompileConfig(fullgraph=True, dynamic=False))
    assert torch.equal(actual.cpu(), expected)
    assert tpu._last_compile_config.backend == "tpu"


def _run(code: str, **env) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env={**__import__("os").environ, "HF_TPU_NUM_DEVICES": "1", **env}, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_import_hf_tpu_does_not_import_transformers():
    assert _run("import sys, hf_tpu; print('transformers' in sys.modules)") == "False"


@pytest.mark.parametrize("order", ["hf_tpu first", "transformers first"])
def test_adapter_installs_in_either_import_order(order):
    imports = ["import hf_tpu", "import transformers.generation.utils, transformers.modeling_utils"]
    if order == "transformers first":
        imports.reverse()
    out = _run("\n".join(imports) + """
        from transformers import GenerationMixin, PreTrainedModel
        print(hasattr(GenerationMixin.generate, "_hf_tpu_original"),
              hasattr(PreTrainedModel.__dict__["from_pretrained"], "_hf_tpu_original"))
    """.replace("\n        ", "\n"))
    assert out == "True True"


def test_a_second_process_loads_every_program_of_generate_from_the_disk_cache(checkpoint, tmp_path):
    """Every program the first generate() compiles (prefill, decode loop, the ops around them) is written to
    HF_TPU_CACHE_DIR: a second process with the same folder compiles none and makes the same tokens, and loads
    the prefill's and the decode loop's programs while it traces them (`hf_tpu.disk_cache`)."""
    code = f"""
        import json, torch, hf_tpu
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(checkpoint)!r}, device_map="tpu")
        hf_tpu.reset_metrics()
        tokens = model.generate(torch.tensor([[3, 14, 15, 92, 65]]).to("tpu"), max_new_tokens=6, do_sample=False)
        metrics = hf_tpu.metrics()
        import torch._dynamo.utils
        print(json.dumps([tokens.cpu().tolist(), metrics["xla_compiles"], metrics["disk_cache_hits"],
                          sum(torch._dynamo.utils.counters["frames"].values()), metrics["disk_cache_prefetched"]]))
    """
    first = json.loads(_run(code, HF_TPU_CACHE_DIR=str(tmp_path)).splitlines()[-1])
    second = json.loads(_run(code, HF_TPU_CACHE_DIR=str(tmp_path)).splitlines()[-1])
    assert first[1] > 0 and first[2] == first[4] == 0
    assert second[1] == 0 and second[2] == first[1] and second[0] == first[0] and second[4] == 2
    assert first[3] == second[3] == 0  # traced straight from Python: no frame for Dynamo to capture


def test_a_first_generate_compiles_its_prefill_and_decode_loop_and_two_small_programs(checkpoint):
    """A process's first generate() pays XLA for every program it compiles, and each op run eagerly on the device
    is one (0.1-0.5 s each on a TPU v5e). Compiled are the prefill, the decode loop (whose first condition is
    computed inside it, `loop_chunks.loop_chunk`), and two small programs that stay: the fresh static cache's
    zeros, one program for all its layers (an uninitialised buffer would read as zeros through a program of its
    own too), and the merge of the device's record of index errors, once per process. Nothing else: the loop's
    first condition evaluated eagerly, a mask entry made before the loop and a part of the tokens read back to
    the host were five programs more."""
    code = f"""
        import json, torch, hf_tpu
        from jax._src import monitoring
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(checkpoint)!r}, device_map="tpu")
        compiled = []
        monitoring.register_event_duration_secs_listener(
            lambda event, seconds, **kwargs: compiled.append(kwargs.get("fun_name"))
            if event.endswith("backend_compile_duration") else None)
        tokens = model.generate(torch.tensor([[3, 14, 15, 92, 65]]).to("tpu"), max_new_tokens=8, do_sample=False)
        print(json.dumps([tokens.cpu().tolist(), sorted(compiled)]))
    """
    tokens, compiled = json.loads(_run(code, HF_TPU_CACHE_DIR="").splitlines()[-1])
    from transformers import AutoModelForCausalLM

    expected = AutoModelForCausalLM.from_pretrained(checkpoint).generate(PROMPT, max_new_tokens=8, do_sample=False)
    assert tokens == expected.tolist()
    prefill = next((name for name in compiled if name.startswith("jit(traced_")), None)
    assert prefill in ("jit(traced__prefill_forward)", "jit(traced__scanned_forward)"), compiled
    assert sorted(compiled) == sorted(["jit(<lambda>)", "jit(_merged)", "jit(loop_body)", prefill]), compiled


# --- continuous batching (generate_batch): the paged cache is sized from the tpu's memory


def _generate_batch(model, **cb_kwargs):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=2, pad_token_id=0)
    outputs = model.generate_batch([[3, 14, 15, 92, 65], [7, 8, 9]], generation_config=config,
                                   continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs))
    return {name: output.generated_tokens for name, output in outputs.items()}


def test_continuous_batching_sizes_its_cache_from_the_tpus_memory_and_generates_the_cpu_tokens(models, monkeypatch):
    """Transformers sized the paged cache from the host's RAM: on tpu it asked the device for 90% of it
    and the process was killed. A device reporting 64 MiB free must get a cache within 64 MiB."""
    cpu, tpu = models
    expected = _generate_batch(cpu, num_blocks=16, max_batch_tokens=64)
    monkeypatch.setattr(torch.tpu, "mem_get_info", lambda device=None: (64 * 2**20, 128 * 2**20))
    torch.tpu.reset_peak_memory_stats()
    before = torch.tpu.memory_allocated()
    assert _generate_batch(tpu, max_batch_tokens=64) == expected
    assert torch.tpu.max_memory_allocated() - before <= 64 * 2**20


def test_continuous_batching_takes_a_modest_share_of_the_hosts_memory_on_the_virtual_tpu():
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import initialization

    from hf_tpu.integrations.transformers import continuous_batching

    chosen = ContinuousBatchingConfig()
    initialization.resolve_max_memory_percent(chosen, False, torch.device("tpu"))
    on_the_host = torch.tpu.get_device_properties().platform == "cpu"
    assert chosen.max_memory_percent == (continuous_batching.HOST_MEMORY_SHARE if on_the_host else 0.9)
    kept = ContinuousBatchingConfig(max_memory_percent=0.5)
    initialization.resolve_max_memory_percent(kept, False, torch.device("tpu"))
    assert kept.max_memory_percent == 0.5


# --- Ctrl-C stops the device loop: it runs in chunks the host launches one after another (hf_tpu/loop_chunks.py)

_LONG_GENERATE = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a process that inherits SIGINT ignored keeps ignoring it
import torch
import hf_tpu
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=16384)
torch.manual_seed(0)
model = LlamaForCausalLM(config).to("tpu")
prompt = torch.tensor([[3, 14, 15, 92, 65]], device="tpu")
model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)  # compiles the prefill and the loop
print("started", flush=True)
try:
    out = model.generate(prompt, max_new_tokens=16000, do_sample=False, eos_token_id=None)
    print("finished", out.shape[1] - prompt.shape[1], "tokens", flush=True)
except KeyboardInterrupt:
    interrupted = time.time()
    assert (torch.ones(2, device="tpu") + 1).cpu().tolist() == [2.0, 2.0]
    print("interrupted", interrupted, time.time() - interrupted, flush=True)
"""


def test_ctrl_c_stops_a_long_generate_and_the_device_is_free_at_once():
    """The whole decode loop was one device program: after Ctrl-C the next op waited for its end."""
    import os
    import signal
    import time

    env = {**os.environ, "HF_TPU_PLATFORM": "cpu", "HF_TPU_CACHE_LENGTH_MULTIPLE": "16384"}
    child = subprocess.Popen([sys.executable, "-c", _LONG_GENERATE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "started", child.stderr.read()[-2000:]
        time.sleep(1.0)  # the 16,000 tokens take 5 s or more here (6,000 took from under 2 s to 15 s)
        sent = time.time()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=300)
    finally:
        child.kill()
    assert out.startswith("interrupted"), (out, err[-2000:])
    _, interrupted, next_op = out.split()
    assert float(interrupted) - sent < 1.5  # the chunk running and the one queued behind it
    assert float(next_op) < 1.5


@torch.no_grad()
def test_a_model_running_the_per_expert_loop_decodes_eagerly_with_the_cpu_tokens():
    """Transformers' per-expert loop (`experts_implementation="eager"`) routes a count of tokens to each expert
    that depends on the data: on tpu `generate()` runs it eagerly, where compiled decoding broke the graph at
    every expert and compiled the pieces again for every new count (the direct trace cannot take it, and its
    fallback is Dynamo)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=16, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                            num_experts_per_tok=2, vocab_size=128, max_position_embeddings=256)
    torch.manual_seed(0)
    cpu = Qwen3MoeForCausalLM(config).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    prompt = torch.randint(3, 128, (4, 8), generator=torch.Generator().manual_seed(0))
    for model in (cpu, tpu):
        model.set_experts_implementation("eager")
    torch._dynamo.utils.counters.clear()
    expected = cpu.generate(prompt, max_new_tokens=6, do_sample=False)
    actual = tpu.generate(prompt.to("tpu"), max_new_tokens=6, do_sample=False)
    assert torch.equal(actual.cpu(), expected)
    assert not torch._dynamo.utils.counters["frames"], dict(torch._dynamo.utils.counters["frames"])
