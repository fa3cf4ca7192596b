"""Attention: PyTorch's fused SDPA op, and hf_tpu's own blocked attention op.

`F.scaled_dot_product_attention` picks its backend through a C++ DispatchStub that a Python backend
cannot register, which would leave `tpu` on the unfused math path (matmuls and `_safe_softmax`, eight
ops). `_scaled_dot_product_attention` below makes the choice for `tpu` instead: where PyTorch's CPU takes
its fused kernel, so does `tpu` (`_scaled_dot_product_flash_attention_for_cpu`, one op with one lowering
and PyTorch's own derivative); elsewhere (dropout, grouped heads, a mask needing a gradient) PyTorch's math
path runs. `torch.ops.hf_tpu.flash_attention` (further below) is the op to call for long
sequences: its tpu lowering never holds the (query, key) score matrix.

On a TPU both ops' lowerings call the Pallas flash attention kernel (`hf_tpu.kernels.flash_attention`,
JAX's splash attention) for the calls it takes (`_takes_kernel`), forward and backward; every other call,
and every call elsewhere, takes the XLA lowerings below.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
import torch

from ..dispatch import backend_choice, lowering
from ..kernels import flash_attention as flash_kernel
from ..kernels import selection as kernel_selection
from .products import matmul_precision, product_precision
from .nn import _opmath

aten = torch.ops.aten


def _scores(query, key, attn_mask, is_causal, scale):
    """The scale multiplies the (query, head_dim) query, not the (query, key) scores: read by both the
    row maximum and the exponential, scaled scores become a pass of their own over the whole matrix on
    XLA:CPU (about 30% of the tiny SD3 attention's CPU time)."""
    scores = jnp.einsum("...le,...se->...ls", query * _default_scale(query, scale), key, precision=matmul_precision())
    if is_causal:
        length, source = scores.shape[-2:]
        scores = jnp.where(jnp.tril(jnp.ones((length, source), jnp.bool_)), scores, -jnp.inf)
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            scores = jnp.where(attn_mask, scores, -jnp.inf)
        else:
            scores = scores + _opmath(attn_mask)
    return scores


def _attention(query, key, value, attn_mask, is_causal, scale):
    """(output, logsumexp). The exponentials are normalised after the product with the values: dividing
    the (query, head_dim) result rather than the (query, key) probabilities saves a whole pass over the
    scores (on XLA:CPU a quarter to a third of the attention's time). Rows with every position masked out
    give 0."""
    scores = _scores(query, key, attn_mask, is_causal, scale)
    row_max = lax.stop_gradient(jnp.max(scores, -1, keepdims=True, initial=-jnp.inf))
    row_max = jnp.where(row_max == -jnp.inf, 0, row_max)  # a fully masked row: every weight is 0
    weights = jnp.exp(scores - row_max)
    total = jnp.sum(weights, -1, keepdims=True)
    out = jnp.einsum("...ls,...se->...le", weights, value, precision=matmul_precision())
    return out / jnp.where(total == 0, 1, total), (row_max + jnp.log(total))[..., 0]


def _no_dropout(dropout_p):
    if dropout_p > 0:
        # the op has no Generator argument, so its mask could not follow torch.manual_seed
        raise NotImplementedError("attention dropout on tpu: use F.scaled_dot_product_attention (math path)")


def _mask_broadcasts(attn_mask, query, key) -> bool:
    """Whether the mask broadcasts to (batch, query heads, query length, key length)."""
    full = (*query.shape[:3], key.shape[2])
    return attn_mask.dim() <= 4 and all(m in (1, f) for m, f in zip(reversed(attn_mask.shape), reversed(full)))


def _fused_attention_applies(query, key, value, attn_mask, dropout_p, grouped: bool = False) -> bool:
    """Whether SDPA's fused CPU op computes this call: PyTorch's own conditions for it (4-D, one head size,
    no dropout, as many key as query heads), a mask that needs no gradient; everything else is left to the
    math path, which also raises PyTorch's errors for inputs it rejects. As on CPU, a mask may come with
    `is_causal` (the math path refuses the pair). `grouped`: the same conditions, but with query heads a
    multiple of the key heads (`enable_gqa`), for hf_tpu's grouped op instead."""
    if dropout_p != 0.0 or not torch.backends.cuda.flash_sdp_enabled():  # `sdpa_kernel` may exclude it
        return False
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    if not query.dtype.is_floating_point or not query.dtype == key.dtype == value.dtype:
        return False
    heads_fit = query.shape[1] % key.shape[1] == 0 if grouped else query.shape[1] == key.shape[1]
    if key.shape != value.shape or query.shape[0] != key.shape[0] or not heads_fit or query.shape[3] != key.shape[3]:
        return False
    if attn_mask is None:
        return True
    return (not attn_mask.requires_grad and attn_mask.device == query.device
            and attn_mask.dtype in (torch.bool, query.dtype) and _mask_broadcasts(attn_mask, query, key))


def _grouped_attention_applies(query, key, value, attn_mask, dropout_p, is_causal) -> bool:
    """Whether hf_tpu's own op (below) computes an `enable_gqa` call: it takes the key/value heads as they
    are, where PyTorch's math path repeats them for every query head (`repeat_interleave`: a copy of the keys
    and values per group, as Transformers' `repeat_kv` makes; in a decode step at batch 64 such copies, in
    float32, were half of the step's time on a TPU). The op aligns a causal pattern to the last keys, SDPA to
    the first: the two agree where the query and key lengths do. A mask with `is_causal` is left to the math
    path, which raises PyTorch's error."""
    if is_causal and (attn_mask is not None or query.shape[-2] != key.shape[-2]):
        return False
    return _fused_attention_applies(query, key, value, attn_mask, dropout_p, grouped=True)


@backend_choice(aten.scaled_dot_product_attention.default)
def _scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                  enable_gqa=False):
    """SDPA on tpu: the fused op (one launch in eager modes, one lowering to fuse in programs) where
    PyTorch's CPU would take its fused kernel, else PyTorch's math decomposition."""
    if _fused_attention_applies(query, key, value, attn_mask, dropout_p):
        out = aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        # the fused op's meta strides follow the query's; the math path's result, which callers (and
        # compiled graphs' views) expect here, is contiguous, as every tpu result already is
        return out.contiguous()
    if enable_gqa and _grouped_attention_applies(query, key, value, attn_mask, dropout_p, is_causal):
        return torch.ops.hf_tpu.flash_attention(query, key, value, attn_mask, scale, is_causal)
    return aten.scaled_dot_product_attention.default.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _takes_kernel(query, key, value, attn_mask, is_causal, query_offset) -> bool:
    """Whether this call runs the Pallas flash attention kernel: on the platform and setting that allow
    Pallas (`hf_tpu.kernels.selection`), for shapes the kernel takes, and in float32 only below the
    "highest" matmul precision (the kernel's products are not guaranteed full float32 precision)."""
    if not kernel_selection.pallas_enabled():
        return False
    if query.dtype == jnp.float32 and matmul_precision() == lax.Precision.HIGHEST:
        return False
    return flash_kernel.unsupported(query, key, value, attn_mask, is_causal=is_causal,
                                    query_offset=query_offset) is None


