"""Sentence Transformers on `tpu`: each batch of text padded to a bucket length, and the model run as one
program per shape.

`SentenceTransformer.encode` sorts its inputs by length and pads each batch to its longest text, so every
batch has a sequence length of its own; on `tpu` each new shape compiles every op of the encoder again (100
sentences of varying length compiled 191 programs, and the first pass took twice the CPU's time). Padded
further, to the next of a few bucket lengths (`HF_TPU_ENCODE_BUCKETS`, by default 16, 32, 48, 64, 96, 128, ...),
batches of different lengths share one shape and its programs.

The padding is added where Sentence Transformers pads (the tokenized batch of its `Transformer` module), as
the tokenizer pads: pad tokens on the tokenizer's padding side, zeros in the attention mask and token
types. The encoder masks those positions out of attention, pooling reads the mask, and token embeddings
are cut at the mask, so the results are the unpadded batch's. A batch is left as it is when it is not text
with an attention mask, holds another per-token input, or would outgrow the model's positions.

Without gradients, the model's forward (`BaseModel.forward`: the encoder and the modules after it, pooling
and normalisation among them) runs as one program per batch shape, traced straight from Python
(`hf_tpu.jit`), instead of op by op: a first pass then compiles a program per bucket and batch size, not every
op of the model for each of them, and a later pass launches one program per batch (100 sentences: 3
programs, where tracing the encoder alone left 24 more for the ops after it).

A program compiles for seconds on a TPU (13 s for all-MiniLM-L6-v2's buckets on a v5e, whose host embeds 100
sentences in 0.5 s), and its trace takes the host's Python for as long as several batches. Until a bucket's
program is compiled, its batches run the model in PyTorch on the host's CPU, the weights copied there once
(`hf_tpu.jit(meanwhile=)`); a bucket is traced, and its compile started, once its batches have spent on the
host as long as a trace takes (`trace_after`): a short pass runs on the host as it would on the CPU, and
one that goes on moves to the chip bucket by bucket.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref

import torch
from torch.utils import _pytree as pytree

import hf_tpu
from hf_tpu import settings as _environment
from hf_tpu.wrapping import module_on_tpu, wrap_once

log = logging.getLogger("hf_tpu.integrations")

# powers of two and the halfway points between them (16, 32, 48, 64, 96, 128, 192, ... 8192): a batch grows by
# at most half its length (on the CPU backend, where compute is dear, powers of two alone cost more in
# padding than they saved in compiles)
DEFAULT_BUCKETS = tuple(sorted({2 ** k for k in range(4, 14)} | {3 * 2 ** k for k in range(4, 12)}))

_environment.register(
    _environment.Setting("HF_TPU_ENCODE_BUCKETS", "lengths", None, "Sentence Transformers on tpu: sequence lengths "
                         "to pad each batch to (\"64,128,256\"; empty: no padding)", empty_is_value=True),
)

# what a tokenizer returns per token, and the value a padded position takes (None: the pad token)
_PADDED_INPUTS = {"input_ids": None, "attention_mask": 0, "token_type_ids": 0}


def buckets() -> tuple[int, ...]:
    lengths = _environment.get("HF_TPU_ENCODE_BUCKETS")
    return DEFAULT_BUCKETS if lengths is None else lengths


def bucketed_length(length: int, longest: int | None) -> int:
    """The length a batch of `length` tokens is padded to: the next bucket, at most `longest` (the model's
    positions), and `length` itself past the last bucket that fits."""
    for bucket in buckets():
        if bucket >= length:
            return bucket if longest is None or bucket <= longest else length
    return length


def _longest_sequence(module) -> int | None:
    """The most tokens the encoder takes: its position table, and the module's own limit."""
    limits = [getattr(module, "max_seq_length", None),
              getattr(getattr(module.auto_model, "config", None), "max_position_embeddings", None)]
    limits = [limit for limit in limits if isinstance(limit, int) and limit > 0]
    return min(limits) if limits else None


def pad_to_bucket(features: dict, pad_token_id: int, side: str, longest: int | None) -> dict:
    """`features` (a tokenized text batch) with its per-token inputs padded to the bucket length."""
    per_token = {name: value for name, value in features.items()
                 if isinstance(value, torch.Tensor) and value.dim() == 2}
    if "attention_mask" not in per_token or not set(per_token) <= set(_PADDED_INPUTS):
        return features
    batch, length = per_token["attention_mask"].shape
    if any(value.shape != (batch, length) for value in per_token.values()):
        return features
    padding = bucketed_length(length, longest) - length
    if padding <= 0:
        return features
    padded = dict(features)
    for name, value in per_token.items():
        fill = pad_token_id if _PADDED_INPUTS[name] is None else _PADDED_INPUTS[name]
        pad = value.new_full((batch, padding), fill)
        padded[name] = torch.cat([pad, value] if side == "left" else [value, pad], dim=1)
    return padded


