"""`Int8StaticCache`: a static KV cache that keeps keys and values in int8, each position's vector of each head
with one float32 scale, for contexts whose bfloat16 cache would not fit beside the weights.

    from hf_tpu.integrations.transformers import Int8StaticCache

    cache = Int8StaticCache(config=model.config, max_cache_len=32768)
    out = model.generate(ids, cache=cache, max_new_tokens=256)

A head's key (or value) at one position, `x` of `head_dim` numbers, is stored as `round(x / s)` in int8 with
`s = max|x| / 127` in float32: 8 bits a number and 32 a vector, where bfloat16 takes 16 a number (a head of 128:
0.52 of the bytes; of 64: 0.53). Each number comes back within `s / 2 = max|x| / 254` of what was written, 0.4% of
the vector's largest magnitude. Per-vector scales need no calibration and stay exact as positions are appended, so
the cache is written in place, like Transformers' `StaticLayer`, with no residual window of unquantized positions
(which Transformers' `QuantizedCache` keeps, growing, and which would change the shapes a compiled decode
step sees). Attention reads the cache dequantized to the model's dtype: the saving is the cache's memory; what the
conversion costs or saves in decode time on a TPU is not measured (XLA may fuse it into attention's products, a
Pallas kernel would read a converted copy).

Works on every device (differential tests run it on the CPU and on tpu), with `generate()`'s device loop on tpu.
Layers with a sliding window keep Transformers' own static layer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticCache, StaticLayer

INT8_LIMIT = 127


def quantized(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`states` (..., head_dim) as int8 numbers and one float32 scale a vector (..., 1), their product within
    `scale / 2` of `states`. A vector of zeros gets the smallest positive scale, not zero, so it dequantizes to
    zeros rather than NaN."""
    scale = (states.abs().amax(-1, keepdim=True).float() / INT8_LIMIT).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(states.float() / scale).clamp(-INT8_LIMIT, INT8_LIMIT).to(torch.int8), scale


def dequantized(numbers: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (numbers.float() * scale).to(dtype)


def _write(cache: torch.Tensor, start: torch.Tensor, new: torch.Tensor) -> None:
    """`new` into `cache` at positions `start`, `start + 1`, ... of dim 2. On tpu one dynamic-update-slice (as the
    adapter writes Transformers' static layers: `cache._wrap_static_layer_update`), elsewhere `index_copy_`."""
    if cache.device.type == "tpu":
        torch.ops.hf_tpu.dynamic_update_slice_(cache, 2, start, new)
    else:
        cache.index_copy_(2, torch.arange(new.shape[2], device=cache.device) + start, new)


class Int8StaticLayer(StaticLayer):
    """A `StaticLayer` whose `keys` and `values` are int8, with `key_scales` and `value_scales` (float32, one per
    batch row, head and position) beside them; `update` returns them dequantized to the dtype of the states
    written."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        positions = (self.batch_size, self.num_heads, self.max_cache_len)
        self.keys = torch.zeros((*positions, self.k_head_dim), dtype=torch.int8, device=self.device)
        self.values = torch.zeros((*positions, self.v_head_dim), dtype=torch.int8, device=self.device)
        self.key_scales = torch.zeros((*positions, 1), dtype=torch.float32, device=self.device)
        self.value_scales = torch.zeros_like(self.key_scales)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.cumulative_length
        for cache, scales, states in ((self.keys, self.key_scales, key_states),
                                      (self.values, self.value_scales, value_states)):
            numbers, scale = quantized(states)
            _write(cache, start, numbers)
            _write(scales, start, scale)
        self.cumulative_length.add_(key_states.shape[-2])
        return (dequantized(self.keys, self.key_scales, self.dtype),
                dequantized(self.values, self.value_scales, self.dtype))

    def reset(self) -> None:
        super().reset()
        if self.is_initialized:
            self.key_scales.zero_()
            self.value_scales.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            beam_idx = beam_idx.to(self.device)
            for name in ("keys", "values", "key_scales", "value_scales"):
                setattr(self, name, getattr(self, name).index_select(0, beam_idx))

    def offload(self):
        raise NotImplementedError("Int8StaticCache does not offload its layers to the CPU")


class Int8StaticCache(StaticCache):
    """Transformers' `StaticCache` (same arguments) with int8 layers in place of its full-attention static ones
    (`Int8StaticLayer`); sliding-window layers stay Transformers' own."""

    def __init__(self, config, max_cache_len: int, **kwargs):
        if kwargs.get("offloading"):
            raise NotImplementedError("Int8StaticCache does not offload its layers to the CPU")
        super().__init__(config, max_cache_len, **kwargs)
        self.layers = [Int8StaticLayer(max_cache_len=layer.max_cache_len) if type(layer) is StaticLayer else layer
                       for layer in self.layers]
