"""Seconds per image of the tiny Diffusers pipelines (examples/text_to_image.py) on tpu in each execution
mode beside Diffusers on CPU, with compiles per call (first/second) and host syncs per call.

"compiled" is `hf_tpu.integrations.diffusers.compile_pipeline(pipe)`: the denoiser, the text encoders
and the VAE decoder through `torch.compile(backend="tpu")`, the rest (scheduler, guidance) in strict eager.

Each tpu row is timed alternating call by call with Diffusers on CPU, and its ratio is to those CPU calls:
the CPU row gives the median of all of them.

Run: python -m benchmarks.diffusers_pipelines [--steps 10] [--iters 5] [--cpu-threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

import hf_tpu
from benchmarks.common import table, timeit_alternating
from examples.text_to_image import BUILDERS, CALL_ARGS, load, saved_pipeline
from hf_tpu.integrations.diffusers import compile_pipeline

TPU_MODES = [("strict (DEFER_NEVER)", "DEFER_NEVER", False), ("deferred (DEFER_AND_FUSE)", "DEFER_AND_FUSE", False),
             ("compiled", "DEFER_NEVER", True)]


def _runner(pipe, kind, steps):
    def run():
        generator = torch.Generator().manual_seed(0)
        return pipe("a photo of a cat", num_inference_steps=steps, generator=generator, output_type="np",
                    **CALL_ARGS[kind]).images

    return run


def _per_call_counts(run):
    counts = []
    for _ in range(2):
        hf_tpu.reset_metrics()
        run()
        metrics = hf_tpu.metrics()
        counts.append((metrics["compiles"], metrics["host_syncs"]))
    return counts


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--pipelines", default=",".join(BUILDERS), help="comma-separated: " + ", ".join(BUILDERS))
    p.add_argument("--cpu-threads", type=int, default=0, help="torch CPU threads (0: PyTorch's default)")
    args = p.parse_args(argv)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for kind in args.pipelines.split(","):
            path = saved_pipeline(kind, directory)
            cpu_run = _runner(load(kind, path), kind, args.steps)
            cpu_run()  # warm-up
            cpu_row = len(rows)
            rows.append(None)
            cpu_medians = []
            for name, mode, compiled in TPU_MODES:
                pipe = load(kind, path).to("tpu")
                if compiled:
                    compile_pipeline(pipe)
                run = _runner(pipe, kind, args.steps)
                with torch.tpu.use_eager_mode(mode):
                    (first, _), (second, syncs) = _per_call_counts(run)
                    cpu, seconds = timeit_alternating([cpu_run, run], warmup=0, iters=args.iters)
                cpu_medians.append(cpu)
                rows.append([kind, name, f"{seconds:.3f}", f"{cpu / seconds:.2f}x", str(first), str(second),
                             str(syncs)])
                del pipe
            rows[cpu_row] = [kind, "diffusers cpu", f"{statistics.median(cpu_medians):.3f}", "1.00x", "", "", ""]
    print(f"{args.steps} denoising steps, 16x16 images, batch 1")
    print(table(["pipeline", "run", "s/image", "vs cpu", "compiles 1st call", "compiles 2nd call",
                 "host syncs per call"], rows))


if __name__ == "__main__":
    main()
