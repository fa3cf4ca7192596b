"""What a training step's program takes on a TPU v5e, found on a machine without one: hf-tpu's traced step
(`hf_tpu.jit`: forward, backward, AdamW) lowered for a v5e of JAX's topology descriptions and compiled by libtpu's
compiler, which runs on the host, with XLA's memory analysis of the result (its arguments, outputs and
temporaries) and the compile's time. XLA:CPU's own analysis is no proxy for this: it removes optimization
barriers before its common-subexpression pass, so a checkpointed layer's recomputation merges with the forward
there, as `jax.checkpoint`'s does.

The trace runs on the CPU platform with every platform-dependent choice of the lowering made as on a TPU
(`as_on_a_tpu`: the Pallas kernels, compiled for Mosaic, not interpreted; bfloat16 products asked for in bfloat16
from 8192 rows, `hf_tpu.ops.products._product_dtype`); nothing runs. A model of fewer layers than its real depth compiles faster:
`--layers 2,4` measures two depths and extrapolates each figure to the real one (every figure is a constant plus
one term per layer).

Needs libtpu importable (`pip install --target DIR libtpu`, then `PYTHONPATH=DIR`); run with `JAX_PLATFORMS=cpu`.

Run: JAX_PLATFORMS=cpu PYTHONPATH=DIR python -m benchmarks.train_memory --model 1.1b --layers 2,4
(`--composite-loss` for PyTorch's cross-entropy in place of hf-tpu's; `--loss-only` for the loss alone, which
`--topology cpu` compiles for the host's CPU without libtpu)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time



def _topology_device(name: str):
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name=name, chips_per_host_bounds=(1, 1, 1),
                                            num_slices=1)
    return topology.devices[0]


@contextlib.contextmanager
def as_on_a_tpu():
    """The lowering's platform-dependent choices made as on a TPU while the step is traced on the CPU platform:
    the platform's name is what every such choice reads (`hf_tpu.platform.name`)."""
    from hf_tpu import platform

    name = platform.name
    platform.name = lambda: "tpu"
    try:
        yield
    finally:
        platform.name = name


def measure(config: dict, layers: int, batch: int, length: int, recipe: str, checkpointing: bool, device,
            dump: str | None = None) -> dict:
    """XLA's memory analysis (bytes), its cost analysis's bytes accessed and the compile's seconds of the first
    traced step of a `layers`-deep model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.training import training_step
    from hf_tpu import direct

    torch.manual_seed(0)
    llama = LlamaConfig(**dict(config, num_hidden_layers=layers), attn_implementation="sdpa")
    model = LlamaForCausalLM._from_config(llama, dtype=torch.bfloat16 if recipe == "bf16" else torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    step = training_step(model, opt, autocast=recipe == "mixed")

    ids = torch.randint(0, config["vocab_size"], (batch, length)).to("tpu")
    start = time.perf_counter()
    with as_on_a_tpu():
        lowered = direct.lower(step, (ids,), {}, device=device)
    traced = time.perf_counter() - start
    start = time.perf_counter()
    executable = lowered.compile()
    compiled = time.perf_counter() - start
    analysis = executable.memory_analysis()
    if dump:
        with open(os.path.join(dump, f"step_{layers}_layers.hlo.txt"), "w") as f:
            f.write(executable.as_text())
    figures = {name: getattr(analysis, f"{name}_size_in_bytes") for name in ("argument", "output", "alias", "temp")}
    figures["total"] = figures["argument"] + figures["output"] - figures["alias"] + figures["temp"]
    # what XLA's cost model reads and writes in the program (each loop's body counted once per iteration)
    figures["bytes_accessed"] = executable.cost_analysis()["bytes accessed"]
    return dict(figures, trace_seconds=traced, compile_seconds=compiled)


def measure_loss(config: dict, batch: int, length: int, device) -> dict:
    """XLA's memory analysis (bytes) of the loss alone in a traced step: the head's product of bfloat16 hidden states
    and the causal LM loss as Transformers computes it (the logits cast to float32, then `cross_entropy`), with its
    backward; `device` None compiles it for the host's CPU."""
    import torch
    import torch.nn.functional as F

    from hf_tpu import direct

    torch.manual_seed(0)
    tokens, vocab = batch * length, config["vocab_size"]
    head = (torch.randn(vocab, config["hidden_size"], dtype=torch.bfloat16) * 0.02).to("tpu").requires_grad_()
    hidden = torch.randn(tokens, config["hidden_size"], dtype=torch.bfloat16).to("tpu")
    labels = torch.randint(0, vocab, (tokens,)).to("tpu")

    def step(hidden, labels):
        loss = F.cross_entropy((hidden @ head.T).float(), labels)
        loss.backward()
        return loss.detach()

    with as_on_a_tpu() if device is not None else contextlib.nullcontext():
        executable = direct.lower(step, (hidden, labels), {}, device=device).compile()
    analysis = executable.memory_analysis()
    return {name: getattr(analysis, f"{name}_size_in_bytes") for name in ("argument", "output", "alias", "temp")}


