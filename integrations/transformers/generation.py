"""`generate()` on `tpu`: the prompt left-padded to a bucket length, the token bookkeeping on the host,
the prefill compiled once per bucket, and greedy search or sampling with a static cache decoding every
token after the first in one `hf_tpu.while_loop` on the device."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import types
import weakref

import torch

import hf_tpu
from hf_tpu import model_patches

from .cache import (ALLOCATED_WHOLE, PLAIN_VALUES, allocated_ahead, given_caches_written_back, plain_key,
                    returned_as_transformers_returns_it, spare_static_cache, static_cache_kept, zero_static_cache)
from .loading import _on_tpu, prepare_model
from .settings import settings


def bucketed_length(length: int) -> int:
    """The prompt length `generate()` pads a prompt of `length` tokens to."""
    buckets = settings.prompt_buckets
    if not buckets:
        return length
    for bucket in buckets:
        if length <= bucket:
            return bucket
    return -(-length // buckets[-1]) * buckets[-1]


def _is_plain_prompt(model, input_ids, model_kwargs) -> bool:
    """A decoder-only prompt of token ids that `generate()` itself extends: its bookkeeping can run
    on the host, and it can be left-padded."""
    return (
        not model.config.is_encoder_decoder
        and input_ids.dim() == 2
        and not input_ids.is_floating_point()
        and all(model_kwargs.get(name) is None for name in ("inputs_embeds", "cache", "past_key_values", "position_ids"))
        and (model_kwargs.get("attention_mask") is None or model_kwargs["attention_mask"].dim() == 2)
    )


def _loop_runs_on_the_host(generation_config, kwargs) -> bool:
    """Greedy search, sampling and beam search move each step's inputs to the model and its logits back;
    assisted generation (an assistant model or prompt lookup) mixes the ids with the model's tensors,
    classifier-free guidance (`guidance_scale`) runs the model on the ids from a logits processor, and
    a user's own processors and stopping criteria may hold tensors on the model's device, where
    Transformers gives them the scores and ids."""
    from transformers.generation import GenerationMode

    mode = generation_config.get_generation_mode(kwargs.get("assistant_model"))
    return (mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH,
                     GenerationMode.BEAM_SAMPLE)
            and generation_config.guidance_scale in (None, 1)
            and not kwargs.get("logits_processor") and not kwargs.get("stopping_criteria"))


# generate() arguments that see the prompt's tokens or length: a streamer is sent the prompt, and a
# processor, stopping criterion or `prefix_allowed_tokens_fn` may read any of it
_SEE_THE_PROMPT = ("streamer", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                   "negative_prompt_ids", "negative_prompt_attention_mask")


def _padding_keeps_the_result(generation_config, kwargs, model_kwargs) -> bool:
    """Left padding leaves the result unchanged when nothing reads the prompt's length (lengths are
    given as new tokens), its n-grams or token sequences, when the model takes no other input per
    prompt token or position (`token_type_ids`, the image tokens of `pixel_values`), and when only
    the sequences come back: the attentions, hidden states and cache of a `return_dict_in_generate`
    output would hold the padded prompt."""
    return (
        generation_config.max_new_tokens is not None
        and not generation_config.min_length
        and generation_config.forced_bos_token_id is None  # forced where the ids are one token long
        and not generation_config.no_repeat_ngram_size
        and not generation_config.bad_words_ids
        and not generation_config.sequence_bias
        and not generation_config.stop_strings
        and generation_config.watermarking_config is None
        and generation_config.guidance_scale in (None, 1)
        and generation_config.prefill_chunk_size is None
        and not generation_config.return_dict_in_generate
        and not any(kwargs.get(name) for name in _SEE_THE_PROMPT)
        and not any(isinstance(value, torch.Tensor) for name, value in model_kwargs.items()
                    if name not in ("input_ids", "attention_mask"))
    )


def _prompt_mask(input_ids, generation_config):
    """The attention mask Transformers infers for a prompt given without one: pad tokens are masked
    when the pad token is set and is not an end-of-sequence token."""
    pad, eos = generation_config.pad_token_id, generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    if pad is not None and pad not in eos:
        return (input_ids != pad).long()
    return torch.ones_like(input_ids)


def _left_pad(input_ids, attention_mask, padding: int):
    """Pad with each row's first token (so penalties that look at the prompt's tokens see no new
    token) and zeros in the mask."""
    first = input_ids[:, :1].expand(-1, padding)
    zeros = attention_mask.new_zeros((attention_mask.shape[0], padding))
    return torch.cat([first, input_ids], dim=1), torch.cat([zeros, attention_mask], dim=1)


def _to_device(output, device):
    """generate()'s result (a tensor, or a ModelOutput of tensors and tuples of them) on `device`."""
    if isinstance(output, torch.Tensor):
        return output.to(device)
    if isinstance(output, tuple):
        return tuple(_to_device(item, device) for item in output)
    if hasattr(output, "keys"):
        for key in output.keys():
            if isinstance(output[key], (torch.Tensor, tuple)):
                output[key] = _to_device(output[key], device)
    return output


def _strip_padding(output, padding: int):
    if isinstance(output, torch.Tensor):
        return output[:, padding:]
    output.sequences = output.sequences[:, padding:]
    return output


