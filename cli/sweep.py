"""`hf-tpu sweep`: every architecture in Transformers' auto-model mappings, built from a tiny config, run on
CPU and on `tpu`, and compared.

Per model type, one class is checked: the first task in `TASKS` whose mapping lists it. The model is built
from a shrunk default config with a fixed seed, saved with `save_pretrained`, loaded back on CPU and with
`device_map="tpu"` (so the real loading code runs), and both run the same forward; generative models also
compare a few greedy tokens. Each architecture runs in a worker process with a timeout, so a hang or a crash
costs one architecture, not the sweep.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import inspect
import json
import multiprocessing
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict

RTOL = 1e-4
ATOL = 1e-4
NEW_TOKENS = 4
BATCH, SEQUENCE, DECODER_SEQUENCE = 2, 8, 4
TINY_VOCAB = 256
SPECIAL_TOKEN_BAND = 32  # the top ids of the tiny vocabulary hold the config's special tokens
INITIALIZER_RANGE = 0.02  # Transformers' usual standard deviation for initial weights

# (task, mapping name in transformers.models.auto.modeling_auto, generative), in the order a model type's
# class is chosen.
TASKS = (
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", True),
    ("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", True),
    ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", False),
    ("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", False),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", False),
    ("speech-seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", True),
    ("ctc", "MODEL_FOR_CTC_MAPPING_NAMES", False),
    ("audio-classification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", False),
    ("image-text-to-text", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", False),
    ("multimodal-lm", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", False),
)

# Config attributes shrunk wherever they appear (also inside sub-configs), to these values.
TINY_SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "hidden_dim", "word_embed_proj_dim",
                     "projection_dim", "embedding_size", "embedding_dim"), 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim",
                     "hidden_dim_ffn"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers",
                     "n_layers", "num_decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "encoder_attention_heads", "decoder_attention_heads",
                     "num_heads", "n_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads"), 2),
    "head_dim": 16,
    # multi-head latent attention (DeepSeek-style)
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "qk_head_dim": 16,
    "v_head_dim": 16,
    **dict.fromkeys(("n_group", "num_group", "num_expert_group", "topk_group", "first_k_dense_replace"), 1),
    **dict.fromkeys(("vocab_size_per_layer_input",), 256),
    "hidden_size_per_layer_input": 16,
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k", "top_k_experts",
                     "num_experts_per_token"), 2),
    **dict.fromkeys(("n_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_source_positions", "max_target_positions"), 128),
    "image_size": 32,
    "patch_size": 8,
    "num_mel_bins": 16,
}
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
MAX_LAYER_KINDS = 4  # a hybrid model gets up to this many layers, one of each kind
# Attributes whose default is a multiple of the hidden size, scaled with it.
SIZED_LIKE_HIDDEN = ("attention_hidden_size",)
# Attributes that only ever get smaller (a default already below the tiny size stays).
SHRINK_ONLY = {"max_position_embeddings", "n_positions", "max_source_positions", "max_target_positions",
               "num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k", "top_k_experts",
               "num_experts_per_token", "n_shared_experts", "moe_num_shared_experts", "n_group", "num_group",
               "num_expert_group", "topk_group", "first_k_dense_replace"}

# Per model type, attributes the generic shrinker gets wrong (set after it, at the top level).
OVERRIDES: dict[str, dict] = {
    "whisper": {"max_source_positions": 16},  # input_features must be exactly 2 * max_source_positions frames
    # one attention layer and one MoE layer among the two
    "recurrent_gemma": {"num_hidden_layers": 3},  # block_types cycles recurrent, recurrent, attention
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2},
    # ReformerModelWithLMHead refuses an encoder's config; axial position factors need a big hidden size
    "reformer": {"is_decoder": True, "axial_pos_embds": False, "attn_layers": ["local", "local"]},
}


@dataclasses.dataclass
class Result:
    model_type: str
    task: str
    class_name: str
    outcome: str  # "passes" | "fails-on-tpu" | "skipped-cpu-fails" | "timeout"
    detail: str = ""  # exception type and first line, or the max abs diff
    seconds: float = 0.0
    cpu_fallbacks: dict = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- choosing


def architectures(only=None, limit=None) -> list[tuple[str, str, str, bool]]:
    """(model_type, task, class name, generative) for each model type, in `TASKS` order."""
    from transformers.models.auto import modeling_auto

    chosen = {}
    for task, mapping_name, generative in TASKS:
        for model_type, class_name in getattr(modeling_auto, mapping_name).items():
            if model_type not in chosen and (only is None or model_type in only):
                if isinstance(class_name, tuple):  # e.g. DeiT's (ForImageClassification, ...WithTeacher)
                    class_name = class_name[0]
                chosen[model_type] = (model_type, task, class_name, generative)
    found = list(chosen.values())
    if only is not None:
        missing = sorted(set(only) - set(chosen))
        if missing:
            raise SystemExit(f"not in Transformers' auto-model mappings: {', '.join(missing)}")
    return found[:limit] if limit is not None else found


# ---------------------------------------------------------------------------------------------- configs


def _special_token_ids(values: dict) -> list[tuple[str, object]]:
    return [(k, v) for k, v in values.items()
            if (k.endswith("_token_id") or k.endswith("_token_index") or k.endswith("_token_ids")) and v is not None]


def _shrink_dict(values: dict) -> dict:
    """A config's to_dict() with sizes made tiny; sub-configs (nested dicts with a model_type) shrunk too."""
    original, values = values, dict(values)
    for key, tiny in TINY_SIZES.items():
        current = values.get(key)
        if isinstance(current, int) and not isinstance(current, bool) and current > 0:
            values[key] = min(current, tiny) if key in SHRINK_ONLY else tiny
    for heads_key, kv_heads_key in (("num_attention_heads", "num_key_value_heads"), ("n_head", "n_kv_heads"),
                                    ("num_heads", "num_kv_heads")):
        if kv_heads_key in values and original.get(kv_heads_key) in (None, original.get(heads_key)):
            values[kv_heads_key] = values.get(heads_key)  # multi-head attention stays so (MLA modules assume it)
    hidden = next((values[k] for k in ("hidden_size", "d_model", "n_embd") if k in values), 64)
    heads = next((values[k] for k in ("num_attention_heads", "n_head") if k in values), 4)
    if "qk_rope_head_dim" in values and values.get("head_dim") is not None:
        values["head_dim"] = values["qk_rope_head_dim"]  # MLA models rotate only the rope part of each head
    elif "head_dim" in values:  # None too: some default configs leave it to a derivation their model lacks
        values["head_dim"] = hidden // heads
    if isinstance(values.get("rotary_dim"), int):  # rotary part of each head (GPT-J, CodeGen)
        values["rotary_dim"] = min(values["rotary_dim"], hidden // heads)
    original_hidden = next((original[k] for k in ("hidden_size", "d_model", "n_embd") if k in original), None)
    for key in SIZED_LIKE_HIDDEN:
        if isinstance(values.get(key), int) and original_hidden:
            values[key] = max(1, values[key] * hidden // original_hidden)
    _shrink_per_layer_settings(original, values)
    for key in ("out_features", "out_indices"):  # a backbone's outputs: its last stage, of the fewer stages
        if values.get(key) is not None:
            values[key] = None
    if "vocab_size" in values and (values["vocab_size"] is None or values["vocab_size"] > TINY_VOCAB):
        values["vocab_size"] = TINY_VOCAB  # None too: a CTC or protein model's head needs one
    for key, value in values.items():
        if isinstance(value, dict) and "model_type" in value:
            values[key] = _shrink_dict(value)
    return values


def _shrink_per_layer_settings(original: dict, values: dict) -> None:
    """Per-layer lists (layer_types, ...) and {layer index: setting} dicts follow the new layer count. A hybrid
    model keeps one layer of each kind (attention, linear attention, convolution), with more layers than the
    tiny count if it has more kinds, so that every kind of layer and cache runs."""
    layer_key = next((k for k in LAYER_COUNT_KEYS if isinstance(values.get(k), int)), None)
    if layer_key is None:
        return
    old_layers = original[layer_key]

    def kinds(value) -> list:
        if isinstance(value, list) and len(value) == old_layers and all(isinstance(v, str) for v in value):
            distinct = list(dict.fromkeys(value))
            return distinct if 1 < len(distinct) <= MAX_LAYER_KINDS else []
        return []

    new_layers = values[layer_key] = max([values[layer_key], *(len(kinds(value)) for value in values.values())])
    for key, value in values.items():
        if isinstance(value, list) and len(value) == old_layers:
            values[key] = kinds(value) + value[: new_layers - len(kinds(value))]
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            values[key] = {k: v for k, v in value.items() if int(k) < new_layers}


def _vocab_sizes(values: dict):
    if isinstance(values.get("vocab_size"), int):
        yield values["vocab_size"]
    for value in values.values():
        if isinstance(value, dict) and "model_type" in value:
            yield from _vocab_sizes(value)


def _remap_special_tokens(values: dict, remapped: dict, band) -> None:
    """Moves special token ids past the tiny vocabulary into its top band, the same id to the same place at
    every level (a multimodal config holds its image token id, its text config the vocabulary)."""
    for key, value in _special_token_ids(values):
        ids = value if isinstance(value, list) else [value]
        if all(isinstance(i, int) for i in ids):
            new = [i if i < TINY_VOCAB - SPECIAL_TOKEN_BAND else remapped.setdefault(i, next(band, 0)) for i in ids]
            values[key] = new if isinstance(value, list) else new[0]
    for value in values.values():
        if isinstance(value, dict) and "model_type" in value:
            _remap_special_tokens(value, remapped, band)


def tiny_config(model_type: str, config_class=None):
    """The model type's default config, shrunk; its text config where `config_class` (the model class's) is that."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    text_config = getattr(default, "text_config", None)
    if config_class is not None and not isinstance(default, config_class) and isinstance(text_config, config_class):
        default = text_config  # e.g. Llama4ForCausalLM is mapped from 'llama4' but takes a Llama4TextConfig
    original = default.to_dict()
    values = _shrink_dict(original)
    if max(_vocab_sizes(original), default=0) > TINY_VOCAB:
        _remap_special_tokens(values, {}, iter(range(TINY_VOCAB - 1, TINY_VOCAB - SPECIAL_TOKEN_BAND - 1, -1)))
    if values.get("is_encoder_decoder") and values.get("decoder_start_token_id") is None:
        values["decoder_start_token_id"] = values.get("pad_token_id") or 0  # generation needs one; T5 uses pad
    values.update(OVERRIDES.get(model_type, {}))
    return type(default).from_dict(values)


# ---------------------------------------------------------------------------------------------- inputs


def _all_configs(config):
    yield config
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            yield from _all_configs(sub)


def _first(config, *names, default=None):
    for c in _all_configs(config):
        for name in names:
            value = getattr(c, name, None)
            if value is not None:
                return value
    return default


def dummy_inputs(model, generator) -> dict:
    """Inputs for the model's forward, by the names its signature takes: text, image or audio."""
    import torch

    config = model.config
    parameters = inspect.signature(model.forward).parameters
    main = model.main_input_name
    inputs = {}
    if main == "pixel_values" or ("pixel_values" in parameters and "input_ids" not in parameters):
        channels = _first(config, "num_channels", default=3)
        size = _first(config, "image_size", default=32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        inputs["pixel_values"] = torch.randn(BATCH, channels, size, size, generator=generator)
    elif main == "input_features":
        if _first(config, "num_mel_bins") is not None:  # whisper-like: (batch, mel bins, frames)
            frames = 2 * _first(config, "max_source_positions", default=16)
            inputs["input_features"] = torch.randn(BATCH, _first(config, "num_mel_bins"), frames, generator=generator)
        else:  # speech2text-like: (batch, frames, features)
            features = _first(config, "input_feat_per_channel", "feature_size", default=80)
            features *= _first(config, "input_channels", default=1)
            inputs["input_features"] = torch.randn(BATCH, 64, features, generator=generator)
    elif main == "input_values":
        inputs["input_values"] = torch.randn(BATCH, 1600, generator=generator)
    else:
        embeddings = model.get_input_embeddings()
        vocab = embeddings.num_embeddings if hasattr(embeddings, "num_embeddings") else TINY_VOCAB
        high = vocab - SPECIAL_TOKEN_BAND if vocab > 2 * SPECIAL_TOKEN_BAND else vocab
        inputs["input_ids"] = torch.randint(0, high, (BATCH, SEQUENCE), generator=generator)
        if "attention_mask" in parameters:
            inputs["attention_mask"] = torch.ones(BATCH, SEQUENCE, dtype=torch.long)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in parameters:
        start = getattr(config, "decoder_start_token_id", None) or 0
        inputs["decoder_input_ids"] = torch.full((BATCH, DECODER_SEQUENCE), start, dtype=torch.long)
    return inputs


# ---------------------------------------------------------------------------------------------- comparing


def _tensors(value, prefix="output"):
    """(name, tensor) for every tensor in a model output, skipping caches."""
    import torch

    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):  # ModelOutput is one
        for key in value.keys():
            yield from _tensors(value[key], f"{prefix}.{key}")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{prefix}[{i}]")


def compare(expected, actual) -> str | None:
    """None when every tensor of `actual` matches `expected` (float: RTOL/ATOL; others exactly), else why."""
    import torch

    expected, actual = dict(_tensors(expected)), dict(_tensors(actual))
    if expected.keys() != actual.keys():
        return f"outputs differ in structure: {sorted(expected)} vs {sorted(actual)}"
    for name, want in expected.items():
        got = actual[name].cpu()
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{name}: {got.dtype}{tuple(got.shape)} on tpu vs {want.dtype}{tuple(want.shape)} on cpu"
        if want.is_floating_point() or want.is_complex():
            if not torch.allclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True):
                diff = (got - want).abs().nan_to_num(float("inf")).max().item()
                return f"numeric mismatch: {name} max abs diff {diff:.3g} (rtol {RTOL}, atol {ATOL})"
        elif not torch.equal(got, want):
            return f"{name}: values differ"
    return None


def float32_rounding(cpu_model, inputs, expected, actual) -> str:
    """Whether a numeric mismatch is float32 rounding that the model amplifies (huge activations, a sharp
    softmax) rather than a wrong result: so when every output on tpu is as close to a float64 run on CPU as
    CPU's own float32 output is (up to ATOL). Returns a note giving both distances, or "" when it is not so."""
    import copy

    try:
        exact = dict(_tensors(copy.deepcopy(cpu_model).double()(
            **{name: value.double() if value.is_floating_point() else value for name, value in inputs.items()})))
    except Exception:  # noqa: BLE001 - a model that cannot run in float64 keeps its mismatch
        return ""
    actual = dict(_tensors(actual))
    worst_tpu = worst_cpu = 0.0
    for name, want in _tensors(expected):
        if name not in exact or not want.is_floating_point():
            continue
        cpu_error = (want.double() - exact[name]).abs().max().item()
        tpu_error = (actual[name].cpu().double() - exact[name]).abs().max().item()
        if not tpu_error <= cpu_error + ATOL:  # NaN fails too
            return ""
        worst_tpu, worst_cpu = max(worst_tpu, tpu_error), max(worst_cpu, cpu_error)
    return (f"differs from cpu beyond the tolerance by float32 rounding: against a float64 run, tpu is off by "
            f"{worst_tpu:.2g}, cpu by {worst_cpu:.2g}")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


# ---------------------------------------------------------------------------------------------- one run


def check_architecture(model_type: str, task: str, class_name: str, generative: bool) -> Result:
    """Builds, saves, loads and compares one architecture; runs in the worker process."""
    import torch
    import transformers

    import hf_tpu
    from hf_tpu import model_patches

    result = Result(model_type, task, class_name, "skipped-cpu-fails")
    start = time.perf_counter()
    try:
        model_class = getattr(transformers, class_name)
        with tempfile.TemporaryDirectory(prefix=f"hf_tpu_sweep_{model_type}_") as path:
            try:
                torch.manual_seed(0)
                model = model_class(tiny_config(model_type, model_class.config_class))
                randomize_zero_matrices(model)
                model.save_pretrained(path)
                torch.manual_seed(0)
                cpu_model = model_class.from_pretrained(path).eval()
                inputs = dummy_inputs(cpu_model, torch.Generator().manual_seed(0))
                with torch.no_grad():
                    expected = cpu_model(**inputs)
                    expected_tokens = _greedy_tokens(cpu_model, inputs) if generative else None
            except Exception as error:  # noqa: BLE001 - every failure is a result to record
                result.detail = _first_line(error)
                return result
            result.outcome, rounding_note = "fails-on-tpu", ""
            hf_tpu.reset_metrics()
            try:
                torch.manual_seed(0)
                tpu_model = model_class.from_pretrained(path, device_map="tpu").eval()
                model_patches.apply(tpu_model)
                tpu_inputs = {name: value.to("tpu") for name, value in inputs.items()}
                with torch.no_grad():
                    actual = tpu_model(**tpu_inputs)
                    mismatch = compare(expected, actual)
                    if mismatch is not None and mismatch.startswith("numeric mismatch"):
                        rounding_note = float32_rounding(cpu_model, inputs, expected, actual)
                        mismatch = None if rounding_note else mismatch
                    if mismatch is None and expected_tokens is not None:
                        tokens = _greedy_tokens(tpu_model, tpu_inputs).cpu()
                        if not torch.equal(tokens, expected_tokens):
                            mismatch = f"greedy tokens differ: {tokens.tolist()} vs cpu {expected_tokens.tolist()}"
                            if _tokens_match_unpadded(tpu_model, tpu_inputs, expected_tokens):
                                mismatch = PADDING_SENSITIVE
            except Exception as error:  # noqa: BLE001
                mismatch = _first_line(error)
            result.cpu_fallbacks = dict(hf_tpu.metrics()["cpu_fallbacks"])
            result.outcome, result.detail = ("fails-on-tpu", mismatch) if mismatch else ("passes", rounding_note)
            return result
    finally:
        result.seconds = round(time.perf_counter() - start, 2)


PADDING_SENSITIVE = ("greedy tokens differ only with the prompt left-padded to a bucket: this model's output depends "
                     "on padding; HF_TPU_PROMPT_BUCKETS='' turns bucketing off")


def _tokens_match_unpadded(tpu_model, tpu_inputs, expected_tokens) -> bool:
    """Whether `generate()` on tpu matches CPU once the adapter stops left-padding prompts to a bucket."""
    import torch

    from hf_tpu.integrations import transformers as adapter

    buckets = adapter.settings.prompt_buckets
    adapter.configure(prompt_buckets=())
    try:
        return torch.equal(_greedy_tokens(tpu_model, tpu_inputs).cpu(), expected_tokens)
    finally:
        adapter.configure(prompt_buckets=buckets)


def randomize_zero_matrices(model) -> None:
    """Gives weight matrices that initialization leaves all zero (MoE router gates) random values: a zero
    router scores every expert alike, and which of tied experts `topk` picks is arbitrary (CPU and tpu pick
    differently), so the comparison would test the tie-breaking instead of the model."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2 and parameter.is_floating_point() and not parameter.any():
                parameter.normal_(std=INITIALIZER_RANGE)


def _greedy_tokens(model, inputs):
    """NEW_TOKENS tokens (no end-of-sequence token stops them), made the way `generate()` makes them by
    default: on tpu, a decoder-only model decodes all tokens after the first in one device loop."""
    generate_inputs = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
    return model.generate(**generate_inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)


# ---------------------------------------------------------------------------------------------- workers


def _worker_main(connection) -> None:
    import logging
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    while True:
        job = connection.recv()
        if job is None:
            return
        try:
            result = check_architecture(*job)
        except BaseException as error:  # noqa: BLE001 - report it, keep the worker alive
            result = Result(job[0], job[1], job[2], "fails-on-tpu", _first_line(error) + " (in the sweep itself: "
                            + traceback.format_exc(limit=-1).strip().splitlines()[-1] + ")")
        connection.send(dataclasses.asdict(result))


class _Worker:
    """A process that checks architectures one at a time; killed and replaced when one overruns its timeout."""

    def __init__(self):
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()

    def run(self, job, timeout: float) -> Result | None:
        self.connection.send(job)
        if self.connection.poll(timeout):
            try:
                return Result(**self.connection.recv())
            except EOFError:
                return None
        return None

    def stop(self, kill: bool = False) -> None:
        if kill or not self.process.is_alive():
            self.process.kill()
        else:
            self.connection.send(None)
        self.process.join(timeout=10)


def run_sweep(jobs_list, jobs: int = 1, timeout: float = 120.0, on_result=None) -> list[Result]:
    """Runs the architectures on `jobs` worker processes; a timeout or a crash costs one architecture."""
    pending = list(reversed(jobs_list))
    results = []
    lock = threading.Lock()

    def drive():
        worker = None
        while True:
            with lock:
                if not pending:
                    break
                job = pending.pop()
            start = time.perf_counter()
            worker = worker or _Worker()
            result = worker.run(job, timeout)
            if result is None:
                alive = worker.process.is_alive()
                worker.stop(kill=True)
                worker = None
                detail = f"no answer within {timeout:.0f} s" if alive else "the worker process died (crash)"
                result = Result(job[0], job[1], job[2], "timeout" if alive else "fails-on-tpu", detail,
                                round(time.perf_counter() - start, 2))
            with lock:
                results.append(result)
                if on_result:
                    on_result(result)
        if worker:
            worker.stop()

    threads = [threading.Thread(target=drive) for _ in range(max(1, min(jobs, len(jobs_list))))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    order = {job[0]: i for i, job in enumerate(jobs_list)}
    return sorted(results, key=lambda r: order[r.model_type])


# ---------------------------------------------------------------------------------------------- reporting


def failure_cause(result: Result) -> str:
    """A grouping key for a failure: the op without a lowering, 'numeric mismatch', or the error's type and text."""
    detail = result.detail
    if detail.startswith("numeric mismatch") or detail.startswith("greedy tokens differ"):
        return detail.split(":")[0]
    return detail.split(" (")[0][:120]


def summary(results: list[Result]) -> str:
    counts = Counter(r.outcome for r in results)
    ran_on_cpu = [r for r in results if r.outcome != "skipped-cpu-fails"]
    passed = counts["passes"]
    share = passed / len(ran_on_cpu) if ran_on_cpu else 0.0
    lines = [
        f"{len(results)} architectures: {passed} pass, {counts['fails-on-tpu']} fail on tpu, "
        f"{counts['timeout']} time out, {counts['skipped-cpu-fails']} skipped (their tiny config fails on CPU)",
        f"of those that run on CPU, {passed}/{len(ran_on_cpu)} = {share:.0%} pass on tpu",
    ]
    failures = defaultdict(list)
    for r in results:
        if r.outcome in ("fails-on-tpu", "timeout"):
            failures[failure_cause(r)].append(r.model_type)
    if failures:
        lines.append("failures by cause:")
        for cause, model_types in sorted(failures.items(), key=lambda item: -len(item[1])):
            lines.append(f"  {len(model_types):3d}  {cause}: {', '.join(model_types)}")
    fallbacks = Counter()
    for r in results:
        fallbacks.update(r.cpu_fallbacks.keys())
    if fallbacks:
        lines.append("ops run through the CPU fallback (architectures using each): "
                     + ", ".join(f"{op} ({n})" for op, n in fallbacks.most_common()))
    return "\n".join(lines)


def versions() -> dict:
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    import hf_tpu

    return {"torch": version("torch"), "jax": version("jax"), "transformers": version("transformers"),
            "hf_tpu": hf_tpu.__version__}


def table_entry(result: Result, patches: list[str], checked_on: str, checked_with: dict) -> dict:
    limits = result.detail
    if result.cpu_fallbacks:
        limits = "; ".join(filter(None, [limits, "ops on the CPU fallback: " + ", ".join(sorted(result.cpu_fallbacks))]))
    status = "fails" if result.outcome != "passes" else ("works with patches" if patches else "works")
    return {"status": status, "tested_class": result.class_name, "patches": patches, "limits": limits,
            "checked": checked_on, "versions": checked_with}


TABLE_FILE = "model_patches/table.json"


def table_path():
    """The checkout's model_patches/table.json, or None when hf-tpu is not an editable install of a checkout."""
    from . import _checkout

    return _checkout.checkout_file(TABLE_FILE)


def write_table(results: list[Result], path) -> None:
    """Records the results in the table file at `path` (starting from the installed table when `path` does
    not exist yet); architectures not in `results` keep their entries. The sweep calls it after each
    architecture, so an interrupted sweep keeps what it checked."""
    import os

    from hf_tpu import model_patches

    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    else:
        table = model_patches.load_table()
    checked_on, checked_with = datetime.date.today().isoformat(), versions()
    for result in results:
        if result.outcome == "skipped-cpu-fails":
            table["architectures"].pop(result.model_type, None)
            table["not_checked"][result.model_type] = f"{result.class_name}: {result.detail}"
        else:
            table["not_checked"].pop(result.model_type, None)
            patches = model_patches.patches_for(result.model_type)
            table["architectures"][result.model_type] = table_entry(result, patches, checked_on, checked_with)
    table = {"architectures": dict(sorted(table["architectures"].items())),
             "not_checked": dict(sorted(table["not_checked"].items()))}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1, sort_keys=False)
        f.write("\n")
    model_patches.load_table.cache_clear()


