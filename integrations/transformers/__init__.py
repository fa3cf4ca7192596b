"""The Transformers adapter: loading onto `tpu` and generation with a static KV cache and compiled decoding.

Installed by `hf_tpu.integrations.activate()` when `transformers.modeling_utils` or
`transformers.generation.utils` is first imported. What it changes, only for models on `tpu`:

- `from_pretrained`: `device_map="auto"` means the current `tpu` (Accelerate cannot size a `tpu` yet and
  would place everything on the CPU); a missing local checkpoint, an unreadable safetensors file or a
  dtype `tpu` cannot hold is reported before any weight is read; the loaded model gets its
  per-architecture patches (`hf_tpu.model_patches`).
- `generate`: a static KV cache unless the caller chose a cache (or the model has sliding-window layers,
  whose static layers recompile every token), so that Transformers decodes through
  `torch.compile(backend="tpu")` (its `_default_compile_config` for `tpu`) with shapes that never change;
  the cache length rounded up to a multiple of `cache_length_multiple` and the prompt left-padded (with
  its attention mask) to the next of `prompt_buckets`, so that a new prompt length or `max_new_tokens`
  rarely compiles anew. The padding is removed from the returned sequences.
- greedy search and sampling with a static cache: after Transformers' own prefill and first token, the
  other tokens are decoded in one `hf_tpu.while_loop` on the device (forward, logits warpers, token
  choice, end-of-sequence test), with no host round-trip per token.

`configure(...)` or the environment variables `HF_TPU_PROMPT_BUCKETS` ("32,64,128"; "" turns bucketing
off), `HF_TPU_CACHE_LENGTH_MULTIPLE`, `HF_TPU_STATIC_CACHE` ("0" keeps Transformers' dynamic cache) and
`HF_TPU_DEVICE_LOOP` ("0" decodes token by token from Python) change these defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import warnings

import torch

from hf_tpu import model_patches
from .. import attention

DEFAULT_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _buckets_from_env() -> tuple[int, ...]:
    text = os.environ.get("HF_TPU_PROMPT_BUCKETS")
    if text is None:
        return DEFAULT_PROMPT_BUCKETS
    try:
        return _valid_buckets(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError as e:
        raise ValueError(f"HF_TPU_PROMPT_BUCKETS={text!r}: {e}") from None


def _valid_buckets(buckets) -> tuple[int, ...]:
    buckets = tuple(sorted(set(int(b) for b in buckets)))
    if any(b <= 0 for b in buckets):
        raise ValueError(f"prompt buckets must be positive lengths, got {buckets}")
    return buckets


@dataclasses.dataclass
class Settings:
    prompt_buckets: tuple[int, ...] = dataclasses.field(default_factory=_buckets_from_env)
    cache_length_multiple: int = dataclasses.field(
        default_factory=lambda: int(os.environ.get("HF_TPU_CACHE_LENGTH_MULTIPLE", "128"))
    )
    static_cache: bool = dataclasses.field(default_factory=lambda: os.environ.get("HF_TPU_STATIC_CACHE", "1") != "0")
    device_loop: bool = dataclasses.field(default_factory=lambda: os.environ.get("HF_TPU_DEVICE_LOOP", "1") != "0")


settings = Settings()


def configure(*, prompt_buckets=None, cache_length_multiple: int | None = None, static_cache: bool | None = None,
              device_loop: bool | None = None):
    """Change how `generate()` runs on `tpu`.

    prompt_buckets: prompt lengths to left-pad to (a longer prompt goes to a multiple of the largest);
        `()` turns bucketing off.
    cache_length_multiple: the static cache length is rounded up to a multiple of this (1: exact).
    static_cache: False keeps Transformers' default dynamic cache (eager decoding, no compilation).
    device_loop: False decodes a static cache token by token from Python, one compiled forward per token,
        instead of all tokens after the first in one device loop.
    """
    if prompt_buckets is not None:
        settings.prompt_buckets = _valid_buckets(prompt_buckets)
    if cache_length_multiple is not None:
        if cache_length_multiple < 1:
            raise ValueError(f"cache_length_multiple must be at least 1, got {cache_length_multiple}")
        settings.cache_length_multiple = int(cache_length_multiple)
    if static_cache is not None:
        settings.static_cache = bool(static_cache)
    if device_loop is not None:
        settings.device_loop = bool(device_loop)


def bucketed_length(length: int) -> int:
    """The prompt length `generate()` pads a prompt of `length` tokens to."""
    buckets = settings.prompt_buckets
    if not buckets:
        return length
    for bucket in buckets:
        if length <= bucket:
            return bucket
    return -(-length // buckets[-1]) * buckets[-1]


def _on_tpu(model) -> bool:
    try:
        return model.device.type == "tpu"
    except (AttributeError, StopIteration):
        return False


# --- Loading


def _tpu_device() -> torch.device:
    return torch.device("tpu", torch.tpu.current_device())


def _targets_tpu(device_map) -> bool:
    if isinstance(device_map, dict):
        return any(_targets_tpu(d) for d in device_map.values())
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return torch.accelerator.current_accelerator().type == "tpu"
    if device_map == "auto":
        return torch.accelerator.current_accelerator().type == "tpu"
    try:
        return torch.device(device_map).type == "tpu"
    except (TypeError, RuntimeError):
        return False


def _current_chip(device_map):
    """`device_map="tpu"` means the current chip, as "cuda" means the current CUDA device. Transformers
    moves weights with `.to("tpu")`, which PyTorch gives index 0 (it fills a missing index from the
    device guard, and a Python backend's guard always answers 0), while buffers made by factories
    with `device="tpu"` went to the current chip: one model on two chips."""
    if isinstance(device_map, dict):
        return {name: _current_chip(device) for name, device in device_map.items()}
    if isinstance(device_map, (str, torch.device)) and device_map != "auto":
        try:
            device = torch.device(device_map)
        except (TypeError, RuntimeError):  # "disk"
            return device_map
        if device.type == "tpu" and device.index is None:
            return _tpu_device()
    return device_map


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
}


def _looks_like_local_path(path) -> bool:
    if isinstance(path, os.PathLike):
        return True
    return isinstance(path, str) and (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1)


def _safetensors_dtypes(files) -> set:
    """Check each file's header (cheap: no tensor is read) and return the dtypes the files hold."""
    from safetensors import SafetensorError, safe_open

    found = set()
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                names = list(f.keys())
                found.update(f.get_slice(name).get_dtype() for name in names)
        except (SafetensorError, OSError) as e:
            raise OSError(
                f"{file} is not a readable safetensors file ({e}). It is truncated or corrupt: download or "
                "save the checkpoint again. Nothing was loaded."
            ) from e
    return {_SAFETENSORS_DTYPES.get(name, name) for name in found}


def _check_dtype(dtype, where: str) -> None:
    supported = torch.tpu.supported_dtypes()
    if isinstance(dtype, torch.dtype) and dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise TypeError(
            f"{where} is {dtype}, which tpu tensors cannot hold on this platform "
            f"({torch.tpu.get_device_name()}). Pass dtype= one of: {names}. Nothing was loaded."
        )


def check_before_loading(pretrained_model_name_or_path, dtype) -> None:
    """The errors a `tpu` load should raise before anything is read: a missing local checkpoint, a
    corrupt safetensors file, a dtype the platform lacks."""
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype, dtype)
    if isinstance(dtype, torch.dtype):
        _check_dtype(dtype, "The requested dtype")
    if pretrained_model_name_or_path is None:
        return
    path = os.path.expanduser(os.fspath(pretrained_model_name_or_path))
    if not os.path.exists(path):
        if _looks_like_local_path(pretrained_model_name_or_path):
            raise FileNotFoundError(
                f"No checkpoint at {path}: the directory does not exist. Pass the directory that "
                "save_pretrained wrote (it holds config.json and the weights). Nothing was loaded."
            )
        return  # a Hub id: Transformers resolves it
    if not os.path.isdir(path):
        return
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    checkpoint_dtypes = _safetensors_dtypes(files)
    if dtype in (None, "auto"):
        for stored in checkpoint_dtypes:
            if isinstance(stored, torch.dtype) and stored.is_floating_point:
                _check_dtype(stored, "The checkpoint's weight dtype (dtype='auto' keeps it)")


