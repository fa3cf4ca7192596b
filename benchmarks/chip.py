"""The headline benchmark: a Llama-shaped and a Qwen3-MoE-shaped model on the chip, hf-tpu beside torchax
and the chip's limits.

One command prints, from one run, side by side:
- `limits`: the chip's limits measured in raw JAX: HBM read bandwidth (a large `jnp.sum`) and bf16 matmul
  throughput, with the published peaks; and at each batch x length of the grid the Llama model's weight products
  alone as one program (what any forward takes at least beside attention and the elementwise work) and a call of
  a program of the same inputs that computes nothing (the least a jitted call of them takes);
- `forward`: hf-tpu's forward (logits of every position, no cache) compiled by `torch.compile(backend="tpu")`,
  with its MFU, at each batch x prompt length of the grid;
- `eager`: the same forward in strict eager and in defer-and-fuse;
- `decode`: hf-tpu's `generate()`: decode time per step (tokens/s) at each batch x prompt length, against the
  HBM-bound limit (every weight and the whole KV cache read once a step);
- `ttft`: `generate()` of one token against the compiled forward of the same prompt;
- `torchax`: torchax's jitted forward (`torchax.interop.JittableModule`) of the same model and input;
- `moe`: a Qwen3-MoE-shaped model's decode at batch 64 with Transformers' `experts_implementation="grouped_mm"`
  (its default; hf-tpu lowers `aten._grouped_mm` to a ragged dot) against `"eager"` (Transformers' loop over
  the experts a batch routes to, one expert at a time), with the ratio. Each step of the loop routes other
  counts, for which its ops compile again: each call is stopped by `max_time` (`moe_eager_seconds`); where the
  first call makes all its tokens, the step is timed warm, else the ratio, compiles included, is a bound from
  below;
- `quant`, `quant_prefill` and `quant_big` (run only when `--only` names them, a chip command each;
  `benchmarks.quant`): the Llama model's decode in bfloat16, int8 weight-only and int4 side by side against the
  HBM limit of each one's bytes; its prefill with int8 activations and weights against bfloat16's, and its weight
  products alone in raw JAX in each form; what XLA fused in each quantized program; a 7B and a 9B model loaded in
  int8 from a bfloat16 checkpoint onto one chip, their peak memory, loading GB/s and decode.

Each group runs in its own process with its own time limit (`--timeout`, `--budget`): torchax and hf-tpu both
claim PyTorch's PrivateUse1 backend, one process at a time holds a TPU chip, and a group that runs out of time
is stopped without losing the others. This process only starts them and prints each figure as it arrives
(`--json PATH` is rewritten after each one, so a stopped run keeps what it measured); it never holds the chip.
A row whose memory would not fit on the chip is skipped with the reason printed.

MFU counts 2 FLOPs per parameter of every matmul (the embedding lookup excluded) per token, plus attention's
QK^T and PV over the whole (not causally halved) sequence, against the chip's published bf16 peak (on a CPU,
where there is none, against the measured matmul throughput).

Run: python -m benchmarks.chip                              (the 1.1B and MoE models: on a TPU)
     python -m benchmarks.chip --only forward,torchax --timeout 300 --json f.json
     python -m benchmarks.chip --figures f.json d.json --plot chip.png   (report and plot saved runs)
     python -m benchmarks.chip --size tiny --plot /tmp/p.png   (tiny models, same work: CI runs one batch and length)
     python -m benchmarks.chip --size small --only ttft         (a 512-wide, 8-layer Llama at 128 and 1024 tokens)
     python -m benchmarks.chip --only forward,torchax --dump-hlo DIR   (XLA's optimized HLO of each side)
     python -m benchmarks.chip --only forward,torchax,decode --profile DIR   (device time per XLA op)
     python -m benchmarks.chip --only quant   (then --only quant_prefill, --only quant_big: quantized models, torchao)
     python -m benchmarks.chip --only train_libraries --train-rows 0,2,3   (training: the Trainer, PEFT's LoRA,
         `accelerate launch`; benchmarks.training)
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

from benchmarks import training

_LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=8192, vocab_size=32000, max_position_embeddings=8192)
# Qwen3-30B-A3B's routing (128 experts, 8 a token, experts of 768) and attention (32 query and 4 key/value heads
# of 128) with its vocabulary, in 5 layers instead of 48: 3.74B parameters, 7.5 GB in bfloat16
_QWEN3_MOE = dict(hidden_size=2048, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, vocab_size=151936, max_position_embeddings=4096)

# the models and the grid each group runs at. The MoE model's prompt is one token: its prefill then routes
# the counts a decode step routes (64 tokens x 8 experts over 128), so the per-expert loop's eager prefill
# compiles the programs its decode steps use; a 16-token prompt's prefill (1024 tokens) routes counts of about
# 64, and on the v5e (2026-12-05) it compiled for 315 s before its first token.
SIZES = {
    "1b": dict(model=_LLAMA_1B, moe=_QWEN3_MOE, batches=[1, 8, 64], lengths=[128, 1024, 4096], eager=(1, 1024),
               decode_steps=64, moe_batch=64, moe_prompt=1, moe_steps=8, moe_eager_seconds=150, matmul=8192,
               hbm_bytes=2 << 30, iters=10),
    "tiny": dict(model=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=256, max_position_embeddings=512),
                 moe=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=True, vocab_size=128, max_position_embeddings=512),
                 batches=[1, 2], lengths=[16, 32], eager=(1, 16), decode_steps=32, moe_batch=2, moe_prompt=16,
                 moe_steps=8, moe_eager_seconds=None, matmul=256, hbm_bytes=16 << 20, iters=3),
}
# the training groups' models and rows (`benchmarks.training`): a row is a model, a recipe, a batch x length (the
# tokens of an optimizer step), whether the decoder layers are checkpointed, and the micro-batches a step
# accumulates
def _train_row(model: str, recipe: str, batch: int, length: int, checkpointing: bool, accumulation: int = 1) -> dict:
    return dict(model=model, recipe=recipe, batch=batch, length=length, checkpointing=checkpointing,
                accumulation=accumulation)


def _library_row(mode: str, seconds: float, *row, **options) -> dict:
    """A row of `train_libraries`: the way a library runs it ("Trainer", "Trainer compile" or "accelerate launch"),
    the seconds its process may take, and the row."""
    return dict(mode=mode, seconds=seconds, row=_train_row(*row, **options))


SIZES["1b"]["train"] = dict(models={"0.44b": training.LLAMA_044B, "1.1b": _LLAMA_1B}, steps=5,
                            rows=[_train_row("1.1b", "bf16", 8, 1024, True), _train_row("0.44b", "bf16", 8, 1024, True),
                                  _train_row("0.44b", "mixed", 8, 1024, True), _train_row("1.1b", "bf16", 4, 1024, True),
                                  _train_row("1.1b", "bf16", 2, 1024, True)])
SIZES["tiny"]["train"] = dict(models={"tiny": training.TINY}, steps=2,
                              rows=[_train_row("tiny", "bf16", 2, 32, True), _train_row("tiny", "mixed", 2, 32, False)])


def _library_rows(model: str, lora_model: str, length: int) -> list:
    """`train_libraries`' rows, 8 x `length` tokens a step, checkpointed: the Trainer with the arguments users pass
    (`bf16=True`, 4 micro-batches a step) as its traced steps and with `torch_compile=True`, of `model`; PEFT's LoRA
    through the Trainer and a plain Accelerate loop under `accelerate launch`, of `lora_model` in bfloat16. Each
    row's time limit keeps a slow first step from taking the rows after it."""
    return [_library_row("Trainer", 180, model, "mixed", 8, length, True, accumulation=4),
            _library_row("Trainer compile", 280, model, "mixed", 8, length, True, accumulation=4),
            _library_row("Trainer", 200, lora_model, "lora", 8, length, True),
            _library_row("accelerate launch", 150, lora_model, "bf16", 8, length, True)]


SIZES["1b"]["train"]["libraries"] = _library_rows("0.44b", "1.1b", 1024)
SIZES["tiny"]["train"]["libraries"] = _library_rows("tiny", "tiny", 32)
# `compile`: a Flux-shaped transformer of about 1B parameters (Flux's blocks at hidden 1536: 6 double-stream and 12
# single-stream blocks of 12 heads of 128), at a 512x512 image (1024 latent tokens) and a 512-token prompt, then a
# second resolution (768x768: 2304 tokens); and the Llama's training step with 4 of its layers (0.4B parameters)
SIZES["1b"].update(flux=dict(num_layers=6, num_single_layers=12, attention_head_dim=128, num_attention_heads=12,
                             joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64,
                             axes_dims_rope=[16, 56, 56]),
                   denoiser_images=[(512, 512), (768, 768)], flux_text=512, train_layers=4)
SIZES["tiny"].update(flux=dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                               joint_attention_dim=32, pooled_projection_dim=16, in_channels=4,
                               axes_dims_rope=[4, 4, 8]),
                     denoiser_images=[(32, 32), (48, 48)], flux_text=16, train_layers=1)
# and a Stable-Diffusion-1.5-shaped UNet (0.86B parameters; its text encoder's 77 states of 768) at 512x512 (64x64
# latents) and 768x768
SIZES["1b"].update(unet=dict(block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, cross_attention_dim=768,
                             attention_head_dim=8, sample_size=64), unet_text=(77, 768))
