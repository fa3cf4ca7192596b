"""`benchmarks.chip`'s training groups: a Llama-shaped causal LM's training step (forward, backward, AdamW) on
the chip, in each way hf-tpu runs one, beside torchax's jitted step of the same model, and through the libraries
users train with.

Rows (`SIZES[size]["train"]["rows"]`): a model (0.44B: hidden 1024, 24 layers; 1.1B: the forward group's),
a recipe, a batch x length (the tokens of an optimizer step), whether the decoder layers are checkpointed, and
the micro-batches a step accumulates (1 but for the Trainer's `gradient_accumulation_steps`). Recipes:
- `bf16`: bfloat16 parameters, `torch.optim.AdamW(foreach=True)` (its moments bfloat16 too);
- `mixed`: the Trainer's `bf16=True`: float32 parameters (the master weights), the forward and backward under
  `torch.autocast("tpu", torch.bfloat16)`, float32 gradients and moments;
- `lora`: PEFT's LoRA (`LORA_RANK` on every projection): frozen bfloat16 weights, float32 adapters that alone
  train.

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
  `gradient_checkpointing=True` for a checkpointed row): its traced micro step and optimizer step;
- `train_libraries`: rows of its own (`SIZES[size]["train"]["libraries"]`), each run its library's way within a
  time limit of its own: the Trainer with `bf16=True`, `gradient_accumulation_steps=4` and
  `gradient_checkpointing=True`, traced (`Trainer`) and with `torch_compile=True` (`Trainer compile`); PEFT's LoRA
  through the Trainer, which checks what a LoRA fine-tune must keep (`_adapter_figures`); a plain Accelerate
  loop in a process `accelerate launch` started with `examples/accelerate/one-chip.yaml` (`accelerate launch`).

Each row prints tokens/s, MFU (3 x the forward's FLOPs: 6 x parameters x tokens plus attention, a checkpointed
row's recomputation not counted; LoRA's own count, `train_flops`), the first step's time and where it went (the
Python trace, JAX's trace and lowering, XLA's compile), the second step's (a traced step's second program: the
optimizer's moments exist from then on), and the peak device memory beside its arithmetic (`train_memory`). A
Trainer row's last step is a batch of another length in the same bucket (`shorter_in_bucket`): its time and the
programs it traced and compiled are printed apart.
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

RECIPES = ("bf16", "mixed", "lora")
LEARNING_RATE, WEIGHT_DECAY = 1e-4, 0.1
# the `lora` recipe's adapters (PEFT's `LoraConfig`): rank 16 on every projection of attention and the MLP
LORA_RANK = 16
LORA_TARGETS = {"q_proj": ("hidden", "query"), "k_proj": ("hidden", "key"), "v_proj": ("hidden", "key"),
                "o_proj": ("query", "hidden"), "gate_proj": ("hidden", "intermediate"),
                "up_proj": ("hidden", "intermediate"), "down_proj": ("intermediate", "hidden")}


def row_name(row: dict) -> str:
    accumulation = row.get("accumulation", 1)
    micro = f" in {accumulation} micro-batches" if accumulation > 1 else ""
    return (f"{row['model']} {row['recipe']} {row['batch']}x{row['length']}{micro}"
            f"{' checkpointed' if row['checkpointing'] else ''}")


def shorter_in_bucket(length: int) -> int:
    """A length 1/128 shorter than `length` (1000 for 1024): a batch of it pads to the same bucket of lengths
    (`HF_TPU_COMPILED_BUCKETS`: 16, 32, 48, 64, 96, 128, ..., 768, 1024: no bucket lies between), so it should
    compile nothing new."""
    return length * 125 // 128


# --- The arithmetic: parameters, FLOPs, memory


def parameters(config: dict) -> int:
    """Every parameter: the layers' matmuls and norms, the embedding and the (untied) LM head, the final norm."""
    from benchmarks.chip import _layer_matmul_params

    h = config["hidden_size"]
    layer = _layer_matmul_params(config) + 2 * h
    return int(config["num_hidden_layers"] * layer + 2 * h * config["vocab_size"] + h)


