"""A causal language model compiled with `torch.compile(model, backend="tpu")`, called with new prompt lengths and
batch sizes: one program per bucket of shapes, not one per shape (`hf_tpu.compiled_modules.SHAPE_POLICIES`).

A causal LM's output at a position depends on the tokens up to it only, so tokens appended after a prompt change
nothing before them: a call of `input_ids` (batch, length) is computed as a call padded on the right to the next
bucket length (`HF_TPU_COMPILED_BUCKETS`: 16, 32, 48, 64, 96, 128, 192, ..., as Sentence Transformers' encode pads),
its outputs cut back to `length` (the logits and hidden states along their positions, a `DynamicCache` by its own
`crop`). The padding is token 0 with 1 in the attention mask, where a mask is given: each real position attends to
exactly what it did, whatever the padded ones attend to. Rows are independent too: with the batch marked dynamic
(`torch._dynamo.mark_dynamic(input_ids, 0)`, or `torch.compile(..., dynamic=True)`) a batch is padded to the next
power of two, and a batch whose own program is not compiled yet is computed in chunks of a batch size that is.

While a new bucket's program is not compiled, a call is computed from programs that are (the core's `meanwhile`): its
inputs padded further, to a longer bucket compiled already, or its rows in chunks of a compiled batch size. A prompt
of 128 tokens after prompts of 1024 then runs at once in the 1024 program, and its own bucket is traced once such
calls have cost as long as a trace (the rent-or-buy rule of `hf_tpu.jit(meanwhile=)`), then compiled beside them.

Only where padding provably changes nothing real: a decoder-only `*ForCausalLM` whose prompts `generate()` may pad
(`model_patches.pads_prompts`), with rotary embeddings that do not scale with the sequence length ("dynamic" and
"longrope" do), called with token ids and at most an attention mask, `use_cache`, `return_dict`,
`output_hidden_states` and `logits_to_keep=0`, without gradients. Anything else (labels, a cache passed in, embeddings,
positions, attentions asked for) is compiled for its exact shape. `torch.compile(..., dynamic=False)` and
`torch._dynamo.mark_static` keep shapes exact.
"""

from __future__ import annotations

import torch

from hf_tpu import settings as _environment
from hf_tpu.compiled_modules import Bucketing

DEFAULT_BUCKETS = tuple(sorted({2 ** k for k in range(4, 15)} | {3 * 2 ** k for k in range(4, 13)}))
_environment.register(
    _environment.Setting("HF_TPU_COMPILED_BUCKETS", "lengths", None, "Transformers on tpu: the lengths a causal LM's "
                         "token batches are padded to, a prompt under torch.compile and a Trainer's training batch "
                         "(\"128,512,1024\"; empty: exact lengths)",
                         empty_is_value=True),
)

# the arguments a bucketed call may take besides the token ids
_ALLOWED = frozenset(("attention_mask", "use_cache", "return_dict", "output_hidden_states", "logits_to_keep"))
_LENGTH_SCALED_ROPE = ("dynamic", "longrope")


def buckets() -> tuple[int, ...]:
    lengths = _environment.get("HF_TPU_COMPILED_BUCKETS")
    return DEFAULT_BUCKETS if lengths is None else lengths


def _lengths_from(length: int, longest: int | None) -> list:
    """The bucket lengths a prompt of `length` tokens may be padded to, shortest first (none past `longest`)."""
    return [b for b in buckets() if b >= length and (longest is None or b <= longest)]


def _batches_from(batch: int) -> list:
    return [1 << k for k in range(12) if 1 << k >= batch]


def _model_pads(model) -> bool:
    from hf_tpu import model_patches

    config = model.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_types = [rope.get("rope_type")] if "rope_type" in rope else [p.get("rope_type") for p in rope.values()
                                                                       if isinstance(p, dict)]
    return (type(model).__name__.endswith("ForCausalLM") and not config.is_encoder_decoder
            and model_patches.pads_prompts(model) and not set(rope_types) & set(_LENGTH_SCALED_ROPE))