def prepare_model(model) -> None:
    """Per-architecture patches and the output-capturing hooks for a model on `tpu`, once per model."""
    if getattr(model, "_hf_tpu_prepared", False):
        return
    model._hf_tpu_prepared = True
    model_patches.warn_if_failing(getattr(model.config, "model_type", ""))
    model_patches.apply(model)
    install_output_capturing_hooks(model)


def install_output_capturing_hooks(module) -> None:
    """Installs the hooks a Transformers model records hidden states and attentions with, so that a
    `torch.compile` of the model finds them. Transformers installs them on the first call that asks for
    them, under a lock Dynamo cannot trace: compiled, that call breaks the graph for good, and every later
    call runs two graphs with eager code between them (a CLIP text encoder: 1.26 ms a call against 0.52 ms
    as one graph). The hooks do nothing unless a call asks for those outputs.

    A model that has run such a call has its hooks already, maybe on a submodel only (a
    `CLIPTextModelWithProjection` records on its `text_model`): installing again from the top would
    hook those layers twice and return each hidden state twice, so such a model is left as it is."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a Transformers without lazily installed capturing hooks
        return
    from transformers import PreTrainedModel

    if isinstance(module, PreTrainedModel) and not any(
            getattr(m, "_output_capturing_hooks_installed", False) for m in module.modules()):
        maybe_install_capturing_hooks(module)


_TENSOR_PARALLEL_ARGUMENTS = ("tp_plan", "tp_size", "distributed_config")


def _tensor_parallel_request(kwargs) -> tuple:
    """(plan, size) from `tp_plan=`/`tp_size=` or a `DistributedConfig`, removed from `kwargs`: on tpu
    they shard over the chips of the run (this process's, or every process's after
    `hf_tpu.distributed.initialize`) instead of starting `torch.distributed`."""
    from hf_tpu import distributed

    config = kwargs.pop("distributed_config", None)
    plan = kwargs.pop("tp_plan", None) or getattr(config, "tp_plan", None) or "auto"
    size = kwargs.pop("tp_size", None) or getattr(config, "tp_size", None) or distributed.device_count()
    return plan, size


def _check_tensor_parallel(pretrained_model_name_or_path, kwargs, size: int) -> None:
    """The errors a sharded load raises before any weight is read."""
    from transformers import AutoConfig

    from hf_tpu import distributed

    chips = distributed.device_count()
    if size > chips:
        raise ValueError(f"tp_size={size} needs {size} tpu chips but this run has {chips} "
                         "(on the CPU, HF_TPU_NUM_DEVICES=N simulates N chips). Nothing was loaded.")
    config = kwargs.get("config")
    if not hasattr(config, "get_text_config"):
        config = AutoConfig.from_pretrained(pretrained_model_name_or_path)
    text = config.get_text_config()
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, name, None)
        if heads is not None and heads % size:
            raise ValueError(f"tp_size={size} does not divide {name}={heads} of this {text.model_type} "
                             "model: each chip must hold whole attention heads. Nothing was loaded.")


def _load_sharded(original, cls, pretrained_model_name_or_path, args, kwargs):
    """`from_pretrained(..., device_map="tpu", tp_plan="auto")`: the checkpoint is read on the host and
    each weight goes to the chips as its shards (`hf_tpu.distributed.shard_model`), so no chip ever
    holds a whole weight that the plan splits."""
    from hf_tpu import distributed

    plan, size = _tensor_parallel_request(kwargs)
    _check_tensor_parallel(pretrained_model_name_or_path, kwargs, size)
    check_before_loading(pretrained_model_name_or_path, kwargs.get("dtype", kwargs.get("torch_dtype")))
    kwargs.pop("device_map")
    # the blocked attention op keeps batch and heads apart for any head count, so a head-sharded layer
    # needs only its 2 all-reduces; SDPA's math path (taken for grouped-query heads) merges them for its
    # bmm and adds 3 all-gathers; see docs/design/sharding.md
    kwargs.setdefault("attn_implementation", "tpu")
    model = original.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)
    if plan == "auto":
        plan = model.tp_plan
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan of its own: pass tp_plan= a dict "
                         "of module patterns to styles ('colwise', 'rowwise', ...).")
    distributed.shard_model(model, plan, distributed.mesh(size, "tp"))
    prepare_model(model)
    return model


def _wrap_from_pretrained(original):
    """For `PreTrainedModel` and the Auto classes (which read the config first, so they check first)."""

    @functools.wraps(original.__func__)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if device_map is None or not _targets_tpu(device_map):
            return original.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)
        if any(kwargs.get(name) is not None for name in _TENSOR_PARALLEL_ARGUMENTS):
            return _load_sharded(original, cls, pretrained_model_name_or_path, args, kwargs)
        check_before_loading(pretrained_model_name_or_path, kwargs.get("dtype", kwargs.get("torch_dtype")))
        if device_map == "auto" and kwargs.get("max_memory") is None:
            kwargs["device_map"] = {"": _tpu_device()}
        else:
            kwargs["device_map"] = _current_chip(device_map)
        model = original.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)
        if _on_tpu(model):
            prepare_model(model)
        return model

    return classmethod(from_pretrained)


# --- Generation


_ADAPTER_CHOSE_STATIC_CACHE = "_hf_tpu_default_static_cache"


def _wrap_prepare_generation_config(original):
    @functools.wraps(original)
    def _prepare_generation_config(self, generation_config=None, **kwargs):
        generation_config, model_kwargs = original(self, generation_config, **kwargs)
        if not _on_tpu(self):
            return generation_config, model_kwargs
        if (
            settings.static_cache
            and generation_config.cache_implementation is None
            and model_kwargs.get("cache") is None
            and model_kwargs.get("past_key_values") is None
            and generation_config.use_cache is not False
            and not generation_config.output_attentions  # their key length would be the static cache's
            and self._supports_default_dynamic_cache()
            and getattr(self, "_can_compile_fullgraph", False)
            and not _static_cache_has_sliding_layers(self.config)
        ):
            generation_config.cache_implementation = "static"
            setattr(generation_config, _ADAPTER_CHOSE_STATIC_CACHE, True)
        compile_config = generation_config.compile_config
        if compile_config is not None and compile_config.backend == "inductor":
            generation_config.compile_config = _tpu_compile_config(compile_config)
        return generation_config, model_kwargs

    return _prepare_generation_config


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
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return any(issubclass(STATIC_LAYER_TYPE_MAPPING.get(kind, object), StaticSlidingWindowLayer)
               for kind in layer_types)


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
        reuse its decode graph; one the user asked for keeps the length Transformers gives it."""
        if _on_tpu(self) and getattr(generation_config, _ADAPTER_CHOSE_STATIC_CACHE, False):
            multiple = settings.cache_length_multiple
            max_cache_length = -(-max_cache_length // multiple) * multiple
        result = original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
                          *args, **kwargs)
        if _on_tpu(self):
            _shard_static_cache_like_the_model(self, model_kwargs.get("cache"))
        return result

    return _prepare_cache_for_generation


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
        compiled forward, not dozens of small device ops whose shapes grow with every token."""
        if not _on_tpu(self):
            return original(self, inputs, generation_config, *args, **kwargs)
        prepare_model(self)
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if args or not isinstance(input_ids, torch.Tensor) or input_ids.device.type != "tpu":
            return original(self, inputs, generation_config, *args, **kwargs)
        resolved, model_kwargs = self._prepare_generation_config(generation_config, **kwargs)
        if not _is_plain_prompt(self, input_ids, model_kwargs) or not _loop_runs_on_the_host(resolved, kwargs):
            return original(self, inputs, generation_config, *args, **kwargs)
        kwargs.pop("input_ids", None)
        mask = kwargs.pop("attention_mask", None)
        host_ids = input_ids.cpu()
        host_mask = mask.cpu() if mask is not None else None
        padding = 0
        if settings.prompt_buckets and getattr(self, "_hf_tpu_pad_prompts", True) and _padding_keeps_the_result(
                resolved, kwargs, model_kwargs):
            padding = bucketed_length(host_ids.shape[1]) - host_ids.shape[1]
            longest = _longest_sequence(self.config.get_text_config(decoder=True))
            if longest is not None and host_ids.shape[1] + padding + resolved.max_new_tokens > longest:
                padding = 0
        if padding:
            if host_mask is None:
                host_mask = _prompt_mask(host_ids, resolved)
            host_ids, host_mask = _left_pad(host_ids, host_mask, padding)
        with _step_inputs_on_the_model(self):
            output = original(self, host_ids, generation_config, attention_mask=host_mask, **kwargs)
        return _to_device(_strip_padding(output, padding), input_ids.device)

    return generate


# what configs call the longest sequence their position tables (GPT-Neo's causal mask, MPT's ALiBi
# biases) cover
_LONGEST_SEQUENCE_NAMES = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length")


def _longest_sequence(config) -> int | None:
    return next((getattr(config, name) for name in _LONGEST_SEQUENCE_NAMES
                 if isinstance(getattr(config, name, None), int)), None)


@contextlib.contextmanager
def _step_inputs_on_the_model(model):
    """Transformers' own `prepare_inputs_for_generation` moves each step's inputs to the model; some
    models' overrides build them on the ids' device and do not (XLM, Flaubert), which with the ids on
    the host gave a tpu model CPU inputs. For the call, the model's own preparation is followed by
    that move (a no-op where it already happened)."""
    from transformers.pytorch_utils import move_to_device

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
    (a streamer, returned scores, a processor or stopping criterion that reads the growing ids)."""
    from transformers.cache_utils import StaticLayer
    from transformers.generation import GenerationMixin
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    cache = model_kwargs.get("cache")
    return (
        settings.device_loop
        and _on_tpu(model)
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
        """Transformers' own loop makes the prefill and the first token; the rest is one device loop."""
        if not _decodes_on_device(self, logits_processor, stopping_criteria, generation_config, synced_gpus,
                                  streamer, model_kwargs):
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                            streamer, **model_kwargs)
        from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList

        max_length = next(c.max_length for c in stopping_criteria if type(c) is MaxLengthCriteria)
        eos = next((c.eos_token_id for c in stopping_criteria if type(c) is not MaxLengthCriteria), None)
        first_token_only = StoppingCriteriaList(
            [MaxLengthCriteria(input_ids.shape[1] + 1) if type(c) is MaxLengthCriteria else c for c in stopping_criteria])
        input_ids = original(self, input_ids, logits_processor, first_token_only, generation_config, synced_gpus,
                             streamer, **model_kwargs)
        finished = torch.isin(input_ids[:, -1], eos.to(input_ids.device)) if eos is not None else None
        if input_ids.shape[1] >= max_length or (finished is not None and bool(finished.all())):
            return input_ids
        new_tokens = _decode_loop(self, input_ids, finished, max_length - input_ids.shape[1], eos,
                                  logits_processor, generation_config, model_kwargs)
        return torch.cat([input_ids, new_tokens.to(input_ids.device)], dim=-1)

    return _sample


