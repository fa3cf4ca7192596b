"""`benchmarks.chip`'s training groups: a Llama-shaped causal LM's training step (forward, backward, AdamW) on
the chip, in each way hf-tpu runs one, beside torchax's jitted step of the same model.

Rows (`SIZES[size]["train"]["rows"]`): a model (0.44B: hidden 1024, 24 layers; 1.1B: the forward group's),
a recipe, a batch x length, and whether the decoder layers are checkpointed. Recipes:
- `bf16`: bfloat16 parameters, `torch.optim.AdamW(foreach=True)` (its moments bfloat16 too);
- `mixed`: the Trainer's `bf16=True`: float32 parameters (the master weights), the forward and backward under
  `torch.autocast("tpu", torch.bfloat16)`, float32 gradients and moments.

Each way of running the step is a group, and each row runs in a process of its own (its peak memory is its own;
one that runs out of memory leaves the next a clean chip):
- `train`: the whole step as one program, `hf_tpu.jit(step)` (autograd and the optimizer inside the trace);
- `train_compile`: `torch.compile(model, backend="tpu")` for the forward and backward (AOT autograd's two
  graphs), `torch.compile(opt.step, backend="tpu")` for the optimizer;
- `train_eager`: the same Python step in defer-and-fuse and in strict eager;
- `train_torchax`: torchax's functional call of the same model under `jax.value_and_grad`, optax's `adamw` of the
  same hyperparameters, one `jax.jit` with parameters and moments donated; checkpointed rows wrap each decoder
  layer in `jax.checkpoint` (`torchax.interop.gradient_checkpoint`);
- `train_trainer`: Transformers' `Trainer` as a user runs it (`bf16=True` for the mixed recipe,
  `gradient_checkpointing=True` for a checkpointed row): its traced micro step and optimizer step.

Each row prints tokens/s, MFU (3 x the forward's FLOPs: 6 x parameters x tokens plus attention, a checkpointed
row's recomputation not counted), the first step's time and where it went (the Python trace, JAX's trace and
lowering, XLA's compile), the second step's (a traced step's second program: the optimizer's moments exist
from then on), and the peak device memory beside its arithmetic (`train_memory`).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

# the 0.44B model of the issue that opened the training work: 8 heads of 128
LLAMA_044B = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=8,
                  intermediate_size=4096, vocab_size=32000, max_position_embeddings=8192)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=256, max_position_embeddings=512)

RECIPES = ("bf16", "mixed")
LEARNING_RATE, WEIGHT_DECAY = 1e-4, 0.1


def row_name(row: dict) -> str:
    return (f"{row['model']} {row['recipe']} {row['batch']}x{row['length']}"
            f"{' checkpointed' if row['checkpointing'] else ''}")


# --- The arithmetic: parameters, FLOPs, memory


def parameters(config: dict) -> int:
    """Every parameter: the layers' matmuls and norms, the embedding and the (untied) LM head, the final norm."""
    from benchmarks.chip import _layer_matmul_params

    h = config["hidden_size"]
    layer = _layer_matmul_params(config) + 2 * h
    return int(config["num_hidden_layers"] * layer + 2 * h * config["vocab_size"] + h)


def train_flops(config: dict, batch: int, length: int) -> float:
    """A step's FLOPs as MFU counts them: the forward's (`chip.forward_flops`) and twice that for the backward."""
    from benchmarks.chip import forward_flops

    return 3 * forward_flops(config, batch, length)


def _layer_activation_bytes(config: dict, dtype_bytes: int) -> int:
    """Bytes a token's activations take in one decoder layer as eager autograd saves them: the layer input and the
    two norms' outputs, with each norm's float32 input; the query, key and value, rotated, and attention's output;
    the MLP's gate and up projections, the gate's activation and the product."""
    from benchmarks.chip import _head_dim

    h, kv = config["hidden_size"], config["num_key_value_heads"] * _head_dim(config)
    i = config["intermediate_size"]
    return dtype_bytes * (3 * h + 2 * (h + 2 * kv) + h + 4 * i) + 4 * 2 * h


