"""Flash attention for prefill on a TPU: JAX's splash attention kernel, and its reference.

`jax.experimental.pallas.ops.tpu.splash_attention` (JAX 0.10.2) has everything prefill attention needs:
grouped-query heads without repeating keys (its MHA kernel maps each query head to its key/value head),
logit soft-capping, a block-sparse mask that skips every (query block, key block) pair the mask hides
(so a causal prefill computes about half the blocks), and a backward pass of its own (a `custom_vjp`
with dq and dkv kernels). This module adapts the call to it:

- Position patterns (causal, sliding window) become splash's static masks (`CausalMask`, `LocalMask`,
  `FullMask`), whose block structure is worked out once at trace time. `query_offset` is the position
  of the first query among the keys: `k_len - q_len` for queries aligned to the last keys (hf_tpu's op,
  a chunk of prefill after a cache), 0 for SDPA's top-left `is_causal`.
- A boolean mask shared by the heads is first tried, on the device, against the form the models'
  masks take: a position pattern and hidden keys per sequence (`causal & padding`, a padded encoder's
  `padding`). In that form the pattern is a static splash mask and the hidden keys are splash's key
  segment ids (0 hidden, 1 seen; every query in segment 1), blocked inputs that `vmap` turns into one
  more grid axis: one kernel call for the whole batch. Any other mask becomes a dynamic splash mask per
  batch element; its block map lives in scalar memory, which `vmap` cannot batch into the grid, so
  that kernel runs once per batch element (a loop). Both skip the blocks the mask hides entirely (the
  first the blocks its pattern hides). Rows the mask hides entirely give 0, as the XLA lowerings do:
  the kernel computes them over hidden keys or unmasked, never a softmax over nothing, and they are
  zeroed after, their gradients with them.
- The scale multiplies the query before the kernel: splash soft-caps and masks the logits q.k as given.

What the kernel cannot take (`unsupported` says why) stays on the XLA lowering: lengths that are not
multiples of 128 (a decode step's single query among them), float16, additive float masks, head sizes
that are not multiples of 64, and a causal pattern that would hide whole rows (`query_offset < 0`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import selection

# splash's blocks are multiples of the TPU's 128 lanes: along the key axis (the scores' minor axis) and,
# for the segment/mask layout it uses, along the query axis too
LANES = 128
DTYPES = (jnp.bfloat16, jnp.float32)


def unsupported(query, key, value, attn_mask=None, *, is_causal=False, query_offset=0):
    """Why the kernel cannot compute this call (a sentence), or None when it can. Reads shapes and
    dtypes only, so it works on tracers."""
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        return "query, key and value must be 4-D"
    if not query.dtype == key.dtype == value.dtype or query.dtype not in DTYPES:
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype}: the kernel takes one of bfloat16, float32"
    q_len, k_len = query.shape[2], key.shape[2]
    if q_len % LANES or k_len % LANES:
        return f"query length {q_len} and key length {k_len} must be multiples of {LANES}"
    if query.shape[-1] % 64 or value.shape[-1] % 64:
        return f"head sizes {query.shape[-1]}, {value.shape[-1]} must be multiples of 64"
    if query.shape[1] % key.shape[1]:
        return "query heads must be a multiple of key/value heads"
    if attn_mask is not None and attn_mask.dtype != jnp.bool_:
        return "an additive (float) mask: the kernel takes boolean masks"
    if is_causal and query_offset < 0:
        return "more queries than keys under a causal pattern aligned to the last keys (hidden rows)"
    return None


def _block(length: int, limit: int) -> int:
    """The largest multiple of 128, at most `limit`, that divides `length` (a multiple of 128)."""
    return next(b for b in range(limit - limit % LANES, 0, -LANES) if length % b == 0)


def block_sizes(q_len: int, k_len: int, limit: int | None = None):
    """splash's BlockSizes for these lengths: blocks of up to `limit` (`HF_TPU_KERNEL_BLOCK`, 512 by
    default) queries and keys, the same for the forward and both backward kernels."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    limit = limit or selection.attention_block()
    bq, bkv = _block(q_len, limit), _block(k_len, limit)
    return splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                             block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)