@lowering(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *,
                                                attn_mask=None, scale=None):
    _no_dropout(dropout_p)
    if _takes_kernel(query, key, value, attn_mask, is_causal, query_offset=0):  # SDPA's causal is top-left
        return flash_kernel.flash_attention(query, key, value, attn_mask, scale=_default_scale(query, scale),
                                            is_causal=is_causal, with_logsumexp=True)
    return _attention(_opmath(query), _opmath(key), _opmath(value), attn_mask, is_causal, scale)


@lowering(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                                                         is_causal, *, attn_mask=None, scale=None):
    _no_dropout(dropout_p)
    if _takes_kernel(query, key, value, attn_mask, is_causal, query_offset=0):
        return flash_kernel.gradients(grad_out, query, key, value, attn_mask, scale=_default_scale(query, scale),
                                      is_causal=is_causal)

    def forward(q, k, v):
        return _attention(q, k, v, attn_mask, is_causal, scale)[0]

    _, pullback = jax.vjp(forward, _opmath(query), _opmath(key), _opmath(value))
    return pullback(_opmath(grad_out))


# --- hf_tpu::flash_attention: blocked attention with an online softmax.
#
# One public op for attention as models use it: grouped-query heads without repeating keys, an
# optional mask, causal and sliding-window patterns computed from positions (never materialised),
# logit soft-capping. On tpu it scans over blocks of keys, keeping a running max and sum per query
# (the FlashAttention recurrence), so the scores held at once are (query, KV_BLOCK) rather than
# (query, key). The CPU kernel is the plain reference computation the lowering is checked against.