def train_memory(config: dict, batch: int, length: int, recipe: str, checkpointing: bool) -> dict:
    """Bytes a training step holds at its peak, by part: parameters, gradients and AdamW's two moments (in the
    parameters' dtype: bfloat16 for `bf16`, float32 for `mixed`, which also holds bfloat16 copies of the weights
    its autocast made), the activations kept for the backward (a checkpointed layer's input alone, and one
    layer's whole activations while it is recomputed), and the loss's logits and their gradient, both bfloat16
    (`hf_tpu.ops.cross_entropy`: no float32 log-probabilities, the gradient made in the logits' dtype)."""
    n = parameters(config)
    weight = 2 if recipe == "bf16" else 4
    tokens = batch * length
    layers, h = config["num_hidden_layers"], config["hidden_size"]
    layer = _layer_activation_bytes(config, 2)
    parts = {"parameters": weight * n, "gradients": weight * n, "AdamW moments": 2 * weight * n}
    if recipe == "mixed":
        parts["bf16 weight copies"] = 2 * n
    parts["activations"] = tokens * (layers * 2 * h + layer if checkpointing else layers * layer)
    parts["logits"] = tokens * config["vocab_size"] * (2 + 2)
    return parts


# --- One row, in its own process


def _device_figures() -> dict:
    """The device's kind and the peak memory the process used on it (a CPU reports none)."""
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return dict(device=device.device_kind, peak_bytes=stats.get("peak_bytes_in_use"))