def adapter_parameters(config: dict) -> int:
    """The `lora` recipe's adapter parameters: rank x (inputs + outputs) of each targeted projection of each layer."""
    from benchmarks.chip import _head_dim

    widths = {"hidden": config["hidden_size"], "intermediate": config["intermediate_size"],
              "query": config["num_attention_heads"] * _head_dim(config),
              "key": config["num_key_value_heads"] * _head_dim(config)}
    layer = sum(LORA_RANK * (widths[inputs] + widths[outputs]) for inputs, outputs in LORA_TARGETS.values())
    return config["num_hidden_layers"] * layer


def train_flops(config: dict, batch: int, length: int, recipe: str = "bf16") -> float:
    """A step's FLOPs as MFU counts them: the forward's (`chip.forward_flops`) and twice that for the backward. With
    the `lora` recipe the frozen weights get no gradient: 2 FLOPs a matmul parameter a token forward and 2 backward
    (the activations' gradients), the adapters' 6 (forward, their inputs' and their own gradients), attention's
    forward and backward as in full training."""
    from benchmarks.chip import attention_flops, forward_flops, matmul_params

    if recipe != "lora":
        return 3 * forward_flops(config, batch, length)
    per_token = 4 * matmul_params(config) + 6 * adapter_parameters(config)
    return batch * length * per_token + 3 * attention_flops(config, batch, length)


def _layer_activation_bytes(config: dict, dtype_bytes: int) -> int:
    """Bytes a token's activations take in one decoder layer as eager autograd saves them: the layer input and the
    two norms' outputs, with each norm's float32 input; the query, key and value, rotated, and attention's output;
    the MLP's gate and up projections, the gate's activation and the product."""
    from benchmarks.chip import _head_dim

    h, kv = config["hidden_size"], config["num_key_value_heads"] * _head_dim(config)
    i = config["intermediate_size"]
    return dtype_bytes * (3 * h + 2 * (h + 2 * kv) + h + 4 * i) + 4 * 2 * h


def train_memory(config: dict, batch: int, length: int, recipe: str, checkpointing: bool,
                 accumulation: int = 1) -> dict:
    """Bytes a training step holds at its peak, by part: parameters, gradients and AdamW's two moments (in the
    parameters' dtype: bfloat16 for `bf16`, float32 for `mixed`, which also holds bfloat16 copies of the weights
    its autocast made; for `lora`, the frozen bfloat16 weights alone, and the float32 adapters with their
    gradients and moments), the activations kept for the backward (a checkpointed layer's input alone, and one
    layer's whole activations while it is recomputed), and the loss's logits and their gradient, both bfloat16
    (`hf_tpu.ops.cross_entropy`: no float32 log-probabilities, the gradient made in the logits' dtype). The
    activations and logits are one micro-batch's: `batch` / `accumulation` rows."""
    n = parameters(config)
    tokens = batch * length // accumulation
    layers, h = config["num_hidden_layers"], config["hidden_size"]
    layer = _layer_activation_bytes(config, 2)
    if recipe == "lora":
        adapters = adapter_parameters(config)
        parts = {"frozen parameters": 2 * n, "adapters": 4 * adapters, "adapter gradients": 4 * adapters,
                 "adapter AdamW moments": 8 * adapters}
    else:
        weight = 2 if recipe == "bf16" else 4
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
    """The first and second steps' seconds (each waits for its loss), then `steps` more dispatched back to back as
    a training loop runs them, their losses read at the end: the step time is their seconds over `steps` (the host's
    work for a step overlaps the chip's previous one), beside the median of `steps` steps each timed to its loss
    (`synced_step_seconds`, host and chip in series). `step()` returns the loss as a tensor or JAX array."""
    from benchmarks.common import jax_compile_phases

    phases = jax_compile_phases()
    before = {name: dict(p) for name, p in phases.items()}
    start = time.perf_counter()
    losses = [float(step())]
    first = time.perf_counter() - start
    compiled = {name: {k: v - before.get(name, {}).get(k, 0.0) for k, v in p.items()} for name, p in phases.items()}
    start = time.perf_counter()
    losses.append(float(step()))
    second = time.perf_counter() - start
    synced = []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(float(step()))
        synced.append(time.perf_counter() - start)
    start = time.perf_counter()
    pending = [step() for _ in range(steps)]
    losses.extend(float(loss) for loss in pending)
    pipelined = (time.perf_counter() - start) / steps
    return dict(first_step=first, second_step=second, step_seconds=pipelined,
                synced_step_seconds=statistics.median(synced), first_split=_compile_split(compiled),
                losses=losses[:3] + losses[-1:])


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


