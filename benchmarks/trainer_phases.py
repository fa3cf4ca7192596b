"""Where a Transformers `Trainer` step's time goes on the chip: the host's time between the Trainer's callbacks
(each micro step with what follows it, the last one's up to the clipping, the optimizer's step, the schedule and
`zero_grad`, the logging), with what each part launched per optimizer step: the traced programs
(`hf_tpu.metrics()["programs_launched"]`) and the bytes of their arguments, the ops dispatched eagerly, the host reads and the XLA compiles; and the
first step's compile by program. The training row of `benchmarks.training._trainer_row` (AdamW, clipping at 1.0, a
linear schedule, a loss logged every step), as a user runs it: `--mixed` is `bf16=True` (float32 master weights,
bfloat16 autocast), `--accumulation N` is `gradient_accumulation_steps=N` (micro-batches of `batch / N` rows).

The parts are host time: dispatch is asynchronous, so a part that reads a value (the learning rate the Trainer reads
after the optimizer's step, the logging's loss and gradient norm, and the Trainer's check of each micro-batch's loss
for NaN where it runs on the host) also waits there for the programs before it.
Bytes are each traced program's arguments (the parameters, gradients, moments and batch it is given: what it reads,
but for an input it does not use); an eager op's are not counted.

`--jit` runs the same model, recipe and tokens as one traced step instead (`hf_tpu.jit` of
`benchmarks.training.training_step`: the `train` group's row, the whole batch at once), with the same counts per step.

Run: python -m benchmarks.trainer_phases [--model 1.1b] [--batch 8] [--length 1024] [--steps 8]
     python -m benchmarks.trainer_phases --model 0.44b --mixed --accumulation 4   (the train_libraries Trainer row)
     python -m benchmarks.trainer_phases --model 0.44b --mixed --jit              (the train group's row beside it)
(`--model tiny --length 32` on a CPU; `--layers 24` gives the tiny model the 0.44B's tensors)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

# the Trainer's callbacks, in the order a step calls them; a part runs from one to the next (`on_substep_end`
# after each micro step but the last)
_MARKS = ("on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log")
_PARTS = {"on_step_begin": "first micro step", "on_substep_end": "next micro step",
          "on_pre_optimizer_step": "optimizer step", "on_optimizer_step": "learning rate, schedule, zero_grad",
          "on_step_end": "logging (loss, norm read)", "on_log": "next batches"}
_LAST_MICRO = "last micro step, clipping"
_COUNTS = ("programs_launched", "argument_bytes", "ops_dispatched", "host_syncs", "xla_compiles")


def main(argv=None) -> None:
    import hf_tpu  # noqa: F401  (before JAX starts)
    import jax
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from benchmarks import chip, training
    from benchmarks.common import jax_compile_phases

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "0.44b", "1.1b"], default="1.1b")
    parser.add_argument("--batch", type=int, default=8, help="rows of an optimizer step")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches an optimizer step accumulates")
    parser.add_argument("--mixed", action="store_true", help="bf16=True: float32 master weights, bfloat16 autocast")
    parser.add_argument("--layers", type=int, help="the model's layers (the host's work per step follows them)")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--jit", action="store_true", help="one traced step of the whole batch, not the Trainer")
    args = parser.parse_args(argv)
    size = "tiny" if args.model == "tiny" else "1b"
    config = chip.SIZES[size]["train"]["models"][args.model]
    if args.layers:
        config = dict(config, num_hidden_layers=args.layers)
    model = chip._llama(dict(chip.SIZES[size], model=config))
    if args.mixed:
        model = model.float()
    flops = training.train_flops(config, args.batch, args.length, "mixed" if args.mixed else "bf16")
    peak = chip.PEAK_BF16.get(jax.devices()[0].device_kind)
    if args.jit:
        return _jit_steps(model, config, args, flops, peak)
    steps = 2 + args.steps
    rows = chip._ids(config["vocab_size"], args.batch * steps, args.length)
    data = [{"input_ids": ids, "labels": ids} for ids in rows]
    marks = []  # (callback, time, counts)

    class Marks(TrainerCallback):
        pass

    for name in _MARKS:
        def mark(self, *a, _name=name, logs=None, **kw):
            if _name != "on_log" or (logs and "loss" in logs):
                marks.append((_name, time.perf_counter(), hf_tpu.metrics()))
        setattr(Marks, name, mark)

    phases = jax_compile_phases()
    before = {name: dict(p) for name, p in phases.items()}
    with tempfile.TemporaryDirectory() as folder:
        arguments = TrainingArguments(folder, per_device_train_batch_size=args.batch // args.accumulation,
                                      gradient_accumulation_steps=args.accumulation, max_steps=steps, bf16=args.mixed,
                                      learning_rate=training.LEARNING_RATE, weight_decay=training.WEIGHT_DECAY,
                                      gradient_checkpointing=not args.no_checkpointing, logging_steps=1, report_to=[],
                                      save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False)
        started = time.perf_counter()
        Trainer(model=model, args=arguments, train_dataset=data, callbacks=[Marks()]).train()
    first_log = next(t for name, t, _ in marks if name == "on_log")
    print(f"first step {first_log - started:.1f} s; compile by program (s):")
    for name, p in phases.items():
        spent = {k: v - before.get(name, {}).get(k, 0.0) for k, v in p.items()}
        if sum(spent.values()) > 0.5:
            print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in spent.items() if v > 0.05))
    begins = [i for i, (name, _, _) in enumerate(marks) if name == "on_step_begin"]
    steady = begins[2:]  # from the third step
    parts: dict = {}
    for begin, end in zip(steady, steady[1:]):
        step_marks = marks[begin:end + 1]
        for k, ((name, t, m), (next_name, t_next, m_next)) in enumerate(zip(step_marks, step_marks[1:])):
            part = _LAST_MICRO if next_name == "on_pre_optimizer_step" and name != "on_log" else _PARTS[name]
            parts.setdefault(part, []).append((k, t_next - t, {c: m_next[c] - m[c] for c in _COUNTS}))
    totals = [{c: marks[end][2][c] - marks[begin][2][c] for c in _COUNTS} for begin, end in zip(steady, steady[1:])]
    step = statistics.median(marks[end][1] - marks[begin][1] for begin, end in zip(steady, steady[1:]))
    _print_step(step, flops, peak, totals[-1])
    for part, samples in parts.items():
        times = len(samples) // len(totals)
        ms = statistics.median(seconds for _, seconds, _ in samples) * 1e3
        counts = {c: sum(m[c] for _, _, m in samples[-times:]) // times for c in _COUNTS}
        print(f"  {part:<40} {ms:8.1f} ms" + (f" (x{times})" if times > 1 else "     ") + "  " + _counts_text(counts))


def _jit_steps(model, config: dict, args, flops: float, peak) -> None:
    """`--jit`: the row as one traced step a batch (forward, backward, AdamW), each step waited for by reading its
    loss, as the `train` group times it; its counts per step."""
    import torch

    import hf_tpu
    from benchmarks import chip, training

    if not args.no_checkpointing:
        model.gradient_checkpointing_enable()
    model.train().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=training.LEARNING_RATE, weight_decay=training.WEIGHT_DECAY,
                            foreach=True)
    step = hf_tpu.jit(training.training_step(model, opt, autocast=args.mixed))
    ids = chip._ids(config["vocab_size"], args.batch, args.length).to("tpu")
    times, counts = [], None
    for _ in range(2 + args.steps):
        before, started = hf_tpu.metrics(), time.perf_counter()
        step(ids).item()
        times.append(time.perf_counter() - started)
        counts = {c: hf_tpu.metrics()[c] - before[c] for c in _COUNTS}
    print(f"first step {times[0]:.1f} s")
    _print_step(statistics.median(times[2:]), flops, peak, counts)


def _print_step(seconds: float, flops: float, peak, counts: dict) -> None:
    print(f"step {seconds * 1e3:.1f} ms (median from the third step)"
          + (f", MFU {100 * flops / seconds / peak:.0f}%" if peak else ""))
    print("  per optimizer step: " + _counts_text(counts))


def _counts_text(counts: dict) -> str:
    return ", ".join(f"{c} {counts[c] / 2**30:.3f} GiB" if c == "argument_bytes" else f"{c} {counts[c]}"
                     for c in _COUNTS)


if __name__ == "__main__":
    main()
