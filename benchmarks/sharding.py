"""A tiny Llama sharded over 1, 2, 4 and 8 simulated chips with its Transformers tensor-parallel plan:
weight bytes per chip (expected: 1/N of the total, within 5%), the static KV cache bytes per chip that
`generate()` allocates (expected: 1/N, split by heads), forward time (logits to the host) in the
strict and deferred modes, and the collectives XLA's partitioner inserted per transformer layer (expected for
column/row sharding: two all-reduces per layer, after o_proj and after down_proj).

Collectives are counted in the optimized HLO of the deferred mode's forward programs (XLA dumps
them): the model is built with L and 2L layers and the difference is divided by L, so the embedding's
and the head's collectives are not counted as a layer's. The deferred mode's early cuts are off here:
with them, identical layers share pieces that compile (and are dumped) once. Each chip count runs in
its own process with 8 simulated chips and no compilation cache (a cached program is not compiled, so
not dumped). On the CPU the simulated chips share the host's cores: the times show overheads, not
speed-ups.

Run: python -m benchmarks.sharding [--layers 2] [--iters 5] [--attention tpu|sdpa]   (about 4 minutes on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def tiny_llama(layers: int, attention: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=1024, max_position_embeddings=512,
                         attn_implementation=attention)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def count_collectives(hlo: str) -> dict:
    """Collective instructions in an HLO module's text (async pairs counted once, at their start)."""
    return {name: len(re.findall(rf"= \S+ {name}(?:-start)?\(", hlo)) for name in COLLECTIVES}


def collectives_compiled_since(dump_dir: str, before: set) -> dict:
    """Collectives in the optimized HLO of every program compiled since the dump held `before` (the
    deferred forward is one program per sync point the model's code hits)."""
    total = dict.fromkeys(COLLECTIVES, 0)
    for name in os.listdir(dump_dir):
        if name not in before and name.endswith("after_optimizations.txt"):
            with open(os.path.join(dump_dir, name)) as f:
                for kind, count in count_collectives(f.read()).items():
                    total[kind] += count
    return total


def forward(model, inputs):
    import torch

    with torch.no_grad():
        return model(inputs).logits.cpu()


def cache_bytes_per_chip(model, ids, chips: int) -> tuple:
    """(the whole static cache `generate()` decodes with, the most any chip frees when that cache is dropped). The
    cache is noted as it is made: a result holds Transformers' own cache, not the adapter's static one."""
    import gc

    import torch
    from transformers import StaticCache

    made, init = [], StaticCache.__init__
    StaticCache.__init__ = lambda self, *a, **k: made.append(self) or init(self, *a, **k)
    try:  # a result that holds the cache: its static cache is not kept for a next call (`static_cache_kept`)
        model.generate(ids.to("tpu"), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    finally:
        StaticCache.__init__ = init
    layers = made.pop().layers
    whole = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    gc.collect()
    holding = [torch.tpu.memory_allocated(i) for i in range(chips)]
    del layers
    gc.collect()
    return whole, max(then - torch.tpu.memory_allocated(i) for i, then in enumerate(holding))


def measure(chips: int, layers: int, iters: int, dump_dir: str, attention: str) -> dict:
    """In a process with 8 simulated chips: one chip count's memory, times and collectives."""
    import jax
    import torch

    import hf_tpu.distributed as dist
    from benchmarks.common import timeit

    ids = torch.randint(0, 1024, (4, 64), generator=torch.Generator().manual_seed(0))
    mesh = dist.mesh(chips, "tp")
    result = {"chips": chips}
    collectives = {}
    for num_layers in (layers, 2 * layers):
        model = tiny_llama(num_layers, attention)
        before = [torch.tpu.memory_allocated(i) for i in range(chips)]
        dist.shard_model(model, model.tp_plan, mesh)
        inputs = dist.replicate(ids, mesh)
        if num_layers == layers:
            total = sum(p.numel() * p.element_size() for p in model.parameters())
            per_chip = max(torch.tpu.memory_allocated(i) - b for i, b in enumerate(before))
            result.update(weight_bytes=total, per_chip_bytes=per_chip, per_chip_over_ideal=per_chip * chips / total - 1)
            for mode in ("DEFER_NEVER", "DEFER_AND_FUSE"):
                with torch.tpu.use_eager_mode(mode):
                    result[f"{mode} ms"] = 1000 * timeit(lambda m=model, x=inputs: forward(m, x), warmup=2, iters=iters)
            result["cache_bytes"], result["per_chip_cache_bytes"] = cache_bytes_per_chip(model, ids, chips)
        jax.clear_caches()  # every program of the forward compiles (so is dumped) again, timed ones too
        seen = set(os.listdir(dump_dir))
        with torch.tpu.use_eager_mode("DEFER_AND_FUSE"):
            forward(model, inputs)
        collectives[num_layers] = collectives_compiled_since(dump_dir, seen)
        del model, inputs
    result["per layer"] = {name: (collectives[2 * layers][name] - collectives[layers][name]) / layers
                           for name in COLLECTIVES}
    result["outside layers"] = {name: collectives[layers][name] - layers * result["per layer"][name]
                                for name in COLLECTIVES}
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--attention", default="tpu",
                        help="attn_implementation: 'tpu' (what a tensor-parallel from_pretrained picks) or 'sdpa'")
    parser.add_argument("--chips", type=int, help=argparse.SUPPRESS)  # one measurement, in a child process
    parser.add_argument("--dump-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.chips:
        print(json.dumps(measure(args.chips, args.layers, args.iters, args.dump_dir, args.attention)))
        return

    from benchmarks.common import table

    rows = []
    for chips in (1, 2, 4, 8):
        with tempfile.TemporaryDirectory() as dump_dir:
            # no early cuts: identical layers would share cut pieces, compiled (and dumped) only once
            env = dict(os.environ, HF_TPU_NUM_DEVICES="8", HF_TPU_PLATFORM="cpu", HF_TPU_CACHE_DIR="",
                       HF_TPU_EARLY_FLUSH="0", XLA_FLAGS=f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text")
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.sharding", "--chips", str(chips), "--layers", str(args.layers),
                 "--iters", str(args.iters), "--dump-dir", dump_dir, "--attention", args.attention],
                env=env, capture_output=True, text=True, check=False,
            )
        if done.returncode:
            sys.exit(f"the {chips}-chip measurement failed:\n{done.stderr[-3000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        per_layer = ", ".join(f"{n} {v:g}" for n, v in r["per layer"].items() if v)
        outside = ", ".join(f"{n} {v:g}" for n, v in r["outside layers"].items() if v)
        rows.append([chips, f"{r['per_chip_bytes'] / 2**20:.2f} of {r['weight_bytes'] / 2**20:.2f}",
                     f"{100 * r['per_chip_over_ideal']:+.1f}%",
                     f"{r['per_chip_cache_bytes'] / 2**10:.0f} of {r['cache_bytes'] / 2**10:.0f}", f"{r['DEFER_NEVER ms']:.1f}",
                     f"{r['DEFER_AND_FUSE ms']:.1f}", per_layer or "none", outside or "none"])
    print(f"tiny Llama, {args.layers} layers, hidden 256, 8 heads, batch 4x64, float32, attention {args.attention!r}; "
          "Transformers' tp_plan; KV cache: generate() of 2 tokens")
    print(table(["chips", "weights MiB per chip", "vs 1/N", "KV cache KiB per chip", "strict ms", "deferred ms",
                 "collectives per layer", "outside the layers"], rows))


if __name__ == "__main__":
    main()
