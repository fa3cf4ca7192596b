"""Greedy search and sampling on `tpu` after the first token: every other token in one `hf_tpu.while_loop` on the
device (forward, logits warpers, token choice, end-of-sequence test), with no host round trip per token; the
loop traced and compiled ahead, beside the prefill, on a first call of its kind."""

from __future__ import annotations

import functools
import math

import torch

from .cache import allocated_ahead
from .loading import _on_tpu
from .prefill import allocate_static_cache, compiles_the_prefill, traces_directly
from .settings import settings


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
    the caller gave a `compile_config`: that asks for Transformers' compiled decode steps (`traces_directly`).
    The static layers may be int8 ones (`Int8StaticCache`)."""
    from transformers.cache_utils import StaticLayer
    from transformers.generation import GenerationMixin
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    from .quantized_cache import Int8StaticLayer

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
        and cache is not None
        and all(type(layer) in (StaticLayer, Int8StaticLayer) for layer in getattr(cache, "layers", [None]))
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
        return torch.cat([input_ids, new_tokens], dim=-1)

    return _sample


def _decode_loop(model, input_ids, finished, steps: int, eos, logits_processor, generation_config, model_kwargs,
                 run: bool = True):
    """Up to `steps` more tokens, on the device of `input_ids`, as Transformers' `_sample` would make them after its
    first: each step feeds the last token at the next position. The 2D attention mask is as long as the static
    cache and zero past the token fed, which is what Transformers' growing mask is once padded to the cache. With
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
        # the mask's entry for the token fed, made in the step: made before it, it would be an op run on its own
        mask = torch.ops.hf_tpu.dynamic_update_slice(mask, 1, first_position + index, mask.new_ones((batch, 1)))
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
    # the last tokens in a storage of their own: a carried tensor is the loop's to overwrite, and ids left on tpu (a
    # cache the caller made is prefilled eagerly) would make them a view of the ids
    carried = (input_ids[:, -1].contiguous(), position_ids, mask, unfinished, generated,
               torch.zeros(1, dtype=torch.long))
    from hf_tpu import while_loop

    # traced straight from Python with the model, the cache and the warpers as the loop's state, unless the
    # compile config asks for what only torch.compile does
    state = (model, cache, called) if traces_directly(generation_config.compile_config) else None
    carried = tuple(t.to(device) for t in carried)
    if not run:
        return while_loop(cond, body, carried, state=state, run=False)
    *_, generated, index = while_loop(cond, body, carried, state=state)
    # moved whole to the ids' device, then cut: a part of it read to the host would be a program of its own
    return generated.to(input_ids.device)[:, :int(index)]


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
    if not (traces_directly(generation_config.compile_config)
            and compiles_the_prefill(model, input_ids, generation_config, model_kwargs)):
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
    allocate_static_cache(model, cache, input_ids.shape[0], shape)
    allocated_ahead.add(cache)
    batch, length = input_ids.shape
    ids = input_ids.new_zeros((batch, length + 1))  # the prompt and its first new token
    finished = None if eos is None else torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    _decode_loop(model, ids, finished, max_length - length - 1, eos, logits_processor, generation_config,
                 model_kwargs, run=False)