def _memory_analysis(lowered) -> dict | None:
    """The compiled program's memory (XLA's analysis: its arguments, outputs and temporaries; the CPU's is a proxy
    for the TPU's, without the TPU's rematerialization). Taken where the device reports no peak (a CPU): it compiles
    the program again, which on a chip costs as long as the first step's compile."""
    try:
        analysis = lowered.compile().memory_analysis()
    except Exception as e:  # noqa: BLE001 - a figure, not the benchmark's point
        print(f"memory analysis unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    if analysis is None:
        return None
    return {name: getattr(analysis, f"{name}_size_in_bytes") for name in ("argument", "output", "alias", "temp")}


def _time_steps(step, steps: int) -> dict:
    """The first and second steps' seconds (each waits for its loss), and the median of `steps` more, each
    timed to its loss on the host; the losses."""
    from benchmarks.common import jax_compile_phases

    phases = jax_compile_phases()
    before = {name: dict(p) for name, p in phases.items()}
    start = time.perf_counter()
    losses = [step()]
    first = time.perf_counter() - start
    compiled = {name: {k: v - before.get(name, {}).get(k, 0.0) for k, v in p.items()} for name, p in phases.items()}
    start = time.perf_counter()
    losses.append(step())
    second = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    return dict(first_step=first, second_step=second, step_seconds=statistics.median(times),
                first_split=_compile_split(compiled), losses=losses[:3] + losses[-1:])


def _compile_split(compiled: dict) -> dict:
    """Compile seconds by phase (`jax_compile_phases`' figures since a point): hf_tpu.jit's Python trace, JAX's
    trace and lowering, XLA."""
    split = {"XLA": 0.0, "JAX trace and lowering": 0.0, "Python trace": 0.0}
    for name, p in compiled.items():
        if name.startswith("trace_"):  # hf_tpu.jit's run of the Python function on tracers
            split["Python trace"] += p.get("trace", 0.0)
        else:
            split["XLA"] += p.get("XLA", 0.0)
            split["JAX trace and lowering"] += p.get("trace", 0.0) + p.get("lowering", 0.0)
    return split


def training_step(model, opt, autocast: bool):
    """One training step of a causal LM on token ids, as a user writes it: the forward (under bfloat16 autocast for
    the mixed recipe), the backward, the optimizer's update; it returns the loss, detached."""
    import torch

    def step(ids):
        with torch.autocast("tpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def _hf_tpu_row(spec: dict, rows, row: dict, mode: str) -> None:
    import torch

    import hf_tpu
    from benchmarks.chip import _ids, _llama

    config = spec["train"]["models"][row["model"]]
    model = _llama(dict(spec, model=config))
    if row["recipe"] == "mixed":
        model = model.float()
    if row["checkpointing"]:
        model.gradient_checkpointing_enable()
    model.train().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, foreach=True)
    ids = _ids(config["vocab_size"], row["batch"], row["length"]).to("tpu")
    autocast = row["recipe"] == "mixed"
    step = training_step(model, opt, autocast)
    lowered = None
    if mode == "jit":
        jitted = hf_tpu.jit(step)
        run = jitted
    elif mode == "compile":
        compiled = torch.compile(model, backend="tpu")
        opt_step = torch.compile(opt.step, backend="tpu")

        def run(ids):
            with torch.autocast("tpu", dtype=torch.bfloat16, enabled=autocast):
                loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            opt_step()
            opt.zero_grad()
            return loss.detach()
    else:
        def run(ids):
            with torch.tpu.use_eager_mode(mode):
                return step(ids)

    figures = _time_steps(lambda: run(ids).item(), spec["train"]["steps"])
    device = _device_figures()
    if mode == "jit" and device["peak_bytes"] is None:
        lowered = jitted.lower(ids)
    metrics = hf_tpu.metrics()
    rows.emit("train", side="hf-tpu", mode=mode, **row, **figures, **device,
              memory_analysis=_memory_analysis(lowered) if lowered is not None else None,
              fallbacks=sum(metrics["cpu_fallbacks"].values()))


def _torchax_row(spec: dict, rows, row: dict) -> None:
    import jax
    import optax
    import torch
    import torchax
    import torchax.interop as interop

    from benchmarks.chip import _ids, _llama

    config = spec["train"]["models"][row["model"]]
    model = _llama(dict(spec, model=config))
    if row["recipe"] == "mixed":
        model = model.float()
    model.train()
    env = torchax.default_env()
    with env:
        model.to("jax")
        if row["checkpointing"]:  # each decoder layer's forward recomputed in the backward, as jax.checkpoint does
            for layer in model.model.layers:
                layer.forward = interop.gradient_checkpoint(layer.forward)
        params, buffers = interop.extract_all_buffers(model)
        params, buffers = interop.jax_view(params), interop.jax_view(buffers)
        ids = interop.jax_view(_ids(config["vocab_size"], row["batch"], row["length"]).to("jax"))
    tx = optax.adamw(LEARNING_RATE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY)
    opt_state = tx.init(params)
    autocast = row["recipe"] == "mixed"

    def loss_of(params, buffers, ids):
        with env:
            tensors = interop.torch_view({**params, **buffers})
            ids = interop.torch_view(ids)
            with torch.autocast("jax", dtype=torch.bfloat16, enabled=autocast):
                out = torch.func.functional_call(model, tensors, (ids,), {"labels": ids, "use_cache": False})
            return interop.jax_view(out.loss)

    def train_step(params, buffers, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_of)(params, buffers, ids)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(train_step, donate_argnums=(0, 2))
    state = [params, opt_state]

    def step():
        state[0], state[1], loss = jitted(state[0], buffers, state[1], ids)
        return float(loss)

    try:
        figures = _time_steps(step, spec["train"]["steps"])
    except Exception as e:  # noqa: BLE001 (torchax raises JAX's own error for memory)
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        rows.out_of_memory(row_name(row), e)
        return
    device = _device_figures()
    analysis = None if device["peak_bytes"] else _memory_analysis(jitted.lower(state[0], buffers, state[1], ids))
    rows.emit("train", side="torchax", mode="jit", **row, **figures, **device, memory_analysis=analysis, fallbacks=0)


def _trainer_row(spec: dict, rows, row: dict) -> None:
    """The row trained by Transformers' `Trainer` as a user runs it (`bf16=True` for the mixed recipe,
    `gradient_checkpointing`, AdamW, clipping at 1.0, a linear schedule, a loss logged every step): its steps are
    traced programs on one chip (`integrations/transformers/trainer.py`). A step's time is from one logged loss to
    the next (logging reads the loss on the host); the first step's from the start of training."""
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import hf_tpu
    from benchmarks.chip import _ids, _llama
    from benchmarks.common import jax_compile_phases

    config = spec["train"]["models"][row["model"]]
    model = _llama(dict(spec, model=config))
    mixed = row["recipe"] == "mixed"
    if mixed:
        model = model.float()
    steps = 2 + spec["train"]["steps"]
    data = [{"input_ids": ids, "labels": ids}
            for ids in _ids(config["vocab_size"], row["batch"] * steps, row["length"])]
    marks = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                marks.append(time.perf_counter())

    phases = jax_compile_phases()
    before = {name: dict(p) for name, p in phases.items()}
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(folder, per_device_train_batch_size=row["batch"], max_steps=steps,
                                 learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, bf16=mixed,
                                 gradient_checkpointing=row["checkpointing"], logging_steps=1, report_to=[],
                                 save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()])
        trainer.train()
    compiled = {name: {k: v - before.get(name, {}).get(k, 0.0) for k, v in p.items()} for name, p in phases.items()}
    times = [b - a for a, b in zip(marks, marks[1:])]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    metrics = hf_tpu.metrics()
    rows.emit("train", side="hf-tpu", mode="Trainer", **row, first_step=times[0], second_step=times[1],
              step_seconds=statistics.median(times[2:]), first_split=_compile_split(compiled),
              losses=losses[:3] + losses[-1:], **_device_figures(), memory_analysis=None,
              fallbacks=sum(metrics["cpu_fallbacks"].values()))