SIZES["tiny"].update(unet=dict(block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
                               attention_head_dim=8, sample_size=8, norm_num_groups=16,
                               down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                               up_block_types=("UpBlock2D", "CrossAttnUpBlock2D")), unet_text=(8, 32))
# the quantization groups (`benchmarks.quant`): a 7B Llama-2-shaped model (6.7B parameters, 13.5 GB in bfloat16)
# and a Qwen3-8B-shaped one of 40 layers (9.0B parameters, 18 GB in bfloat16: more than a v5e holds)
_LLAMA_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096)
_QWEN3_9B = dict(hidden_size=4096, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=12288, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=False)
SIZES["1b"].update(quant_steps=32, quant_prefill=(8, 1024), int4_group=128,
                   quant_big=[("llama-7b", "llama", _LLAMA_7B), ("qwen3-9b", "qwen3", _QWEN3_9B)],
                   quant_big_write_seconds=180)
SIZES["tiny"].update(quant_steps=16, quant_prefill=(2, 16), int4_group=32,
                     quant_big=[("llama-tiny", "llama", dict(SIZES["tiny"]["model"], num_hidden_layers=2)),
                                ("qwen3-tiny", "qwen3", dict(SIZES["tiny"]["model"], head_dim=16,
                                                             tie_word_embeddings=False))],
                     quant_big_write_seconds=60)

# a Llama small enough for the CPU at the lengths that matter on the chip, where the fixed costs of a call
# show beside real work (`--only ttft`)
SIZES["small"] = dict(SIZES["tiny"], model=dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                                                num_key_value_heads=4, intermediate_size=1408, vocab_size=32000,
                                                max_position_embeddings=4096),
                      lengths=[128, 1024], iters=15)
SIZES["small"]["train"] = dict(models={"small": SIZES["small"]["model"]}, steps=3,
                               rows=[_train_row("small", "bf16", 2, 256, True)])

# published bf16 peak FLOP/s and HBM bytes/s by JAX device kind
PEAK_BF16 = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12}
PEAK_HBM = {"TPU v5 lite": 819e9, "TPU v5e": 819e9, "TPU v4": 1228e9, "TPU v5p": 2765e9, "TPU v6 lite": 1640e9}

# a row is skipped when its estimate passes this share of the device's memory (XLA's own buffers take the rest)
_MEMORY_SHARE = 0.9


# --- The models' arithmetic: parameters, FLOPs, bytes


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _layer_matmul_params(config: dict, active_experts: float | None = None) -> float:
    """Parameters of one layer's matmuls: attention's four projections and the MLP (for a mixture of experts,
    the router and `active_experts` experts, all of them when None)."""
    h, d = config["hidden_size"], _head_dim(config)
    attention = 2 * h * config["num_attention_heads"] * d + 2 * h * config["num_key_value_heads"] * d
    if "num_experts" not in config:
        return attention + 3 * h * config["intermediate_size"]
    experts = config["num_experts"] if active_experts is None else active_experts
    return attention + h * config["num_experts"] + experts * 3 * h * config["moe_intermediate_size"]


def weight_bytes(config: dict) -> float:
    """bfloat16 bytes of every weight (embedding and LM head untied, norms left out)."""
    embedding_and_head = 2 * config["hidden_size"] * config["vocab_size"]
    return 2 * (config["num_hidden_layers"] * _layer_matmul_params(config) + embedding_and_head)


def kv_bytes_per_token(config: dict) -> int:
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * _head_dim(config) * 2


def matmul_params(config: dict) -> float:
    """Parameters of every matmul of a forward: the layers' and the LM head (the embedding is a lookup)."""
    return config["num_hidden_layers"] * _layer_matmul_params(config) + config["hidden_size"] * config["vocab_size"]


def attention_flops(config: dict, batch: int, length: int) -> float:
    """A forward's FLOPs of attention's QK^T and PV over the whole (not causally halved) sequence."""
    heads = config["num_attention_heads"] * _head_dim(config)
    return batch * 2 * 2 * config["num_hidden_layers"] * length * length * heads


def forward_flops(config: dict, batch: int, length: int) -> float:
    return batch * 2 * length * matmul_params(config) + attention_flops(config, batch, length)


