"""Where a Transformers `Trainer` step's time goes on the chip: the host's time between the Trainer's callbacks
(the micro step and what follows it up to the clipping, the optimizer's step, the schedule and `zero_grad`, the
logging), with the ops dispatched eagerly, the host reads and the XLA compiles of each part, per step; and the
first step's compile by program. The training row of `benchmarks.training._trainer_row` (bfloat16 parameters,
AdamW, clipping at 1.0, a linear schedule, a loss logged every step), as a user runs it.

The parts are host time: dispatch is asynchronous, so a part that reads a value (the Trainer's NaN check of the
loss after the micro step, the logging's loss and gradient norm) also waits there for the programs before it.

Run: python -m benchmarks.trainer_phases [--model 1.1b] [--batch 8] [--length 1024] [--steps 8]
(`--model tiny` on a CPU)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

# the Trainer's callbacks, in the order a step calls them; a part runs from one to the next
_MARKS = ("on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log")
_PARTS = {"on_step_begin": "micro step, loss's NaN check, clipping", "on_pre_optimizer_step": "optimizer step",
          "on_optimizer_step": "learning rate, schedule, zero_grad", "on_step_end": "logging (loss, norm read)",
          "on_log": "next batch"}
_COUNTS = ("ops_dispatched", "host_syncs", "xla_compiles")


def main(argv=None) -> None:
    import hf_tpu  # noqa: F401  (before JAX starts)
    import jax
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from benchmarks import chip, training
    from benchmarks.common import jax_compile_phases

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "0.44b", "1.1b"], default="1.1b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-checkpointing", action="store_true")
    args = parser.parse_args(argv)
    size = "tiny" if args.model == "tiny" else "1b"
    config = chip.SIZES[size]["train"]["models"][args.model]
    model = chip._llama(dict(chip.SIZES[size], model=config))
    steps = 2 + args.steps
    data = [{"input_ids": ids, "labels": ids} for ids in chip._ids(config["vocab_size"], args.batch * steps, args.length)]
    marks = []  # (callback, time, metrics)

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
        arguments = TrainingArguments(folder, per_device_train_batch_size=args.batch, max_steps=steps,
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
    parts = {name: [] for name in _MARKS}
    steady = [i for i, (name, _, _) in enumerate(marks) if name == "on_step_begin"][2:]  # from the third step
    for i in steady:
        for (name, t, m), (_, t_next, m_next) in zip(marks[i:i + len(_MARKS)], marks[i + 1:i + 1 + len(_MARKS)]):
            parts[name].append((t_next - t, {k: m_next[k] - m[k] for k in _COUNTS}))
    step = statistics.median(b[1] - a[1] for a, b in zip([marks[i] for i in steady], [marks[i] for i in steady[1:]]))
    flops = training.train_flops(config, args.batch, args.length)
    peak = chip.PEAK_BF16.get(jax.devices()[0].device_kind)
    print(f"step {step * 1e3:.1f} ms (median from the third step)" + (f", MFU {100 * flops / step / peak:.0f}%"
                                                                      if peak else ""))
    for name in _MARKS:
        if parts[name]:
            ms = statistics.median(seconds for seconds, _ in parts[name]) * 1e3
            counts = parts[name][-1][1]
            print(f"  {_PARTS[name]:<40} {ms:8.1f} ms  " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