def training_step(model, opt, autocast: bool, backward=None):
    """One training step of a causal LM on token ids, as a user writes it: the forward (under bfloat16 autocast for
    the mixed recipe), the backward (`backward(loss)`: Accelerate's `accelerator.backward`; by default
    `loss.backward()`), the optimizer's update; it returns the loss, detached."""
    import torch

    def step(ids):
        with torch.autocast("tpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        if backward is None:
            loss.backward()
        else:
            backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


# what `accelerate launch` sets in the environment of the script it starts (`accelerate.utils.launch`)
_ACCELERATE_LAUNCHED = "ACCELERATE_USE_CPU"


def _hf_tpu_row(spec: dict, rows, row: dict, mode: str) -> None:
    """The row's step as a user writes it, run `mode`'s way. `accelerate launch`: the process was started by
    Accelerate's launcher (`run_group`), and the loop is Accelerate's as the user's guide writes it: `Accelerator()`,
    `accelerator.prepare(model, optimizer)`, `accelerator.backward(loss)`, the whole step traced by `hf_tpu.jit`."""
    import torch

    import hf_tpu
    from benchmarks.chip import _ids, _llama, _profile

    config = spec["train"]["models"][row["model"]]
    accelerator = launch = None
    if mode == "accelerate launch":
        from accelerate import Accelerator

        if _ACCELERATE_LAUNCHED not in os.environ:
            raise RuntimeError("the `accelerate launch` row's process was not started by `accelerate launch`")
        accelerator = Accelerator()
        launch = dict(distributed_type=str(accelerator.distributed_type), accelerator_device=str(accelerator.device),
                      mixed_precision=accelerator.mixed_precision)
    model = _llama(dict(spec, model=config))
    if row["recipe"] == "mixed":
        model = model.float()
    if row["checkpointing"]:
        model.gradient_checkpointing_enable()
    model.train()
    if accelerator is None:
        model.to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, foreach=True)
    if accelerator is not None:
        model, opt = accelerator.prepare(model, opt)
    ids = _ids(config["vocab_size"], row["batch"], row["length"]).to("tpu")
    autocast = row["recipe"] == "mixed"
    step = training_step(model, opt, autocast, backward=accelerator.backward if accelerator is not None else None)
    lowered = None
    if mode in ("jit", "accelerate launch"):
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

    figures = _time_steps(lambda: run(ids), spec["train"]["steps"])
    device = _device_figures()
    _profile(rows, lambda: run(ids).item(), calls=2, side=f"hf-tpu {mode}", batch=row["batch"], length=row["length"])
    if mode in ("jit", "accelerate launch") and device["peak_bytes"] is None:
        lowered = jitted.lower(ids)
    metrics = hf_tpu.metrics()
    rows.emit("train", side="hf-tpu", mode=mode, **row, **figures, **device,
              memory_analysis=_memory_analysis(lowered) if lowered is not None else None,
              fallbacks=sum(metrics["cpu_fallbacks"].values()), **({"launch": launch} if launch else {}))


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
        return loss

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