def format_result(result: Result) -> str:
    fallbacks = f"  cpu fallbacks: {', '.join(result.cpu_fallbacks)}" if result.cpu_fallbacks else ""
    return (f"{result.model_type:<28} {result.outcome:<18} {result.seconds:6.1f}s  {result.class_name}"
            f"{'  ' + result.detail if result.detail else ''}{fallbacks}")


# ---------------------------------------------------------------------------------------------- the command


def run(args) -> int:
    """The `hf-tpu sweep` command."""
    table = None
    if args.write or args.table:
        table = args.table or table_path()
        if table is None:
            from . import _checkout

            return _checkout.not_a_checkout("sweep", TABLE_FILE, "--table")
    jobs = architectures(only=args.only, limit=args.limit)  # args.only: a non-empty list, or None for all
    print(f"checking {len(jobs)} architectures on cpu and tpu ({args.jobs} worker(s), {args.timeout:.0f} s each)")

    def record(result):
        print(format_result(result), flush=True)
        if table is not None:
            write_table([result], table)

    results = run_sweep(jobs, jobs=args.jobs, timeout=args.timeout, on_result=record)
    print(summary(results))
    if table is not None:
        print(f"updated {table}; run `hf-tpu compat --write-docs` to regenerate the docs")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return 0 if all(r.outcome in ("passes", "skipped-cpu-fails") for r in results) else 1
