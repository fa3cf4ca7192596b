"""The headline benchmark: a Llama-shaped model on the chip, hf-tpu beside torchax and the chip's limits.

One command prints, from one run, side by side:
- the chip's limits measured in raw JAX: HBM bandwidth (a large `jnp.sum`) and bf16 matmul throughput;
- hf-tpu's forward (logits of every position) compiled by `torch.compile(backend="tpu")`, in strict eager
  and in defer-and-fuse, with its MFU, at each (batch, prompt length) of the size's grid;
- torchax's jitted forward (`torchax.interop.JittableModule`) of the same model on the same input;
- hf-tpu's `generate()`: decode time per step at each batch, time to first token against the compiled
  forward of the same prompt, and the first call's seconds (compiles included).

Each side runs in its own process: both claim PyTorch's PrivateUse1 backend, and one process at a time
holds a TPU chip. This process only starts the others and prints what they report, so it never holds it.

MFU counts 2 FLOPs per parameter of every matmul (the embedding lookup excluded) per token, plus
attention's QK^T and PV over the whole (not causally halved) sequence, against the chip's published bf16
peak (on a CPU, where there is none, against the measured matmul throughput).

Run: python -m benchmarks.chip                 (the 1.1B model: on a TPU)
     python -m benchmarks.chip --size tiny     (a tiny model with the same shape of work: CI runs this)
     python -m benchmarks.chip --only forward --dump-hlo DIR   (XLA's optimized HLO of each side, for
     comparing the two programs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# model shape, and the grid each section runs at
SIZES = {
    "1b": dict(model=dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=8192, vocab_size=32000, max_position_embeddings=8192),
               forward=[(1, 128), (1, 1024), (8, 1024), (1, 4096)], eager=(1, 1024),
               decode_batches=[1, 8, 64], decode_prompt=128, decode_steps=64, ttft=[128, 1024, 4096],
               matmul=8192, hbm_bytes=2 << 30, iters=10),
    "tiny": dict(model=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=256, max_position_embeddings=512),
                 forward=[(1, 16), (2, 64)], eager=(1, 16), decode_batches=[1, 2], decode_prompt=8,
                 decode_steps=4, ttft=[8, 32], matmul=256, hbm_bytes=16 << 20, iters=3),
}

# published bf16 peak FLOP/s by JAX device kind
PEAK_BF16 = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12}


def _median_seconds(fn, iters: int) -> float:
    """Median seconds of `fn` after one untimed call (a first call compiles)."""
    from benchmarks.common import timeit

    return timeit(fn, warmup=1, iters=iters)


def _forward_flops(config: dict, batch: int, length: int) -> float:
    h, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter  # q, o, k, v, gate/up/down
    matmul_params = layers * per_layer + h * config["vocab_size"]  # + the LM head
    attention = 2 * 2 * layers * length * length * h  # QK^T and PV per sequence
    return batch * (2 * length * matmul_params + attention)


def _emit(section: str, **figures) -> None:
    print("RESULT " + json.dumps({"section": section, **figures}), flush=True)


def _limits(spec: dict) -> None:
    """The chip's limits in raw JAX, measured in this process."""
    import jax
    import jax.numpy as jnp

    n = spec["matmul"]
    a = jnp.ones((n, n), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: x @ y)
    seconds = _median_seconds(lambda: matmul(a, a).block_until_ready(), spec["iters"])
    x = jnp.ones((spec["hbm_bytes"] // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    read = _median_seconds(lambda: total(x).block_until_ready(), spec["iters"])
    kind = jax.devices()[0].device_kind
    _emit("limits", device=kind, platform=jax.devices()[0].platform, matmul_tflops=2 * n ** 3 / seconds / 1e12,
          hbm_gbs=spec["hbm_bytes"] / read / 1e9, peak_tflops=PEAK_BF16.get(kind, 0) / 1e12)


def _model(spec: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**spec["model"], attn_implementation="sdpa")
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def _logits_module():
    import torch

    class Logits(torch.nn.Module):
        """The model's logits alone, without a cache (a jitted function returns arrays, not model outputs)."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(ids, use_cache=False, return_dict=False)[0]

    return Logits


def _ids(spec: dict, batch: int, length: int):
    import torch

    g = torch.Generator().manual_seed(batch * 100003 + length)
    return torch.randint(0, spec["model"]["vocab_size"], (batch, length), generator=g)


def _hf_tpu(spec: dict, sections: set) -> None:
    import torch

    import hf_tpu  # noqa: F401  (registers tpu)

    model = _model(spec).to("tpu")
    sync = torch.accelerator.synchronize
    if "forward" in sections:
        compiled = torch.compile(model, backend="tpu")
        for batch, length in spec["forward"]:
            ids = _ids(spec, batch, length).to("tpu")

            def forward():
                with torch.no_grad():
                    logits = compiled(ids, use_cache=False, return_dict=False)[0]
                sync()  # waits for the arrays alive on the device: the logits among them
                return logits

            start = time.perf_counter()
            forward()
            first = time.perf_counter() - start
            _emit("forward", side="hf-tpu", batch=batch, length=length,
                  seconds=_median_seconds(forward, spec["iters"]), first_call=first)
        batch, length = spec["eager"]
        ids = _ids(spec, batch, length).to("tpu")
        for mode in ("DEFER_NEVER", "DEFER_AND_FUSE"):
            with torch.tpu.use_eager_mode(mode):
                def eager():
                    with torch.no_grad():
                        logits = model(ids, use_cache=False, return_dict=False)[0]
                    sync()
                    return logits

                _emit("eager", side="hf-tpu", mode=mode, batch=batch, length=length,
                      seconds=_median_seconds(eager, max(2, spec["iters"] // 3)))
    if "generate" in sections:
        _generate(spec, model, sync)


def _generate(spec: dict, model, sync) -> None:
    import torch

    def generate(ids, new_tokens: int):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        sync()

    steps = spec["decode_steps"]
    for batch in spec["decode_batches"]:
        ids = _ids(spec, batch, spec["decode_prompt"]).to("tpu")
        start = time.perf_counter()
        generate(ids, 1 + steps)
        first = time.perf_counter() - start
        one = _median_seconds(lambda: generate(ids, 1), max(2, spec["iters"] // 3))
        full = _median_seconds(lambda: generate(ids, 1 + steps), max(2, spec["iters"] // 3))
        _emit("decode", side="hf-tpu", batch=batch, step_seconds=(full - one) / steps, first_call=first)
    compiled = torch.compile(model, backend="tpu")
    for length in spec["ttft"]:
        ids = _ids(spec, 1, length).to("tpu")

        def forward():
            with torch.no_grad():
                logits = compiled(ids, use_cache=False, return_dict=False)[0]
            sync()
            return logits

        ttft = _median_seconds(lambda: generate(ids, 1), max(2, spec["iters"] // 3))
        _emit("ttft", side="hf-tpu", length=length, seconds=ttft,
              forward_seconds=_median_seconds(forward, max(2, spec["iters"] // 3)))


def _torchax(spec: dict, sections: set) -> None:
    import jax
    import torch
    import torchax
    import torchax.interop

    model = _model(spec)
    env = torchax.default_env()
    with env:
        model.to("jax")
        jitted = torchax.interop.JittableModule(_logits_module()(model))
        for batch, length in spec["forward"]:
            ids = _ids(spec, batch, length).to("jax")

            def forward():
                with torch.no_grad():
                    logits = jitted(ids)
                jax.block_until_ready(logits.jax())

            start = time.perf_counter()
            forward()
            first = time.perf_counter() - start
            _emit("forward", side="torchax", batch=batch, length=length,
                  seconds=_median_seconds(forward, spec["iters"]), first_call=first)


def _worker(args) -> None:
    spec = SIZES[args.size]
    sections = set(args.only.split(","))
    if args.worker == "limits":
        _limits(spec)
    elif args.worker == "hf-tpu":
        _hf_tpu(spec, sections)
    else:
        _torchax(spec, sections)


def _run_worker(name: str, args) -> list:
    """The figures one worker process reports (its other output passes through to stderr)."""
    env = dict(os.environ)
    if args.dump_hlo:
        path = os.path.join(args.dump_hlo, name)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={path} --xla_dump_hlo_as_text"
                            " --xla_dump_hlo_pass_re=^$").strip()
    command = [sys.executable, "-m", "benchmarks.chip", "--worker", name, "--size", args.size, "--only", args.only]
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0:
        print(f"[{name}] exited with {proc.returncode} after {len(results)} figures", file=sys.stderr)
    return results


def _table(headers, rows) -> str:
    from benchmarks.common import table

    return table(headers, rows)


def report(results: list, spec: dict) -> str:
    """The side-by-side tables of every worker's figures."""
    by = lambda section, side=None: [r for r in results if r["section"] == section and side in (None, r.get("side"))]
    out = []
    limits = by("limits")
    peak = None
    if limits:
        lim = limits[0]
        peak = (lim["peak_tflops"] or lim["matmul_tflops"]) * 1e12
        out.append(f"device: {lim['device']} ({lim['platform']})  bf16 matmul {lim['matmul_tflops']:.1f} TFLOP/s "
                   f"(peak {lim['peak_tflops'] or 'n/a'})  HBM read {lim['hbm_gbs']:.0f} GB/s\n")
    mfu = lambda r: (f"{100 * _forward_flops(spec['model'], r['batch'], r['length']) / r['seconds'] / peak:.0f}%"
                     if peak else "-")
    rows = []
    for r in by("forward", "hf-tpu"):
        peer = [p for p in by("forward", "torchax") if (p["batch"], p["length"]) == (r["batch"], r["length"])]
        p = peer[0] if peer else None
        rows.append([f"{r['batch']}x{r['length']}", f"{r['seconds'] * 1e3:.2f}", mfu(r), f"{r['first_call']:.1f}",
                     f"{p['seconds'] * 1e3:.2f}" if p else "-", mfu(p) if p else "-",
                     f"{p['first_call']:.1f}" if p else "-", f"{p['seconds'] / r['seconds']:.2f}x" if p else "-"])
    if rows:
        out.append("compiled forward (torch.compile backend='tpu' / torchax JittableModule)")
        out.append(_table(["batch x len", "hf-tpu ms", "MFU", "first s", "torchax ms", "MFU", "first s",
                           "hf-tpu speed / torchax"], rows) + "\n")
    eager = by("eager", "hf-tpu")
    if eager:
        strict = {(r["batch"], r["length"]): r["seconds"] for r in eager if r["mode"] == "DEFER_NEVER"}
        out.append(_table(["eager forward", "batch x len", "ms", "strict / this"],
                          [[r["mode"], f"{r['batch']}x{r['length']}", f"{r['seconds'] * 1e3:.1f}",
                            f"{strict[(r['batch'], r['length'])] / r['seconds']:.2f}x"] for r in eager]) + "\n")
    decode = by("decode", "hf-tpu")
    if decode:
        out.append(_table(["decode batch", "ms/step", "tokens/s", "first call s"],
                          [[r["batch"], f"{r['step_seconds'] * 1e3:.2f}", f"{r['batch'] / r['step_seconds']:.0f}",
                            f"{r['first_call']:.1f}"] for r in decode]) + "\n")
    ttft = by("ttft", "hf-tpu")
    if ttft:
        out.append(_table(["prompt", "generate(1 token) ms", "compiled forward ms", "ratio"],
                          [[r["length"], f"{r['seconds'] * 1e3:.1f}", f"{r['forward_seconds'] * 1e3:.1f}",
                            f"{r['seconds'] / r['forward_seconds']:.2f}x"] for r in ttft]) + "\n")
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--only", default="forward,generate", help="sections: forward, generate")
    parser.add_argument("--worker", choices=["limits", "hf-tpu", "torchax"], help=argparse.SUPPRESS)
    parser.add_argument("--no-torchax", action="store_true", help="skip the torchax side")
    parser.add_argument("--dump-hlo", help="write each side's optimized HLO under this folder")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each worker may take")
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    results = _run_worker("limits", args) + _run_worker("hf-tpu", args)
    if not args.no_torchax and "forward" in args.only:
        results += _run_worker("torchax", args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(report(results, SIZES[args.size]))


if __name__ == "__main__":
    main()