def _decode_loop(model, input_ids, finished, steps: int, eos, logits_processor, generation_config, model_kwargs):
    """Up to `steps` more tokens, as Transformers' `_sample` would make them after its first: each step
    feeds the last token at the next position. The 2D attention mask is as long as the static cache and
    zero past the token fed, which is what Transformers' growing mask is once padded to the cache."""
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
    # per processor: None, or (its kind of gate, its end-of-sequence ids, the loop step where the ids reach
    # its length); the step is a tensor, so that another prompt length or bound does not recompile the step
    gates = []
    for processor in logits_processor:
        gate = _length_gate(processor)
        gates.append(None if gate is None else
                     (gate[0], processor.eos_token_id.to(device), torch.tensor([gate[1] - length], device=device)))
    has_positions = model_kwargs.get("position_ids") is not None  # models like Bloom take none

    def body(tokens, position_ids, mask, unfinished, generated, index):
        mask = mask.index_fill(1, first_position + index, 1)
        inputs = model.prepare_inputs_for_generation(tokens[:, None], next_sequence_length=1, attention_mask=mask,
                                                     position_ids=position_ids if has_positions else None, **kwargs)
        logits = model(**inputs, return_dict=True).logits[:, -1].to(torch.float32)
        scores = logits
        for processor, gate in zip(logits_processor, gates):
            if gate is None:
                scores = processor(tokens[:, None], scores)
                continue
            kind, eos_ids, step = gate  # the ids are `length + index` long at this step
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
        generated = generated.index_copy(1, index, tokens[:, None])
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

    *_, generated, index = while_loop(cond, body, tuple(t.to(device) for t in carried))
    return generated[:, :int(index)]