def _trainer_row(spec: dict, rows, row: dict, compiled: bool = False) -> None:
    """The row trained by Transformers' `Trainer` as a user runs it (`bf16=True` for the mixed recipe,
    `gradient_checkpointing`, `gradient_accumulation_steps` for a row of micro-batches, AdamW, clipping at 1.0, a
    linear schedule, a loss logged every step; PEFT's LoRA adapters for the `lora` recipe): its steps are traced
    programs on one chip (`integrations/transformers/trainer.py`), with `compiled` (`torch_compile=True`) too, the
    compiled model traced into the micro step. A step's time is from one logged loss to the next (logging reads the
    loss on the host); the first step's from the start of training. The last step's batch is shorter, inside the
    same bucket of lengths (`shorter_in_bucket`): its time and the programs it traced and compiled are reported
    apart, and left out of the median."""
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments

    import hf_tpu
    from benchmarks.chip import _ids, _llama
    from benchmarks.common import jax_compile_phases

    config = spec["train"]["models"][row["model"]]
    model = _llama(dict(spec, model=config))
    mixed = row["recipe"] == "mixed"
    if mixed:
        model = model.float()
    if row["recipe"] == "lora":
        model = _with_lora(model)
    steps = 2 + spec["train"]["steps"] + 1
    batches = [*_ids(config["vocab_size"], row["batch"] * (steps - 1), row["length"]),
               *_ids(config["vocab_size"], row["batch"], shorter_in_bucket(row["length"]), variant=1)]
    data = [{"input_ids": ids, "labels": ids} for ids in batches]
    phases = jax_compile_phases()
    marks = []  # at the start of training and at each logged loss: the time, hf-tpu's counters, JAX's compiles

    def mark():
        marks.append((time.perf_counter(), hf_tpu.metrics(), {name: dict(p) for name, p in phases.items()}))

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            mark()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                mark()

    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(folder, per_device_train_batch_size=row["batch"] // row["accumulation"],
                                 gradient_accumulation_steps=row["accumulation"], max_steps=steps,
                                 learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, bf16=mixed,
                                 gradient_checkpointing=row["checkpointing"], torch_compile=compiled,
                                 logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
                                 dataloader_pin_memory=False, train_sampling_strategy="sequential")
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()])
        trainer.train()
        adapters = _adapter_figures(trainer.model, spec, row, folder) if row["recipe"] == "lora" else None
    (_, _, started), (_, _, first_done) = marks[:2]
    compiled_first = {name: {k: v - started.get(name, {}).get(k, 0.0) for k, v in p.items()}
                      for name, p in first_done.items()}
    times = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    before_last, last = marks[-2][1], marks[-1][1]
    bucket_step = dict(length=shorter_in_bucket(row["length"]), seconds=times[-1],
                       programs_traced=last["compiles"] - before_last["compiles"],
                       xla_compiles=last["xla_compiles"] - before_last["xla_compiles"])
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    rows.emit("train", side="hf-tpu", mode="Trainer compile" if compiled else "Trainer", **row, first_step=times[0],
              second_step=times[1], step_seconds=statistics.median(times[2:-1]),
              first_split=_compile_split(compiled_first), losses=losses[:3] + losses[-2:-1], bucket_step=bucket_step,
              **_device_figures(), memory_analysis=None, fallbacks=sum(last["cpu_fallbacks"].values()),
              **({"adapters": adapters} if adapters else {}))