def _wrap_generate(original):
    @functools.wraps(original)
    def generate(self, inputs=None, generation_config=None, *args, **kwargs):
        """On tpu, the token bookkeeping of the loop (the growing ids, logits processors, stopping
        criteria, sampling) runs on the host, as Transformers allows for an accelerator (its
        `prepare_inputs_for_generation` moves each step's inputs to the model): a step then costs one
        compiled forward, not dozens of small device ops whose shapes grow with every token. A result that
        holds the cache the adapter chose holds the cache Transformers would have returned instead
        (`cache.returned_as_transformers_returns_it`), and a `DynamicCache` the caller gave holds the tokens
        cached afterwards (`cache.given_caches_written_back`)."""
        if not _on_tpu(self):
            return original(self, inputs, generation_config, *args, **kwargs)
        with given_caches_written_back(self):
            output = _generate(original, self, inputs, generation_config, *args, **kwargs)
        return returned_as_transformers_returns_it(self, output)

    return generate


def _generate(original, self, inputs, generation_config, *args, **kwargs):
    """`generate()` on tpu, the host-side bookkeeping where it applies (see `_wrap_generate`)."""
    prepare_model(self)
    _signatures_read_once(self)
    input_ids = inputs if inputs is not None else kwargs.get("input_ids")
    if args or not isinstance(input_ids, torch.Tensor) or input_ids.device.type != "tpu":
        return original(self, inputs, generation_config, *args, **kwargs)
    resolved_kwargs = dict(kwargs)
    resolved, model_kwargs = self._prepare_generation_config(generation_config, **resolved_kwargs)
    if not _is_plain_prompt(self, input_ids, model_kwargs) or not _loop_runs_on_the_host(resolved, kwargs):
        return original(self, inputs, generation_config, *args, **kwargs)
    kwargs.pop("input_ids", None)
    mask = kwargs.pop("attention_mask", None)
    host_ids = input_ids.cpu()
    host_mask = mask.cpu() if mask is not None else None
    padding = 0
    if settings.prompt_buckets and model_patches.pads_prompts(self) and _padding_keeps_the_result(
            resolved, kwargs, model_kwargs):
        padding = bucketed_length(host_ids.shape[1]) - host_ids.shape[1]
        longest = _longest_sequence(self.config.get_text_config(decoder=True))
        if longest is not None and host_ids.shape[1] + padding + resolved.max_new_tokens > longest:
            padding = 0
    if padding:
        if host_mask is None:
            host_mask = _prompt_mask(host_ids, resolved)
        host_ids, host_mask = _left_pad(host_ids, host_mask, padding)
    reuses_the_cache = _prefill_reuses_the_cache(resolved, host_ids.shape[1])
    plain = plain_key(kwargs) if reuses_the_cache and settings.static_cache and generation_config is None else None
    kind = None if plain is None else (plain, tuple(host_ids.shape), host_mask is None)
    # the launch ahead first: the contexts after it set functions of their own on the model for the call
    with _prefill_launched_ahead(self, kind, host_ids), _step_inputs_on_the_model(self), \
            _config_resolved_once(self, resolved, model_kwargs, resolved_kwargs), \
            static_cache_kept(self, keep=reuses_the_cache):
        output = original(self, host_ids, generation_config, attention_mask=host_mask, **kwargs)
    return _to_device(_strip_padding(output, padding), input_ids.device)


# what Transformers' `generate()` reads the signature of at each call: the model's `forward` (four times), its input
# preparation (to check the call's arguments), and the decoding method
_SIGNATURES_READ = ("forward", "prepare_inputs_for_generation", "_sample")


def _signatures_read_once(model) -> None:
    """`inspect.signature` computes a function's signature anew at every call (and follows each decorator's
    `__wrapped__`); Transformers' `generate()` asks for seven of the model's class's functions' at each call,
    0.18 ms of a warm `generate()` of one token on the development CPU, before the prefill starts. A function's
    signature does not change: each gets it as `__signature__`, which `inspect.signature` returns at once (for
    a bound method too, less its first argument)."""
    for name in _SIGNATURES_READ:
        function = getattr(type(model), name, None)
        if isinstance(function, types.FunctionType) and "__signature__" not in function.__dict__:
            function.__signature__ = inspect.signature(function)


def _prefill_reuses_the_cache(generation_config, length: int) -> bool:
    """Whether a call keeps its static cache for the next and may take the previous one's
    (`cache.static_cache_kept`): where its result does not hold the cache, and its prompt's length is a
    bucket's, so that its prefill is the compiled one, which writes into an allocated cache. An eager prefill
    reads a cache's length from the device once its layers are allocated (three host reads more)."""
    return (not generation_config.return_dict_in_generate and bool(settings.prompt_buckets)
            and bucketed_length(length) == length)


# what configs call the longest sequence their position tables (GPT-Neo's causal mask, MPT's ALiBi
# biases) cover
_LONGEST_SEQUENCE_NAMES = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length")


def _longest_sequence(config) -> int | None:
    return next((getattr(config, name) for name in _LONGEST_SEQUENCE_NAMES
                 if isinstance(getattr(config, name, None), int)), None)


# generation config attributes that Transformers' `_prepare_generation_config` takes from the kwargs and then
# puts back among the model's kwargs when set
_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states")