# --- Installation


def _patch(owner, name: str, wrap) -> None:
    """Wrap `owner.name` once (installing twice, e.g. after a reload, keeps one wrapper)."""
    current = owner.__dict__[name]
    if getattr(current, "_hf_tpu_original", None) is not None:
        return
    wrapped = wrap(current)
    wrapped._hf_tpu_original = current
    setattr(owner, name, wrapped)


# --- The Trainer's checkpoints: the tpu random state beside the CUDA one


def _trainer_rng_file(trainer, folder: str) -> str:
    name = "rng_state.pth" if trainer.args.world_size <= 1 else f"rng_state_{trainer.args.process_index}.pth"
    return os.path.join(folder, name)


def _wrap_save_rng_state(original):
    @functools.wraps(original)
    def _save_rng_state(self, output_dir):
        """A checkpoint holds the random states of the devices Transformers knows; the tpu's is added, so
        a resumed run draws the dropout masks the uninterrupted run would have drawn."""
        original(self, output_dir)
        path = _trainer_rng_file(self, output_dir)
        if self.args.device.type == "tpu" and os.path.isfile(path):
            states = torch.load(path, weights_only=False)  # the Trainer's own file (Python's random state)
            states["tpu"] = torch.tpu.get_rng_state_all()
            torch.save(states, path)

    return _save_rng_state