def _wrap_preprocess(original):
    @functools.wraps(original)
    def preprocess(self, *args, **kwargs):
        features = original(self, *args, **kwargs)
        if features.get("modality") != "text" or not module_on_tpu(self):
            return features
        tokenizer = getattr(self, "tokenizer", None)
        pad_token_id = getattr(tokenizer, "pad_token_id", None)
        if pad_token_id is None:
            return features
        return pad_to_bucket(features, pad_token_id, getattr(tokenizer, "padding_side", "right"),
                             _longest_sequence(self))

    return preprocess


# `BaseModel.forward` as Sentence Transformers defines it, set when the adapter replaces it
_untraced_forward = None
# set while `_forward_on_the_host` runs the model: its forward is then the untraced one
_running_on_the_host = [False]


def _model_forward(model, features: dict, kwargs: dict):
    # the modules add their outputs to the features they are given: to a copy made inside the trace, which
    # the program returns, not to its argument
    return _untraced_forward(model, dict(features), **kwargs)


# model -> {name: (its tpu tensor, that tensor's storage and version, the tensor's copy on the host, the copy's
# version)}
_host_weights: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _state(model) -> dict:
    """The model's parameters and buffers by name, tied ones under each of their names."""
    return dict(itertools.chain(model.named_parameters(remove_duplicate=False),
                                model.named_buffers(remove_duplicate=False)))


def _version(t) -> int | None:
    """A tensor's version counter; None for an inference tensor (a copy read back under `torch.inference_mode`,
    as `encode` runs), which has none."""
    return None if t.is_inference() else t._version


def _host_entry(tensor, copy) -> tuple:
    return (tensor, (tensor.untyped_storage().data_ptr(), _version(tensor)), copy, _version(copy))


def _weights_on_the_host(model) -> dict:
    """The model's parameters and buffers by name, copied to the host's CPU once each: a copy serves until its
    tensor is written in place (its version moves) or replaced (`.data =` moves its storage), or the copy itself
    is written (one kept from the CPU the model was moved from, `_wrap_to`, that the caller still holds)."""
    state, kept, entries, stale = _state(model), _host_weights.get(model, {}), {}, {}
    for name, tensor in state.items():
        entry = kept.get(name)
        if (entry is None or entry[0] is not tensor or _version(entry[2]) != entry[3]
                or entry[1] != (tensor.untyped_storage().data_ptr(), _version(tensor))):
            stale.setdefault(id(tensor), tensor)  # a tied weight: one copy
            entry = None
        entries[name] = entry
    # the stale ones read back together: one wait for the chip, not one per tensor
    fresh = dict(zip(stale, hf_tpu.to_cpu(stale.values())))
    copies = {name: entries[name] or _host_entry(tensor, fresh[id(tensor)]) for name, tensor in state.items()}
    _host_weights[model] = copies
    return {name: entry[2] for name, entry in copies.items()}


# the largest model whose batches run on the host while the chip compiles (its parameters and buffers, bytes):
# a small encoder's batch takes the host's CPU a fraction of a second, where a billion-parameter model's would
# outlast the chip's compile, and its weights would take gigabytes of host memory
HOST_MODEL_BYTES = 1 << 30
# models whose forward failed on the host (a tpu tensor outside their parameters and buffers): they wait
_not_on_the_host: "weakref.WeakSet" = weakref.WeakSet()


