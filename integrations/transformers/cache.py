"""The static KV cache `generate()` decodes with on `tpu`: chosen by default (unless the caller chose a
cache, or the model has sliding-window layers), its length rounded up to `cache_length_multiple`, decoding
compiled with the `tpu` backend instead of Inductor, and for a tensor-parallel model split by heads over
the chips as the attention projections are."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import warnings
import weakref

import torch

from .loading import _on_tpu
from .settings import settings


_ADAPTER_CHOSE_STATIC_CACHE = "_hf_tpu_default_static_cache"


def _wrap_prepare_generation_config(original):
    @functools.wraps(original)
    def _prepare_generation_config(self, generation_config=None, **kwargs):
        """On tpu, whether `generate()` makes the adapter's static cache is decided with the config, and noted on
        it (`_ADAPTER_CHOSE_STATIC_CACHE`) rather than set as its `cache_implementation`, which stays the caller's:
        model code reads that field and changes what it does for a static cache the caller asked for (Whisper's
        long-form `generate` pads the previous segments' text to a fixed length: a logits processor then saw
        other ids than on the CPU, and a batch conditioned on previous text got other tokens). The cache is made
        as Transformers makes a static one (`_prepare_cache_for_generation`)."""
        if not _on_tpu(self):
            return original(self, generation_config, **kwargs)
        generation_config, model_kwargs = _resolved_configs(self).resolve(self, original, generation_config, kwargs)
        chooses_static_cache = (
            model_kwargs.get("cache") is None
            and model_kwargs.get("past_key_values") is None
            and _static_cache_suits(self, generation_config)
        )
        # decided anew for every config resolved: one resolved before (a model's own `generate`, Whisper's, hands
        # its resolved config to Transformers' `generate`) keeps the attribute
        setattr(generation_config, _ADAPTER_CHOSE_STATIC_CACHE, chooses_static_cache)
        compile_config = generation_config.compile_config
        if compile_config is not None and compile_config.backend == "inductor":
            generation_config.compile_config = _tpu_compile_config(compile_config)
        return generation_config, model_kwargs

    return _prepare_generation_config


class _ResolvedConfigs:
    """The generation configs Transformers' `_prepare_generation_config` resolved for one model with no
    `generation_config` given, by the call's other arguments, while the model's generation config and config
    hold what they held then. Resolving copies a fresh config deeply, copies the model's deeply again
    (`to_dict`) and merges both with the defaults: 0.3 ms of a warm `generate()` of one token on the development
    CPU, 0.45 ms on the v5e's host, every call, for the same result. A call it has seen gets a copy of that
    result (its containers copied too: Transformers sets attributes of the config it is given, and a caller
    may change a list it reads) and the kwargs that are not config attributes, as Transformers returns them.

    What it keys a call by: each argument's name and value where the value is a number, a string, None, or a
    list or tuple of those; a tensor (a mask, ids) by its name alone, as long as it is not a config attribute
    (it is handed on as a model kwarg). A call with any other argument (a cache, an object) is resolved by
    Transformers, and so is one with a `generation_config` (an object the caller may change between calls)."""

    _KEPT = 64

    def __init__(self):
        self.generation_config, self.config = None, None  # the attributes they were resolved with
        # the call's key -> (the resolved config, the names it took as config attributes, the config's attributes
        # that hold lists, dicts or sets)
        self.results: dict = {}

    def resolve(self, model, original, generation_config, kwargs: dict):
        key = plain_key(kwargs) if generation_config is None else None
        if key is not None and not self._unchanged(model):
            self.results.clear()
            self.generation_config, self.config = None, None
        found = self.results.get(key) if key is not None else None
        if found is None:
            resolved, model_kwargs = original(model, generation_config, **kwargs)
            taken = frozenset(kwargs) - frozenset(model_kwargs)
            if key is not None and not any(isinstance(kwargs[name], torch.Tensor) for name in taken):
                self._keep(model, key, resolved, taken)
            return resolved, model_kwargs
        resolved, taken, containers = found
        model_kwargs = {name: value for name, value in kwargs.items() if name not in taken}
        # as Transformers hands them on to the model
        model_kwargs.update({flag: getattr(resolved, flag) for flag in ("output_attentions", "output_hidden_states")
                             if getattr(resolved, flag, False)})
        return _copied_config(resolved, containers), model_kwargs

    def _unchanged(self, model) -> bool:
        try:
            return (self.generation_config is not None and vars(model.generation_config) == self.generation_config
                    and vars(model.config) == self.config)
        except Exception:  # noqa: BLE001  (a value whose == does not give a bool: an array)
            return False

    def _keep(self, model, key, resolved, taken) -> None:
        if self.generation_config is None:
            try:
                self.generation_config = copy.deepcopy(vars(model.generation_config))
            except Exception:  # noqa: BLE001  (an attribute that cannot be copied: nothing is kept)
                return
            self.config = dict(vars(model.config))
        if len(self.results) >= self._KEPT:
            self.results.clear()
        kept = _copied_config(resolved)
        containers = tuple(name for name, value in vars(kept).items() if isinstance(value, (list, dict, set)))
        self.results[key] = (kept, taken, containers)


# the values a call's kwargs and a prefill's inputs are compared by as they are
PLAIN_VALUES = (bool, int, float, str, type(None))


def plain_key(kwargs: dict):
    """A `generate()` call's kwargs as a key (`_ResolvedConfigs`', and part of the kind of call whose prefill is
    launched ahead), or None when one of them cannot be keyed."""
    parts = []
    for name, value in kwargs.items():
        if isinstance(value, PLAIN_VALUES):
            parts.append((name, type(value), value))
        elif isinstance(value, torch.Tensor):
            parts.append((name, torch.Tensor))
        elif isinstance(value, (list, tuple)) and all(isinstance(item, PLAIN_VALUES) for item in value):
            parts.append((name, type(value), tuple((type(item), item) for item in value)))
        else:
            return None
    return tuple(sorted(parts, key=lambda part: part[0]))


def _copied_config(config, containers: tuple | None = None):
    """A copy of a generation config whose lists, dicts and sets (those named by `containers`, when it is
    given) are copies too, one level deep."""
    copied = copy.copy(config)
    attributes = vars(copied)
    if containers is None:
        containers = [name for name, value in attributes.items() if isinstance(value, (list, dict, set))]
    for name in containers:
        attributes[name] = copy.copy(attributes[name])
    return copied


def _static_cache_suits(model, generation_config) -> bool:
    """Whether the adapter decodes with a static cache where the caller chose no cache implementation."""
    return (
        settings.static_cache
        and generation_config.cache_implementation is None
        and generation_config.use_cache is not False
        and not generation_config.output_attentions  # their key length would be the static cache's
        and model._supports_default_dynamic_cache()
        and getattr(model, "_can_compile_fullgraph", False)
        and not _static_cache_has_sliding_layers(model.config)
    )


# model -> its `_ResolvedConfigs`
_resolved_by_model: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _resolved_configs(model) -> _ResolvedConfigs:
    configs = _resolved_by_model.get(model)
    if configs is None:
        configs = _resolved_by_model[model] = _ResolvedConfigs()
    return configs


def _static_cache_has_sliding_layers(config) -> bool:
    """Whether a static cache for this model would hold sliding-window layers. Transformers counts such a
    layer's length in a Python int that Dynamo guards on, so a compiled decoding step recompiles for every
    token until Dynamo's recompile limit (8) and then runs eagerly: a tiny Mistral's first `generate()`
    took 17-21 s instead of 2-5 s, for later calls of 0.27 s instead of 0.40 s (24 tokens; 1.08 s instead
    of 0.80 s for 64). Those models keep the dynamic cache."""
    try:
        from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING, StaticSlidingWindowLayer, \
            get_layer_types_and_kwargs
    except ImportError:  # another Transformers: its static cache is not known here
        return False
    text_config = config.get_text_config(decoder=True)
    fields = _layer_type_fields(text_config)
    known = _SLIDING_BY_FIELDS.get(fields) if fields is not None else None
    if known is not None:
        return known
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    sliding = any(issubclass(STATIC_LAYER_TYPE_MAPPING.get(kind, object), StaticSlidingWindowLayer)
                  for kind in layer_types)
    if fields is not None:
        if len(_SLIDING_BY_FIELDS) >= 1024:
            _SLIDING_BY_FIELDS.clear()
        _SLIDING_BY_FIELDS[fields] = sliding
    return sliding


# the answer of `_static_cache_has_sliding_layers` per `_layer_type_fields`: it runs at every `generate()` on tpu, and
# Transformers' `get_layer_types_and_kwargs` reads each layer's config through the heterogeneity checks of its
# attribute access (0.19 ms for 16 layers on the development CPU, 0.7 ms profiled on the v5e's host)
_SLIDING_BY_FIELDS: dict = {}
# what `get_layer_types_and_kwargs` derives a config's layer types from, when every layer's config is the config
_LAYER_TYPE_FIELDS = ("layer_types", "sliding_window", "attention_chunk_size", "kv_sharing_modes")


def _layer_type_fields(text_config) -> tuple | None:
    """The values a homogeneous config's layer types follow from (each layer's config is the config itself: its
    type, its layer count and `_LAYER_TYPE_FIELDS`), or None for a heterogeneous config, whose layers have fields
    of their own, or for fields that cannot be keyed."""
    if text_config.__dict__.get("_heterogeneity_spec") is not None:
        return None
    values = tuple(getattr(text_config, name, None) for name in _LAYER_TYPE_FIELDS)
    fields = (type(text_config), len(text_config.per_layer_config),
              *(tuple(value) if isinstance(value, list) else value for value in values))
    try:
        hash(fields)
    except TypeError:
        return None
    return fields


def _tpu_compile_config(compile_config):
    """A `CompileConfig` left at Inductor (its default backend, e.g. `CompileConfig(fullgraph=True)`) with the
    `tpu` backend instead: Inductor cannot generate code for `tpu` (it looks for a `torch_tpu` module), so
    this is the only backend under which the user's other settings can take effect."""
    _warn_inductor_replaced()
    tpu_config = dataclasses.replace(compile_config, backend="tpu", mode="default")
    tpu_config._compile_all_devices = compile_config._compile_all_devices
    return tpu_config