def _with_lora(model):
    """The model with PEFT's LoRA adapters (`LORA_RANK` on `LORA_TARGETS`), as a user adds them: only the adapters
    train; PEFT keeps them in float32 beside the frozen bfloat16 weights."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=LORA_RANK, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM"))


def _adapter_figures(model, spec: dict, row: dict, folder: str) -> dict:
    """What a LoRA fine-tune must keep, checked after training (an AssertionError ends the row, loudly): only the
    adapters required gradients, every frozen weight is still bfloat16 on tpu, every adapter's B (zero before
    training) moved, and the adapters saved (`save_pretrained`) and loaded onto a fresh base model on tpu
    (`PeftModel.from_pretrained`) hold the trained values and give the trained model's logits on a batch."""
    import torch
    from peft import PeftModel

    from benchmarks.chip import _ids, _llama

    named = dict(model.named_parameters())
    trainable = {name: p for name, p in named.items() if p.requires_grad}
    frozen = {name: p for name, p in named.items() if not p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable), \
        f"parameters besides LoRA's adapters require gradients: {[n for n in trainable if 'lora_' not in n][:5]}"
    moved = [name for name, p in frozen.items() if p.dtype != torch.bfloat16 or p.device.type != "tpu"]
    assert not moved, f"frozen weights no longer bfloat16 on tpu after training: {moved[:5]}"
    b_largest = torch.stack([p.detach().abs().amax() for name, p in trainable.items() if "lora_B" in name]).cpu()
    assert bool((b_largest > 0).all()), f"{int((b_largest == 0).sum())} adapters' B are still zero after training"
    config = spec["train"]["models"][row["model"]]
    ids = _ids(config["vocab_size"], 1, row["length"], variant=2).to("tpu")
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits.float().cpu()
        with model.disable_adapter():
            base = model(input_ids=ids).logits.float().cpu()
    path = os.path.join(folder, "adapter")
    model.save_pretrained(path)
    reloaded = PeftModel.from_pretrained(_llama(dict(spec, model=config)).to("tpu"), path).eval()
    again_named = dict(reloaded.named_parameters())
    weights_differ = torch.stack([(again_named[name] - p).abs().amax() for name, p in trainable.items()]).max().item()
    with torch.no_grad():
        again = reloaded(input_ids=ids).logits.float().cpu()
    difference = (again - trained).abs().max().item()
    # the logits are bfloat16: one unit in the last place at their largest magnitude
    tolerance = 2.0**-7 * trained.abs().max().item()
    assert weights_differ == 0 and difference <= tolerance, (
        f"the adapters reloaded differ: weights by up to {weights_differ}, logits by {difference} (tolerance {tolerance})")
    return dict(trainable=sum(p.numel() for p in trainable.values()), trainable_tensors=len(trainable),
                frozen=sum(p.numel() for p in frozen.values()), frozen_tensors=len(frozen),
                reload_difference=difference, reload_tolerance=tolerance,
                adapters_moved_logits=(trained - base).abs().max().item())


# the ways each training group runs the shared rows (`SIZES[size]["train"]["rows"]`); `train_libraries` has rows of
# its own (`SIZES[size]["train"]["libraries"]`), each with its way: "Trainer", "Trainer compile", "accelerate launch"
MODES = {"train": ("jit",), "train_compile": ("compile",), "train_eager": ("DEFER_AND_FUSE", "DEFER_NEVER"),
         "train_torchax": ("torchax",), "train_trainer": ("Trainer",)}
_ONE_CHIP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "accelerate",
                         "one-chip.yaml")
# how a mode's process starts, before `benchmarks.chip`'s arguments: `accelerate launch` as a user types it, through
# the module of its command (this interpreter's, with no PATH assumed) and the one-chip config
_LAUNCHERS = {"accelerate launch": ("-m", "accelerate.commands.launch", "--config_file", _ONE_CHIP, "-m")}


def group_rows(spec: dict, group: str) -> list:
    """[(index, row, mode, seconds its process may take or None)] of what `group` runs, the indices `--train-rows`
    chose: `train_libraries`' own rows, each its library's way within its time limit; for the other groups each
    shared row in each of the group's ways, within the group's limit alone."""
    if group == "train_libraries":
        runs = [(index, entry["row"], entry["mode"], entry["seconds"])
                for index, entry in enumerate(spec["train"].get("libraries", ()))]
    else:
        runs = [(index, row, mode, None) for index, row in enumerate(spec["train"]["rows"]) for mode in MODES[group]]
    chosen = spec["train"].get("chosen")
    return [run for run in runs if chosen is None or run[0] in chosen]