def _wrap_load_rng_state(original):
    @functools.wraps(original)
    def _load_rng_state(self, checkpoint):
        original(self, checkpoint)
        path = _trainer_rng_file(self, checkpoint) if checkpoint is not None else None
        if path is not None and self.args.device.type == "tpu" and os.path.isfile(path):
            states = torch.load(path, weights_only=False)
            if "tpu" in states:
                torch.tpu.set_rng_state_all(states["tpu"])

    return _load_rng_state


# --- The Trainer's `torch_compile=True`: the tpu backend, as Transformers picks HPU's and Neuron's


def _wrap_training_args_post_init(original):
    @functools.wraps(original)
    def __post_init__(self):
        """`TrainingArguments(torch_compile=True)` names no backend, and Transformers then picks its
        accelerator's (`hpu_backend`, `neuron`) or Inductor, which cannot compile for tpu (it imports a
        `torch_tpu` module). With tpu as PyTorch's accelerator the Trainer compiles with
        `backend="tpu"` (`integrations/accelerate.py` makes it one of Accelerate's backends)."""
        accelerator = torch.accelerator.current_accelerator()
        if ((self.torch_compile or self.torch_compile_mode is not None) and self.torch_compile_backend is None
                and not self.use_cpu and accelerator is not None and accelerator.type == "tpu"):
            self.torch_compile_backend = "tpu"
        original(self)

    return __post_init__