def cache_length(prompt: int, new_tokens: int, multiple: int = 128) -> int:
    """The static cache's length `generate()` on tpu allocates (rounded up to HF_TPU_CACHE_LENGTH_MULTIPLE)."""
    return -(-(prompt + new_tokens) // multiple) * multiple


def decode_limit_tokens_per_second(config: dict, batch: int, context: int, hbm_bytes_per_second: float) -> float:
    """The HBM-bound decode limit: each step reads every matmul weight the batch uses (the embedding table only
    a row a token) and the KV cache of `context` positions once. For a mixture of experts, the experts a batch
    of `batch` tokens is expected to reach when each picks `num_experts_per_tok` of `num_experts` uniformly."""
    reached = None
    if "num_experts" in config:
        experts, chosen = config["num_experts"], config["num_experts_per_tok"]
        reached = experts * (1 - (1 - chosen / experts) ** batch)
    layers = config["num_hidden_layers"] * _layer_matmul_params(config, active_experts=reached)
    weights = 2 * (layers + config["hidden_size"] * config["vocab_size"])
    step_bytes = weights + batch * context * kv_bytes_per_token(config)
    return batch * hbm_bytes_per_second / step_bytes


def memory_estimate(config: dict, batch: int, length: int, new_tokens: int | None = None,
                    score_matrix: bool = True) -> dict:
    """Bytes a row needs at its peak, by part: the forward's logits of every position (`new_tokens` None), or a
    `generate()`'s static KV cache; and with `score_matrix`, the float32 attention scores and weights of one
    layer, which an XLA lowering of attention materialises (`[batch, heads, length, length]`, twice) and a
    flash attention kernel does not."""
    parts = {"weights": weight_bytes(config), "activations": 16 * 2 * batch * length * config["hidden_size"]}
    if score_matrix:
        parts["attention scores"] = 2 * 4 * batch * config["num_attention_heads"] * length * length
    if new_tokens is None:
        parts["logits"] = 2 * 2 * batch * length * config["vocab_size"]
    else:
        parts["KV cache"] = batch * cache_length(length, new_tokens) * kv_bytes_per_token(config)
    return parts


def does_not_fit(config: dict, batch: int, length: int, device_bytes: float, new_tokens: int | None = None,
                 score_matrix: bool = True):
    """None when the row fits in the device's memory, else why not."""
    parts = memory_estimate(config, batch, length, new_tokens, score_matrix)
    need = sum(parts.values())
    if need <= _MEMORY_SHARE * device_bytes:
        return None
    largest = ", ".join(f"{name} {size / 1e9:.1f}" for name, size in sorted(parts.items(), key=lambda p: -p[1])[:3])
    return (f"needs ~{need / 1e9:.1f} GB ({largest}) of the device's {device_bytes / 1e9:.1f} GB "
            "(--no-memory-check to try)")


# --- Measuring


def _median_seconds(fn, iters: int) -> float:
    """Median seconds of `fn` after one untimed call (a first call compiles)."""
    from benchmarks.common import timeit

    return timeit(fn, warmup=1, iters=iters)


# the most XLA ops a profile row lists, the longest first
_PROFILE_TOP = 40


def _op_kind(text: str) -> str:
    """An XLA op's kind from its HLO text: the instruction (`fusion`, `copy-done`, `custom-call`...), and a
    fusion's kind (`fusion kOutput`: a fusion around a matmul or convolution)."""
    match = re.search(r"\s([a-z][a-z0-9-]*)\(", text.split("=", 1)[-1])
    kind = match.group(1) if match else "?"
    fusion_kind = re.search(r"kind=(k[A-Za-z]+)", text)
    return f"{kind} {fusion_kind.group(1)}" if kind == "fusion" and fusion_kind else kind


def _kinds(ops: list) -> dict:
    """{op kind: (microseconds per call, ops per call)} over every op of a profile, the longest first."""
    kinds: dict = {}
    for _, us, count, text in ops:
        entry = kinds.setdefault(_op_kind(text), [0.0, 0.0])
        entry[0] += us
        entry[1] += count
    return dict(sorted(((k, tuple(v)) for k, v in kinds.items()), key=lambda item: -item[1][0]))


def _device_events(trace_dir: str, line_name: str):
    """Each event on the device planes' `line_name` line of the `jax.profiler` traces under `trace_dir`: a TPU
    records each op of a program on "XLA Ops" and each program on "XLA Modules"; a CPU records no device plane."""
    import glob

    from jax.profiler import ProfileData

    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if plane.name.startswith("/device:"):
                for line in plane.lines:
                    if line.name == line_name:
                        yield from line.events


def _device_op_times(trace_dir: str, calls: int) -> list:
    """[(op name, microseconds per call, launches per call, the op's HLO text)] of every one of the device's XLA
    ops in the `jax.profiler` trace under `trace_dir`, the longest first; an empty list where the trace holds no
    device plane (a CPU)."""
    totals: dict = {}
    for event in _device_events(trace_dir, "XLA Ops"):
        # the v5e's profiles (2026-12-06) name each op by its whole HLO text and give no long_name
        text = str(dict(event.stats).get("long_name") or event.name)
        entry = totals.setdefault(event.name, [0.0, 0, text])
        entry[0] += event.duration_ns / 1e3
        entry[1] += 1
    ops = sorted(totals.items(), key=lambda item: -item[1][0])
    return [(name, us / calls, count / calls, text) for name, (us, count, text) in ops]


def _device_program_times(trace_dir: str, calls: int) -> dict:
    """{program name: (microseconds per call, runs per call)} of every XLA program the device ran in the
    `jax.profiler` trace under `trace_dir`, the longest first. A program's time holds its ops and the device's
    idle time between them; a call's time beyond its programs' is the host's (Python, the launch, the wait for
    the result) and the gaps between programs."""
    totals: dict = {}
    for event in _device_events(trace_dir, "XLA Modules"):
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += event.duration_ns / 1e3
        entry[1] += 1
    return {name: (us / calls, count / calls) for name, (us, count) in
            sorted(totals.items(), key=lambda item: -item[1][0])}


def _profile(rows: "_Rows", fn, calls: int = 3, **figures) -> None:
    """With `--profile DIR`: `fn` (already compiled) run `calls` times under `jax.profiler.trace`, and a row of
    its device time per XLA op and per program, and its time a call while traced: to compare the programs of
    both sides op by op, and to tell the device's share of a call from the host's."""
    directory = os.environ.get("HF_TPU_BENCH_PROFILE")
    if not directory:
        return
    import jax

    trace_dir = os.path.join(directory, rows.group, "x".join(str(figures.get(k, "")) for k in ("batch", "length")),
                             figures["side"].replace(" ", "-"))
    with jax.profiler.trace(trace_dir):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        wall = time.perf_counter() - start
    ops = _device_op_times(trace_dir, calls)
    programs = _device_program_times(trace_dir, calls)
    rows.emit("profile", device_us=sum(us for _, us, _, _ in ops), launches=sum(count for _, _, count, _ in ops),
              program_us=sum(us for us, _ in programs.values()), programs={k[:120]: v for k, v in programs.items()},
              wall_us=wall / calls * 1e6, kinds=_kinds(ops),
              ops=[(name[:300], us, count, text[:300]) for name, us, count, text in ops[:_PROFILE_TOP]], **figures)


def _first_call(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _first_call_and_compile(fn) -> tuple[float, float]:
    """(seconds of the first call of `fn`, of them the seconds XLA's backend compiled): what a first call pays
    beyond XLA (tracing, Dynamo, lowering) is the difference."""
    from benchmarks.common import jax_compile_phases

    phases = jax_compile_phases()

    def xla_seconds() -> float:
        return sum(phase.get("XLA", 0.0) for phase in phases.values())

    before = xla_seconds()
    return _first_call(fn), xla_seconds() - before


_BELOW_NOISE = "a decode step is below the timing noise: a longer call took no longer than a shorter one"


def _step_seconds(generate, ids, steps: int, iters: int) -> tuple[float | None, float]:
    """(seconds a decode step takes, seconds of the first call): `generate()` of 2 and of 1 + `steps` new tokens
    timed in turns, the difference divided by `steps - 1`. Both fill the same static cache length, so they run
    the same programs, and both pay what a call pays once whatever its length (the prefill, the first token,
    starting the decode loop), which the difference leaves out. The first call compiles. The step is None
    where the difference is below the timing noise (a tiny model on the CPU)."""
    first = _first_call(lambda: generate(ids, 1 + steps))
    generate(ids, 2)
    short, full = [], []
    for _ in range(iters):
        short.append(_first_call(lambda: generate(ids, 2)))
        full.append(_first_call(lambda: generate(ids, 1 + steps)))
    step = (statistics.median(full) - statistics.median(short)) / (steps - 1)
    return (step if step > 0 else None), first


class _Rows:
    """The figures of one group, printed as `RESULT {json}` lines the moment each is measured."""

    def __init__(self, group: str, check_memory: bool):
        self.group, self.check_memory = group, check_memory
        self._device_bytes = None

    def emit(self, section: str, **figures) -> None:
        print("RESULT " + json.dumps({"section": section, "group": self.group, **figures}), flush=True)

    def skip(self, row: str, reason: str) -> None:
        self.emit("skipped", row=row, reason=reason)

    def fits(self, row: str, config: dict, batch: int, length: int, new_tokens: int | None = None,
             score_matrix: bool = True) -> bool:
        if not self.check_memory:
            return True
        if self._device_bytes is None:
            self._device_bytes = _device_bytes()
        reason = does_not_fit(config, batch, length, self._device_bytes, new_tokens, score_matrix)
        if reason:
            self.skip(row, reason)
        return reason is None

    def out_of_memory(self, row: str, error: Exception) -> None:
        import gc

        gc.collect()
        self.skip(row, f"out of memory: {str(error).splitlines()[0][:200]}")


def _device_bytes() -> float:
    """Memory of JAX's first device (the host's, where XLA states none), read without hf_tpu: the torchax
    process must not import it (both claim PrivateUse1)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _grid(spec: dict) -> list:
    return [(batch, length) for batch in spec["batches"] for length in spec["lengths"]]


# --- The groups, each run in a process of its own


def _group_limits(spec: dict, rows: _Rows) -> None:
    """The chip's limits in raw JAX, on the device hf-tpu would use (HF_TPU_PLATFORM honoured)."""
    device = measure_limits(spec, rows)
    for batch, length in _grid(spec):
        if rows.fits(f"products {batch}x{length}", spec["model"], batch, length, score_matrix=False):
            _weight_products(spec, rows, device, batch, length)


def measure_limits(spec: dict, rows: _Rows):
    """The `limits` row (bf16 matmul throughput, HBM read bandwidth, the published peaks); returns the device."""
    from hf_tpu import platform  # noqa: I001  (first: it configures JAX before a backend starts)
    import jax
    import jax.numpy as jnp

    device = platform.devices()[0]
    n = spec["matmul"]
    a = jax.device_put(jnp.ones((n, n), jnp.bfloat16), device)
    matmul = jax.jit(lambda x, y: x @ y)
    seconds = _median_seconds(lambda: matmul(a, a).block_until_ready(), spec["iters"])
    # the int8 matrix unit (int8 x int8 -> int32), whose peak on a v5e is twice bfloat16's
    b = jax.device_put(jnp.ones((n, n), jnp.int8), device)
    int8_matmul = jax.jit(lambda x, y: jax.lax.dot(x, y, preferred_element_type=jnp.int32))
    int8_seconds = _median_seconds(lambda: int8_matmul(b, b).block_until_ready(), spec["iters"])
    x = jax.device_put(jnp.ones((spec["hbm_bytes"] // 4,), jnp.float32), device)
    total = jax.jit(jnp.sum)
    read = _median_seconds(lambda: total(x).block_until_ready(), spec["iters"])
    kind = device.device_kind
    rows.emit("limits", device=kind, platform=device.platform, matmul_tflops=2 * n ** 3 / seconds / 1e12,
              int8_matmul_tops=2 * n ** 3 / int8_seconds / 1e12,
              hbm_gbs=spec["hbm_bytes"] / read / 1e9, peak_tflops=PEAK_BF16.get(kind, 0) / 1e12,
              peak_hbm_gbs=PEAK_HBM.get(kind, 0) / 1e9, memory_gb=platform.memory_info(0)[1] / 1e9)
    return device


def _weight_products(spec: dict, rows: _Rows, device, batch: int, length: int) -> None:
    """The Llama model's weight products alone, in raw JAX, at `batch` x `length` tokens: each layer's
    projections and MLP and the LM head, as one jitted program, timed per call as the forward is (called,
    then waited for). What any implementation of the forward takes at least beside attention, the norms and
    the rotary embedding, which this leaves out; and the time of a call of a program with the same inputs
    that computes nothing, the least any jitted call of them takes."""
    import jax
    import jax.numpy as jnp

    config = spec["model"]
    h, d = config["hidden_size"], _head_dim(config)
    shapes = [(h, config["num_attention_heads"] * d), (h, config["num_key_value_heads"] * d),
              (h, config["num_key_value_heads"] * d), (config["num_attention_heads"] * d, h),
              (h, config["intermediate_size"]), (h, config["intermediate_size"]), (config["intermediate_size"], h)]
    keys = iter(jax.random.split(jax.random.key(0), len(shapes) * config["num_hidden_layers"] + 2))
    weight = lambda shape: jax.device_put(jax.random.normal(next(keys), shape, jnp.bfloat16) * 0.02, device)
    layers = [[weight(shape) for shape in shapes] for _ in range(config["num_hidden_layers"])]
    head = weight((h, config["vocab_size"]))
    x = weight((batch * length, h))

    @jax.jit
    def products(x, layers, head):
        for wq, wk, wv, wo, wg, wu, wd in layers:
            k, v = x @ wk, x @ wv
            # the key and value projections' sums stand in for attention's use of them (XLA drops an unused one)
            used = (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True)).astype(x.dtype)
            x = x + (x @ wq) @ wo + ((x @ wg) * (x @ wu)) @ wd + used
        return x @ head

    @jax.jit
    def nothing(x, layers, head):
        return x[:1] + 1

    seconds = _median_seconds(lambda: products(x, layers, head).block_until_ready(), spec["iters"])
    call = _median_seconds(lambda: nothing(x, layers, head).block_until_ready(), spec["iters"])
    flops = 2 * batch * length * (config["num_hidden_layers"] * _layer_matmul_params(config) + h * config["vocab_size"])
    rows.emit("products", batch=batch, length=length, seconds=seconds, tflops=flops / seconds / 1e12,
              call_seconds=call, inputs=2 + len(shapes) * len(layers))


def _llama(spec: dict, arrange_scanned: bool = True):
    """The Llama of `spec` in bfloat16 on the CPU; with `arrange_scanned`, its layer lists arranged as
    `from_pretrained(device_map="tpu")` arranges them, for the scans HF_TPU_SCAN_LAYERS asks (a torchax row passes
    False: its process must not import hf_tpu)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**spec["model"], attn_implementation="sdpa")
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    if arrange_scanned:
        from hf_tpu.integrations.transformers import scanned_layers

        scanned_layers.arrange(model)
    return model


def _ids(vocab: int, batch: int, length: int, variant: int = 0):
    import torch

    g = torch.Generator().manual_seed(batch * 100003 + length + 7919 * variant)
    return torch.randint(0, vocab, (batch, length), generator=g)


# distinct prompts a first-token row cycles through: equal small values recur for free (`host_transfers.from_host` keeps
# them uploaded), and a user's next prompt, and so the result it makes, is rarely the last one
_PROMPTS_CYCLED = 8


def _compiled_forward(compiled, ids):
    """A function running the compiled model's logits of `ids`, waiting for them."""
    import torch

    def forward():
        with torch.no_grad():
            logits = compiled(ids, use_cache=False, return_dict=False)[0]
        torch.accelerator.synchronize()  # waits for the arrays alive on the device: the logits among them
        return logits

    return forward


def _flash_attention() -> bool:
    """Whether hf-tpu's prefill attention runs the Pallas kernel here, which holds no score matrix."""
    from hf_tpu.kernels import selection

    return selection.pallas_enabled()


def _group_forward(spec: dict, rows: _Rows) -> None:
    import torch

    import hf_tpu  # noqa: F401  (registers tpu)

    model = _llama(spec).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    for batch, length in _grid(spec):
        row = f"{batch}x{length}"
        if not rows.fits(row, spec["model"], batch, length, score_matrix=not _flash_attention()):
            continue
        forward = _compiled_forward(compiled, _ids(spec["model"]["vocab_size"], batch, length).to("tpu"))
        try:
            first, xla = _first_call_and_compile(forward)
            rows.emit("forward", side="hf-tpu", batch=batch, length=length,
                      seconds=_median_seconds(forward, spec["iters"]), first_call=first, xla_compile=xla)
            _profile(rows, forward, side="hf-tpu", batch=batch, length=length)
        except torch.OutOfMemoryError as e:
            rows.out_of_memory(row, e)
        del forward


def _group_eager(spec: dict, rows: _Rows) -> None:
    import torch

    import hf_tpu  # noqa: F401

    model = _llama(spec).to("tpu")
    batch, length = spec["eager"]
    ids = _ids(spec["model"]["vocab_size"], batch, length).to("tpu")
    for mode in ("DEFER_NEVER", "DEFER_AND_FUSE"):
        with torch.tpu.use_eager_mode(mode):
            def eager():
                with torch.no_grad():
                    model(ids, use_cache=False, return_dict=False)[0]
                torch.accelerator.synchronize()

            first = _first_call(eager)
            rows.emit("eager", side="hf-tpu", mode=mode, batch=batch, length=length, first_call=first,
                      seconds=_median_seconds(eager, max(2, spec["iters"] // 3)))


def _generate(model):
    import torch

    def generate(ids, new_tokens: int):
        # `min_new_tokens` keeps a call of several tokens from ending at an end-of-sequence token (random weights
        # pick one now and then); a call of one token makes one token either way, and the processor it adds (a
        # `torch.isin` over the vocabulary on the host: 0.16 ms on the development CPU, about 1 ms on the v5e's
        # host) is not part of the time to first token
        at_least = dict(min_new_tokens=new_tokens) if new_tokens > 1 else {}
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **at_least)
        torch.accelerator.synchronize()

    return generate


def _group_decode(spec: dict, rows: _Rows) -> None:
    import torch

    import hf_tpu  # noqa: F401

    model = _llama(spec).to("tpu")
    generate = _generate(model)
    steps = spec["decode_steps"]
    for length in spec["lengths"]:  # the shortest prompt at every batch first
        for batch in spec["batches"]:
            row = f"{batch}x{length}"
            if not rows.fits(row, spec["model"], batch, length, new_tokens=1 + steps,
                             score_matrix=not _flash_attention()):
                continue
            ids = _ids(spec["model"]["vocab_size"], batch, length).to("tpu")
            try:
                step, first = _step_seconds(generate, ids, steps, max(2, spec["iters"] // 3))
                if step is None:
                    rows.skip(row, _BELOW_NOISE)
                else:
                    rows.emit("decode", side="hf-tpu", batch=batch, length=length, step_seconds=step,
                              first_call=first, context=length + steps // 2)
                _profile(rows, lambda: generate(ids, 1 + steps), calls=1, side="hf-tpu decode", batch=batch,
                         length=length)
            except torch.OutOfMemoryError as e:
                rows.out_of_memory(row, e)


def _group_ttft(spec: dict, rows: _Rows) -> None:
    import torch

    import hf_tpu  # noqa: F401
    from benchmarks.common import static_compiled, timeit_alternating

    model = _llama(spec).to("tpu")
    generate = _generate(model)
    compiled = static_compiled(model)
    for length in spec["lengths"]:
        row = f"1x{length}"
        if not rows.fits(row, spec["model"], 1, length, score_matrix=not _flash_attention()):
            continue
        prompts = itertools.cycle([_ids(spec["model"]["vocab_size"], 1, length, variant).to("tpu")
                                   for variant in range(_PROMPTS_CYCLED)])

        def first_token():
            generate(next(prompts), 1)

        def forward():
            _compiled_forward(compiled, next(prompts))()

        try:
            first = _first_call(first_token)
            # the two take turns, twice the group's calls each: the ratio is the goal, and medians of three calls
            # of one side and then of the other put the forward at 4.6-5.5 ms at 128 tokens across v5e runs
            seconds, forward_seconds = timeit_alternating([first_token, forward], warmup=1, iters=2 * spec["iters"])
            rows.emit("ttft", side="hf-tpu", length=length, seconds=seconds, first_call=first,
                      forward_seconds=forward_seconds)
            _profile(rows, first_token, side="generate", batch=1, length=length)
            _profile(rows, forward, side="forward", batch=1, length=length)
        except torch.OutOfMemoryError as e:
            rows.out_of_memory(row, e)


def _first_call_phases(fn) -> tuple[float, dict]:
    """(seconds of the first call of `fn`, where they went as JAX reports its compiles): `python_trace`, the Python
    traced by `hf_tpu.jit` (the trace of its `trace_*` functions, which holds every op's); `trace`, the JAX trace
    of the program compiled (Dynamo's graph run on tracers, or the traced jaxpr; each op's nested trace is in the
    trace around it, never counted twice); `lowering`; `xla`. Whatever else the call took (Dynamo's capture and
    AOT autograd, the run itself) is the rest."""
    from benchmarks.common import jax_compile_phases

    phases = jax_compile_phases()
    before = {name: dict(p) for name, p in phases.items()}
    first = _first_call(fn)
    spent = {"python_trace": 0.0, "trace": 0.0, "lowering": 0.0, "xla": 0.0}
    traces = []
    for name, p in list(phases.items()):
        for phase, seconds in p.items():
            seconds -= before.get(name, {}).get(phase, 0.0)
            if seconds <= 0:
                continue
            if phase == "trace":
                traces.append((name, seconds))
            else:
                spent[phase.lower()] += seconds
    for name, seconds in traces:  # the outermost traces: hf_tpu.jit's Python trace and the programs compiled
        if name.startswith("trace_"):
            spent["python_trace"] += seconds
        elif name.startswith(("traced_", "_trace", "loop_", "_loop")):
            spent["trace"] += seconds
    if not spent["python_trace"] and not spent["trace"] and traces:  # another library's program (torchax's)
        spent["trace"] = max(seconds for _, seconds in traces)
    return first, spent


def _compile_row(rows: _Rows, side: str, what: str, fn, warm_iters: int = 3, **figures) -> None:
    """A first call of `fn` and where its time went (`_first_call_phases`), with a warm call's time: the rest of
    the first call beyond its compiles and a warm call is the capture (Dynamo and AOT autograd, where they ran)."""
    import hf_tpu

    traced = lambda: hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0)  # noqa: E731
    before = traced()
    first, spent = _first_call_phases(fn)
    programs = traced() - before  # 0: the call ran programs compiled already (a bucket served by another's)
    warm = _median_seconds(fn, warm_iters)
    compiles = sum(spent.values())
    if side == "hf-tpu" and what == "forward" and _scan_layers() == "first-calls":
        figures.update(_settled(fn, warm_iters))
    rows.emit("compile", side=side, what=what, first_call=first, warm=warm, programs_traced=programs,
              capture=max(0.0, first - compiles - warm), **spent, **figures)


def _scan_layers() -> str:
    from hf_tpu.integrations.transformers.settings import settings

    return settings.scan_layers


def _settled(fn, warm_iters: int) -> dict:
    """`HF_TPU_SCAN_LAYERS=first-calls`: the calls after the first run the scanned form while the unrolled program
    compiles beside them; the seconds until it serves (calls made all along), and a warm call's time then."""
    from hf_tpu import compile_log

    start = time.perf_counter()
    while compile_log.compiling_in_background():
        fn()
    fn()  # the first call of the program compiled meanwhile
    return dict(settle_seconds=time.perf_counter() - start, settled_warm=_median_seconds(fn, warm_iters))


def _train_step(spec: dict):
    """A function making one training step of the Llama model with `train_layers` of its layers: the forward and
    backward of `torch.compile(model)`, then AdamW's step through `torch.compile(opt.step)`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**dict(spec["model"], num_hidden_layers=spec["train_layers"]), attn_implementation="sdpa")
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).to("tpu").train()
    compiled = torch.compile(model, backend="tpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    update = torch.compile(optimizer.step, backend="tpu")
    ids = _ids(spec["model"]["vocab_size"], 1, spec["lengths"][0]).to("tpu")

    def step():
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        update()
        optimizer.zero_grad()
        torch.accelerator.synchronize()

    return step


def _flux_transformer(spec: dict, device: str):
    """The Flux-shaped transformer (`spec["flux"]`) in bfloat16 on `device`, and a function of (height, width) giving
    the inputs a FluxPipeline hands it at that image size: packed latents, the prompt's T5 states and CLIP's pooled
    one, the timestep and guidance, and the rotary ids of the text and image tokens."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    config = spec["flux"]
    transformer = FluxTransformer2DModel(patch_size=1, guidance_embeds=True, **config).to(torch.bfloat16).to(device)

    def inputs(height: int, width: int) -> dict:
        g = torch.Generator().manual_seed(height * 7 + width)
        tokens = (height // 16) * (width // 16)  # 8x the VAE's downsampling, then 2x2 packing
        rows, columns = torch.meshgrid(torch.arange(height // 16), torch.arange(width // 16), indexing="ij")
        image_ids = torch.stack([torch.zeros_like(rows), rows, columns], -1).reshape(tokens, 3).float()
        tensors = dict(
            hidden_states=torch.randn(1, tokens, config["in_channels"], generator=g),
            encoder_hidden_states=torch.randn(1, spec["flux_text"], config["joint_attention_dim"], generator=g),
            pooled_projections=torch.randn(1, config["pooled_projection_dim"], generator=g),
            timestep=torch.tensor([0.5]),
        )
        tensors = {k: v.to(torch.bfloat16).to(device) for k, v in tensors.items()}  # as the pipeline's latents'
        tensors["guidance"] = torch.tensor([3.5]).to(device)  # float32, as the pipeline makes it
        return dict(tensors, img_ids=image_ids.to(device), txt_ids=torch.zeros(spec["flux_text"], 3).to(device),
                    return_dict=False)

    return transformer, inputs


def _sd_unet(spec: dict, device: str):
    """The Stable-Diffusion-shaped UNet (`spec["unet"]`) in bfloat16 on `device`, and a function of (height, width)
    giving the inputs a StableDiffusionPipeline hands it at that image size: the latents (8x the VAE's
    downsampling), the timestep and the prompt's text-encoder states."""
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**spec["unet"]).to(torch.bfloat16).to(device)
    text_tokens, text_width = spec["unet_text"]

    def inputs(height: int, width: int) -> dict:
        g = torch.Generator().manual_seed(height * 7 + width)
        tensors = dict(sample=torch.randn(1, 4, height // 8, width // 8, generator=g),
                       encoder_hidden_states=torch.randn(1, text_tokens, text_width, generator=g))
        tensors = {k: v.to(torch.bfloat16).to(device) for k, v in tensors.items()}
        return dict(tensors, timestep=torch.tensor(500).to(device), return_dict=False)

    return unet, inputs


def _denoiser_rows(rows: _Rows, side: str, what: str, module, inputs, images) -> None:
    """A Diffusers denoiser's first and warm calls at each image size: compiled as a Diffusers user compiles it
    (`torch.compile(pipe.transformer, backend="tpu")`), then run eagerly (in the process's mode: strict eager
    unless HF_TPU_EAGER_MODE says otherwise) for the warm call a compiled one is measured against."""
    import torch

    compiled = torch.compile(module, backend="tpu")
    for how, fn in ((side, compiled), ("hf-tpu eager", module)):
        if how == "hf-tpu eager" and "Dynamo" in side:
            continue  # `compile` measures it
        for height, width in images:
            arguments = inputs(height, width)

            def denoise():
                with torch.no_grad():
                    out = fn(**arguments)[0]
                torch.accelerator.synchronize()
                return out

            _compile_row(rows, how, what, denoise, height=height, width=width)


def _group_compile(spec: dict, rows: _Rows) -> None:
    """First calls and where their time went (`_compile_row`): the Llama's compiled forward at each shape of the grid
    (each batch at its lengths longest first: a shorter prompt after a longer one is the second shape the design
    serves), a training step, and a Flux-shaped transformer and a Stable-Diffusion-shaped UNet compiled as a
    Diffusers user does (`torch.compile(pipe.transformer, backend="tpu")`) at two image sizes, beside their eager
    calls. The parent runs it in a fresh disk cache
    (`compile`), again in a second process with that cache warm (`compile_again`), and with Dynamo for every call
    (`compile_dynamo`, HF_TPU_COMPILE_DIRECT=0)."""
    import torch

    import hf_tpu  # noqa: F401

    side = "hf-tpu" + ("" if settings_direct() else " (Dynamo)")
    model = _llama(spec).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    for batch in spec["batches"]:
        for length in sorted(spec["lengths"], reverse=True):
            if not rows.fits(f"compile {batch}x{length}", spec["model"], batch, length,
                             score_matrix=not _flash_attention()):
                continue
            forward = _compiled_forward(compiled, _ids(spec["model"]["vocab_size"], batch, length).to("tpu"))
            try:
                _compile_row(rows, side, "forward", forward, batch=batch, length=length)
            except torch.OutOfMemoryError as e:  # a shape served from a longer bucket's program may not fit
                rows.out_of_memory(f"compile {batch}x{length}", e)
    del model, compiled, forward
    if settings_direct():  # a training step takes Dynamo either way: `compile_dynamo` leaves it to `compile`
        try:
            _compile_row(rows, side, "training step", _train_step(spec), batch=1, length=spec["lengths"][0])
        except torch.OutOfMemoryError as e:
            rows.out_of_memory("compile training step", e)
    for what, build in (("flux transformer", _flux_transformer), ("sd unet", _sd_unet)):
        module, inputs = build(spec, "tpu")
        _denoiser_rows(rows, side, what, module, inputs, spec["denoiser_images"])
        del module, inputs


def settings_direct() -> bool:
    from hf_tpu import settings

    return settings.get("HF_TPU_COMPILE_DIRECT")


def _group_torchax(spec: dict, rows: _Rows) -> None:
    try:
        import torchax
        import torchax.interop
    except ImportError as e:
        rows.skip("torchax", f"torchax is not importable here ({e})")
        return
    import jax
    import torch

    class Logits(torch.nn.Module):
        """The model's logits alone, without a cache (a jitted function returns arrays, not model outputs)."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(ids, use_cache=False, return_dict=False)[0]

    model = _llama(spec, arrange_scanned=False)
    with torchax.default_env():
        model.to("jax")
        jitted = torchax.interop.JittableModule(Logits(model))
        for batch, length in _grid(spec):
            row = f"{batch}x{length}"
            if not rows.fits(row, spec["model"], batch, length):
                continue
            ids = _ids(spec["model"]["vocab_size"], batch, length).to("jax")

            def forward():
                with torch.no_grad():
                    logits = jitted(ids)
                jax.block_until_ready(logits.jax())

            try:
                first, spent = _first_call_phases(forward)
                seconds = _median_seconds(forward, spec["iters"])
                rows.emit("forward", side="torchax", batch=batch, length=length, seconds=seconds, first_call=first,
                          xla_compile=spent["xla"])
                rows.emit("compile", side="torchax", what="forward", batch=batch, length=length, first_call=first,
                          warm=seconds, capture=max(0.0, first - sum(spent.values()) - seconds), **spent)
                _profile(rows, forward, side="torchax", batch=batch, length=length)
            except Exception as e:  # noqa: BLE001  (torchax raises JAX's own error for memory)
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                rows.out_of_memory(row, e)


def _group_moe(spec: dict, rows: _Rows) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import hf_tpu  # noqa: F401
    from hf_tpu.integrations.transformers import configure

    # The prefill runs eagerly (no prompt buckets, so it is not compiled): the step time leaves it out, and the
    # loop over experts has data-dependent shapes, with which a compiled prefill breaks its graph at every expert.
    configure(prompt_buckets=())
    config = spec["moe"]
    torch.manual_seed(0)
    start = time.perf_counter()
    model = Qwen3MoeForCausalLM._from_config(Qwen3MoeConfig(**config), dtype=torch.bfloat16).eval().to("tpu")
    print(f"moe: {weight_bytes(config) / 1e9:.1f} GB of weights built and moved in "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    generate = _generate(model)
    batch, prompt, steps = spec["moe_batch"], spec["moe_prompt"], spec["moe_steps"]
    ids = _ids(config["vocab_size"], batch, prompt).to("tpu")
    for implementation in ("grouped_mm", "eager"):
        model.set_experts_implementation(implementation)
        if implementation == "eager" and spec["moe_eager_seconds"]:
            step, first, made = _capped_step_seconds(model, ids, steps, spec["moe_eager_seconds"])
            if step is None:
                rows.skip(f"{implementation} {batch}x{prompt}", _BELOW_NOISE)
                continue
            stopped = {} if made is None else {"capped_tokens": made}
            rows.emit("moe", side="hf-tpu", implementation=implementation, batch=batch, length=prompt,
                      step_seconds=step, first_call=first, context=prompt + steps // 2, **stopped)
            continue
        step, first = _step_seconds(generate, ids, steps, max(2, spec["iters"] // 3))
        if step is None:
            rows.skip(f"{implementation} {batch}x{prompt}", _BELOW_NOISE)
            continue
        rows.emit("moe", side="hf-tpu", implementation=implementation, batch=batch, length=prompt,
                  step_seconds=step, first_call=first, context=prompt + steps // 2)


def _capped_step_seconds(model, ids, steps: int, seconds: float) -> tuple[float | None, float, int | None]:
    """(seconds a decode step takes, seconds of the first call, new tokens made where a call was stopped) of
    Transformers' per-expert loop, each `generate()` stopped after `seconds` (`max_time`). Each step routes
    another number of tokens to each expert, and eager mode compiles each op of the loop once per new count, so
    a first call may not end (on the v5e at commit `483fb46` its first 9-token call did not end within 200 s).
    Where the first call of `1 + steps` tokens makes them all, a call of 2 and one of `1 + steps` tokens are
    timed as in `_step_seconds` (the same prompt routes the same counts again: warm; None where the difference
    is below the timing noise). Where a call stops early, its time per token made, compiles included, is what
    a user waits: against a warm `grouped_mm` step it bounds their ratio from below."""
    import torch

    def call(tokens: int) -> tuple[float, int]:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 max_time=seconds)
        torch.accelerator.synchronize()
        return time.perf_counter() - start, out.shape[1] - ids.shape[1]

    first, made = call(1 + steps)
    if made < 1 + steps:
        return first / max(made, 1), first, made
    short, _ = call(2)
    full, made = call(1 + steps)
    if made < 1 + steps:
        return full / max(made, 1), first, made
    step = (full - short) / (steps - 1)
    return (step if step > 0 else None), first, None


def _group_quant(spec: dict, rows: _Rows) -> None:
    from benchmarks import quant

    quant.group_quant(spec, rows)


def _group_quant_prefill(spec: dict, rows: _Rows) -> None:
    from benchmarks import quant

    quant.group_quant_prefill(spec, rows)


def _group_quant_big(spec: dict, rows: _Rows) -> None:
    from benchmarks import quant

    quant.group_quant_big(spec, rows)


GROUPS = {  # name: (the worker, its default time limit in seconds)
    "limits": (_group_limits, 240),
    "forward": (_group_forward, 420),
    "torchax": (_group_torchax, 300),
    "decode": (_group_decode, 540),
    "ttft": (_group_ttft, 420),
    "eager": (_group_eager, 300),
    "moe": (_group_moe, 540),
    # each row in a process of its own (`benchmarks.training.run_group`)
    "train": (None, 480),
    "train_compile": (None, 540),
    "train_eager": (None, 540),
    "train_torchax": (None, 420),
    "train_trainer": (None, 540),
    "train_libraries": (None, 570),
    "quant": (_group_quant, 570),
    "quant_prefill": (_group_quant_prefill, 570),
    "quant_big": (_group_quant_big, 570),
    "compile": (_group_compile, 570),
    "compile_again": (_group_compile, 420),
    "compile_dynamo": (_group_compile, 540),
}
# the compile groups run in one fresh disk cache of the parent's (`compile_again` finds what `compile` left in it),
# and the environment each sets
_HLO_READING_GROUPS = ("quant", "quant_prefill")  # they read XLA's optimized HLO of the programs they compile
_COMPILE_GROUPS = {"compile": {}, "compile_again": {}, "compile_dynamo": {"HF_TPU_COMPILE_DIRECT": "0"}}
TRAIN_GROUPS = ("train", "train_compile", "train_eager", "train_torchax", "train_trainer", "train_libraries")
# groups a run takes only when `--only` names them: each is most of a chip command's device time on its own
NAMED_ONLY = ("quant", "quant_prefill", "quant_big", *_COMPILE_GROUPS, *TRAIN_GROUPS)


# --- The parent: starts each group's process, relays its figures


def _worker(args, spec: dict) -> None:
    rows = _Rows(args.worker, check_memory=not args.no_memory_check)
    if args.worker in TRAIN_GROUPS:
        if args.train_row is None:
            return training.run_group(spec, rows, args.worker)
        return training.run_row(spec, rows, args.worker, args.train_row, args.train_mode)
    GROUPS[args.worker][0](spec, rows)


def _worker_command(group: str, args) -> list:
    command = [sys.executable, "-m", "benchmarks.chip", "--worker", group, "--size", args.size]
    for option in ("batches", "lengths", "train_rows"):
        if getattr(args, option):
            command += [f"--{option.replace('_', '-')}", getattr(args, option)]
    return command + (["--no-memory-check"] if args.no_memory_check else [])


def _run_group(group: str, args, timeout: float, on_row) -> None:
    """Runs one group's process, handing each figure to `on_row` as it arrives; stops it after `timeout`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if group in _COMPILE_GROUPS:
        env.update(_COMPILE_GROUPS[group], HF_TPU_CACHE_DIR=_compile_cache(args))
    if group in _HLO_READING_GROUPS:  # a program loaded from the disk cache is not compiled, so XLA dumps no HLO
        env["HF_TPU_CACHE_DIR"] = ""
    if args.profile:
        env["HF_TPU_BENCH_PROFILE"] = args.profile
    if args.dump_hlo:
        path = os.path.join(args.dump_hlo, group)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={path} --xla_dump_hlo_as_text"
                            " --xla_dump_hlo_pass_re=^$").strip()
    start = time.monotonic()
    proc = subprocess.Popen(_worker_command(group, args), env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: stopping it stops its children
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=max(0.0, start + timeout - time.monotonic()))
        except queue.Empty:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            on_row({"section": "skipped", "group": group, "row": group,
                    "reason": f"stopped after its time limit of {timeout:.0f} s"})
            return
        if line is None:
            break
        if line.startswith("RESULT "):
            on_row(json.loads(line[len("RESULT "):]))
        else:
            print(line, end="", file=sys.stderr, flush=True)
    if proc.wait() != 0:
        on_row({"section": "skipped", "group": group, "row": group,
                "reason": f"its process exited with {proc.returncode} (its error is above)"})
    print(f"[{group}] done in {time.monotonic() - start:.0f} s", flush=True)


def _compile_cache(args) -> str:
    """The disk cache the compile groups share, fresh for this run (a cache left by an earlier run would make a first
    call a load)."""
    if getattr(args, "compile_cache", None) is None:
        import tempfile

        args.compile_cache = tempfile.mkdtemp(prefix="hf_tpu_compile_cache_")
    return args.compile_cache


def _compile_line(row: dict) -> str:
    shape = (f"{row['batch']}x{row['length']}" if "batch" in row else f"{row['height']}x{row['width']}")
    parts = ", ".join(f"{name} {row[key]:.2f} s" for name, key in (
        ("capture", "capture"), ("Python trace", "python_trace"), ("trace", "trace"), ("lowering", "lowering"),
        ("XLA", "xla")) if row.get(key))
    traced = f", {row['programs_traced']} programs traced" if "programs_traced" in row else ""
    settled = (f"; the unrolled program served after {row['settle_seconds']:.1f} s more, warm then "
               f"{row['settled_warm'] * 1e3:.1f} ms" if "settled_warm" in row else "")
    return (f"{row['side']} {row['what']} {shape}: first call {row['first_call']:.2f} s ({parts}{traced}); "
            f"warm {row['warm'] * 1e3:.1f} ms{settled}")


def describe(row: dict, spec: dict, limits: dict | None = None) -> str:
    """One figure as a line, printed the moment it arrives (with MFU and the HBM limit once `limits` is known)."""
    peak, hbm = _peak_flops(limits), _hbm_limit(limits)
    section = row["section"]
    if section == "skipped":
        return f"[{row['group']}] skipped {row['row']}: {row['reason']}"
    if section == "run":
        line = f"[run] --size {row['size']}, batches {row['batches']}, lengths {row['lengths']}, {row['started']}"
        if row.get("zstandard") is False:  # an install without hf-tpu's dependencies (`pip install --no-deps`)
            line += ("\n[run] zstandard is not installed: JAX compresses the disk cache's programs with zlib, and each "
                     "first call pays seconds for it that an install of hf-tpu does not (`pip install zstandard`)")
        return line
    if section == "limits":
        int8 = f"int8 matmul {row['int8_matmul_tops']:.1f} TOP/s, " if "int8_matmul_tops" in row else ""
        return (f"[limits] {row['device']} ({row['platform']}): bf16 matmul {row['matmul_tflops']:.1f} TFLOP/s, {int8}"
                f"HBM read {row['hbm_gbs']:.0f} GB/s, memory {row['memory_gb']:.1f} GB")
    if section == "products":
        return (f"[limits] the model's weight products alone in raw JAX {row['batch']}x{row['length']}: "
                f"{row['seconds'] * 1e3:.2f} ms a call ({row['tflops']:.1f} TFLOP/s); a call of {row['inputs']} "
                f"inputs computing nothing {row['call_seconds'] * 1e3:.3f} ms")
    shape = f"{row.get('batch', 1)}x{row.get('length')}"
    if section == "forward":
        flops = forward_flops(spec["model"], row["batch"], row["length"]) / row["seconds"]
        return (f"[{row['group']}] {row['side']} forward {shape}: {row['seconds'] * 1e3:.2f} ms "
                f"({flops / 1e12:.1f} TFLOP/s{f', MFU {100 * flops / peak:.0f}%' if peak else ''}), "
                f"first call {row['first_call']:.1f} s"
                + (f" (XLA compile {row['xla_compile']:.1f} s)" if "xla_compile" in row else ""))
    if section == "eager":
        return (f"[eager] {row['mode']} forward {shape}: {row['seconds'] * 1e3:.1f} ms, "
                f"first call {row['first_call']:.1f} s")
    if section in ("decode", "moe"):
        what = f"{row['implementation']} " if section == "moe" else ""
        tokens = row["batch"] / row["step_seconds"]
        limit = (decode_limit_tokens_per_second(spec["moe" if section == "moe" else "model"], row["batch"],
                                                row["context"], hbm) if hbm else None)
        capped = (f", stopped by max_time after {row['first_call']:.0f} s with {row['capped_tokens']} new tokens "
                  "(every step compiles)" if "capped_tokens" in row else "")
        return (f"[{section}] {what}decode batch {row['batch']} after {row['length']}: "
                f"{row['step_seconds'] * 1e3:.2f} ms/step, {tokens:.0f} tokens/s"
                f"{f' ({100 * tokens / limit:.0f}% of the HBM limit)' if limit else ''}, "
                f"first call {row['first_call']:.1f} s{capped}")
    if section == "profile":
        kinds = "".join(f"\n    {us:9.1f} us  {count:6.0f} ops  {kind}" for kind, (us, count) in row["kinds"].items())
        ops = "".join(f"\n    {us:9.1f} us  x{count:<4.0f} {text[:160] if name in text else f'{name}  {text[:120]}'}"
                      for name, us, count, text in row["ops"][:15])
        programs = "".join(f"\n    {us:9.1f} us  x{count:<4.0f} {name}" for name, (us, count) in row["programs"].items())
        return (f"[{row['group']}] {row['side']} profile {shape}: {row['device_us'] / 1e3:.2f} ms on the device in "
                f"{row['launches']:.0f} op launches a call, {row['program_us'] / 1e3:.2f} ms in its programs, "
                f"{row['wall_us'] / 1e3:.2f} ms a call traced; programs:{programs}\n  by kind:{kinds}"
                f"\n  the longest ops:{ops}")
    if section == "train":
        return training.describe(row, spec, peak)
    if section == "compile":
        return f"[{row['group']}] {_compile_line(row)}"
    if section.startswith("quant"):
        from benchmarks import quant

        return quant.describe(row, hbm) or json.dumps(row)
    if section == "ttft":
        return (f"[ttft] prompt {row['length']}: generate(1 token) {row['seconds'] * 1e3:.1f} ms, compiled forward "
                f"{row['forward_seconds'] * 1e3:.1f} ms ({row['seconds'] / row['forward_seconds']:.2f}x)")
    return json.dumps(row)


def _save(results: list, path: str) -> None:
    """The figures so far, replacing the file whole (a stopped run leaves a readable file)."""
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def run(args, spec: dict) -> list:
    results: list = []
    deadline = time.monotonic() + args.budget if args.budget else None

    def on_row(row):
        results.append(row)
        print(describe(row, spec, _limits(results)), flush=True)
        if args.json:
            _save(results, args.json)

    on_row({"section": "run", "size": args.size, "batches": spec["batches"], "lengths": spec["lengths"],
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
            "zstandard": importlib.util.find_spec("zstandard") is not None})
    for group in args.only.split(","):
        timeout = args.timeout or GROUPS[group][1]
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
            if timeout < 10:
                on_row({"section": "skipped", "group": group, "row": group, "reason": "no time left in --budget"})
                continue
        _run_group(group, args, timeout, on_row)
    return results


# --- The tables and the plot


def _table(headers, rows) -> str:
    from benchmarks.common import table

    return table(headers, rows)


def _limits(results: list) -> dict | None:
    return next((r for r in results if r["section"] == "limits"), None)


def _peak_flops(limits: dict | None) -> float | None:
    return (limits["peak_tflops"] or limits["matmul_tflops"]) * 1e12 if limits else None


def _hbm_limit(limits: dict | None) -> float | None:
    """Bytes/s the decode roofline assumes: the published HBM bandwidth, else (a CPU) the measured read."""
    return (limits.get("peak_hbm_gbs") or limits["hbm_gbs"]) * 1e9 if limits else None


def report(results: list, spec: dict) -> str:
    """The side-by-side tables of every group's figures."""
    by = lambda section, side=None: [r for r in results if r["section"] == section and side in (None, r.get("side"))]
    out = []
    limits = _limits(results)
    peak, hbm = _peak_flops(limits), _hbm_limit(limits)
    if limits:
        out.append(f"device: {limits['device']} ({limits['platform']})  bf16 matmul {limits['matmul_tflops']:.1f} "
                   f"TFLOP/s (peak {limits['peak_tflops'] or 'n/a'})  HBM read {limits['hbm_gbs']:.0f} GB/s "
                   f"(peak {limits.get('peak_hbm_gbs') or 'n/a'})\n")
    mfu = lambda r: (f"{100 * forward_flops(spec['model'], r['batch'], r['length']) / r['seconds'] / peak:.0f}%"
                     if peak else "-")
    rows = []
    products = {(r["batch"], r["length"]): r for r in by("products")}
    for r in by("forward", "hf-tpu"):
        peer = [p for p in by("forward", "torchax") if (p["batch"], p["length"]) == (r["batch"], r["length"])]
        p = peer[0] if peer else None
        floor = products.get((r["batch"], r["length"]))
        rows.append([f"{r['batch']}x{r['length']}", f"{r['seconds'] * 1e3:.2f}", mfu(r), f"{r['first_call']:.1f}",
                     f"{p['seconds'] * 1e3:.2f}" if p else "-", mfu(p) if p else "-",
                     f"{p['first_call']:.1f}" if p else "-", f"{p['seconds'] / r['seconds']:.2f}x" if p else "-",
                     f"{floor['seconds'] * 1e3:.2f}" if floor else "-"])
    if rows:
        out.append("compiled forward (torch.compile backend='tpu' / torchax JittableModule; the model's weight "
                   "products alone in raw JAX)")
        out.append(_table(["batch x len", "hf-tpu ms", "MFU", "first s", "torchax ms", "MFU", "first s",
                           "hf-tpu speed / torchax", "products ms"], rows) + "\n")
    eager = by("eager", "hf-tpu")
    if eager:
        strict = {(r["batch"], r["length"]): r["seconds"] for r in eager if r["mode"] == "DEFER_NEVER"}
        out.append(_table(["eager forward", "batch x len", "ms", "strict / this"],
                          [[r["mode"], f"{r['batch']}x{r['length']}", f"{r['seconds'] * 1e3:.1f}",
                            f"{strict[(r['batch'], r['length'])] / r['seconds']:.2f}x"
                            if (r["batch"], r["length"]) in strict else "-"] for r in eager]) + "\n")
    decode = by("decode", "hf-tpu")
    if decode:
        limit = lambda r: decode_limit_tokens_per_second(spec["model"], r["batch"], r["context"], hbm) if hbm else None
        out.append(_table(["decode batch x prompt", "ms/step", "tokens/s", "HBM limit tokens/s", "of limit",
                           "first call s"],
                          [[f"{r['batch']}x{r['length']}", f"{r['step_seconds'] * 1e3:.2f}",
                            f"{r['batch'] / r['step_seconds']:.0f}", f"{limit(r):.0f}" if hbm else "-",
                            f"{100 * r['batch'] / r['step_seconds'] / limit(r):.0f}%" if hbm else "-",
                            f"{r['first_call']:.1f}"] for r in decode]) + "\n")
    ttft = by("ttft", "hf-tpu")
    if ttft:
        out.append(_table(["prompt", "generate(1 token) ms", "compiled forward ms", "ratio"],
                          [[r["length"], f"{r['seconds'] * 1e3:.1f}", f"{r['forward_seconds'] * 1e3:.1f}",
                            f"{r['seconds'] / r['forward_seconds']:.2f}x"] for r in ttft]) + "\n")
    moe = {r["implementation"]: r for r in by("moe")}
    if moe:
        limit = lambda r: decode_limit_tokens_per_second(spec["moe"], r["batch"], r["context"], hbm) if hbm else None
        out.append("MoE decode (Qwen3-MoE-shaped), experts_implementation")
        out.append(_table(["implementation", "batch", "ms/step", "tokens/s", "HBM limit tokens/s", "first call s"],
                          [[name, r["batch"], f"{r['step_seconds'] * 1e3:.2f}", f"{r['batch'] / r['step_seconds']:.0f}",
                            f"{limit(r):.0f}" if hbm else "-", f"{r['first_call']:.1f}"] for name, r in moe.items()]))
        if {"grouped_mm", "eager"} <= set(moe):
            capped = "capped_tokens" in moe["eager"]  # its time per token holds compiles: a bound from below
            out.append(f"grouped_mm is {'at least ' if capped else ''}"
                       f"{moe['eager']['step_seconds'] / moe['grouped_mm']['step_seconds']:.1f}x the per-expert loop "
                       f"(eager{', stopped by max_time, every step compiling' if capped else ''})")
        out.append("")
    trained = training.report(results, spec, peak)
    if trained:
        out.append(trained)
    compiles = by("compile")
    if compiles:
        out.append("first calls, where the time goes (s): capture is the rest beyond the compiles and a warm call "
                   "(Dynamo and AOT autograd where they ran, the ops' dispatch in eager mode); Python trace, "
                   "hf_tpu.jit's trace of the module's Python; trace, JAX's trace of the program compiled")
        out.append(_table(["group", "side", "what", "shape", "first call", "capture", "Python trace", "trace",
                           "lowering", "XLA", "warm ms"],
                          [[r["group"], r["side"], r["what"],
                            f"{r['batch']}x{r['length']}" if "batch" in r else f"{r['height']}x{r['width']}",
                            f"{r['first_call']:.2f}", f"{r['capture']:.2f}", f"{r['python_trace']:.2f}",
                            f"{r['trace']:.2f}", f"{r['lowering']:.2f}", f"{r['xla']:.2f}", f"{r['warm'] * 1e3:.1f}"]
                           for r in compiles]) + "\n")
    if any(r["section"].startswith("quant") for r in results):
        from benchmarks import quant

        out += quant.report(results, spec, hbm)
    skipped = by("skipped")
    if skipped:
        out.append("skipped:\n" + "\n".join(f"  [{r['group']}] {r['row']}: {r['reason']}" for r in skipped) + "\n")
    return "\n".join(out)


def plot(results: list, spec: dict, path: str) -> None:
    """Decode tokens/s against batch and prefill MFU against prompt length, beside torchax and the roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limits = _limits(results)
    peak, hbm = _peak_flops(limits), _hbm_limit(limits)
    figure, (decode_axes, prefill_axes) = plt.subplots(1, 2, figsize=(12, 4.8))
    decode = [r for r in results if r["section"] == "decode"]
    for length in sorted({r["length"] for r in decode}):
        points = sorted((r["batch"], r["batch"] / r["step_seconds"]) for r in decode if r["length"] == length)
        line, = decode_axes.plot(*zip(*points), "o-", label=f"hf-tpu generate(), prompt {length}")
        if hbm:
            batches = sorted({batch for batch, _ in points} | set(spec["batches"]))
            context = length + spec["decode_steps"] // 2
            decode_axes.plot(batches, [decode_limit_tokens_per_second(spec["model"], b, context, hbm) for b in batches],
                             "--", color=line.get_color(), alpha=0.6, label=f"HBM limit, prompt {length}")
    moe = [r for r in results if r["section"] == "moe"]
    for r in moe:
        decode_axes.plot([r["batch"]], [r["batch"] / r["step_seconds"]], "s" if r["implementation"] == "eager" else "D",
                         label=f"Qwen3-MoE-shaped, experts {r['implementation']}")
    if moe and hbm:
        decode_axes.plot([moe[0]["batch"]], [decode_limit_tokens_per_second(spec["moe"], moe[0]["batch"],
                                                                            moe[0]["context"], hbm)],
                         "k_", markersize=14, label="Qwen3-MoE-shaped, HBM limit")
    if not decode and not moe:
        if hbm:
            batches, length = sorted(set(spec["batches"]) | {1, 64}), min(spec["lengths"])
            context = length + spec["decode_steps"] // 2
            decode_axes.plot(batches, [decode_limit_tokens_per_second(spec["model"], b, context, hbm) for b in batches],
                             "--", color="grey", label=f"HBM limit, prompt {length}")
        decode_axes.text(0.5, 0.5, "no decode figures in these runs", transform=decode_axes.transAxes,
                         ha="center", va="center", color="grey")
    decode_axes.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s",
                    title="decode: tokens/s against batch")
    if decode_axes.get_legend_handles_labels()[0]:
        decode_axes.legend(fontsize=7)
    forward = [r for r in results if r["section"] == "forward"]
    if peak:
        for side, style in (("hf-tpu", "o-"), ("torchax", "s--")):
            for batch in sorted({r["batch"] for r in forward if r["side"] == side}):
                mfu = lambda r: 100 * forward_flops(spec["model"], batch, r["length"]) / r["seconds"] / peak
                points = sorted((r["length"], mfu(r)) for r in forward if r["side"] == side and r["batch"] == batch)
                prefill_axes.plot(*zip(*points), style, label=f"{side}, batch {batch}")
        prefill_axes.axhline(100, color="black", label="peak bf16 FLOP/s")
        prefill_axes.axhline(100 * limits["matmul_tflops"] * 1e12 / peak, color="grey", linestyle=":",
                             label="raw JAX bf16 matmul")
    prefill_axes.set(xscale="log", xlabel="prompt length (tokens)", ylabel="MFU %", ylim=(0, 110),
                     title="prefill (compiled forward): MFU against length")
    prefill_axes.set_xscale("log", base=2)
    prefill_axes.legend(fontsize=7)
    device = f"{limits['device']} ({limits['platform']})" if limits else "device unknown"
    figure.suptitle(f"benchmarks.chip --size {spec['name']} on {device}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _spec(args) -> dict:
    spec = dict(SIZES[args.size], name=args.size)
    if getattr(args, "train_rows", None):  # each training group runs its rows of these indices
        spec["train"] = dict(spec["train"], chosen=[int(k) for k in args.train_rows.split(",")])
    for option in ("batches", "lengths"):
        if getattr(args, option):
            spec[option] = [int(n) for n in getattr(args, option).split(",")]
    return spec


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--only", default=",".join(g for g in GROUPS if g not in NAMED_ONLY),
                        help=f"groups, in order: {', '.join(GROUPS)} (by default all but {', '.join(NAMED_ONLY)})")
    parser.add_argument("--batches", help="batch sizes of the grid (e.g. 1,8)")
    parser.add_argument("--lengths", help="prompt lengths of the grid (e.g. 128,1024)")
    parser.add_argument("--timeout", type=float, help="seconds each group may take (default: its own, "
                        + ", ".join(f"{name} {limit}" for name, (_, limit) in GROUPS.items()) + ")")
    parser.add_argument("--budget", type=float, help="seconds the whole run may take: later groups get what is left")
    parser.add_argument("--no-memory-check", action="store_true", help="run rows estimated not to fit")
    parser.add_argument("--json", help="write every figure to this file, after each one")
    parser.add_argument("--figures", nargs="+", help="report (and plot) the figures of these --json files (runs of "
                        "different groups, e.g. one device call each) instead of running")
    parser.add_argument("--plot", help="write a PNG of decode tokens/s and prefill MFU here (needs matplotlib)")
    parser.add_argument("--dump-hlo", help="write each group's optimized HLO under this folder")
    parser.add_argument("--profile", help="trace 3 calls of each forward row (one generate() of each decode row) under "
                        "this folder (jax.profiler) and report the device time per XLA op")
    parser.add_argument("--worker", choices=sorted(GROUPS), help=argparse.SUPPRESS)
    parser.add_argument("--train-rows", help="the training groups' rows to run, by index (default: all; at --size 1b "
                        + "; ".join(f"{k} {training.row_name(r)}" for k, r in enumerate(SIZES["1b"]["train"]["rows"]))
                        + "; train_libraries' "
                        + "; ".join(f"{k} {r['mode']} {training.row_name(r['row'])}"
                                    for k, r in enumerate(SIZES["1b"]["train"]["libraries"])) + ")")
    parser.add_argument("--train-row", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--train-mode", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.only.split(",")) - set(GROUPS)
    if unknown:
        parser.error(f"--only: unknown groups {', '.join(sorted(unknown))}; the groups are {', '.join(GROUPS)}")
    spec = _spec(args)
    if args.worker:
        return _worker(args, spec)
    if args.figures:
        results = []
        for path in args.figures:
            with open(path) as f:
                results += json.load(f)
        run_row = next((r for r in results if r["section"] == "run"), None)
        if run_row:  # the grid the figures were measured at
            spec = dict(SIZES[run_row["size"]], name=run_row["size"], batches=run_row["batches"],
                        lengths=run_row["lengths"])
    else:
        results = run(args, spec)
    print("\n" + report(results, spec), flush=True)
    if args.plot:
        try:
            plot(results, spec, args.plot)
            print(f"plot: {args.plot}")
        except ImportError:
            print("plot: matplotlib is not installed here; plot the --json file where it is "
                  "(python -m benchmarks.chip --figures FILE --plot PATH)")


if __name__ == "__main__":
    main()