def run_row(spec: dict, rows, group: str, index: int, mode: str) -> None:
    """Row `index` of the group's rows, run `mode`'s way."""
    if mode != "torchax":
        import hf_tpu  # noqa: F401  (before JAX starts: it sets JAX's flags; the torchax process must not import it)
    import torch

    (row,) = [row for i, row, m, _ in group_rows(spec, group) if (i, m) == (index, mode)]
    if rows.check_memory and not _fits(rows, row, spec["train"]["models"][row["model"]]):
        return
    try:
        if mode == "torchax":
            _torchax_row(spec, rows, row)
        elif mode in ("Trainer", "Trainer compile"):
            _trainer_row(spec, rows, row, compiled=mode == "Trainer compile")
        else:
            _hf_tpu_row(spec, rows, row, mode)
    except torch.OutOfMemoryError as e:
        rows.out_of_memory(f"{row_name(row)} {mode}", e)


def run_group(spec: dict, rows, group: str) -> None:
    """Each of the group's runs (`group_rows`) in a process of its own (see the module's docstring), which checks
    that its memory fits, stopped with what it started past its time limit. This process starts no JAX backend: on
    a TPU the row's process must hold the chip alone."""
    import importlib.util

    if group == "train_torchax":
        missing = [name for name in ("torchax", "optax") if importlib.util.find_spec(name) is None]
        if missing:
            rows.skip("train_torchax", f"{' and '.join(missing)} not importable here")
            return
    runs = group_rows(spec, group)
    if not runs:
        rows.skip(group, f"no training rows of this group at --size {spec['name']}")
    for index, row, mode, seconds in runs:
        if row["recipe"] == "lora" and importlib.util.find_spec("peft") is None:
            rows.skip(f"{row_name(row)} {mode}", "peft not importable here")
            continue
        command = [sys.executable, *_LAUNCHERS.get(mode, ("-m",)), "benchmarks.chip", "--worker", group,
                   "--size", spec["name"], "--train-row", str(index), "--train-mode", mode]
        if not rows.check_memory:
            command.append("--no-memory-check")
        process = subprocess.Popen(command, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            returncode = process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            _stop_process_tree(process.pid)
            process.wait()
            rows.skip(f"{row_name(row)} {mode}", f"stopped after its time limit of {seconds:.0f} s")
            continue
        if returncode:
            rows.skip(f"{row_name(row)} {mode}", f"its process exited with {returncode} (its error is above)")


def _stop_process_tree(pid: int) -> None:
    """Kills a row's process and every process under it, the deepest first: Accelerate's launcher runs the script as
    its child, which would otherwise keep the chip. They share this process's group (the parent's time limit stops
    the group whole), so the tree is read from the parents in `/proc`."""
    import signal

    children: dict = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])  # "pid (name) state ppid ..."
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    tree, pending = [], [pid]
    while pending:
        tree.append(pending.pop())
        pending += children.get(tree[-1], [])
    for process in reversed(tree):
        try:
            os.kill(process, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fits(rows, row: dict, config: dict) -> bool:
    from benchmarks.chip import _device_bytes

    parts = _row_memory(row, config)
    device = _device_bytes()
    need = sum(parts.values())
    if need <= device:
        return True
    largest = ", ".join(f"{name} {size / 1e9:.1f}" for name, size in sorted(parts.items(), key=lambda p: -p[1])[:3])
    rows.skip(row_name(row), f"needs ~{need / 1e9:.1f} GB ({largest}) of the device's {device / 1e9:.1f} GB "
              "(--no-memory-check to try)")
    return False


def _row_memory(row: dict, config: dict) -> dict:
    return train_memory(config, row["batch"], row["length"], row["recipe"], row["checkpointing"],
                        row.get("accumulation", 1))


# --- Lines and the table


def _mfu(row: dict, spec: dict, peak: float | None) -> str:
    """MFU against the limits group's peak, else the published peak of the row's device (none for a CPU)."""
    from benchmarks.chip import PEAK_BF16

    peak = peak or PEAK_BF16.get(row.get("device"))
    if not peak:
        return "-"
    config = spec["train"]["models"][row["model"]]
    flops = train_flops(config, row["batch"], row["length"], row["recipe"])
    return f"{100 * flops / row['step_seconds'] / peak:.0f}%"


def _size(n: float, unit: int) -> str:
    return f"{n / unit:.2f}"


def _memory_text(row: dict, spec: dict) -> str:
    """The measured peak (a TPU's), else the program's memory by XLA's analysis (a traced step on a CPU), beside
    the arithmetic, in GiB (MiB for a tiny model)."""
    parts = _row_memory(row, spec["train"]["models"][row["model"]])
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


# how each library row's step runs, said in its line
_HOW = {"Trainer": "the Trainer's micro step and optimizer step traced (hf_tpu.jit)",
        "Trainer compile": ("torch_compile=True (backend tpu): the compiled model traced into the Trainer's "
                            "micro step, the optimizer step traced"),
        "accelerate launch": ("started by `accelerate launch --config_file examples/accelerate/one-chip.yaml`; "
                              "Accelerator(), prepare(model, optimizer), the whole step (forward, accelerator.backward, "
                              "optimizer.step, zero_grad) traced by hf_tpu.jit as the user's guide recommends")}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _library_text(row: dict) -> str:
    """What a library row adds to its line: how its step runs, LoRA's checks, and the step of another length in the
    same bucket."""
    parts = []
    if row.get("group") == "train_libraries":
        parts.append(_HOW[row["mode"]])
    launch = row.get("launch")
    if launch:
        parts.append(f"Accelerate's {launch['distributed_type']} on {launch['accelerator_device']}, mixed precision "
                     f"{launch['mixed_precision']}")
    adapters = row.get("adapters")
    if adapters:
        parts.append(f"PEFT LoRA r{LORA_RANK}: only the adapters train ({_count(adapters['trainable'])} parameters "
                     f"in {adapters['trainable_tensors']} tensors), the {_count(adapters['frozen'])} frozen ("
                     f"{adapters['frozen_tensors']} tensors) still bfloat16 on tpu; saved and reloaded onto a fresh base "
                     f"model: the same adapter weights, logits within {adapters['reload_difference']:.3g} (tolerance "
                     f"{adapters['reload_tolerance']:.3g}; the adapters moved them by "
                     f"{adapters['adapters_moved_logits']:.3g}); MFU counts LoRA's FLOPs: 4 a frozen matmul parameter "
                     "a token, 6 an adapter's, attention's forward and backward")
    bucket = row.get("bucket_step")
    if bucket:
        parts.append(f"a last step of {bucket['length']} tokens (the same bucket): {bucket['seconds']:.1f} s, "
                     f"{bucket['programs_traced']} programs traced, {bucket['xla_compiles']} XLA compiles")
    return "".join(f"; {part}" for part in parts)


def describe(row: dict, spec: dict, peak: float | None) -> str:
    config = spec["train"]["models"][row["model"]]
    tokens = row["batch"] * row["length"] / row["step_seconds"]
    split = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in row["first_split"].items() if seconds)
    mfu = _mfu(row, spec, peak)
    return (f"[{row['group']}] {row['side']} {row['mode']} {row_name(row)} ({parameters(config) / 1e9:.2f}B): "
            f"{row['step_seconds'] * 1e3:.1f} ms/step, {tokens:.0f} tokens/s"
            f"{f', MFU {mfu}' if mfu != '-' else ''}"
            + (f" ({row['synced_step_seconds'] * 1e3:.1f} ms each step waited for)" if "synced_step_seconds" in row
               else "") + f"; first step {row['first_step']:.1f} s ({split or 'no compile'}), "
            f"second {row['second_step']:.1f} s; {_memory_text(row, spec)}; losses "
            + " ".join(f"{loss:.4f}" for loss in row["losses"]) + _library_text(row))


def report(results: list, spec: dict, peak: float | None) -> str:
    """The training rows side by side, with each hf-tpu row's speed over torchax's row of the same model, recipe and
    shape."""
    train = [r for r in results if r["section"] == "train"]
    if not train:
        return ""
    key = lambda r: (r["model"], r["recipe"], r["batch"], r["length"], r["checkpointing"], r.get("accumulation", 1))
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