def main(argv=None) -> None:
    from benchmarks import chip, training

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["0.44b", "1.1b"], default="1.1b")
    parser.add_argument("--layers", default="2,4", help="depths to compile (two: extrapolated to the model's own)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--recipe", choices=training.RECIPES, default="bf16")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--dump", help="write each compiled program's optimized HLO into this folder")
    parser.add_argument("--without-saved-barrier", action="store_true",
                        help="the values the forward saves for the backward not passed through an optimization "
                             "barrier (hf_tpu.remat.saved_values_materialized), to see what the barrier saves")
    parser.add_argument("--composite-loss", action="store_true",
                        help="cross_entropy as PyTorch's composite (log_softmax, nll_loss) instead of hf-tpu's op "
                             "(hf_tpu.ops.cross_entropy), to see what the op saves")
    parser.add_argument("--loss-only", action="store_true",
                        help="compile the head's product and the loss alone (--topology cpu: for the host's CPU)")
    args = parser.parse_args(argv)
    if args.composite_loss:
        from hf_tpu.ops import cross_entropy

        cross_entropy._fused_applies = lambda *args: False
    if args.without_saved_barrier:
        from hf_tpu import remat

        remat.saved_values_materialized = lambda input_buffers: contextlib.nullcontext()
    config = chip.SIZES["1b"]["train"]["models"][args.model]
    device = None if args.topology == "cpu" else _topology_device(args.topology)
    if args.loss_only:
        figures = measure_loss(config, args.batch, args.length, device)
        print(f"the loss of {args.model} alone ({'composite' if args.composite_loss else 'hf-tpu'}), "
              f"{args.batch}x{args.length} on {args.topology}: "
              + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in figures.items()), flush=True)
        return
    depths = [int(n) for n in args.layers.split(",")]
    checkpointing = not args.no_checkpointing
    rows = {}
    for layers in depths:
        rows[layers] = measure(config, layers, args.batch, args.length, args.recipe, checkpointing, device, args.dump)
        print(f"{args.model} with {layers} layers, {args.recipe} {args.batch}x{args.length}"
              f"{' checkpointed' if checkpointing else ''}: " + ", ".join(
                  f"{k} {v / 2**30:.3f} GiB" if not k.endswith("seconds") else f"{k} {v:.1f}" for k, v in rows[layers].items()),
              flush=True)
    if len(depths) == 2:
        (a, fa), (b, fb) = sorted(rows.items())
        real = config["num_hidden_layers"]
        extrapolated = {k: fa[k] + (fb[k] - fa[k]) * (real - a) / (b - a) for k in fa}
        parts = training.train_memory(config, args.batch, args.length, args.recipe, checkpointing)
        estimate = sum(parts.values())
        print(f"{args.model} ({real} layers), extrapolated: program {extrapolated['total'] / 2**30:.2f} GiB "
              f"(temporaries {extrapolated['temp'] / 2**30:.2f}, arguments {extrapolated['argument'] / 2**30:.2f}), "
              f"{extrapolated['total'] / estimate:.2f}x the arithmetic {estimate / 2**30:.2f} GiB ("
              + " + ".join(f"{k} {v / 2**30:.2f}" for k, v in parts.items()) + f"); compile {extrapolated['compile_seconds']:.0f} s here")
        rows["extrapolated"] = extrapolated
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
