"""`generate()` on `tpu`: the token bookkeeping on the host, the prompt left-padded to a bucket length (and the
padding taken off the result), the generation config resolved once a call, and which of Transformers' steps
compile (`get_compiled_call` made when first called, no compile for a model running the per-expert loop). The
prefill is `prefill.py`'s; the tokens after the first, `decode_loop.py`'s."""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref

import torch

from hf_tpu import model_patches

from .cache import given_caches_written_back, plain_key, returned_as_transformers_returns_it, static_cache_kept
from .loading import _on_tpu, prepare_model
from .prefill import bucketed_length, prefill_launched_ahead
from .settings import settings


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
    with prefill_launched_ahead(self, kind, host_ids), _step_inputs_on_the_model(self), \
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


# --- What Transformers compiles on tpu

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
        1.33 s). A `compile_config` the caller gave asks for Transformers' compiled path (`traces_directly`):
        the call is made at once, as Transformers makes it, and the decode steps run it, so that the model holds
        it as `_compiled_call` afterwards, as Transformers' API has it."""
        if not _on_tpu(self) or compile_config is not None:
            return original(self, compile_config)
        return functools.partial(_call_compiled, original, self, compile_config)

    return get_compiled_call


def _call_compiled(get_compiled_call, model, compile_config, *args, **kwargs):
    return get_compiled_call(model, compile_config)(*args, **kwargs)