@functools.cache
def _warn_inductor_replaced() -> None:
    warnings.warn("hf_tpu: generate() compiles decoding for tpu with torch.compile(backend='tpu'); the "
                  "compile_config's 'inductor' backend cannot compile for tpu.", stacklevel=3)


def _wrap_prepare_cache_for_generation(original):
    @functools.wraps(original)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length, *args, **kwargs):
        """The static cache the adapter chose is rounded up to `cache_length_multiple` so that other lengths
        reuse its prefill and decode programs; one the user asked for keeps the length Transformers gives it.

        Transformers sizes the cache for every token but the last generated one (it is never fed back). A
        prompt padded to a bucket (a multiple) then fills the cache exactly when one token is asked for, and
        that call got a cache, and so a prefill program, of its own, where counting the last token too gives
        it the cache of calls asking for up to a multiple more (a first call of one token, then one of nine,
        compiled the 1.1B model's prefill twice on a TPU: 18 and 14 s).

        A `DynamicCache` the caller hands back (one a result held) is decoded in a static cache as well, with
        its tokens written in first, and gets the tokens cached back when the call ends (`given_caches_written_back`):
        decoding it as it is would run every op eagerly, a new program for every length, each token."""
        given = model_kwargs.get("cache")
        if _on_tpu(self) and given is not None:
            _check_static_layers_hold(given, max_cache_length)
        takes_over = _on_tpu(self) and _takes_over(self, generation_config, given, batch_size)
        if takes_over:
            del model_kwargs["cache"]
        adapter_chose = _on_tpu(self) and (takes_over or getattr(generation_config, _ADAPTER_CHOSE_STATIC_CACHE, False))
        if adapter_chose:
            multiple = settings.cache_length_multiple
            if multiple > 1:  # 1: the exact length Transformers gives
                max_cache_length = -(-(max_cache_length + 1) // multiple) * multiple
        with _static_cache_implementation(generation_config, adapter_chose):
            result = original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
                              *args, **kwargs)
        if adapter_chose and model_kwargs.get("cache") is not None:
            setattr(model_kwargs["cache"], ADAPTERS_CACHE, True)
        if _on_tpu(self):
            _shard_static_cache_like_the_model(self, model_kwargs.get("cache"))
        if takes_over:
            static = model_kwargs["cache"]
            for index, layer in enumerate(given.layers):  # the tokens cached so far, at the cache's start
                static.update(layer.keys, layer.values, index)
            _taken_over.get().append((static, given))
            setattr(static, _GIVEN, given)
        return result

    return _prepare_cache_for_generation