# the ways each training group runs a row
MODES = {"train": ("jit",), "train_compile": ("compile",), "train_eager": ("DEFER_AND_FUSE", "DEFER_NEVER"),
         "train_torchax": ("torchax",), "train_trainer": ("Trainer",)}


def run_row(spec: dict, rows, group: str, index: int, mode: str) -> None:
    """Row `index` of the size's training rows, run `mode`'s way."""
    if mode != "torchax":
        import hf_tpu  # noqa: F401  (before JAX starts: it sets JAX's flags; the torchax process must not import it)
    import torch

    row = spec["train"]["rows"][index]
    if rows.check_memory and not _fits(rows, row, spec["train"]["models"][row["model"]]):
        return
    try:
        if mode == "torchax":
            _torchax_row(spec, rows, row)
        elif mode == "Trainer":
            _trainer_row(spec, rows, row)
        else:
            _hf_tpu_row(spec, rows, row, mode)
    except torch.OutOfMemoryError as e:
        rows.out_of_memory(f"{row_name(row)} {mode}", e)


def run_group(spec: dict, rows, group: str) -> None:
    """Each training row of the size in each of the group's ways, in a process of its own (see the module's
    docstring), which checks that its memory fits. This process starts no JAX backend: on a TPU the row's process
    must hold the chip alone."""
    import importlib.util

    if group == "train_torchax":
        missing = [name for name in ("torchax", "optax") if importlib.util.find_spec(name) is None]
        if missing:
            rows.skip("train_torchax", f"{' and '.join(missing)} not importable here")
            return
    for index, row in enumerate(spec["train"]["rows"]):
        for mode in MODES[group]:
            command = [sys.executable, "-m", "benchmarks.chip", "--worker", group, "--size", spec["name"],
                       "--train-row", str(index), "--train-mode", mode]
            if spec["train"].get("chosen"):  # `--train-rows`: the row's index is among those chosen
                command += ["--train-rows", spec["train"]["chosen"]]
            if not rows.check_memory:
                command.append("--no-memory-check")
            finished = subprocess.run(command, env=dict(os.environ, PYTHONUNBUFFERED="1"))
            if finished.returncode:
                rows.skip(f"{row_name(row)} {mode}", f"its process exited with {finished.returncode} (its error is above)")


def _fits(rows, row: dict, config: dict) -> bool:
    from benchmarks.chip import _device_bytes

    parts = train_memory(config, row["batch"], row["length"], row["recipe"], row["checkpointing"])
    device = _device_bytes()
    need = sum(parts.values())
    if need <= device:
        return True
    largest = ", ".join(f"{name} {size / 1e9:.1f}" for name, size in sorted(parts.items(), key=lambda p: -p[1])[:3])
    rows.skip(row_name(row), f"needs ~{need / 1e9:.1f} GB ({largest}) of the device's {device / 1e9:.1f} GB "
              "(--no-memory-check to try)")
    return False