@contextlib.contextmanager
def _config_resolved_once(model, resolved, model_kwargs: dict, resolved_kwargs: dict):
    """Transformers' `generate()` resolves the generation config (a deepcopy of it, merged with the model's
    and the global defaults, then the kwargs) that the wrapper above has already resolved from the same
    arguments: for the call, its first `_prepare_generation_config` gets the wrapper's config instead of a
    second one. The kwargs it is given differ from the wrapper's only in keys that are not config
    attributes (the ids and mask, moved to the host; `generate()`'s own arguments, taken out of them),
    which come back as the model's kwargs, as Transformers' own split returns them; any other difference
    resolves the config again."""
    def _prepare_generation_config(generation_config=None, **kwargs):
        del model.__dict__["_prepare_generation_config"]  # once: a later call resolves its own
        consumed = {key for key in resolved_kwargs if key not in model_kwargs or key in _OUTPUT_FLAGS}
        if not (set(kwargs) - set(resolved_kwargs) <= {"attention_mask"}
                and not consumed - set(kwargs) - {"attention_mask"}
                and all(kwargs[key] is resolved_kwargs[key] for key in consumed if key in kwargs)):
            return model._prepare_generation_config(generation_config, **kwargs)
        unused = {key: value for key, value in kwargs.items() if key not in consumed}
        unused.update({name: getattr(resolved, name) for name in _OUTPUT_FLAGS if getattr(resolved, name)})
        return resolved, unused

    model.__dict__["_prepare_generation_config"] = _prepare_generation_config
    try:
        yield
    finally:
        model.__dict__.pop("_prepare_generation_config", None)


@contextlib.contextmanager
def _step_inputs_on_the_model(model):
    """Transformers' own `prepare_inputs_for_generation` moves each step's inputs to the model; some
    models' overrides build them on the ids' device and do not (XLM, Flaubert), which with the ids on
    the host gave a tpu model CPU inputs. For the call, the model's own preparation is followed by
    that move (a no-op where it already happened)."""
    from transformers.generation import GenerationMixin
    from transformers.pytorch_utils import move_to_device

    if type(model).prepare_inputs_for_generation is GenerationMixin.prepare_inputs_for_generation:
        yield  # Transformers' own: it moves them itself
        return
    prepare = model.prepare_inputs_for_generation

    @functools.wraps(prepare)  # Transformers reads its signature to validate generate()'s arguments
    def prepare_inputs_for_generation(*args, **kwargs):
        return move_to_device(prepare(*args, **kwargs), model.device)

    model.prepare_inputs_for_generation = prepare_inputs_for_generation
    try:
        yield
    finally:
        del model.prepare_inputs_for_generation


# --- Decoding on the device: every token after the first in one hf_tpu.while_loop

# warpers that read only the scores, not the ids generated so far (which the loop does not carry)
_SCORE_ONLY_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")


def _length_gate(processor) -> tuple | None:
    """For a processor whose only input besides the scores is the ids' length: ("hide_eos", n) when it
    hides the end-of-sequence tokens while the ids are shorter than n (`min_length`, `min_new_tokens`),
    ("force_eos", n) when it leaves only them once the ids are n long (`forced_eos_token_id`). Transformers'
    processors read that length from the ids' shape, which the loop does not grow; the loop applies them
    from its step count instead."""
    name = type(processor).__name__
    if name == "MinLengthLogitsProcessor":
        return "hide_eos", processor.min_length
    if name == "MinNewTokensLengthLogitsProcessor":
        return "hide_eos", processor.prompt_length_to_skip + processor.min_new_tokens
    if name == "ForcedEOSTokenLogitsProcessor":
        return "force_eos", processor.max_length - 1
    return None


# what `_sample` may receive besides the ids for the loop to rebuild each step's inputs exactly
_LOOP_MODEL_KWARGS = {"attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep"}


def _decodes_on_device(model, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
                       model_kwargs) -> bool:
    """Greedy search or sampling of a decoder-only model with Transformers' own input preparation, a static
    cache that Transformers would decode with a compiled forward, and nothing that needs the host per token
    (a streamer, returned scores, a processor or stopping criterion that reads the growing ids). Not where
    the caller gave a `compile_config`: that asks for Transformers' compiled decode steps (`_traces_directly`)."""
    from transformers.cache_utils import StaticLayer
    from transformers.generation import GenerationMixin
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    cache = model_kwargs.get("cache")
    return (
        settings.device_loop
        and _on_tpu(model)
        and generation_config.compile_config is None  # one given asks for Transformers' compiled decode steps
        and not model.config.is_encoder_decoder
        and type(model).prepare_inputs_for_generation is GenerationMixin.prepare_inputs_for_generation
        and type(model)._update_model_kwargs_for_generation is GenerationMixin._update_model_kwargs_for_generation
        and not (synced_gpus or streamer is not None or generation_config.return_dict_in_generate
                 or generation_config.is_assistant)
        and set(model_kwargs) <= _LOOP_MODEL_KWARGS
        and model_kwargs.get("use_cache", True)
        and cache is not None and all(type(layer) is StaticLayer for layer in getattr(cache, "layers", [None]))
        and model._valid_auto_compile_criteria(model_kwargs, generation_config)
        and all(type(p).__name__ in _SCORE_ONLY_PROCESSORS or _length_gate(p) is not None for p in logits_processor)
        and all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in stopping_criteria)
        and sum(type(c) is MaxLengthCriteria for c in stopping_criteria) == 1
    )