@functools.lru_cache(maxsize=64)
def _static_mask(heads: int, q_len: int, k_len: int, is_causal: bool, sliding_window: int, query_offset: int):
    """splash's mask object for a position pattern (hashable, so splash caches its block analysis)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (q_len, k_len)
    if sliding_window > 0:
        # visible: query_pos - key_pos < window (and key_pos <= query_pos when causal)
        pattern = splash.LocalMask(shape, (sliding_window - 1, 0 if is_causal else None), query_offset)
    elif is_causal:
        pattern = splash.CausalMask(shape, offset=query_offset)
    else:
        pattern = splash.FullMask(shape)
    return splash.MultiHeadMask([pattern] * heads)


def _positions_visible(q_len, k_len, is_causal, sliding_window, query_offset):
    """(q_len, k_len) bool: the pairs the position pattern allows (as the static masks above)."""
    query_pos = jnp.arange(q_len)[:, None] + query_offset
    key_pos = jnp.arange(k_len)[None, :]
    visible = jnp.ones((q_len, k_len), jnp.bool_)
    if is_causal:
        visible &= key_pos <= query_pos
    if sliding_window > 0:
        visible &= query_pos - key_pos < sliding_window
    return visible


def _batched_mask(attn_mask, batch, heads, q_len, k_len):
    """A mask broadcastable to (batch, heads, q_len, k_len) as (batch, 1 or heads, q_len, k_len)."""
    mask = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + attn_mask.shape)
    return jnp.broadcast_to(mask, (batch, mask.shape[1], q_len, k_len))


def _without_dynamic_flag(kernel):
    """splash stores `is_dynamic_mask` as a leaf of the mask info, which becomes a traced array when
    the kernel is built under `vmap` or `jit` and then fails its Python `if`; it only names a scope."""
    for name in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
        info = getattr(kernel, name)
        if info is not None:
            setattr(kernel, name, info._replace(is_dynamic_mask=None))
    return kernel


def _with_hidden_keys(query, key, value, keys_seen, pattern, options):
    """Attention under a static position `pattern` (is_causal, sliding_window, query_offset) and hidden
    keys per sequence (`keys_seen`, (batch, k_len) bool) as splash's key segment ids: one kernel call
    for the whole batch."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    heads, q_len, k_len = query.shape[1], query.shape[2], key.shape[2]
    kernel = splash.make_splash_mha(_static_mask(heads, q_len, k_len, *pattern), **options)
    segments = splash.SegmentIds(q=jnp.ones((q_len,), jnp.int32), kv=keys_seen.astype(jnp.int32))
    return jax.vmap(kernel, in_axes=(0, 0, 0, splash.SegmentIds(q=None, kv=0)))(query, key, value, segments)


