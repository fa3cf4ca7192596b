"""XLA's compile of the same program built by hf-tpu and by torchax, for a TPU v5e, on a machine without one.

The program is the Llama's training step (forward, backward, AdamW: `hf_tpu.jit` of `benchmarks.training`'s step
against torchax's functional call under `jax.value_and_grad` with optax's `adamw`, as the `train` and
`train_torchax` groups of `benchmarks.chip` run them) or its forward (the logits of every position, as
`torch.compile(model, backend="tpu")`'s direct trace and `torchax.interop.JittableModule` run it). Each side is
lowered for a device of JAX's topology descriptions and compiled by libtpu's compiler on the host
(`benchmarks.train_memory`), with few layers: each depth of `--layers` in a process of its own (torchax's must not
import hf_tpu, which sets JAX's flags), and the seconds extrapolated to the model's depth (a compile is a
constant plus a term per layer), in wall seconds and in the process's CPU seconds (steadier on a shared host),
beside the compiler's stages as libtpu logs them, the persistent-cache entry JAX would write, and XLA's cost
analysis of the compiled program (its FLOPs and bytes: what a change does to the step's run time). The host's
compile does not track the chip's per layer (`docs/design/compile-latency.md`): quote it as this host's.

Needs libtpu (`pip install --target DIR libtpu`) and, for the torchax side, torchax and optax importable:
    JAX_PLATFORMS=cpu PYTHONPATH=LIBTPU_DIR:TORCHAX_DIR python -m benchmarks.compile_aot --program train --layers 2,4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SIDES = ("hf-tpu", "torchax")


def _config(model: str, layers: int) -> dict:
    from benchmarks import chip

    return dict(chip.SIZES["1b"]["train"]["models"][model], num_hidden_layers=layers)


def _model(config: dict, training: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**config, attn_implementation="sdpa"), dtype=torch.bfloat16)
    return model.train(training)


def _hf_tpu_lowered(program: str, config: dict, batch: int, length: int, device, recipe: str = "bf16"):
    import torch

    from benchmarks.train_memory import as_on_a_tpu
    from benchmarks.training import LEARNING_RATE, WEIGHT_DECAY, training_step
    from hf_tpu import direct

    model = _model(config, program == "train")
    if recipe == "mixed":  # the Trainer's bf16=True: float32 weights, bfloat16 products under autocast
        model = model.float()
    if program == "train":
        model.gradient_checkpointing_enable()
    model.to("tpu")
    ids = torch.randint(0, config["vocab_size"], (batch, length)).to("tpu")
    if program == "train":
        opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, foreach=True)
        fn = training_step(model, opt, autocast=recipe == "mixed")
    else:
        def fn(ids):
            with torch.no_grad():
                return model(ids, use_cache=False, return_dict=False)[0]
    with as_on_a_tpu():
        return direct.lower(fn, (ids,), {}, device=device)


def _torchax_lowered(program: str, config: dict, batch: int, length: int, device):
    import jax
    import optax
    import torch
    import torchax
    import torchax.interop as interop

    from benchmarks.training import LEARNING_RATE, WEIGHT_DECAY

    model = _model(config, program == "train")
    env = torchax.default_env()
    with env:
        model.to("jax")
        if program == "train":  # each decoder layer recomputed in the backward, as the train_torchax group does
            for layer in model.model.layers:
                layer.forward = interop.gradient_checkpoint(layer.forward)
        params, buffers = interop.extract_all_buffers(model)
        params, buffers = interop.jax_view(params), interop.jax_view(buffers)
        ids = interop.jax_view(torch.randint(0, config["vocab_size"], (batch, length)).to("jax"))

    def loss_of(params, buffers, ids):
        with env:
            out = torch.func.functional_call(model, interop.torch_view({**params, **buffers}),
                                             (interop.torch_view(ids),), {"labels": interop.torch_view(ids),
                                                                          "use_cache": False})
            return interop.jax_view(out.loss)

    def logits_of(params, buffers, ids):
        with env:
            out = torch.func.functional_call(model, interop.torch_view({**params, **buffers}),
                                             (interop.torch_view(ids),), {"use_cache": False, "return_dict": False})
            return interop.jax_view(out[0])

    sharding = jax.sharding.SingleDeviceSharding(device)
    abstract = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
    if program == "forward":
        return jax.jit(logits_of).lower(abstract(params), abstract(buffers), abstract(ids))
    tx = optax.adamw(LEARNING_RATE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY)

    def train_step(params, buffers, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_of)(params, buffers, ids)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = jax.eval_shape(tx.init, params)
    return jax.jit(train_step, donate_argnums=(0, 2)).lower(abstract(params), abstract(buffers), abstract(opt_state),
                                                            abstract(ids))


def _cache_entry(executable) -> bytes:
    """The entry JAX's persistent compilation cache writes for the executable (serialized, compressed), which JAX
    makes inside the compile its monitoring times as XLA's ("backend_compile_duration") when the cache is on, as
    `import hf_tpu` turns it on (`HF_TPU_CACHE_DIR`) and torchax does not."""
    from jax._src import compilation_cache

    serialized = executable.runtime_executable().serialize()
    return compilation_cache.compress_executable(compilation_cache.combine_executable_and_time(serialized, 0))


# what libtpu's compiler logs of a program's size: the compile on the chip tracks it (the host's seconds do not)
_SIZE_LINES = {"instructions": r"Initial HLO module: .* instructions: ([\d,]+)",
               "inlined instructions": r"HLO optimizing module: .* instructions: ([\d,]+)",
               "bundles": r"final program bundle count: ([\d,]+)"}


def _compiler_log(pid: int) -> tuple[dict, dict]:
    """Seconds of the TPU compiler's stages in process `pid` (HLO passes, backend passes, code generation, end to
    end) and the program's size (HLO instructions as the compiler receives them and once calls are inlined, the
    final program's bundles), as libtpu logs them in its log folder (`/tmp/tpu_logs`, a file a process, complete
    once it exited), summed over its compiles."""
    import glob

    stages, size = {}, {}
    for path in glob.glob(f"/tmp/tpu_logs/*.INFO.*.{pid}"):
        with open(path, errors="replace") as f:
            stages_here, size_here = _parse_compiler_log(f)
        for stage, seconds in stages_here.items():
            stages[stage] = stages.get(stage, 0.0) + seconds
        for figure, count in size_here.items():
            size[figure] = size.get(figure, 0) + count
    return stages, size


def _parse_compiler_log(lines) -> tuple[dict, dict]:
    import re

    stages, size = {}, {}
    for line in lines:
        found = re.search(r"\] (\w+) stage duration: (?:(\d+)m)?([\d.]+)(ms|s)$", line.strip())
        if found:
            stage, minutes, value, unit = found.groups()
            seconds = 60 * int(minutes or 0) + float(value) / (1000 if unit == "ms" else 1)
            stages[stage] = stages.get(stage, 0.0) + seconds
        for figure, pattern in _SIZE_LINES.items():
            if found := re.search(pattern, line):
                size[figure] = size.get(figure, 0) + int(found.group(1).replace(",", ""))
    return stages, size


def worker(side: str, program: str, model: str, layers: int, batch: int, length: int, topology: str,
           dump: str | None, recipe: str) -> dict:
    """One side's program at one depth: lowered, then compiled for the topology's device; the seconds of each."""
    if side == "hf-tpu":
        import hf_tpu  # noqa: F401  (before JAX starts: it sets JAX's flags)
    from benchmarks.train_memory import _topology_device

    device = _topology_device(topology)
    config = _config(model, layers)
    start = time.perf_counter()
    if side == "hf-tpu":
        lowered = _hf_tpu_lowered(program, config, batch, length, device, recipe)
    else:
        lowered = _torchax_lowered(program, config, batch, length, device)
    lowering = time.perf_counter() - start
    start, cpu = time.perf_counter(), time.process_time()
    executable = lowered.compile()
    compiling, compiling_cpu = time.perf_counter() - start, time.process_time() - cpu
    if dump:
        stem = os.path.join(dump, f"{side}_{program}{'' if recipe == 'bf16' else '_' + recipe}_{layers}")
        with open(stem + ".stablehlo.txt", "w") as f:
            f.write(lowered.as_text())
        with open(stem + ".optimized.txt", "w") as f:
            f.write(executable.as_text())
    start = time.perf_counter()
    entry = _cache_entry(executable)
    cache_write = time.perf_counter() - start
    cost = (executable.cost_analysis() or {})
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    return dict(side=side, layers=layers, lowering_seconds=lowering, compile_seconds=compiling,
                compile_cpu_seconds=compiling_cpu,
                cache_entry_seconds=cache_write, cache_entry_bytes=len(entry),
                flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--program", choices=("train", "forward"), default="train")
    parser.add_argument("--model", choices=("0.44b", "1.1b"), default="1.1b")
    parser.add_argument("--layers", default="2,4", help="depths to compile (two: extrapolated to the model's own)")
    parser.add_argument("--batch", type=int, help="default: 8 for train, 1 for forward")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--dump", help="write each program's StableHLO and optimized HLO into this folder")
    parser.add_argument("--recipe", choices=("bf16", "mixed"), default="bf16",
                        help="the training step's: bfloat16 weights, or float32 ones under bfloat16 autocast "
                             "(hf-tpu's side)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batch = args.batch or (8 if args.program == "train" else 1)
    if args.worker:
        side, layers = args.worker.split(":")
        print("RESULT " + json.dumps(worker(side, args.program, args.model, int(layers), batch, args.length,
                                            args.topology, args.dump, args.recipe)), flush=True)
        return
    depths = [int(n) for n in args.layers.split(",")]
    results = {}
    for side in args.sides.split(","):
        for layers in depths:
            command = [sys.executable, "-m", "benchmarks.compile_aot", "--worker", f"{side}:{layers}",
                       "--program", args.program, "--model", args.model, "--batch", str(batch),
                       "--length", str(args.length), "--topology", args.topology, "--recipe", args.recipe]
            if args.dump:
                command += ["--dump", args.dump]
            # the compile alone on both sides: JAX's persistent cache off (its entry is timed on its own)
            finished = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=dict(os.environ, JAX_PLATFORMS="cpu", HF_TPU_CACHE_DIR=""))
            stdout, stderr = finished.communicate()
            lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
            if finished.returncode or not lines:
                print(f"{side} with {layers} layers failed:\n{stderr[-3000:]}", file=sys.stderr)
                continue
            row = results[side, layers] = json.loads(lines[-1][len("RESULT "):])
            row["stages"], row["size"] = _compiler_log(finished.pid)
            print(f"{side} {args.program} {args.model} with {layers} layers, {batch}x{args.length}: "
                  f"lowering {row['lowering_seconds']:.1f} s, XLA compile {row['compile_seconds']:.1f} s "
                  f"({row['compile_cpu_seconds']:.1f} s of CPU); its persistent-cache entry "
                  f"{row['cache_entry_bytes'] / 2**20:.0f} MiB made in {row['cache_entry_seconds']:.1f} s"
                  + "".join(f"; {stage} {seconds:.1f} s" for stage, seconds in row["stages"].items())
                  + "".join(f"; {count:,} {figure}" for figure, count in row["size"].items())
                  + (f"; XLA's cost analysis {row['flops'] / 1e12:.2f} TFLOP, {row['bytes_accessed'] / 2**30:.1f} GiB "
                     "accessed" if row["flops"] else ""), flush=True)
    if len(depths) != 2:
        return
    from benchmarks import chip

    real = chip.SIZES["1b"]["train"]["models"][args.model]["num_hidden_layers"]
    a, b = sorted(depths)
    for figure, what in (("compile_seconds", "wall"), ("compile_cpu_seconds", "CPU")):
        extrapolated = {}
        for side in args.sides.split(","):
            if (side, a) in results and (side, b) in results:
                fa, fb = results[side, a][figure], results[side, b][figure]
                per_layer = (fb - fa) / (b - a)
                extrapolated[side] = fa + per_layer * (real - a)
                print(f"{side}: {per_layer:.2f} s a layer, {fa - per_layer * a:.1f} s besides; "
                      f"{extrapolated[side]:.1f} s of {what} at {real} layers (this host's compile)")
        if len(extrapolated) == 2:
            print(f"hf-tpu / torchax XLA compile ({what}) at {real} layers: "
                  f"{extrapolated['hf-tpu'] / extrapolated['torchax']:.2f}x")
    for side in args.sides.split(","):  # the program's size a layer: what the chip's compile scales with
        if (side, a) in results and (side, b) in results:
            sa, sb = results[side, a]["size"], results[side, b]["size"]
            print(f"{side}: " + ", ".join(f"{(sb[figure] - sa[figure]) / (b - a):,.0f} {figure} a layer, "
                                          f"{sa[figure] + (sb[figure] - sa[figure]) / (b - a) * (real - a):,.0f} "
                                          f"at {real} layers" for figure in sa if figure in sb))


if __name__ == "__main__":
    main()