def _wrap_sample(original):
    @functools.wraps(original)
    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        """Transformers' own loop makes the prefill and the first token; the rest is one device loop. A call
        that makes one token at most (the time to first token) is Transformers' loop alone."""
        from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList

        max_length = next((c.max_length for c in stopping_criteria if type(c) is MaxLengthCriteria), None)
        if (max_length is None or max_length <= input_ids.shape[1] + 1
                or not _decodes_on_device(self, logits_processor, stopping_criteria, generation_config, synced_gpus,
                                          streamer, model_kwargs)):
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                            streamer, **model_kwargs)
        eos = next((c.eos_token_id for c in stopping_criteria if type(c) is not MaxLengthCriteria), None)
        first_token_only = StoppingCriteriaList(
            [MaxLengthCriteria(input_ids.shape[1] + 1) if type(c) is MaxLengthCriteria else c for c in stopping_criteria])
        _compile_loop_ahead(self, input_ids, eos, max_length, logits_processor, generation_config, model_kwargs)
        input_ids = original(self, input_ids, logits_processor, first_token_only, generation_config, synced_gpus,
                             streamer, **model_kwargs)
        finished = torch.isin(input_ids[:, -1], eos.to(input_ids.device)) if eos is not None else None
        if input_ids.shape[1] >= max_length or (finished is not None and bool(finished.all())):
            return input_ids
        new_tokens = _decode_loop(self, input_ids, finished, max_length - input_ids.shape[1], eos,
                                  logits_processor, generation_config, model_kwargs)
        return torch.cat([input_ids, new_tokens.to(input_ids.device)], dim=-1)

    return _sample


def _wrap_valid_auto_compile_criteria(original):
    @functools.wraps(original)
    def _valid_auto_compile_criteria(self, model_kwargs, generation_config):
        """On tpu, a model running Transformers' per-expert loop (`experts_implementation="eager"`) decodes
        without compiling: each expert takes the tokens routed to it (`torch.where`), a shape that depends on
        the data, so no step is one program. Compiled, Dynamo breaks the graph at every expert and compiles the
        pieces again for every new count; on the v5e a Qwen3-MoE-shaped model at batch 64 made no token in
        400 s that way. Run eagerly, each op's program is compiled once per count it meets."""
        if _on_tpu(self) and _runs_the_per_expert_loop(self):
            return False
        return original(self, model_kwargs, generation_config)

    return _valid_auto_compile_criteria


# model -> whether it holds experts modules (Transformers' `use_experts_implementation` classes)
_HAS_EXPERTS = weakref.WeakKeyDictionary()


def _runs_the_per_expert_loop(model) -> bool:
    if getattr(model.config, "_experts_implementation", None) != "eager":
        return False
    has_experts = _HAS_EXPERTS.get(model)
    if has_experts is None:  # the decorated experts classes set `_is_expert_parallel` in their `__init__`
        has_experts = _HAS_EXPERTS[model] = any(hasattr(m, "_is_expert_parallel") for m in model.modules())
    return has_experts


def _wrap_get_compiled_call(original):
    @functools.wraps(original)
    def get_compiled_call(self, compile_config):
        """On tpu, the compiled call for Transformers' default compile config is made when it is first called,
        not when it is asked for. Transformers' `_sample` asks for it before the prefill, for the decode steps,
        also where none follows (a call of one token) or where hf-tpu runs them as one device loop; making it is
        `torch.compile`, whose first use in a process imports Dynamo's backends and AOT autograd (1.2 s in a
        fresh process on the development CPU, a second process's first `generate()` of one token 1.47 ->
        1.33 s). A `compile_config` the caller gave asks for Transformers' compiled path (`_traces_directly`):
        the call is made at once, as Transformers makes it, and the decode steps run it, so that the model holds
        it as `_compiled_call` afterwards, as Transformers' API has it."""
        if not _on_tpu(self) or compile_config is not None:
            return original(self, compile_config)
        return functools.partial(_call_compiled, original, self, compile_config)

    return get_compiled_call


def _call_compiled(get_compiled_call, model, compile_config, *args, **kwargs):
    return get_compiled_call(model, compile_config)(*args, **kwargs)