@contextlib.contextmanager
def _static_cache_implementation(generation_config, applies: bool):
    """While Transformers makes the cache: `cache_implementation="static"` where the adapter chose the static cache,
    and the caller's value again after."""
    if not applies:
        yield
        return
    callers = generation_config.cache_implementation
    generation_config.cache_implementation = "static"
    try:
        yield
    finally:
        generation_config.cache_implementation = callers


# set on a cache `generate()` made because the adapter chose the static cache (not one the caller asked for or gave)
ADAPTERS_CACHE = "_hf_tpu_adapters_cache"


def _check_static_layers_hold(cache, positions: int) -> None:
    """A static cache the caller gave holds the positions the call writes (`positions`: the prompt and the new
    tokens but the last), or `IndexError`, as the CPU raises at its first write past the end (`index_copy_`). On
    tpu the write's start is clamped, as XLA clamps a dynamic-update-slice, and every token past the end would
    overwrite the last position, silently; the check is made before decoding, where the lengths are host numbers
    (a call that would stop early at an end-of-sequence token raises too)."""
    from transformers.cache_utils import StaticLayer

    lengths = [layer.max_cache_len for layer in getattr(cache, "self_attention_cache", cache).layers
               if type(layer) is StaticLayer]
    if lengths and min(lengths) < positions:
        raise IndexError(f"the StaticCache given to generate() holds {min(lengths)} positions and this call writes "
                         f"{positions} (the prompt and max_new_tokens, less one); give a StaticCache with "
                         f"max_cache_len >= {positions}, or ask for fewer new tokens")