def _plain_state(model) -> bool:
    """Whether every parameter and buffer is a plain tensor: not a subclass over tensors of its own (torchao's
    quantized weights), which has no storage whose address and version the host copies could follow."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def _state_bytes(model) -> int:
    tensors = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}.values()
    return sum(t.numel() * t.element_size() for t in tensors)


def _without_bucket_padding(features: dict) -> dict:
    """A tokenized batch (on the host) without its trailing columns that no row attends to: the bucket's padding
    (`pad_to_bucket`). The host then computes what the CPU computes for the tokenizer's batch, for less work (on
    the v5e's host, the padding made all-MiniLM-L6-v2's linear layers 29% slower over a pass): the encoder masks
    those columns out, pooling reads the mask and token embeddings are cut at it, so the embeddings are the
    padded batch's. Its per-token outputs are as long as the tokenizer's batch, as on the CPU. A batch with inputs
    the adapter does not pad, or padded on the left (whose tokens a model with absolute positions would see move),
    is left as it is."""
    mask = features.get("attention_mask")
    tensors = {name for name, value in features.items() if isinstance(value, torch.Tensor)}
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not tensors <= set(_PADDED_INPUTS):
        return features
    attended = mask.any(dim=0).nonzero()
    length = int(attended[-1]) + 1 if len(attended) else mask.shape[1]
    if length == mask.shape[1] or any(features[name].shape != mask.shape for name in tensors):
        return features
    return {name: value[:, :length] if name in tensors else value for name, value in features.items()}


def _forward_on_the_host(model, features: dict, kwargs: dict):
    """`_model_forward` in PyTorch on the host's CPU, on the batch without the bucket's padding
    (`_without_bucket_padding`), its results put on the model's device: what a batch runs while the chip
    compiles its bucket's program (`hf_tpu.jit(meanwhile=)`). A first pass then costs what the CPU's own costs,
    plus copying the weights to the host once (none for a model moved to tpu from the CPU: `_wrap_to`).
    `NotImplemented` (the batch waits for the chip) for a model over `HOST_MODEL_BYTES`, one the host could not
    run before, or one with quantized weights (tensor subclasses, whose host copies this does not keep)."""
    if model in _not_on_the_host or _state_bytes(model) > HOST_MODEL_BYTES or not _plain_state(model):
        return NotImplemented
    device = next(model.parameters()).device
    tensors = {name: value for name, value in features.items() if isinstance(value, torch.Tensor)}
    on_host = _without_bucket_padding({**features, **dict(zip(tensors, hf_tpu.to_cpu(tensors.values())))})
    _running_on_the_host[0] = True
    try:
        out = torch.func.functional_call(model, _weights_on_the_host(model), (on_host,), kwargs)
    except Exception as e:  # noqa: BLE001 - an input error raises again when the chip runs the batch
        log.info("hf_tpu: %s waits for the chip's compile: its forward failed on the host (%s: %s)",
                 type(model).__name__, type(e).__name__, e)
        _not_on_the_host.add(model)
        _host_weights.pop(model, None)
        return NotImplemented
    finally:
        _running_on_the_host[0] = False
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), out)


# how long a bucket's batches run on the host before the model's first trace (later ones wait as long as the
# last trace took): all-MiniLM-L6-v2's trace and lowering on the v5e's host, 0.4 s and 0.1 s, where a batch of
# 32 sentences takes 0.12 s there
TRACE_AFTER = 0.5
# one traced function for every model: its programs are keyed by the call, the model (its type and modules)
# among it
_traced_model_forward = hf_tpu.jit(_model_forward, meanwhile=_forward_on_the_host, trace_after=TRACE_AFTER)


def _wrap_model_forward(original):
    global _untraced_forward
    _untraced_forward = original

    @functools.wraps(original)
    def forward(self, features, **kwargs):
        if (_running_on_the_host[0] or torch.is_grad_enabled() or torch.compiler.is_compiling()
                or not module_on_tpu(self)):
            return original(self, features, **kwargs)  # training, a trace already, or another device: as it is
        # a plain dict: the tokenizer's BatchEncoding is unhashable, so it could not key a program
        return _traced_model_forward(self, dict(features), kwargs)

    return forward


def _wrap_to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        """Moving a model of at most `HOST_MODEL_BYTES` from the CPU to tpu keeps its CPU parameters and
        buffers as their host copies (`_host_weights`), instead of reading them back from the chip at the
        first batch (0.10 s of all-MiniLM-L6-v2's first pass on the v5e's host, which its CPU run does not
        pay). What a copy holds is what the tpu tensor was made from; it serves until that tensor is written
        or replaced, as a copy read back does."""
        before = _state(self)
        if (any(t.device.type != "cpu" for t in before.values()) or module_on_tpu(self)
                or _state_bytes(self) > HOST_MODEL_BYTES or not _plain_state(self)):
            return original(self, *args, **kwargs)
        aliases = {id(t): t.detach() for t in before.values()}  # hold the CPU storages past the move; tied: one
        before = {name: aliases[id(t)] for name, t in before.items()}
        result = original(self, *args, **kwargs)
        if module_on_tpu(self):
            _host_weights[self] = {name: _host_entry(t, before[name]) for name, t in _state(self).items()
                                   if name in before and (before[name].shape, before[name].dtype) == (t.shape, t.dtype)}
        return result

    return to


def install(module) -> None:
    if module.__name__ == "sentence_transformers.base.model":
        wrap_once(module.BaseModel, "forward", _wrap_model_forward)
        wrap_once(module.BaseModel, "to", _wrap_to)
        return
    wrap_once(module.Transformer, "preprocess", _wrap_preprocess)