def _decode_loop(model, input_ids, finished, steps: int, eos, logits_processor, generation_config, model_kwargs,
                 run: bool = True):
    """Up to `steps` more tokens, as Transformers' `_sample` would make them after its first: each step
    feeds the last token at the next position. The 2D attention mask is as long as the static cache and
    zero past the token fed, which is what Transformers' growing mask is once padded to the cache. With
    `run=False`, the loop's program is only traced and compiled (`hf_tpu.while_loop(run=False)`): what it
    depends on is the shapes of the ids and of `finished`, not their values."""
    device = model.device
    cache = model_kwargs["cache"]
    batch, length = input_ids.shape
    mask = torch.zeros((batch, cache.layers[0].max_cache_len), dtype=torch.long)
    mask[:, :length] = 1
    if model_kwargs.get("attention_mask") is not None:
        prompt_mask = model_kwargs["attention_mask"]
        mask[:, :prompt_mask.shape[1]] = prompt_mask
    visible = torch.ones((batch, 1), dtype=torch.long, device=device)  # the mask's entry for each token fed
    do_sample = generation_config.do_sample
    first_position, limit = torch.tensor([length - 1], device=device), torch.tensor([steps], device=device)
    if eos is not None:
        eos = eos.to(device)
        pad = generation_config._pad_token_tensor.to(device)
    kwargs = {k: v for k, v in model_kwargs.items() if k not in ("attention_mask", "position_ids")}
    # the processors in their order, each as the index of one the step calls in `called`, or as its length
    # gate: (its kind, its end-of-sequence ids, the loop step where the ids reach its length). The step is a
    # tensor, so that another prompt length or bound does not recompile the loop. A gated processor is not
    # the loop's state: it is not called, and its own ids may be on the CPU, which a traced loop cannot read.
    called, plan = [], []
    for processor in logits_processor:
        gate = _length_gate(processor)
        if gate is None:
            plan.append(len(called))
            called.append(processor)
        else:
            plan.append((gate[0], processor.eos_token_id.to(device), torch.tensor([gate[1] - length], device=device)))
    has_positions = model_kwargs.get("position_ids") is not None  # models like Bloom take none

    def body(tokens, position_ids, mask, unfinished, generated, index):
        mask = torch.ops.hf_tpu.dynamic_update_slice(mask, 1, first_position + index, visible)
        inputs = model.prepare_inputs_for_generation(tokens[:, None], next_sequence_length=1, attention_mask=mask,
                                                     position_ids=position_ids if has_positions else None, **kwargs)
        logits = model(**inputs, return_dict=True).logits[:, -1].to(torch.float32)
        scores = logits
        for stage in plan:
            if isinstance(stage, int):
                scores = called[stage](tokens[:, None], scores)
                continue
            kind, eos_ids, step = stage  # the ids are `length + index` long at this step
            is_eos = torch.isin(torch.arange(scores.shape[-1], device=scores.device), eos_ids)
            if kind == "hide_eos":
                scores = scores.masked_fill(is_eos & (index < step), -math.inf)
            else:
                scores = scores.masked_fill(~is_eos & (index == step), -math.inf).masked_fill(
                    is_eos & (index == step), 0.0)
        if do_sample:
            tokens = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        if eos is not None:
            tokens = tokens * unfinished + pad * (1 - unfinished)
            unfinished = unfinished & ~torch.isin(tokens, eos)
        generated = torch.ops.hf_tpu.dynamic_update_slice(generated, 1, index, tokens[:, None])
        return tokens, position_ids + 1, mask, unfinished, generated, index + 1

    def cond(tokens, position_ids, mask, unfinished, generated, index):
        go_on = index < limit
        return go_on & (unfinished.max() > 0) if eos is not None else go_on

    unfinished = torch.ones(batch, dtype=torch.long) if finished is None else (~finished).long()
    # the first new token follows the prompt (carried unused by a model that takes no positions)
    position_ids = (model_kwargs["position_ids"][:, -1:] + 1 if has_positions
                    else torch.zeros(batch, 1, dtype=torch.long))
    generated = torch.zeros_like(mask)  # as long as the cache, so that any number of new tokens fits one program
    carried = (input_ids[:, -1], position_ids, mask, unfinished, generated, torch.zeros(1, dtype=torch.long))
    from hf_tpu import while_loop

    # traced straight from Python with the model, the cache and the warpers as the loop's state, unless the
    # compile config asks for what only torch.compile does
    state = (model, cache, called) if _traces_directly(generation_config.compile_config) else None
    carried = tuple(t.to(device) for t in carried)
    if not run:
        return while_loop(cond, body, carried, state=state, run=False)
    *_, generated, index = while_loop(cond, body, carried, state=state)
    return generated[:, :int(index)]


_LOOPS_AHEAD = "_hf_tpu_loops_compiled_ahead"


def _compile_loop_ahead(model, input_ids, eos, max_length: int, logits_processor, generation_config, model_kwargs):
    """On a first call of its kind, the decode loop is traced before the prefill and compiled on a thread of its
    own while the prefill traces and compiles (on the v5e a 1.1B Llama's prefill took 10.9 s of XLA compile and
    its loop 8.9 s, one after the other). The loop's trace needs only the shapes the prefill will leave (the ids
    one token longer, the static cache allocated), so it is traced with placeholder ids, and the cache is
    allocated here instead of just before the prefill.

    "Of its kind" is judged by the ids' shape, the cache's length and what the loop's program depends on
    besides: a call judged new whose program exists costs its trace's key walk; one judged seen compiles as
    before, after the prefill."""
    cache = model_kwargs.get("cache")
    if not (_traces_directly(generation_config.compile_config)
            and _compiles_the_prefill(model, input_ids, generation_config, model_kwargs)):
        return
    kind = (tuple(input_ids.shape), cache.layers[0].max_cache_len, generation_config.do_sample, eos is None,
            tuple(type(p) for p in logits_processor), model_kwargs.get("attention_mask") is not None,
            model_kwargs.get("position_ids") is not None)
    seen = model.__dict__.setdefault(_LOOPS_AHEAD, set())
    if kind in seen:
        return
    shape = model._get_static_cache_init_shape()
    if shape is None:  # the prefill runs eagerly, and the loop compiles after it
        return
    seen.add(kind)
    _allocate_static_cache(model, cache, input_ids.shape[0], shape)
    allocated_ahead.add(cache)
    batch, length = input_ids.shape
    ids = input_ids.new_zeros((batch, length + 1))  # the prompt and its first new token
    finished = None if eos is None else torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    _decode_loop(model, ids, finished, max_length - length - 1, eos, logits_processor, generation_config,
                 model_kwargs, run=False)


def _allocate_static_cache(model, cache, batch: int, shape: tuple) -> None:
    """Allocate a fresh static cache's keys and values, of (heads, head size) `shape`, before the traced
    forward writes into them, as Transformers does for its compiled chunked prefill: allocated inside the
    graph, they would be its outputs, not the fixed inputs the decode step holds."""
    cache.early_initialization(batch_size=batch, num_heads=shape[0], head_dim=shape[1], dtype=model.dtype,
                               device=model.device)
    setattr(cache, ALLOCATED_WHOLE, True)


# --- The prefill compiled once per prompt bucket