KV_BLOCK = 512

_SCHEMA = (
    "(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float? scale=None, bool is_causal=False, "
    "int sliding_window=0, float softcap=0.0)"
)
_library = torch.library.Library("hf_tpu", "FRAGMENT")
_library.define("flash_attention" + _SCHEMA + " -> Tensor")
_library.define(
    "flash_attention_backward(Tensor grad_out, " + _SCHEMA[1:] + " -> (Tensor, Tensor, Tensor)"
)
# what the op's derivative runs (`_FlashAttentionWithGradient`): the forward that also returns the float32
# logsumexp (batch, heads, query) of each row's scores, and the backward that reads it and the output instead of
# running the forward again
_library.define("flash_attention_with_logsumexp" + _SCHEMA + " -> (Tensor, Tensor)")
_library.define(
    "flash_attention_backward_saved(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor logsumexp, " + _SCHEMA[len("(Tensor query, Tensor key, Tensor value, "):] + " -> (Tensor, Tensor, Tensor)"
)


def _check_inputs(query, key, value, attn_mask):
    """PyTorch-style errors for shapes the op cannot take, raised on every device (the meta kernel)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "hf_tpu.flash_attention expects query, key and value as (batch, heads, seq, head_dim); got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape != value.shape[:3] + key.shape[3:] or key.shape[0] != query.shape[0]:
        raise ValueError(
            f"hf_tpu.flash_attention: key {tuple(key.shape)} and value {tuple(value.shape)} must share batch, "
            f"heads and length, with query's batch {query.shape[0]}"
        )
    if query.shape[-1] != key.shape[-1] or query.shape[1] % key.shape[1]:
        raise ValueError(
            f"hf_tpu.flash_attention: query {tuple(query.shape)} and key {tuple(key.shape)} need the same head_dim "
            "and a number of query heads that is a multiple of the key/value heads"
        )
    if attn_mask is not None and not _mask_broadcasts(attn_mask, query, key):
        raise ValueError(
            f"hf_tpu.flash_attention: attn_mask {tuple(attn_mask.shape)} does not broadcast to "
            f"(batch, heads, query, key) = {(*query.shape[:3], key.shape[2])}"
        )


def _default_scale(query, scale):
    """SDPA's scale when none is given: 1/sqrt(head_dim), as PyTorch computes it."""
    return 1 / math.sqrt(query.shape[-1]) if scale is None else scale


# --- The reference computation, in torch (the CPU kernels).


def _reference_visible(q_len, k_len, is_causal, sliding_window, device):
    """Which (query, key) pairs the position rules allow; queries are aligned to the last keys."""
    query_pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    key_pos = torch.arange(k_len, device=device)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if is_causal:
        visible &= key_pos <= query_pos
    if sliding_window > 0:
        visible &= query_pos - key_pos < sliding_window
    return visible


def _reference_probs(query, key, attn_mask, scale, is_causal, sliding_window, softcap):
    """(probabilities, capped scores before masking), float32; keys already repeated per query head."""
    raw = query.float() @ key.float().transpose(-1, -2) * _default_scale(query, scale)
    scores = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    masked = scores.masked_fill(~_reference_visible(*scores.shape[-2:], is_causal, sliding_window, query.device), -math.inf)
    if attn_mask is not None:
        masked = masked.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else masked + attn_mask.float()
    return torch._safe_softmax(masked, -1), scores


def _repeat_heads(x, groups):
    return x.repeat_interleave(groups, dim=1)


def _sum_heads(x, groups):
    return x.unflatten(1, (-1, groups)).sum(2)


@torch.library.impl("hf_tpu::flash_attention", "cpu", lib=_library)
def _flash_attention_cpu(query, key, value, attn_mask=None, scale=None, is_causal=False, sliding_window=0, softcap=0.0):
    _check_inputs(query, key, value, attn_mask)
    groups = query.shape[1] // key.shape[1]
    probs, _ = _reference_probs(query, _repeat_heads(key, groups), attn_mask, scale, is_causal, sliding_window, softcap)
    return (probs @ _repeat_heads(value, groups).float()).to(query.dtype)


