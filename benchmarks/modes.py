"""The same work in every execution mode beside PyTorch on CPU: time per iteration, compiles after
warm-up, and peak device memory.

(a) tiny Llama forward (4 layers, hidden 256, batch 2x64); (b) its AdamW training step; (c) a 128-layer
MLP stack of small matmuls (launch-bound); (d) `generate()` of 32 tokens with the default dynamic cache.
"compile" is `torch.compile(model, backend="tpu")`, and for (b) also `torch.compile(opt.step, backend="tpu")`,
PyTorch's recipe for a compiled optimizer.

Each mode's iterations take turns with PyTorch's on CPU (`benchmarks.common.timeit_alternating`), and
"vs cpu" is to those CPU iterations: a change of the machine's speed hits both sides of that ratio alike.
"vs strict" compares the modes' own times, measured one mode after the other.

Run: python -m benchmarks.modes [--iters 20] [--only a,c] [--modes DEFER_AND_FUSE]
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics

import torch

import hf_tpu
from benchmarks.common import table, timeit_alternating, tiny_llama

MODES = ["DEFER_NEVER", "DEFER_AND_FUSE", "DEFER_NEVER_AND_LAUNCH_BLOCKING", "compile"]


def _sync(t):
    return t.cpu() if t.device.type == "tpu" else t


def workloads():
    llama = tiny_llama().eval()
    ids = torch.randint(0, 1000, (2, 64))
    mlp = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(128)])
    x = torch.randn(8, 64)

    def forward(model, device, compiled):
        run = torch.compile(model, backend="tpu") if compiled else model
        inp = ids.to(device)

        def step():
            with torch.no_grad():
                return _sync(run(inp).logits.sum())

        return step

    def train(model, device, compiled):
        model = model.train()
        run = torch.compile(model, backend="tpu") if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        update = torch.compile(opt.step, backend="tpu") if compiled else opt.step
        inp = ids.to(device)

        def step():
            loss = run(input_ids=inp, labels=inp).loss
            loss.backward()
            update()
            opt.zero_grad()
            return _sync(loss.detach())

        return step

    def stack(model, device, compiled):
        run = torch.compile(model, backend="tpu") if compiled else model
        inp = x.to(device)

        def step():
            with torch.no_grad():
                return _sync(run(inp).sum())

        return step

    def generate(model, device, compiled):
        if compiled:
            return None  # compiled decoding with a static cache: python -m benchmarks.generation
        inp = ids[:1, :16].to(device)

        def step():
            # Transformers' default dynamic cache, decoded op by op in each eager mode
            out = model.generate(inp, max_new_tokens=32, do_sample=False, min_new_tokens=32,
                                 cache_implementation="dynamic")
            return _sync(out)

        return step

    return [("(a) llama forward", llama, forward), ("(b) llama train step", llama, train),
            ("(c) 128-layer MLP", mlp, stack), ("(d) generate 32 tokens", llama, generate)]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--only", default="", help="comma-separated workload letters, e.g. a,c")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated modes to run (DEFER_NEVER, the baseline of 'vs strict', always runs)")
    args = p.parse_args(argv)
    modes = [mode for mode in MODES if mode == "DEFER_NEVER" or mode in args.modes.split(",")]
    rows = []
    for name, model, make in workloads():
        if args.only and name[1] not in args.only.split(","):
            continue
        cpu_step = make(copy.deepcopy(model), "cpu", False)
        for _ in range(2):
            cpu_step()
        results, cpu_times = {}, []
        for mode in modes:
            device_model = copy.deepcopy(model).to("tpu")
            step = make(device_model, "tpu", mode == "compile")
            if step is None:
                continue
            eager = "DEFER_NEVER" if mode == "compile" else mode
            with torch.tpu.use_eager_mode(eager):
                for _ in range(3):
                    step()
                torch.tpu.synchronize()
                torch.tpu.reset_peak_memory_stats()
                hf_tpu.reset_metrics()
                calls = []  # every call of the step, the untimed ones between turns too: per-iteration counts

                def counted_step(step=step):
                    calls.append(None)
                    return step()

                cpu, seconds = timeit_alternating([cpu_step, counted_step], warmup=0, iters=args.iters)
                metrics = hf_tpu.metrics()
                compiles = metrics["compiles"]
                peak = torch.tpu.max_memory_allocated()
            results[mode] = seconds
            cpu_times.append(cpu)
            del device_model, step, counted_step
            torch._dynamo.reset()  # Dynamo's caches hold a compiled model's weights on the device
            gc.collect()  # so the next mode's peak memory counts only its own tensors
            rows.append([name, mode, f"{seconds * 1e3:.1f}", f"{cpu / seconds:.2f}x",
                         f"{results['DEFER_NEVER'] / seconds:.2f}x", str(compiles), f"{peak / 2**20:.1f}",
                         _launches(metrics, len(calls)) if mode == "DEFER_AND_FUSE" else ""])
        rows.append([name, "torch cpu eager", f"{statistics.median(cpu_times) * 1e3:.1f}", "1.00x"] + [""] * 4)
    print(table(["workload", "mode", "ms/iter", "vs cpu", "vs strict", f"compiles in {args.iters} iters",
                 "peak MiB", "fused launches/iter (cut points)"], rows))


def _launches(metrics, iters: int) -> str:
    """Defer-and-fuse's fused programs per iteration (of `iters`), and how many its cut points made."""
    by_reason = metrics["flushes_by_reason"]
    return f"{sum(by_reason.values()) / iters:.1f} ({by_reason.get('a cut point', 0) / iters:.1f})"


if __name__ == "__main__":
    main()