# the (static cache, `DynamicCache` the caller gave) pairs of the `generate()` calls running, innermost last
_taken_over: contextvars.ContextVar = contextvars.ContextVar("hf_tpu_caches_taken_over", default=None)
# set on a static cache made for a `DynamicCache` the caller gave: that cache
_GIVEN = "_hf_tpu_given_cache"


def _takes_over(model, generation_config, given, batch_size: int) -> bool:
    """Whether a cache the caller gave is decoded in the adapter's static cache: a plain `DynamicCache` of a
    decoder-only model (no sliding-window or offloaded layers) holding tokens on tpu, one row per prompt (no
    beams or extra sequences, which Transformers would lay out anew), inside a `generate()` call of the adapter
    (`given_caches_written_back`, which gives the tokens back)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return (
        _taken_over.get() is not None
        and type(given) is DynamicCache
        and not getattr(given, "offloading", False)
        and not model.config.is_encoder_decoder
        and generation_config.num_beams == 1 and generation_config.num_return_sequences == 1
        and not generation_config.is_assistant  # an assistant's cache is cropped back between its calls
        and bool(given.layers)
        and all(type(layer) is DynamicLayer and layer.is_initialized and layer.keys.device.type == "tpu"
                and layer.keys.shape[0] == batch_size for layer in given.layers)
        and _static_cache_suits(model, generation_config)
    )


@contextlib.contextmanager
def given_caches_written_back(model):
    """Around a `generate()` call on tpu: each `DynamicCache` the caller gave and the adapter decoded in a static
    cache (`_prepare_cache_for_generation`) holds, when the call returns, what the static cache holds, as
    Transformers' own decoding leaves it; a call that raised leaves it as it was."""
    taken = []
    token = _taken_over.set(taken)
    try:
        yield
    finally:
        _taken_over.reset(token)
    text_config = model.config.get_text_config(decoder=True)
    for static, given in taken:
        given.layers = _dynamic_cache(static, text_config).layers