# The prefill's own compiled function: Dynamo keeps its graphs per code object, and the one
# `get_compiled_call` compiles (`Module.__call__`) is shared with Transformers' token-by-token decode steps and
# every other model; once that code hits Dynamo's recompile limit (8) it runs eagerly for good, prefill
# included. This code holds an entry per model, prompt bucket and batch size, under a limit of its own.
_PREFILL_RECOMPILE_LIMIT = 64
_COMPILED_PREFILL = "_hf_tpu_compiled_prefill"


def _prefill_forward(model, inputs: dict):
    """The forward over the prompt into static caches that are to hold nothing before it: each is zeroed first,
    inside the program. One kept from the previous call (`cache.static_cache_kept`) holds that call's keys, values
    and lengths, and zeroing it here costs no launch of its own (0.8 ms of a warm `generate()` of one token on
    the v5e's host); a fresh one is zero already, and costs one more pass over its memory."""
    for cache in _prefill_state(model, inputs)[1:]:
        zero_static_cache(cache)
    return model(**inputs, return_dict=True)


def _traces_directly(compile_config) -> bool:
    """Whether the prefill and the decode loop are traced straight from Python (`hf_tpu.jit`,
    `hf_tpu.while_loop(state=...)`) rather than compiled with `torch.compile`: unless turned off
    (`configure(direct_trace=False)`), where the caller gave no `compile_config` (Transformers' default for tpu
    then applies, `backend="tpu"`, static shapes, which the trace makes the same program of).

    A `compile_config` the caller gave, per call or on the model's generation config, asks for Transformers'
    compiled path, and gets it with the `tpu` backend (in place of Inductor, `cache._tpu_compile_config`): the
    decode steps run one by one through `model.get_compiled_call(compile_config)` (`torch.compile` of the
    model's call with that config, kept as `model._compiled_call`, as Transformers keeps it), with no device
    loop (`_decodes_on_device`), and the prefill is `torch.compile`d with that config too. Its settings
    (`fullgraph`, `dynamic`, `options`) then apply as the caller set them."""
    return settings.direct_trace and compile_config is None


def _prefill_state(model, inputs: dict) -> tuple:
    """What the prefill reads and writes besides its inputs: the model's weights and the static cache."""
    from transformers.cache_utils import Cache

    return (model, *(value for value in inputs.values() if isinstance(value, Cache)))


def _compiled_prefill(model, compile_config):
    """`_prefill_forward` traced directly (`hf_tpu.jit`, see `_traces_directly`), or compiled as Transformers
    compiles the decode forward (`generation_config.compile_config`, by default `backend="tpu"`,
    `dynamic=False`), one per model and config; the traced one falls back to the compiled one for a call it
    cannot trace.

    Not guarded, as in Transformers' compiled decode: the model's config (its attention implementation, say)
    and the Python attributes of its modules; changing them between calls needs a new model object. What the
    traced program does key is listed in `hf_tpu.direct`."""
    traced = _traces_directly(compile_config)
    compile_config = compile_config or model._default_compile_config()
    key = (compile_config, traced)
    cached = model.__dict__.get(_COMPILED_PREFILL)
    if cached is None or cached[0] != key:
        compiled = functools.partial(_compiled_forward, functools.cache(
            lambda: torch.compile(_prefill_forward, **compile_config.to_dict())))
        if key[1]:
            compiled = hf_tpu.jit(_prefill_forward, state=_prefill_state, fallback=compiled)
        cached = (key, compiled)
        model.__dict__[_COMPILED_PREFILL] = cached
    return cached[1]


def _compiled_forward(compiled, model, inputs: dict):
    with torch._dynamo.config.patch(recompile_limit=_PREFILL_RECOMPILE_LIMIT):
        return compiled()(model, inputs)


def _compiles_the_prefill(model, input_ids, generation_config, model_kwargs) -> bool:
    """Whether the prefill runs as a compiled forward: on tpu with a fresh static cache that
    Transformers decodes with a compiled forward, in one piece (not chunked), and for a prompt whose length
    is a bucket length. The last bounds the compiles to one per bucket (and batch size): a prompt that was
    not padded (buckets off, padding skipped because it could change the result, or a model whose table
    entry says `unpadded_prompts`, whose output changes with padding) runs eagerly unless its length is a
    bucket's, instead of compiling a program for every length it meets."""
    from transformers.cache_utils import StaticLayer

    cache = model_kwargs.get("cache")
    length = input_ids.shape[1]
    return (
        settings.static_cache
        and _on_tpu(model)
        and not model.config.is_encoder_decoder
        and generation_config.prefill_chunk_size is None
        and model_kwargs.get("inputs_embeds") is None
        and bool(settings.prompt_buckets) and bucketed_length(length) == length
        and cache is not None and not getattr(cache, "_is_user_defined", False)
        and bool(getattr(cache, "layers", None))
        and all(type(layer) is StaticLayer and (cache in allocated_ahead or not layer.is_initialized)
                for layer in cache.layers)
        and model._valid_auto_compile_criteria(model_kwargs, generation_config)
    )


