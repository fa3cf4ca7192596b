"""The prefill on `tpu`: compiled once per prompt bucket (traced by `hf_tpu.jit`, or `torch.compile`d as
Transformers compiles its decode steps) with the static cache as its mutated input, attending to the prompt's own
keys and values only, and on a warm call of a kind seen before launched ahead of Transformers' setup."""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch

import hf_tpu

from .cache import ALLOCATED_WHOLE, PLAIN_VALUES, allocated_ahead, spare_static_cache, zero_static_cache
from .loading import _on_tpu
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


def allocate_static_cache(model, cache, batch: int, shape: tuple) -> None:
    """Allocate a fresh static cache's keys and values, of (heads, head size) `shape`, before the traced
    forward writes into them, as Transformers does for its compiled chunked prefill: allocated inside the
    graph, they would be its outputs, not the fixed inputs the decode step holds."""
    cache.early_initialization(batch_size=batch, num_heads=shape[0], head_dim=shape[1], dtype=model.dtype,
                               device=model.device)
    setattr(cache, ALLOCATED_WHOLE, True)


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


def traces_directly(compile_config) -> bool:
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
    """`_prefill_forward` traced directly (`hf_tpu.jit`, see `traces_directly`), or compiled as Transformers
    compiles the decode forward (`generation_config.compile_config`, by default `backend="tpu"`,
    `dynamic=False`), one per model and config; the traced one falls back to the compiled one for a call it
    cannot trace.

    Not guarded, as in Transformers' compiled decode: the model's config (its attention implementation, say)
    and the Python attributes of its modules; changing them between calls needs a new model object. What the
    traced program does key is listed in `hf_tpu.direct`."""
    traced = traces_directly(compile_config)
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


def compiles_the_prefill(model, input_ids, generation_config, model_kwargs) -> bool:
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
        compiled = is_first_iteration and compiles_the_prefill(self, input_ids, generation_config, model_kwargs)
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
                allocate_static_cache(self, cache, input_ids.shape[0], shape)
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
def prefill_launched_ahead(model, kind, host_ids):
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
    """The outputs of the prefill launched ahead for this call (`prefill_launched_ahead`) when `model_inputs`
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
