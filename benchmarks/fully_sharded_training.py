"""A causal LM trained over several chips with its parameters, gradients and AdamW state split over them
(`hf_tpu.distributed.fully_shard`, FSDP), against the same steps on PyTorch's CPU: the losses side by side, the
time a step takes, and each chip's share of the training state against the arithmetic (parameters, gradients and
AdamW's two moments, 8 bytes a parameter in bfloat16, 16 in the mixed recipe, split N ways).

The tpu side is the user's step as written (forward, backward, AdamW; every layer checkpointed), traced whole by
`hf_tpu.jit`, its batch split over the chips (`shard(ids, mesh, ("dp", None))`); the model is built on the CPU and
each chip receives only its part, so the whole model is never on one chip. Without a TPU the chips are the CPU's
simulated ones, which share the host's memory and cores: the times show that it runs, not how fast a pod does.
The CPU's run goes first, in a process of its own, so the host holds one copy of the training state at a time (the
1.1B in bfloat16: 8.8 GB).

Run: HF_TPU_PLATFORM=cpu HF_TPU_NUM_DEVICES=8 python -m benchmarks.fully_sharded_training --model 1.1b
     [--batch 8] [--length 128] [--steps 3] [--recipe bf16|mixed]
(the 1.1B: about 15 minutes on 2 CPU cores, 12 GB of host memory at the peak)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

MODELS = {"tiny": "TINY", "0.44b": "LLAMA_044B", "1.1b": None}
# bfloat16 losses of the two sides: the CPU's kernels and XLA's accumulate the products in their own orders
LOSS_TOLERANCE = 2e-2


def _config(name: str) -> dict:
    from benchmarks import chip, training

    return chip._LLAMA_1B if name == "1.1b" else getattr(training, MODELS[name])


def _model(config: dict, recipe: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaConfig(**config, attn_implementation="sdpa")
    model = LlamaForCausalLM._from_config(llama, dtype=torch.bfloat16 if recipe == "bf16" else torch.float32)
    model.gradient_checkpointing_enable()
    return model.train()


def _train(model, batches: list, recipe: str, jit: bool) -> dict:
    """The losses and seconds of each step (the first includes the trace and compile where `jit`), each printed
    as it ends."""
    import torch

    import hf_tpu
    from benchmarks.training import LEARNING_RATE, WEIGHT_DECAY, training_step

    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, foreach=True)
    step = training_step(model, opt, autocast=recipe == "mixed")
    if not jit:  # the CPU's autocast: the tpu one in `training_step` leaves CPU tensors alone
        step = torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe == "mixed")(step)
    step = hf_tpu.jit(step) if jit else step
    losses, seconds = [], []
    for ids in batches:
        start = time.perf_counter()
        losses.append(step(ids).float().item())
        seconds.append(time.perf_counter() - start)
        print(f"{'tpu' if jit else 'CPU'} step {len(losses) - 1}: loss {losses[-1]:.4f} in {seconds[-1]:.1f} s",
              flush=True)
    return {"losses": losses, "seconds": seconds, "optimizer": opt}


def _batches(config: dict, batch: int, length: int, steps: int) -> list:
    import torch

    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, config["vocab_size"], (batch, length), generator=generator) for _ in range(steps)]


def _cpu_side(model_name: str, batch: int, length: int, steps: int, recipe: str) -> dict:
    """The CPU's losses and step times, from a process of its own (`--cpu-side`), whose memory the host has back
    before the tpu's run starts."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "cpu.json")
        subprocess.run([sys.executable, "-m", "benchmarks.fully_sharded_training", "--model", model_name, "--batch",
                        str(batch), "--length", str(length), "--steps", str(steps), "--recipe", recipe,
                        "--cpu-side", path], check=True)
        with open(path) as f:
            return json.load(f)


