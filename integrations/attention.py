"""`attn_implementation="tpu"` for Transformers: attention through `torch.ops.hf_tpu.flash_attention`; and
grouped key/value heads passed to SDPA as they are on `tpu` (`attn_implementation="sdpa"`).

The op takes grouped key/value heads as they are (no `repeat_kv`), soft-capping (Gemma 2) and
sliding windows, and on `tpu` never materialises the (query, key) scores. Masks are built as for
SDPA (`sdpa_mask`): a boolean (batch, 1, query, key) mask, or none when causality alone describes
the pattern, which the op then computes from positions.
"""

from __future__ import annotations

import torch

_REGISTERED_NAME = "tpu"


def tpu_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention interface: (batch, heads, seq, head_dim) in, (batch, seq, heads, head_dim) out."""
    if dropout > 0 and module.training:
        raise NotImplementedError(
            'attn_implementation="tpu" has no attention dropout; train with attn_implementation="sdpa" or set '
            "the model's attention_dropout to 0"
        )
    if kwargs.get("output_attentions") or kwargs.get("position_bias") is not None:
        raise NotImplementedError(
            'attn_implementation="tpu" returns no attention weights and takes no position bias; use "eager" or "sdpa"'
        )
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Like SDPA: without a mask, causality is a flag (none for a single query, which sees every key).
    is_causal = attention_mask is None and q_length > 1 and is_causal
    if is_causal and key.shape[2] > q_length:
        # Prefill into an empty static cache: the keys past the queries are unwritten slots. The mask
        # function only leaves the mask out when that is so (SDPA's top-left causal alignment).
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    attn_output = torch.ops.hf_tpu.flash_attention(
        query,
        key,
        value,
        attention_mask,
        scale=scaling,
        is_causal=is_causal,
        # A mask already holds the window, aligned to the cache's real positions.
        sliding_window=sliding_window if is_causal and sliding_window else 0,
        softcap=softcap or 0.0,
    )
    return attn_output.transpose(1, 2).contiguous(), None


def _wrap_use_gqa_in_sdpa(original):
    """On `tpu`, Transformers' SDPA attention passes grouped key/value heads as they are (`enable_gqa=True`),
    with a mask too, as it does on XPU: `tpu`'s SDPA computes them without repeating them per query head.
    Elsewhere Transformers repeats them (`repeat_kv`) whenever there is a mask, and in a traced or compiled
    decode step (a mask over the static cache) that copy of the whole cache per group, in float32, was half of
    a batch-64 step's time on a TPU."""

    def use_gqa_in_sdpa(attention_mask, key, value):
        return key.device.type == "tpu" or original(attention_mask, key, value)

    return use_gqa_in_sdpa


def register() -> None:
    """Make `attn_implementation="tpu"` available to every Transformers model (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_REGISTERED_NAME, tpu_attention_forward)
    AttentionMaskInterface.register(_REGISTERED_NAME, sdpa_mask)