def install(module) -> None:
    """Patch the Transformers module that was just imported (`hf_tpu.integrations.ADAPTERS`)."""
    if module.__name__ == "transformers.training_args":
        _patch(module.TrainingArguments, "__post_init__", _wrap_training_args_post_init)
        return
    if module.__name__ == "transformers.trainer":
        _patch(module.Trainer, "_save_rng_state", _wrap_save_rng_state)
        _patch(module.Trainer, "_load_rng_state", _wrap_load_rng_state)
        return
    if module.__name__ == "transformers.modeling_utils":
        _patch(module.PreTrainedModel, "from_pretrained", _wrap_from_pretrained)
        attention.register()
    elif module.__name__ == "transformers.models.auto.auto_factory":
        _patch(module._BaseAutoModelClass, "from_pretrained", _wrap_from_pretrained)
    elif module.__name__ == "transformers.generation.utils":
        mixin = module.GenerationMixin
        _patch(mixin, "generate", _wrap_generate)
        _patch(mixin, "_sample", _wrap_sample)
        _patch(mixin, "_prepare_generation_config", _wrap_prepare_generation_config)
        _patch(mixin, "_prepare_cache_for_generation", _wrap_prepare_cache_for_generation)
        from transformers.cache_utils import StaticLayer  # imported by generation.utils already

        _patch(StaticLayer, "lazy_initialization", _wrap_static_layer_allocation)