def returned_as_transformers_returns_it(model, output):
    """`generate()`'s result with the cache it holds (a `return_dict_in_generate` output's `cache`) as Transformers
    would have returned it, where the adapter chose the static cache: a `DynamicCache` (inside an
    `EncoderDecoderCache` for an encoder-decoder model) of the tokens cached, not the static cache, whose keys
    and values are as long as the cache and whose length is a count on the device. The caller hands that cache
    back to continue, and model code reads its tensors: the static cache's padding made Whisper's `generate()`
    return a cache 128 positions long, and a continuation given it back fed no token (the cache counted the
    whole prompt as cached); a decoder-only continuation past the static cache's length wrote its last slot
    over and over (the write's start is clamped on tpu, where CPU's `index_copy_` raises) and gave other logits
    than the CPU's, silently. A cache the caller asked for or gave is returned as it is."""
    cache = output.get("cache") if hasattr(output, "keys") else None
    if cache is None or not getattr(cache, ADAPTERS_CACHE, False):
        return output
    if hasattr(cache, _GIVEN):  # the cache the caller gave, holding the tokens now (`given_caches_written_back`)
        output["cache"] = getattr(cache, _GIVEN)
        return output
    from transformers.cache_utils import EncoderDecoderCache

    text_config = model.config.get_text_config(decoder=True)
    if isinstance(cache, EncoderDecoderCache):
        output["cache"] = EncoderDecoderCache(_dynamic_cache(cache.self_attention_cache, text_config),
                                              _dynamic_cache(cache.cross_attention_cache, text_config))
    else:
        output["cache"] = _dynamic_cache(cache, text_config)
    return output


def _dynamic_cache(cache, text_config):
    """A `DynamicCache` holding what each layer of a static cache holds up to its count (one read of the counts),
    built as Transformers builds its default cache (from the config's layer types). A layer never written (no
    token reached it) stays empty."""
    from transformers.cache_utils import DynamicCache

    written = [layer for layer in cache.layers if layer.is_initialized]
    lengths = iter(torch.stack([layer.cumulative_length for layer in written]).tolist() if written else ())
    data = []
    for layer in cache.layers:
        if layer.is_initialized:
            length = next(lengths)
            data.append((layer.keys[:, :, :length], layer.values[:, :, :length]))
        else:
            data.append((None, None))
    return DynamicCache(data, config=text_config)


# --- The static cache kept from one `generate()` to the next

# Static caches whose keys and values are allocated ahead of their prefill (by `_compile_loop_ahead`, or kept from
# the previous call): the compiled prefill zeroes them and writes into them as it does into a fresh cache's
allocated_ahead = weakref.WeakSet()
# set on a static cache allocated whole ahead of its compiled prefill (the model's cache shape is known)
ALLOCATED_WHOLE = "_hf_tpu_allocated_whole"
# model -> {"in use": (key, cache) or None while a call runs, "spare": (key, cache) kept for the next call}; held
# beside the model, not in its `__dict__`, whose contents `hf_tpu.jit`'s replayed module walk compares
_static_caches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _wrap_prepare_static_cache(original):
    @functools.wraps(original)
    def _prepare_static_cache(self, cache_implementation, batch_size, max_cache_len, prefill_chunk_size,
                              model_kwargs):
        """On tpu, the static cache the adapter chose for the previous call is used again when this call asks
        for the same one (batch size, length after Transformers' rounding up to the longest seen, dtype,
        device), instead of a new `StaticCache` built from the config and allocated layer by layer: on the v5e
        that took about 3 ms of a 14 ms `generate()` of one token after a 128-token prompt. It still holds the
        previous call's keys, values and lengths: its prefill zeroes them (`generation._prefill_forward`, inside
        the compiled prefill's program). Only calls within `static_cache_kept` (the adapter's own `generate()`
        path) keep and take a cache, one at a time."""
        kept = _static_caches.get(self, {})
        reusable = ("in use" in kept  # within `static_cache_kept`
                    and cache_implementation == "static" and prefill_chunk_size is None
                    and not self.config.is_encoder_decoder)
        length = max(max_cache_len, getattr(self, "_previous_max_cache_length", -1))
        key = (batch_size, length, self.dtype, self.device)
        spare = kept.pop("spare", None) if reusable else None
        if spare is not None and spare[0] == key:
            cache = spare[1]
            allocated_ahead.add(cache)
            self._previous_max_cache_length = length
        else:
            cache = original(self, cache_implementation, batch_size, max_cache_len, prefill_chunk_size, model_kwargs)
        if reusable:
            kept["in use"] = (key, cache)
        return cache

    return _prepare_static_cache