def _with_any_mask(query, key, value, mask, options):
    """Attention under any (batch, 1 or heads, q_len, k_len) mask that hides no whole row: a dynamic
    splash mask per batch element, one kernel call each."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    def one_element(mask, query, key, value):
        return _without_dynamic_flag(splash.make_splash_mha(mask, **options))(query, key, value)

    return jax.vmap(one_element)(mask, query, key, value)


def patterns_to_try(is_causal, sliding_window, query_offset):
    """The position patterns a mask is checked against, in order: the call's own, or for a bare mask
    the two that models' masks take, SDPA's causal (a prefill: queries at the first keys) and full (an
    encoder)."""
    if is_causal or sliding_window > 0:
        return ((is_causal, sliding_window, query_offset),)
    return ((True, 0, 0), (False, 0, 0))


def matching_pattern(mask, patterns):
    """On the device: the index of the first of `patterns` that `mask` ((batch, 1, q_len, k_len) bool)
    equals once hidden keys are added (`pattern & keys_seen`, the keys some query sees), len(patterns)
    when none does; and those keys_seen, (batch, k_len)."""
    q_len, k_len = mask.shape[-2:]
    keys_seen = mask.any(-2)
    matches = [jnp.all(mask == (_positions_visible(q_len, k_len, *pattern) & keys_seen[:, :, None, :]))
               for pattern in patterns]
    return jnp.argmax(jnp.stack([*matches, jnp.array(True)])), keys_seen[:, 0]


def _masked(query, key, value, attn_mask, mask, row_seen, pattern, options):
    """The kernel's result under `mask` ((batch, 1 or heads, q_len, k_len), the call's position
    `pattern` folded in). A mask constant along the queries (padding, (batch, 1, 1, k_len)) is the
    pattern with hidden keys by its shape; another shared by the heads is checked against
    `patterns_to_try` on the device, one `lax.switch` branch per pattern and one for any other mask,
    the dynamic mask that hidden rows see whole (they are zeroed after)."""
    def any_mask(query, key, value, mask, keys_seen):
        del keys_seen
        return _with_any_mask(query, key, value, mask | ~row_seen[..., None], options)

    if mask.shape[1] != 1:  # per-head masks: segment ids are shared by the heads
        return any_mask(query, key, value, mask, None)
    if attn_mask.ndim < 2 or attn_mask.shape[-2] == 1:
        keys_seen = _batched_mask(attn_mask, mask.shape[0], 1, 1, mask.shape[-1])[:, 0, 0]
        return _with_hidden_keys(query, key, value, keys_seen, pattern, options)

    def hidden_keys(pattern):
        return lambda query, key, value, mask, keys_seen: _with_hidden_keys(
            query, key, value, keys_seen, pattern, options)

    patterns = patterns_to_try(*pattern)
    chosen, keys_seen = matching_pattern(mask, patterns)
    return jax.lax.switch(chosen, [*map(hidden_keys, patterns), any_mask], query, key, value, mask, keys_seen)


@selection.in_32_bit_mode
def flash_attention(query, key, value, attn_mask=None, *, scale, is_causal=False, sliding_window=0, softcap=0.0,
                    query_offset=0, with_logsumexp=False, block=None, interpret=None):
    """Attention of (batch, heads, q_len, head_dim) queries over (batch, kv_heads, k_len, head_dim) keys
    and values through splash attention. `attn_mask`, boolean, broadcasts to (batch, heads, q_len,
    k_len); causal and sliding-window patterns come from positions, the first query at `query_offset`.
    Returns the output in the query's dtype, and with `with_logsumexp` also the float32 logsumexp
    (batch, heads, q_len) of the scaled (and capped) scores, -inf for fully hidden rows. Its gradient is
    `gradients` below (splash's backward kernels)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    interpret = selection.interpret() if interpret is None else interpret
    options = dict(block_sizes=block_sizes(q_len, k_len, block), head_shards=1, q_seq_shards=1,
                   attn_logits_soft_cap=softcap if softcap > 0 else None, save_residuals=with_logsumexp,
                   interpret=interpret)
    query = (query * jnp.asarray(scale, jnp.float32)).astype(query.dtype)

    if attn_mask is None:
        kernel = splash.make_splash_mha(
            _static_mask(heads, q_len, k_len, is_causal, sliding_window, query_offset), **options)
        result = jax.vmap(kernel)(query, key, value)
        row_seen = None
    else:
        mask = _batched_mask(attn_mask, batch, heads, q_len, k_len)
        if is_causal or sliding_window > 0:
            mask = mask & _positions_visible(q_len, k_len, is_causal, sliding_window, query_offset)
        row_seen = mask.any(-1)  # (batch, 1 or heads, q_len)
        result = _masked(query, key, value, attn_mask, mask, row_seen, (is_causal, sliding_window, query_offset),
                         options)

    out, logsumexp = (result[0], result[1][0]) if with_logsumexp else (result, None)
    if row_seen is not None:
        out = jnp.where(row_seen[..., None], out, jnp.zeros((), out.dtype))
        if logsumexp is not None:
            logsumexp = jnp.where(row_seen, logsumexp, -jnp.inf)
    return (out, logsumexp) if with_logsumexp else out


@selection.in_32_bit_mode
def gradients(grad_out, query, key, value, attn_mask=None, **options):
    """The gradients of (query, key, value) of `flash_attention(query, key, value, attn_mask, **options)`
    for the output's gradient `grad_out`, through splash's backward kernels (its `custom_vjp`). Taken here
    rather than by `jax.vjp` at the caller: the backward kernels too must be traced with 32-bit types."""
    def forward(query, key, value):
        return flash_attention(query, key, value, attn_mask, **options)

    _, pullback = jax.vjp(forward, query, key, value)
    return pullback(grad_out.astype(query.dtype))


@selection.in_32_bit_mode
def gradients_from_saved(grad_out, query, key, value, out, logsumexp, *, scale, is_causal=False, sliding_window=0,
                         softcap=0.0, query_offset=0, block=None, interpret=None):
    """`gradients` for a call without a mask, from the output and float32 logsumexp its forward returned
    (`flash_attention(..., with_logsumexp=True)`): splash's backward kernels (dq, dkv) run on them as the
    residuals of its `custom_vjp`, where `jax.vjp` would run the forward kernel once more to make them. The
    same values reach the same kernels; a training step runs one attention kernel fewer a layer, and compiles
    one fewer (XLA compiles each kernel call of a program on its own)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel

    heads, q_len, k_len = query.shape[1], query.shape[2], key.shape[2]
    interpret = selection.interpret() if interpret is None else interpret
    kernel = splash.make_splash_mha(
        _static_mask(heads, q_len, k_len, is_causal, sliding_window, query_offset),
        block_sizes=block_sizes(q_len, k_len, block), head_shards=1, q_seq_shards=1,
        attn_logits_soft_cap=softcap if softcap > 0 else None, interpret=interpret)
    options = kernel.kwargs

    def collapsed(info):  # as `splash_attention_kernel._splash_attention` hands the mask blocks to the kernels
        if info is None or info.partial_mask_blocks is None:
            return info
        return info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(
            -1, *info.partial_mask_blocks.shape[-2:]))

    def one_element(query, key, value, out, logsumexp, grad_out):
        residuals = (query, key, value, None, None, out, logsumexp, collapsed(kernel.dq_mask_info),
                     collapsed(kernel.dkv_mask_info))
        grads = splash_kernel._splash_attention_bwd(
            False, options["mask_value"], options["is_mqa"], options["block_sizes"],
            options["residual_checkpoint_name"], options["mask_function"], options["attn_logits_soft_cap"],
            options["interpret"], residuals, grad_out)
        return grads[3:6]  # (query, key, value) of (mask infos, query, key, value, segment ids, sinks)

    scaled = (query * jnp.asarray(scale, jnp.float32)).astype(query.dtype)  # what `flash_attention` gave the kernel
    grad_scaled, grad_key, grad_value = jax.vmap(one_element)(scaled, key, value, out.astype(query.dtype), logsumexp,
                                                               grad_out.astype(query.dtype))
    grad_query = (grad_scaled.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(query.dtype)
    return grad_query, grad_key.astype(key.dtype), grad_value.astype(value.dtype)


def reference(query, key, value, attn_mask=None, *, scale, is_causal=False, sliding_window=0, softcap=0.0,
              query_offset=0, with_logsumexp=False):
    """The same computation in plain JAX, float32, with the whole score matrix: what the kernel is
    checked against."""
    groups = query.shape[1] // key.shape[1]
    keys = jnp.repeat(key.astype(jnp.float32), groups, axis=1)
    values = jnp.repeat(value.astype(jnp.float32), groups, axis=1)
    scores = jnp.einsum("bhqd,bhkd->bhqk", query.astype(jnp.float32) * scale, keys,
                        precision=jax.lax.Precision.HIGHEST)
    if softcap > 0:
        scores = softcap * jnp.tanh(scores / softcap)
    visible = _positions_visible(query.shape[2], key.shape[2], is_causal, sliding_window, query_offset)
    if attn_mask is not None:
        visible = visible & attn_mask
    scores = jnp.where(visible, scores, -jnp.inf)
    logsumexp = jax.nn.logsumexp(scores, axis=-1)
    weights = jnp.where(jnp.isneginf(logsumexp)[..., None], 0.0, jnp.exp(scores - logsumexp[..., None]))
    out = jnp.einsum("bhqk,bhkd->bhqd", weights, values, precision=jax.lax.Precision.HIGHEST).astype(query.dtype)
    return (out, logsumexp) if with_logsumexp else out