@torch.library.impl("hf_tpu::flash_attention_with_logsumexp", "cpu", lib=_library)
def _flash_attention_with_logsumexp_cpu(query, key, value, attn_mask=None, scale=None, is_causal=False,
                                        sliding_window=0, softcap=0.0):
    _check_inputs(query, key, value, attn_mask)
    groups = query.shape[1] // key.shape[1]
    key_rep = _repeat_heads(key, groups)
    probs, capped = _reference_probs(query, key_rep, attn_mask, scale, is_causal, sliding_window, softcap)
    visible = _reference_visible(*capped.shape[-2:], is_causal, sliding_window, query.device)
    if attn_mask is not None:
        capped = (capped.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool
                  else capped + attn_mask.float())
    logsumexp = capped.masked_fill(~visible, -math.inf).logsumexp(-1)
    return (probs @ _repeat_heads(value, groups).float()).to(query.dtype), logsumexp


@torch.library.impl("hf_tpu::flash_attention_backward_saved", "cpu", lib=_library)
def _flash_attention_backward_saved_cpu(grad_out, query, key, value, out, logsumexp, attn_mask=None, scale=None,
                                        is_causal=False, sliding_window=0, softcap=0.0):
    return torch.ops.hf_tpu.flash_attention_backward(grad_out, query, key, value, attn_mask, scale, is_causal,
                                                     sliding_window, softcap)


@torch.library.impl("hf_tpu::flash_attention_backward", "cpu", lib=_library)
def _flash_attention_backward_cpu(grad_out, query, key, value, attn_mask=None, scale=None, is_causal=False,
                                  sliding_window=0, softcap=0.0):
    groups = query.shape[1] // key.shape[1]
    key_rep, value_rep = _repeat_heads(key, groups).float(), _repeat_heads(value, groups).float()
    probs, capped = _reference_probs(query, key_rep, attn_mask, scale, is_causal, sliding_window, softcap)
    grad_out = grad_out.float()
    out = probs @ value_rep
    grad_value = probs.transpose(-1, -2) @ grad_out
    grad_probs = grad_out @ value_rep.transpose(-1, -2)
    grad_scores = probs * (grad_probs - (grad_out * out).sum(-1, keepdim=True))
    if softcap > 0:
        grad_scores = grad_scores * (1 - (capped / softcap) ** 2)
    grad_scores = grad_scores * _default_scale(query, scale)
    grad_query = grad_scores @ key_rep
    grad_key = grad_scores.transpose(-1, -2) @ query.float()
    return (grad_query.to(query.dtype), _sum_heads(grad_key, groups).to(key.dtype),
            _sum_heads(grad_value, groups).to(value.dtype))


@torch.library.register_fake("hf_tpu::flash_attention", lib=_library)
def _flash_attention_fake(query, key, value, attn_mask=None, scale=None, is_causal=False, sliding_window=0,
                          softcap=0.0):
    _check_inputs(query, key, value, attn_mask)
    return query.new_empty(query.shape[:-1] + value.shape[-1:])


@torch.library.register_fake("hf_tpu::flash_attention_backward", lib=_library)
def _flash_attention_backward_fake(grad_out, query, key, value, attn_mask=None, scale=None, is_causal=False,
                                   sliding_window=0, softcap=0.0):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