def spare_static_cache(model):
    """The static cache kept for `model`'s next call (`static_cache_kept`), or None."""
    spare = _static_caches.get(model, {}).get("spare")
    return None if spare is None else spare[1]


def zero_static_cache(cache) -> None:
    """Zero a static cache's keys, values and lengths, every layer's in one op."""
    torch._foreach_zero_([t for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)])


@contextlib.contextmanager
def static_cache_kept(model, keep: bool):
    """Within it, the static cache `generate()` makes or reuses is noted, and at its end kept for the next call
    of its shape when the call ended without an error. With `keep` False (a result that holds the cache, a
    prefill that does not write into an allocated one: `generation._prefill_reuses_the_cache`) it does
    nothing. Like the `_cache` Transformers 4.x kept on the model, the cache stays allocated between calls
    (one per model; `del model` frees it). Kept are only caches allocated whole ahead of a compiled prefill
    (`ALLOCATED_WHOLE`) whose layers are all plain static layers on one device (not a tensor-parallel
    model's, sharded by heads)."""
    from transformers.cache_utils import StaticLayer

    if not keep:  # neither takes a kept cache nor keeps its own
        yield
        return
    kept = _static_caches.setdefault(model, {})
    kept["in use"] = None
    try:
        yield
    finally:
        in_use = kept.pop("in use", None)
    if in_use is not None and getattr(in_use[1], ALLOCATED_WHOLE, False) and all(
            type(layer) is StaticLayer and layer.is_initialized and not hasattr(layer, _CACHE_MESH)
            for layer in in_use[1].layers):
        kept["spare"] = in_use


# --- A tensor-parallel model's static cache, sharded by heads

_CACHE_MESH = "_hf_tpu_cache_mesh"


def _tensor_parallel_mesh(model):
    """(mesh, tp axis) of a model sharded over several chips (every parameter of a sharded model sits on
    the mesh, split or replicated), or None. The tp axis is found as `shard_model` finds it: the mesh's
    only axis, else the one named "tp" (None when there is neither)."""
    from hf_tpu import distributed

    layout = distributed.sharding(next(model.parameters()))
    if layout is None:
        return None
    names = layout.mesh.axis_names
    return layout.mesh, ("tp" if "tp" in names else names[0] if len(names) == 1 else None)


def _static_layers(cache):
    """The static layers of a cache that `generate()` made (an encoder-decoder cache holds two caches)."""
    from transformers.cache_utils import StaticLayer

    for part in (cache, getattr(cache, "self_attention_cache", None), getattr(cache, "cross_attention_cache", None)):
        for layer in getattr(part, "layers", ()):
            if isinstance(layer, StaticLayer):
                yield layer


def _shard_static_cache_like_the_model(model, cache) -> None:
    """Mark each static layer of a tensor-parallel model's cache to be sharded when it allocates its keys
    and values (lazily, at the first forward), and shard those allocated already (`early_initialization`)."""
    tensor_parallel = _tensor_parallel_mesh(model)
    if tensor_parallel is None:
        return
    for layer in _static_layers(cache):
        setattr(layer, _CACHE_MESH, tensor_parallel)
        if layer.is_initialized:
            _shard_by_heads(layer, *tensor_parallel)


@functools.cache
def _warn_cache_replicated(reason: str) -> None:
    warnings.warn(f"hf_tpu: the static KV cache is not split by heads ({reason}): it is allocated whole on every "
                  "chip of the mesh, and XLA's partitioner lays out its updates.", stacklevel=2)


def _shard_by_heads(layer, mesh, tp_axis) -> None:
    """Keys and values of shape (batch, heads, cache length, head dim), split by heads over `tp_axis` as the
    attention projections are, so each chip holds 1/N of the cache. The tensors keep their identity (the
    compiled decoding step holds them as static addresses); their storage becomes sharded."""
    from hf_tpu import distributed

    heads = layer.keys.shape[1]
    degree = mesh.shape.get(tp_axis)
    spec = (None, tp_axis)
    if degree is None:
        _warn_cache_replicated(f"the mesh {mesh} has several axes and none named 'tp'")
        spec = ()
    elif heads % degree:
        _warn_cache_replicated(f"{degree} chips on the mesh axis {tp_axis!r} do not divide its {heads} key/value heads")
        spec = ()
    for cached in (layer.keys, layer.values):
        cached.data = distributed.shard(cached, mesh, spec)