def run(model_name: str, batch: int, length: int, steps: int, recipe: str) -> dict:
    import torch

    import hf_tpu
    import hf_tpu.distributed as dist
    from benchmarks.training import parameters

    config = _config(model_name)
    chips = torch.tpu.device_count()
    if batch % chips:
        raise SystemExit(f"--batch {batch} does not split over {chips} chips")
    batches = _batches(config, batch, length, steps)

    cpu = _cpu_side(model_name, batch, length, steps, recipe)

    mesh = dist.mesh(chips, "dp")
    model = dist.fully_shard(_model(config, recipe), mesh)
    hf_tpu.reset_metrics()
    tpu = _train(model.to("tpu"), [dist.shard(ids, mesh, ("dp", None)) for ids in batches], recipe, jit=True)
    opt = tpu.pop("optimizer")
    # parameters, their gradients (made in the step, the size of their parameters) and AdamW's moments
    state_bytes = sum(2 * p.nbytes + sum(t.nbytes for t in opt.state[p].values()) for p in model.parameters())
    metrics = hf_tpu.metrics()
    count = parameters(config)
    return {
        "model": model_name, "parameters": count, "recipe": recipe, "batch": batch, "length": length, "chips": chips,
        "cpu_losses": cpu["losses"], "tpu_losses": tpu["losses"],
        "cpu_step_seconds": cpu["seconds"], "tpu_step_seconds": tpu["seconds"],
        "state_bytes_arithmetic": count * (8 if recipe == "bf16" else 16),
        "state_bytes_held": state_bytes,
        "chip_peak_bytes": [torch.tpu.max_memory_allocated(i) for i in range(chips)],
        "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "programs_traced": metrics["compiles_by_mode"].get("COMPILE", 0), "cpu_fallbacks": metrics["cpu_fallbacks"],
    }


def report(result: dict) -> str:
    gib = 2 ** 30
    chips = result["chips"]
    lines = [f"{result['model']} ({result['parameters'] / 1e9:.2f}B parameters, {result['recipe']}) at "
             f"{result['batch']}x{result['length']} tokens a step, fully sharded over {chips} chips, against the CPU",
             "step | CPU loss | tpu loss | difference | CPU seconds | tpu seconds"]
    for k, (a, b) in enumerate(zip(result["cpu_losses"], result["tpu_losses"])):
        lines.append(f"{k} | {a:.4f} | {b:.4f} | {abs(a - b):.4f} | {result['cpu_step_seconds'][k]:.1f} | "
                     f"{result['tpu_step_seconds'][k]:.1f}")
    share = result["state_bytes_arithmetic"] / chips
    peak = max(result["chip_peak_bytes"])
    lines += [f"training state: {result['state_bytes_arithmetic'] / gib:.2f} GiB by the arithmetic, "
              f"{share / gib:.2f} GiB a chip split {chips} ways (replicated: "
              f"{result['state_bytes_arithmetic'] / gib:.2f} GiB on every chip); held: "
              f"{result['state_bytes_held'] / gib:.2f} GiB in all",
              f"each chip's peak of tensors: {peak / gib:.2f} GiB at most ({peak / share:.2f}x its share), the "
              f"host's peak {result['host_peak_bytes'] / gib:.1f} GiB",
              f"programs traced: {result['programs_traced']}, CPU fallbacks: {result['cpu_fallbacks'] or 'none'}"]
    worst = max(abs(a - b) for a, b in zip(result["cpu_losses"], result["tpu_losses"]))
    verdict = "match" if worst <= LOSS_TOLERANCE else "DIFFER"
    lines.append(f"losses {verdict}: largest difference {worst:.4f} (tolerance {LOSS_TOLERANCE} for bfloat16)")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="1.1b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--recipe", choices=("bf16", "mixed"), default="bf16")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--cpu-side", help=argparse.SUPPRESS)  # the CPU's steps alone, their figures to this file
    args = parser.parse_args()
    if args.cpu_side:
        config = _config(args.model)
        cpu = _train(_model(config, args.recipe), _batches(config, args.batch, args.length, args.steps), args.recipe,
                     jit=False)
        with open(args.cpu_side, "w") as f:
            json.dump({"losses": cpu["losses"], "seconds": cpu["seconds"]}, f)
        return
    result = run(args.model, args.batch, args.length, args.steps, args.recipe)
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    worst = max(abs(a - b) for a, b in zip(result["cpu_losses"], result["tpu_losses"]))
    raise SystemExit(0 if worst <= LOSS_TOLERANCE else 1)


if __name__ == "__main__":
    main()