def _wrap_prefill(original):
    @functools.wraps(original)
    def _prefill(self, input_ids, generation_config, model_kwargs, is_first_iteration=True):
        """On tpu, the prefill runs as one program (traced by `hf_tpu.jit`, or `torch.compile(backend="tpu")`
        configured as Transformers compiles its decode steps) with the static cache as its mutated input: one
        compile per prompt bucket, instead of every op over the whole prompt dispatched one by one."""
        compiled = is_first_iteration and _compiles_the_prefill(self, input_ids, generation_config, model_kwargs)
        cache = model_kwargs.get("cache")
        allocated = cache is not None and cache in allocated_ahead
        if allocated:
            allocated_ahead.discard(cache)
        if not compiled:
            if allocated:  # kept from the previous call, whose compiled prefill this call's settings turn off
                zero_static_cache(cache)
            return original(self, input_ids, generation_config, model_kwargs, is_first_iteration)
        # Transformers cannot always tell the cache's shape ahead (layers on several devices, distinct key and
        # value sizes): those prefill eagerly. A cache `_compile_loop_ahead` allocated is allocated already.
        shape = None if allocated else self._get_static_cache_init_shape()
        if not allocated and shape is None:
            return original(self, input_ids, generation_config, model_kwargs, is_first_iteration)
        # Transformers' `_prefill` for a fresh cache (nothing cached: `past_length` is 0), with the compiled call
        attention_mask = model_kwargs.get("attention_mask")
        mask_length = (attention_mask.shape[1] if attention_mask is not None
                       else getattr(generation_config, "_mask_length", -1))
        next_sequence_length = input_ids.shape[1] if mask_length == input_ids.shape[1] else None
        # from the inputs on, which may build a 4D mask: sized to the prompt, with no read of the cache's length
        with _attending_to_the_prompt_only(cache, input_ids.shape[1]):
            model_inputs = self.prepare_inputs_for_generation(input_ids, next_sequence_length=next_sequence_length,
                                                              is_first_iteration=True, **model_kwargs)
            if not allocated:
                _allocate_static_cache(self, cache, input_ids.shape[0], shape)
            outputs = _taken_from_ahead(self, generation_config.compile_config, model_inputs)
            if outputs is None:
                outputs = _compiled_prefill(self, generation_config.compile_config)(self, model_inputs)
                _note_prefill(self, generation_config.compile_config, model_inputs)
        if input_ids.device.type == "cpu":
            # the host's loop (`_wrap_generate`) reads the last position's logits next, after Transformers'
            # bookkeeping: their transfer starts now and overlaps it, instead of following it (0.5-0.7 ms on a v5e)
            hf_tpu.prefetch_to_cpu([outputs.logits])
        return outputs

    return _prefill


@contextlib.contextmanager
def _attending_to_the_prompt_only(cache, length: int):
    """The prefill of an empty static cache attends to the prompt's own keys and values (`length` of them),
    not to the whole cache: each layer still writes them into the cache, but hands the attention what it
    wrote, and tells the mask (and a model that pads its own mask, as Bloom does for ALiBi) that it is as long
    as the prompt, with the queries at offset 0 (as a plain int: the cache's own count is a tensor, with which
    Transformers' mask code builds a mask it could have left out). The cache's empty slots are masked out and
    add nothing to the result, only work: attention over the whole cache with an explicit mask, where a plain
    forward runs causal attention over the prompt (the flash kernel on a TPU; without padding Transformers
    then passes no mask at all). On the v5e a 4096-token prompt's first token took 1.40x its compiled forward
    over the whole cache, 1.26x over the prompt.

    Each layer gets the same function objects at every prefill of its length (`_prompt_only_functions`): the
    traced prefill's walk of the cache is replayed when the layers hold what they held at its last call, and
    new functions each call made it compare 48 entries of a 16-layer cache anew (0.1 ms on the development
    CPU)."""
    set_for_the_call = [(layer, _prompt_only_functions(layer, length)) for layer in cache.layers]
    set_for_the_call.append((cache, {"get_query_offset": _no_query_offset}))
    # what the objects held under those names before (an `update` someone else set), put back after
    held = [{name: vars(obj)[name] for name in attributes if name in vars(obj)} for obj, attributes in set_for_the_call]
    for obj, attributes in set_for_the_call:
        vars(obj).update(attributes)
    try:
        yield
    finally:
        for (obj, attributes), before in zip(set_for_the_call, held):
            for name in attributes:
                del vars(obj)[name]
            vars(obj).update(before)


def _no_query_offset(layer_idx=0):
    return 0


# static cache layer -> (prompt length, the functions `_attending_to_the_prompt_only` sets on it for that length)
_PROMPT_ONLY_FUNCTIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _prompt_only_functions(layer, length: int) -> dict:
    """The attributes a layer of a prefill over `length` prompt tokens gets: its `update` that writes and hands
    back what it wrote, and the mask's and the cache's length as the prompt's. Made once per layer and length;
    they reach the layer by a weak reference, so that keeping them does not keep the layer alive. A layer whose
    `update` someone else set on it gets an `update` that calls that one, made anew at each call (not kept: it
    could change between calls, and would hold the layer)."""
    if "update" in vars(layer):
        return _functions_for(length, layer.update)
    kept = _PROMPT_ONLY_FUNCTIONS.get(layer)
    if kept is not None and kept[0] == length:
        return kept[1]
    layer_ref, write = weakref.ref(layer), type(layer).update
    functions = _functions_for(length, lambda *args, **kwargs: write(layer_ref(), *args, **kwargs))
    _PROMPT_ONLY_FUNCTIONS[layer] = (length, functions)
    return functions


def _functions_for(length: int, write) -> dict:
    """A prefill layer's three attributes over `length` prompt tokens, its `update` writing through `write`."""
    def update(key_states, value_states, *args, **kwargs):
        write(key_states, value_states, *args, **kwargs)
        return key_states, value_states

    return {"update": update, "get_mask_sizes": lambda query_length: (length, 0), "get_max_length": lambda: length}


# --- The prefill launched ahead of Transformers' setup