def bucketing(model, args: tuple, kwargs: dict, dynamic) -> Bucketing | None:
    """How a compiled call of `model` is padded to its bucket (see the module's docstring); None: not this model, or
    not this call, or shapes kept exact."""
    from transformers import PreTrainedModel

    if dynamic is False or not isinstance(model, PreTrainedModel) or torch.is_grad_enabled() and model.training:
        return None
    if len(args) > 1 or (args and "input_ids" in kwargs) or set(kwargs) - _ALLOWED - {"input_ids"}:
        return None
    ids = args[0] if args else kwargs.get("input_ids")
    mask = kwargs.get("attention_mask")
    if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point
            or kwargs.get("logits_to_keep", 0) != 0 or not _model_pads(model)):
        return None
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
        return None
    batch, length = ids.shape
    static = getattr(ids, "_dynamo_static_indices", set())
    marked = getattr(ids, "_dynamo_dynamic_indices", set())
    longest = getattr(model.config, "max_position_embeddings", None)
    lengths = [length] if 1 in static else _lengths_from(length, longest) or [length]
    batches = _batches_from(batch) if (dynamic or 0 in marked) and 0 not in static else [batch]
    if lengths[0] == length and batches[0] == batch and len(lengths) == 1 and len(batches) == 1:
        return None  # nothing to pad, and nothing to serve a new shape from
    rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")}

    def padded(rows: slice, to_batch: int, to_length: int) -> tuple:
        """The call's arguments for its rows `rows`, padded to (to_batch, to_length). A chunk of rows is a tensor of
        its own, not a view of the whole batch: a compiled program takes a view's whole buffer, so a view would key
        another program than the chunk's shape compiled (batch 8 after batch 1 traced at once)."""
        whole = rows == slice(None)
        arguments = dict(rest, input_ids=_pad(ids if whole else ids[rows].clone(), to_batch, to_length, 0))
        if mask is not None:
            arguments["attention_mask"] = _pad(mask if whole else mask[rows].clone(), to_batch, to_length, 1)
        return (), arguments

    kind = (mask is not None, tuple(sorted(rest.items())))  # what else makes a program of its own
    own_batch, own_length = batches[0], lengths[0]

    def alternatives():
        """Other ways to compute the call (`Bucketing`), made as they are asked for: the whole batch padded to a
        longer bucket, then its rows in chunks of a smaller batch size at each bucket."""
        for to_length in lengths[1:]:
            yield ((kind, own_batch, to_length),), lambda to_length=to_length: [
                padded(slice(None), own_batch, to_length)], lambda results, to_length=to_length: _cut(
                results[0], batch, length, own_batch, to_length)
        for chunk in (b for b in (32, 16, 8, 4, 2, 1) if b < batch):
            starts = range(0, batch, chunk)
            for to_length in lengths:
                yield (((kind, chunk, to_length),) * len(starts),
                       lambda chunk=chunk, to_length=to_length, starts=starts: [
                           padded(slice(start, start + chunk), chunk, to_length) for start in starts],
                       lambda results, chunk=chunk, to_length=to_length: _joined(
                           [_cut(r, min(chunk, batch - k * chunk), length, chunk, to_length)
                            for k, r in enumerate(results)]))

    call_args, call_kwargs = padded(slice(None), own_batch, own_length)
    return Bucketing(call_args, call_kwargs, lambda result: _cut(result, batch, length, own_batch, own_length),
                     (kind, own_batch, own_length), alternatives)


def _pad(tensor: torch.Tensor, batch: int, length: int, value: int) -> torch.Tensor:
    rows, columns = tensor.shape
    if (rows, columns) == (batch, length):
        return tensor
    padded = tensor.new_full((batch, length), value)
    padded[:rows, :columns] = tensor
    return padded


def _cut(result, rows: int, length: int, padded_rows: int, padded_length: int):
    """A bucket's result as the call's: tensors of (padded_rows, padded_length, ...) cut to (rows, length, ...), a
    `DynamicCache` cropped to `length` and its rows selected."""
    from transformers.cache_utils import DynamicCache

    if (rows, length) == (padded_rows, padded_length):  # a call of the bucket's own shape: nothing to cut
        return result

    def cut(value):
        if isinstance(value, torch.Tensor):
            if value.dim() >= 2 and value.shape[0] == padded_rows and value.shape[1] == padded_length:
                return value[:rows, :length]
            return value
        if isinstance(value, DynamicCache):
            if padded_length != length:
                value.crop(length - padded_length)  # the tokens to remove, as a negative count
            if padded_rows != rows:
                value.batch_select_indices(torch.arange(rows, device=value.layers[0].keys.device))
            return value
        return value

    return torch.utils._pytree.tree_map(cut, result)


def _joined(results: list):
    """The results of the chunks of a batch, as one: tensors concatenated along the batch, caches' layers too."""
    from transformers.cache_utils import DynamicCache

    first_leaves, spec = torch.utils._pytree.tree_flatten(results[0])
    leaves = [torch.utils._pytree.tree_flatten(r)[0] for r in results]
    joined = []
    for k, value in enumerate(first_leaves):
        parts = [r[k] for r in leaves]
        if isinstance(value, torch.Tensor):
            joined.append(torch.cat(parts) if value.dim() else value)
        elif isinstance(value, DynamicCache):
            for layer, *others in zip(value.layers, *(p.layers for p in parts[1:])):
                layer.keys = torch.cat([layer.keys, *(o.keys for o in others)])
                layer.values = torch.cat([layer.values, *(o.values for o in others)])
            joined.append(value)
        else:
            joined.append(value)
    return torch.utils._pytree.tree_unflatten(joined, spec)


def install() -> None:
    """Add `bucketing` to the core's shape policies (once)."""
    from hf_tpu import compiled_modules

    if bucketing not in compiled_modules.SHAPE_POLICIES:
        compiled_modules.SHAPE_POLICIES.append(bucketing)