# --- Lines and the table


def _mfu(row: dict, spec: dict, peak: float | None) -> str:
    """MFU against the limits group's peak, else the published peak of the row's device (none for a CPU)."""
    from benchmarks.chip import PEAK_BF16

    peak = peak or PEAK_BF16.get(row.get("device"))
    if not peak:
        return "-"
    config = spec["train"]["models"][row["model"]]
    return f"{100 * train_flops(config, row['batch'], row['length']) / row['step_seconds'] / peak:.0f}%"


def _size(n: float, unit: int) -> str:
    return f"{n / unit:.2f}"


def _memory_text(row: dict, spec: dict) -> str:
    """The measured peak (a TPU's), else the program's memory by XLA's analysis (a traced step on a CPU), beside
    the arithmetic, in GiB (MiB for a tiny model)."""
    config = spec["train"]["models"][row["model"]]
    parts = train_memory(config, row["batch"], row["length"], row["recipe"], row["checkpointing"])
    estimate = sum(parts.values())
    unit, name = (2**30, "GiB") if estimate > 2**28 else (2**20, "MiB")
    arithmetic = " + ".join(f"{part} {_size(size, unit)}" for part, size in parts.items())
    measured = row.get("peak_bytes")
    analysis = row.get("memory_analysis")
    if measured:
        seen = f"peak {_size(measured, unit)} {name} ({measured / estimate:.2f}x the arithmetic)"
    elif analysis:
        program = analysis["argument"] + analysis["output"] - analysis["alias"] + analysis["temp"]
        seen = (f"program {_size(program, unit)} {name} by XLA's analysis (temporaries {_size(analysis['temp'], unit)}; "
                f"{program / estimate:.2f}x the arithmetic)")
    else:
        seen = "peak not reported here"
    return f"{seen}; arithmetic {_size(estimate, unit)} {name} = {arithmetic}"


def describe(row: dict, spec: dict, peak: float | None) -> str:
    config = spec["train"]["models"][row["model"]]
    tokens = row["batch"] * row["length"] / row["step_seconds"]
    split = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in row["first_split"].items() if seconds)
    mfu = _mfu(row, spec, peak)
    return (f"[{row['group']}] {row['side']} {row['mode']} {row_name(row)} ({parameters(config) / 1e9:.2f}B): "
            f"{row['step_seconds'] * 1e3:.1f} ms/step, {tokens:.0f} tokens/s"
            f"{f', MFU {mfu}' if mfu != '-' else ''}; first step {row['first_step']:.1f} s ({split or 'no compile'}), "
            f"second {row['second_step']:.1f} s; {_memory_text(row, spec)}; losses "
            + " ".join(f"{loss:.4f}" for loss in row["losses"]))


def report(results: list, spec: dict, peak: float | None) -> str:
    """The training rows side by side, with each hf-tpu row's speed over torchax's row of the same model, recipe and
    shape."""
    train = [r for r in results if r["section"] == "train"]
    if not train:
        return ""
    key = lambda r: (r["model"], r["recipe"], r["batch"], r["length"], r["checkpointing"])
    torchax = {key(r): r for r in train if r["side"] == "torchax"}
    table = []
    for r in train:
        peer = torchax.get(key(r))
        versus = f"{peer['step_seconds'] / r['step_seconds']:.2f}x" if peer and r["side"] != "torchax" else "-"
        table.append([row_name(r), f"{r['side']} {r['mode']}", f"{r['step_seconds'] * 1e3:.1f}",
                      f"{r['batch'] * r['length'] / r['step_seconds']:.0f}", _mfu(r, spec, peak),
                      f"{r['first_step']:.1f}", f"{r['second_step']:.1f}",
                      f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") else "-", versus])
    from benchmarks.common import table as format_table

    return ("training step (forward, backward, AdamW)\n"
            + format_table(["row", "how", "ms/step", "tokens/s", "MFU", "first s", "second s", "peak GiB",
                            "speed / torchax"], table) + "\n")