class _PrefillAhead:
    """A model's compiled prefill as the last `generate()` call of one kind made it (the call's plain arguments,
    the prompt's shape, whether it came with a mask): the inputs besides the ids, in order (its static cache by a
    weak reference), and the compile config; and while a call of that kind runs, the launch made for it."""

    __slots__ = ("kind", "compile_config", "inputs", "launched", "misses")

    def __init__(self, kind, compile_config, inputs: dict):
        self.kind, self.compile_config, self.inputs = kind, compile_config, inputs
        self.launched = None  # (the inputs launched with, their outputs, the cache, its tensors' versions after)
        self.misses = False  # a launch of this kind was not taken: its inputs are not met again (see below)


# model -> its `_PrefillAhead`; model -> the kind of the `generate()` call running now
_prefills_ahead: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_kind_running: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _prefill_launched_ahead(model, kind, host_ids):
    """A warm `generate()` of a kind seen before launches its prefill at once, before Transformers' setup
    (special tokens, mask, cache, processors, input preparation: 1.2 ms of the v5e's host before the prefill's
    launch, with the chip idle), with the inputs the last call of its kind had and this call's ids; the setup
    then runs while the chip computes. The prefill Transformers then asks for takes that launch's outputs when
    its inputs are exactly those: the same keys in the same order, the same objects and plain values, tensors
    reading the same device arrays (`hf_tpu.same_values`: the ids and positions of a prompt of up to 4 KiB are
    shared uploads), the cache's tensors not written since, and the same compile config. Otherwise it launches
    its own: the prefill zeroes the cache and writes it whole, so running it again over the launch's leaves what
    one run leaves, and the kind is not launched ahead again (its inputs are new arrays each call: a longer
    prompt's ids).

    Only for a model in eval mode (a prefill taken or not then draws no random numbers), and a cache kept from
    the last call (`static_cache_kept`), the one Transformers' setup then takes when the call is of that kind."""
    if kind is None:
        yield
        return
    _kind_running[model] = kind
    record = _prefills_ahead.get(model)
    try:
        if record is not None and record.kind == kind and not record.misses and not model.training:
            _launch_ahead(model, record, host_ids)
        yield
    finally:
        _kind_running.pop(model, None)
        if record is not None:
            record.launched = None


def _launch_ahead(model, record: _PrefillAhead, host_ids) -> None:
    """Launch `record`'s prefill with this call's ids, where the cache it names is the one kept for this call."""
    inputs = {name: value() if isinstance(value, weakref.ref) else value for name, value in record.inputs.items()}
    caches = [value for name, value in inputs.items() if isinstance(record.inputs[name], weakref.ref)]
    if len(caches) != 1 or caches[0] is None or caches[0] is not spare_static_cache(model):
        return
    inputs["input_ids"] = host_ids.to(model.device)
    # as Transformers' `generate()` runs its prefill: without autograd
    with torch.no_grad(), _attending_to_the_prompt_only(caches[0], host_ids.shape[1]):
        outputs = _compiled_prefill(model, record.compile_config)(model, inputs)
    hf_tpu.prefetch_to_cpu([outputs.logits])
    record.launched = (inputs, outputs, caches[0], _tensor_versions(caches[0]))


def _taken_from_ahead(model, compile_config, model_inputs: dict):
    """The outputs of the prefill launched ahead for this call (`_prefill_launched_ahead`) when `model_inputs`
    and the compile config are what it was launched with, else None (and the kind is not launched ahead
    again)."""
    record = _prefills_ahead.get(model)
    launched = None if record is None else record.launched
    if launched is None:
        return None
    record.launched = None
    inputs, outputs, cache, versions = launched
    if (compile_config == record.compile_config and list(model_inputs) == list(inputs)
            and all(_same_input(model_inputs[name], inputs[name]) for name in inputs)
            and _tensor_versions(cache) == versions):
        return outputs
    record.misses = True
    return None


def _note_prefill(model, compile_config, model_inputs: dict) -> None:
    """Keep the inputs of a compiled prefill of the running call's kind for the next call of that kind: those
    of a model in eval mode whose inputs are tpu tensors, plain values and one cache."""
    kind = _kind_running.get(model)
    if kind is None or model.training or "input_ids" not in model_inputs:
        return
    record = _prefills_ahead.get(model)
    if record is not None and record.kind == kind and record.misses:
        return
    cache_type = _cache_type()
    caches = [value for value in model_inputs.values() if isinstance(value, cache_type)]
    if len(caches) != 1 or not all(
            isinstance(value, cache_type) or type(value) in PLAIN_VALUES
            or (isinstance(value, torch.Tensor) and value.device.type == "tpu") for value in model_inputs.values()):
        return
    # in their order (the program's key follows it); the ids are each call's own
    inputs = {name: None if name == "input_ids" else weakref.ref(value) if isinstance(value, cache_type) else value
              for name, value in model_inputs.items()}
    _prefills_ahead[model] = _PrefillAhead(kind, compile_config, inputs)


def _same_input(now, then) -> bool:
    if isinstance(now, torch.Tensor):
        return isinstance(then, torch.Tensor) and hf_tpu.same_values(now, then)
    return now is then or (type(now) is type(then) and type(now) in PLAIN_VALUES and now == then)


def _tensor_versions(cache) -> tuple:
    """The version counters of a cache's layers' tensors: an in-place write (a `reset()`) moves them."""
    return tuple(value._version for layer in cache.layers for value in vars(layer).values()
                 if isinstance(value, torch.Tensor))


def _cache_type():
    from transformers.cache_utils import Cache

    return Cache
