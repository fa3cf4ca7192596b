"""Models whose output changes with left padding (a recurrent state, attention that ignores the mask, local
attention chunks that move with the padding): `generate()` on `tpu` must not pad their prompts to a bucket
length. The table lists the patch `unpadded_prompts` for them (rwkv, reformer, deepseek_v4, ...); the
Transformers adapter asks `pads_prompts(model)` before it pads."""

from __future__ import annotations

NAME = "unpadded_prompts"

_PAD_PROMPTS = "_hf_tpu_pad_prompts"


def patch(model) -> None:
    """Marks `model`: its prompts are not padded to a bucket length."""
    setattr(model, _PAD_PROMPTS, False)


def pads_prompts(model) -> bool:
    """Whether `generate()` may left-pad this model's prompts to a bucket length."""
    return getattr(model, _PAD_PROMPTS, True)
