"""The Transformers adapter: loading onto `tpu` and generation with a static KV cache and compiled decoding,
one module a job: `from_pretrained` (the wrapper), `loading` (checks, placement, preparation),
`tensor_parallel`, `cache` (the static cache), `generation` (the host's bookkeeping and
prompt padding), `prefill` (compiled once per prompt bucket, launched ahead), `decode_loop` (the tokens after
the first in one device loop), `compiled_buckets` (a compiled causal LM's calls padded to buckets),
`continuous_batching` (the paged cache's size), `trainer`, `quantized_cache` (`Int8StaticCache`, an int8 KV
cache), and `settings` (`configure`).

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
  rarely compiles anew. The padding is removed from the returned sequences. The prefill of a prompt of a
  bucket's length runs compiled too, once per bucket, into a static cache whose layers are all zeroed by one
  program. The prefill and the device loop below are traced straight from Python with `hf_tpu.jit` (no
  Dynamo), with `torch.compile` where that trace cannot be made. Transformers' compiled call for the decode
  steps (`get_compiled_call`) is made when first called, not when `_sample` asks for it: making it imports
  Dynamo's backends, and with the device loop, or one token, it is never called. A `compile_config` the caller
  gives asks for Transformers' compiled path: decode steps one by one through that call (`torch.compile` with
  that config), made at once. A result that holds the cache holds Transformers' own (a `DynamicCache`), and a
  `DynamicCache` handed back is decoded in a static cache and given its tokens back.
- continuous batching (`generate_batch`): the paged KV cache is sized from the tpu's memory
  (`continuous_batching`), not from the host's RAM.
- greedy search and sampling with a static cache: after Transformers' own prefill and first token, the
  other tokens are decoded in one `hf_tpu.while_loop` on the device (forward, logits warpers, token
  choice, end-of-sequence test), with no host round-trip per token.

`configure(...)` or the environment variables `HF_TPU_PROMPT_BUCKETS` ("32,64,128"; "" turns bucketing
off), `HF_TPU_CACHE_LENGTH_MULTIPLE`, `HF_TPU_STATIC_CACHE` (off keeps Transformers' dynamic cache) and
`HF_TPU_DEVICE_LOOP` (off decodes token by token from Python) and `HF_TPU_DIRECT_TRACE` (off compiles the
prefill and the loop's step with `torch.compile`) change these defaults; they are parsed by
`hf_tpu.settings` like every other variable.
"""

from __future__ import annotations

from hf_tpu.wrapping import wrap_once

from .. import attention
from ..output_capturing import capturing_hooks_traced, install_output_capturing_hooks
from . import (cache, compiled_buckets, continuous_batching, decode_loop, from_pretrained, generation, prefill,
               scanned_layers, trainer)
from .prefill import bucketed_length
from .loading import check_before_loading, prepare_model
from .settings import DEFAULT_PROMPT_BUCKETS, Settings, configure, settings

__all__ = ["DEFAULT_PROMPT_BUCKETS", "Int8StaticCache", "Settings", "bucketed_length", "check_before_loading",
           "configure", "install", "install_output_capturing_hooks", "prepare_model", "settings"]


def __getattr__(name: str):
    """`Int8StaticCache` (`quantized_cache`), imported when first asked for: its module subclasses Transformers'
    cache classes, and this package is imported while Transformers itself is (`install`)."""
    if name == "Int8StaticCache":
        from .quantized_cache import Int8StaticCache

        return Int8StaticCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install(module) -> None:
    """Patch the Transformers module that was just imported (`hf_tpu.integrations.ADAPTERS`)."""
    if module.__name__ == "transformers.training_args":
        wrap_once(module.TrainingArguments, "__post_init__", trainer._wrap_training_args_post_init)
        return
    if module.__name__ == "transformers.trainer":
        wrap_once(module.Trainer, "_save_rng_state", trainer._wrap_save_rng_state)
        wrap_once(module.Trainer, "_load_rng_state", trainer._wrap_load_rng_state)
        wrap_once(module.Trainer, "training_step", trainer._wrap_training_step)
        wrap_once(module.Trainer, "_run_epoch", trainer._wrap_run_epoch)
        wrap_once(module.Trainer, "_maybe_log_save_evaluate", trainer._wrap_maybe_log_save_evaluate)
        wrap_once(module.Trainer, "get_train_dataloader", trainer._wrap_get_train_dataloader)
        # functions the Trainer module imported
        wrap_once(module, "nested_gather", trainer._wrap_nested_gather)
        wrap_once(module, "distributed_broadcast_scalars", trainer._wrap_broadcast_scalars)
        return
    if module.__name__ == "transformers.generation.continuous_batching.cache":
        wrap_once(module.PagedAttentionCache, "__init__", continuous_batching._wrap_paged_cache_init)
        wrap_once(module, "get_device_and_memory_breakdown", continuous_batching._wrap_memory_breakdown)
        return
    if module.__name__ == "transformers.generation.continuous_batching.initialization":
        wrap_once(module, "resolve_max_memory_percent", continuous_batching._wrap_resolve_max_memory_percent)
        return
    if module.__name__ == "transformers.integrations.sdpa_attention":
        wrap_once(module, "use_gqa_in_sdpa", attention._wrap_use_gqa_in_sdpa)
        return
    if module.__name__ == "transformers.modeling_utils":
        wrap_once(module.PreTrainedModel, "from_pretrained", from_pretrained.wrap)
        wrap_once(module.PreTrainedModel, "get_compiled_call", generation._wrap_get_compiled_call)
        wrap_once(module.PreTrainedModel, "_set_gradient_checkpointing",
                  scanned_layers._wrap_set_gradient_checkpointing)
        attention.register()
        capturing_hooks_traced()
        compiled_buckets.install()
        scanned_layers.install()
    elif module.__name__ == "transformers.models.auto.auto_factory":
        wrap_once(module._BaseAutoModelClass, "from_pretrained", from_pretrained.wrap)
    elif module.__name__ == "transformers.generation.utils":
        mixin = module.GenerationMixin
        wrap_once(mixin, "generate", generation._wrap_generate)
        wrap_once(mixin, "_sample", decode_loop._wrap_sample)
        wrap_once(mixin, "_prefill", prefill._wrap_prefill)
        wrap_once(mixin, "_valid_auto_compile_criteria", generation._wrap_valid_auto_compile_criteria)
        wrap_once(mixin, "_prepare_generation_config", cache._wrap_prepare_generation_config)
        wrap_once(mixin, "_prepare_cache_for_generation", cache._wrap_prepare_cache_for_generation)
        wrap_once(mixin, "_prepare_static_cache", cache._wrap_prepare_static_cache)
        from transformers.cache_utils import Cache, StaticLayer  # imported by generation.utils already

        wrap_once(StaticLayer, "lazy_initialization", cache._wrap_static_layer_allocation)
        wrap_once(StaticLayer, "update", cache._wrap_static_layer_update)
        wrap_once(Cache, "early_initialization", cache._wrap_early_initialization)