def _wrap_static_layer_allocation(original):
    @functools.wraps(original)
    def lazy_initialization(self, key_states, value_states):
        """A static layer of a tensor-parallel model's cache is sharded as soon as it is allocated, before
        the prefill writes into it (one layer's cache sits whole on the first chip for that moment)."""
        original(self, key_states, value_states)
        tensor_parallel = getattr(self, _CACHE_MESH, None)
        if tensor_parallel is not None:
            _shard_by_heads(self, *tensor_parallel)

    return lazy_initialization


# --- The static cache's writes as one dynamic-update-slice


def _wrap_static_layer_update(original):
    from transformers.cache_utils import StaticLayer

    @functools.wraps(original)
    def update(self, key_states, value_states, *args, **kwargs):
        """On tpu, a static layer writes its new keys and values with `hf_tpu::dynamic_update_slice_` at its
        count of cached tokens. Transformers' `index_copy_` at `arange(n) + count` writes the same positions,
        but XLA cannot tell that they are contiguous and makes it a scatter: on the v5e, 3.4x slower for a
        4096-token prefill and 16% for a decode step at batch 64 (`benchmarks.cache_write`). A layer on
        another device, or of another kind (sliding-window layers), keeps Transformers' own writes."""
        if type(self) is not StaticLayer or key_states.device.type != "tpu":
            return original(self, key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        torch.ops.hf_tpu.dynamic_update_slice_(self.keys, 2, self.cumulative_length, key_states)
        torch.ops.hf_tpu.dynamic_update_slice_(self.values, 2, self.cumulative_length, value_states)
        self.cumulative_length.add_(key_states.shape[-2])
        return self.keys, self.values

    return update


# --- A fresh static cache allocated in one program


def _wrap_early_initialization(original):
    @functools.wraps(original)
    def early_initialization(self, batch_size, num_heads, head_dim, dtype, device):
        """On tpu, a fresh static cache's keys, values and lengths are zeroed in one program. Layer by layer,
        Transformers runs three zeros ops (a stand-in, the keys, the values) and copies the length from the
        host: 48 launches and 16 transfers for a 16-layer model ahead of each compiled prefill, 6 ms of an
        8-layer model's 14 ms `generate()` of one token on a TPU v5e. A tensor-parallel model's layers, sharded
        as they are allocated, and other kinds of layer keep Transformers' own allocation."""
        from transformers.cache_utils import StaticLayer

        device = torch.device(device)
        layers = [layer for layer in self.layers if layer.supports_early_init and not layer.is_initialized]
        if (device.type != "tpu" or not isinstance(num_heads, int) or not isinstance(head_dim, int)
                or any(type(layer) is not StaticLayer or hasattr(layer, _CACHE_MESH) for layer in layers)):
            return original(self, batch_size, num_heads, head_dim, dtype, device)
        zeroed = []
        for layer in layers:
            _allocate_static_layer(layer, (batch_size, num_heads, layer.max_cache_len, head_dim), dtype, device,
                                   zeroed)
        if zeroed:
            torch._foreach_zero_(zeroed)

    return early_initialization


def _allocate_static_layer(layer, shape: tuple, dtype, device, zeroed: list) -> None:
    """What Transformers' `StaticLayer.lazy_initialization` sets (tests/test_transformers_generation.py compares
    the two), with the keys, values and length left empty, listed in `zeroed`. The length is zero, as it
    is in a layer not yet initialized (`__init__` and `reset()` set it so)."""
    layer.device = device
    layer.batch_size, layer.num_heads, _, layer.k_head_dim = shape
    layer.v_head_dim = layer.k_head_dim
    layer.keys = torch.empty(shape, dtype=dtype, device=device)
    layer.values = torch.empty_like(layer.keys)
    layer.cumulative_length = torch.empty((), dtype=layer.cumulative_length.dtype, device=device)
    for tensor in (layer.keys, layer.values, layer.cumulative_length):
        torch._dynamo.mark_static_address(tensor)  # as Transformers marks them, for the compiled decode step
        zeroed.append(tensor)
    layer.is_initialized = True
