"""Fine-tune a tiny Llama on a small text file with Accelerate on `tpu`, with the Transformers `Trainer`
and with a plain Accelerate loop; a progress bar while it trains, then the losses in
OUTPUT_DIR/losses.json and their plot in OUTPUT_DIR/loss.png (`--output-dir`; by default a folder in the
system's temporary directory, the same for every process of a run, so nothing lands in the folder it runs from).

    accelerate launch examples/train_causal_lm.py                       # both, one chip
    accelerate launch --config_file examples/accelerate/all-chips.yaml examples/train_causal_lm.py --batch-size 8
    python examples/train_causal_lm.py --device cpu --mode loop        # the same run on the CPU

The model is built from a config (nothing is downloaded) and reads bytes (a 256-token vocabulary), so any
UTF-8 text file works. The same seed gives the same losses on tpu and on the CPU
(tests/test_example_train_causal_lm.py compares them).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from tqdm.auto import tqdm

import hf_tpu  # noqa: F401  (registers the tpu device and the Accelerate adapter)

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["trainer", "loop", "both"], default="both")
    parser.add_argument("--device", choices=["tpu", "cpu"], default="tpu")
    parser.add_argument("--text", type=Path, default=HERE / "data" / "alice.txt")
    parser.add_argument("--output-dir", type=Path, default=Path(tempfile.gettempdir()) / "hf_tpu_train_causal_lm",
                        help="where the losses, their plot and the Trainer's files go (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per process and step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def sequences(path: Path, seq_len: int) -> list[dict]:
    """The file's bytes cut into sequences of `seq_len` tokens (its last partial one dropped)."""
    data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
    blocks = data[: len(data) // seq_len * seq_len].view(-1, seq_len)
    return [{"input_ids": ids, "labels": ids} for ids in blocks]


def train_with_loop(args) -> list[float]:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=args.device == "cpu")
    set_seed(args.seed)
    model = tiny_llama(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = torch.utils.data.DataLoader(sequences(args.text, args.seq_len), batch_size=args.batch_size,
                                         shuffle=False, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    bar = tqdm(total=args.steps, desc=f"Accelerate loop on {accelerator.device}",
               disable=not accelerator.is_local_main_process)
    model.train()
    while len(losses) < args.steps:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if len(losses) == args.steps:
                break
    bar.close()
    accelerator.end_training()
    return losses


def train_with_trainer(args) -> list[float]:
    from transformers import Trainer, TrainingArguments

    training_args = TrainingArguments(
        output_dir=str(args.output_dir / "trainer"), per_device_train_batch_size=args.batch_size,
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.01, max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no",
        dataloader_drop_last=True, use_cpu=args.device == "cpu", seed=args.seed)
    trainer = Trainer(model=tiny_llama(args.seed), args=training_args,
                      train_dataset=sequences(args.text, args.seq_len))
    trainer.train()  # the Trainer draws its own progress bar
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def plot(losses: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    for name, values in losses.items():
        axes.plot(range(1, len(values) + 1), values, label=name)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def reset_accelerate() -> None:
    """The Trainer and the loop each make an Accelerator; Accelerate keeps one state per process."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    losses = {}
    if args.mode in ("trainer", "both"):
        losses["Trainer"] = train_with_trainer(args)
        reset_accelerate()
    if args.mode in ("loop", "both"):
        losses["Accelerate loop"] = train_with_loop(args)
        reset_accelerate()
    from accelerate import PartialState

    if PartialState().is_main_process:
        (args.output_dir / "losses.json").write_text(json.dumps(losses, indent=1))
        plot(losses, args.output_dir / "loss.png")
        for name, values in losses.items():
            print(f"{name}: loss {values[0]:.4f} -> {values[-1]:.4f} in {len(values)} steps on {args.device}")
        print(f"losses and plot in {args.output_dir}")
    return losses


if __name__ == "__main__":
    main()