@torch.library.register_fake("hf_tpu::flash_attention_with_logsumexp", lib=_library)
def _flash_attention_with_logsumexp_fake(query, key, value, attn_mask=None, scale=None, is_causal=False,
                                         sliding_window=0, softcap=0.0):
    _check_inputs(query, key, value, attn_mask)
    return query.new_empty(query.shape[:-1] + value.shape[-1:]), query.new_empty(query.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("hf_tpu::flash_attention_backward_saved", lib=_library)
def _flash_attention_backward_saved_fake(grad_out, query, key, value, out, logsumexp, attn_mask=None, scale=None,
                                         is_causal=False, sliding_window=0, softcap=0.0):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, *ctx.options = inputs
    if attn_mask is not None and attn_mask.requires_grad:
        raise NotImplementedError(
            "hf_tpu.flash_attention gives no gradient to attn_mask; pass a mask that does not require grad "
            "(or use F.scaled_dot_product_attention for a learned bias)"
        )
    out, logsumexp = output
    ctx.save_for_backward(query, key, value, out, logsumexp, attn_mask)


def _backward(ctx, grad_out, _grad_logsumexp):
    query, key, value, out, logsumexp, attn_mask = ctx.saved_tensors
    grads = torch.ops.hf_tpu.flash_attention_backward_saved(grad_out, query, key, value, out, logsumexp, attn_mask,
                                                            *ctx.options)
    return *grads, None, None, None, None, None


torch.library.register_autograd("hf_tpu::flash_attention_with_logsumexp", _backward, setup_context=_setup_context,
                                lib=_library)


@torch.library.impl("hf_tpu::flash_attention", "Autograd", lib=_library)
def _flash_attention_autograd(query, key, value, attn_mask=None, scale=None, is_causal=False, sliding_window=0,
                              softcap=0.0):
    """The op's derivative: a call that needs one runs the forward that keeps the logsumexp, whose backward reads
    it and the output (one attention forward a backward fewer: in a checkpointed training step, 4 attention
    kernels a layer instead of 5); any other call runs the op itself."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return torch.ops.hf_tpu.flash_attention_with_logsumexp(query, key, value, attn_mask, scale, is_causal,
                                                               sliding_window, softcap)[0]
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.hf_tpu.flash_attention(query, key, value, attn_mask, scale, is_causal, sliding_window,
                                                softcap)


# --- The blocked computation, in JAX (the tpu lowerings).


class _Blocks:
    """Keys, values and mask cut into KV_BLOCK-long blocks along the key axis, block index first, and
    the queries grouped per key/value head: (batch, kv_heads, groups, query, head_dim)."""

    def __init__(self, query, key, value, attn_mask):
        batch, heads, q_len, head_dim = query.shape
        kv_heads, self.k_len = key.shape[1], key.shape[2]
        self.groups = heads // kv_heads
        self.queries = query.reshape(batch, kv_heads, self.groups, q_len, head_dim)
        # the keys in one block where the whole score matrix is no larger than a block's (a decode step's
        # few queries over a long cache): a loop over blocks would only add a nested XLA loop to compile
        self.block = self.k_len if q_len * self.k_len <= KV_BLOCK * KV_BLOCK else min(KV_BLOCK, self.k_len)
        count = -(-self.k_len // self.block)
        self.pad = count * self.block - self.k_len
        self.keys = self._cut(key, axis=2)
        self.values = self._cut(value, axis=2)
        self.mask = None if attn_mask is None else self._cut(self._grouped_mask(attn_mask), axis=-1)
        self.starts = jnp.arange(count) * self.block

    def _cut(self, x, axis):
        """Pad `axis` (of length k_len) to whole blocks and split it: the block index goes first."""
        axis = axis % x.ndim
        x = jnp.pad(x, [(0, self.pad if i == axis else 0) for i in range(x.ndim)])
        x = x.reshape(*x.shape[:axis], -1, self.block, *x.shape[axis + 1:])
        return jnp.moveaxis(x, axis, 0)

    def _grouped_mask(self, attn_mask):
        mask = attn_mask if attn_mask.dtype == jnp.bool_ else _opmath(attn_mask)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        mask = jnp.broadcast_to(mask, mask.shape[:3] + (self.k_len,))
        if mask.shape[1] == 1:
            return mask[:, :, None]
        return mask.reshape(mask.shape[0], -1, self.groups, *mask.shape[2:])


def _block_scores(queries, keys, mask, start, k_len, scale, is_causal, sliding_window, softcap):
    """Float32 scores of every query against one block of keys; hidden pairs are -inf."""
    scores = jnp.einsum("bhgqd,bhkd->bhgqk", queries, keys, precision=product_precision(jnp.result_type(queries, keys)),
                        preferred_element_type=jnp.float32) * scale
    if softcap > 0:
        scores = softcap * jnp.tanh(scores / softcap)
    q_len = queries.shape[-2]
    query_pos = jnp.arange(q_len)[:, None] + (k_len - q_len)
    key_pos = start + jnp.arange(keys.shape[-2])[None, :]
    visible = key_pos < k_len
    if is_causal:
        visible &= key_pos <= query_pos
    if sliding_window > 0:
        visible &= query_pos - key_pos < sliding_window
    if mask is not None:
        if mask.dtype == jnp.bool_:
            visible &= mask
        else:
            scores = scores + mask
    return jnp.where(visible, scores, -jnp.inf)


def _blocked_attention(query, key, value, attn_mask, scale, is_causal, sliding_window, softcap):
    """(output float32 (batch, kv_heads, groups, query, head_dim), logsumexp); fully masked rows give
    output 0 and logsumexp -inf."""
    blocks = _Blocks(query, key, value, attn_mask)
    scale = _default_scale(query, scale)
    shape = blocks.queries.shape[:-1]

    def step(carry, block):
        running_max, running_sum, acc = carry
        keys, values, mask, start = block
        scores = _block_scores(blocks.queries, keys, mask, start, blocks.k_len, scale, is_causal, sliding_window,
                               softcap)
        new_max = jnp.maximum(running_max, scores.max(-1))
        finite_max = jnp.where(jnp.isneginf(new_max), 0.0, new_max)  # all hidden so far: keep exp() at 0
        probs = jnp.exp(scores - finite_max[..., None])
        rescale = jnp.exp(running_max - finite_max)
        # The probabilities meet the values in the values' dtype, as in PyTorch's CPU flash attention and splash:
        # a float32 operand would make a bfloat16 model's product float32 at "highest" precision, which XLA on
        # a TPU computes as several bfloat16 passes (on the v5e a fifth more program for the attention, whose
        # compile tracks its size). The running sum and the accumulator stay float32.
        acc = acc * rescale[..., None] + jnp.einsum("bhgqk,bhkd->bhgqd", probs.astype(values.dtype), values,
                                                    precision=product_precision(values.dtype),
                                                    preferred_element_type=jnp.float32)
        return (new_max, running_sum * rescale + probs.sum(-1), acc), None

    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + value.shape[-1:], jnp.float32))
    if blocks.starts.shape[0] == 1:  # one block: no loop (a mask of None stays None)
        one = jax.tree.map(lambda x: x[0], (blocks.keys, blocks.values, blocks.mask, blocks.starts))
        (running_max, running_sum, acc), _ = step(init, one)
    else:
        (running_max, running_sum, acc), _ = jax.lax.scan(step, init, (blocks.keys, blocks.values, blocks.mask,
                                                                       blocks.starts))
    seen = running_sum > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, running_sum, 1.0)[..., None], 0.0)
    return out, jnp.where(seen, running_max + jnp.log(jnp.where(seen, running_sum, 1.0)), -jnp.inf)


def _heads_first(grouped):
    """(batch, kv_heads, groups, ...) -> (batch, heads, ...)."""
    return grouped.reshape(grouped.shape[0], -1, *grouped.shape[3:])


def _kernel_options(query, key, value, attn_mask, scale, is_causal, sliding_window, softcap):
    """The Pallas kernel's arguments for a call of hf_tpu's op, or None when the call stays on the scan.
    The op aligns its queries to the last keys."""
    query_offset = key.shape[2] - query.shape[2]
    if not _takes_kernel(query, key, value, attn_mask, is_causal, query_offset):
        return None
    return dict(attn_mask=attn_mask, scale=_default_scale(query, scale), is_causal=is_causal,
                sliding_window=sliding_window, softcap=softcap, query_offset=query_offset)


@lowering(torch.ops.hf_tpu.flash_attention.default)
def flash_attention(query, key, value, attn_mask=None, scale=None, is_causal=False, sliding_window=0, softcap=0.0):
    options = _kernel_options(query, key, value, attn_mask, scale, is_causal, sliding_window, softcap)
    if options is not None:
        return flash_kernel.flash_attention(query, key, value, **options)
    out, _ = _blocked_attention(query, key, value, attn_mask, scale, is_causal, sliding_window, softcap)
    return _heads_first(out)


@lowering(torch.ops.hf_tpu.flash_attention_with_logsumexp.default)
def flash_attention_with_logsumexp(query, key, value, attn_mask=None, scale=None, is_causal=False, sliding_window=0,
                                   softcap=0.0):
    options = _kernel_options(query, key, value, attn_mask, scale, is_causal, sliding_window, softcap)
    if options is not None:
        return flash_kernel.flash_attention(query, key, value, with_logsumexp=True, **options)
    out, logsumexp = _blocked_attention(query, key, value, attn_mask, scale, is_causal, sliding_window, softcap)
    return _heads_first(out).astype(query.dtype), _heads_first(logsumexp)


@lowering(torch.ops.hf_tpu.flash_attention_backward.default)
def flash_attention_backward(grad_out, query, key, value, attn_mask=None, scale=None, is_causal=False,
                             sliding_window=0, softcap=0.0):
    """FlashAttention's backward without the forward's logsumexp: the forward pass again to make it, then
    `flash_attention_backward_saved`'s. Where the forward takes the Pallas kernel, so does the backward (the
    kernel's own)."""
    options = _kernel_options(query, key, value, attn_mask, scale, is_causal, sliding_window, softcap)
    if options is not None:
        return flash_kernel.gradients(grad_out, query, key, value, **options)
    out, logsumexp = _blocked_attention(query, key, value, attn_mask, scale, is_causal, sliding_window, softcap)
    return _blocked_attention_backward(grad_out, query, key, value, out, logsumexp, attn_mask, scale, is_causal,
                                       sliding_window, softcap)


@lowering(torch.ops.hf_tpu.flash_attention_backward_saved.default)
def flash_attention_backward_saved(grad_out, query, key, value, out, logsumexp, attn_mask=None, scale=None,
                                   is_causal=False, sliding_window=0, softcap=0.0):
    """FlashAttention's backward from the forward's output and logsumexp (`flash_attention_with_logsumexp`). The
    Pallas kernel's backward kernels take them as they are, where there is no mask (with one, the kernel's
    backward runs its forward again: a masked kernel call hides rows the saved logsumexp does not say)."""
    options = _kernel_options(query, key, value, attn_mask, scale, is_causal, sliding_window, softcap)
    if options is not None:
        if attn_mask is None:
            del options["attn_mask"]
            return flash_kernel.gradients_from_saved(grad_out, query, key, value, out, logsumexp, **options)
        return flash_kernel.gradients(grad_out, query, key, value, **options)
    groups = query.shape[1] // key.shape[1]
    grouped = lambda x: x.reshape(x.shape[0], key.shape[1], groups, *x.shape[2:])
    return _blocked_attention_backward(grad_out, query, key, value, grouped(_opmath(out)), grouped(logsumexp),
                                       attn_mask, scale, is_causal, sliding_window, softcap)


def _blocked_attention_backward(grad_out, query, key, value, out, logsumexp, attn_mask, scale, is_causal,
                                sliding_window, softcap):
    """One scan over key blocks in which each block's probabilities are rebuilt from the forward's logsumexp;
    `out` and `logsumexp` grouped as `_blocked_attention` returns them. The derivative of the scores (scale,
    soft-cap) is `jax.vjp` of the same `_block_scores` the forward uses."""
    blocks = _Blocks(query, key, value, attn_mask)
    scale = _default_scale(query, scale)
    grad_out = _opmath(grad_out).reshape(out.shape)
    row_dot = (grad_out * out).sum(-1)
    hidden_row = jnp.isneginf(logsumexp)
    finite_logsumexp = jnp.where(hidden_row, jnp.inf, logsumexp)  # exp(-inf - inf) = 0 for hidden rows

    def step(grad_queries, block):
        keys, values, mask, start = block

        def scores_of(queries, keys):
            return _block_scores(queries, keys, mask, start, blocks.k_len, scale, is_causal, sliding_window, softcap)

        scores, pullback = jax.vjp(scores_of, _opmath(blocks.queries), _opmath(keys))
        probs = jnp.exp(scores - finite_logsumexp[..., None])
        grad_values = jnp.einsum("bhgqk,bhgqd->bhkd", probs, grad_out, precision=matmul_precision())
        grad_probs = jnp.einsum("bhgqd,bhkd->bhgqk", grad_out, _opmath(values), precision=matmul_precision())
        grad_scores = probs * (grad_probs - row_dot[..., None])
        grad_q, grad_keys = pullback(grad_scores)
        return grad_queries + grad_q, (grad_keys, grad_values)

    grad_queries, (grad_keys, grad_values) = jax.lax.scan(
        step, jnp.zeros(blocks.queries.shape, jnp.float32), (blocks.keys, blocks.values, blocks.mask, blocks.starts)
    )

    def join(per_block):
        """(blocks, batch, kv_heads, block, head_dim) -> (batch, kv_heads, k_len, head_dim)."""
        joined = jnp.moveaxis(per_block, 0, 2)
        return joined.reshape(*joined.shape[:2], -1, joined.shape[-1])[:, :, : blocks.k_len]

    return _heads_first(grad_queries), join(grad_keys), join(grad_values)
