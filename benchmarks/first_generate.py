"""Where the first `generate()` spends its time, and what a second process with the disk cache saves.

A Llama-shaped model (by default hidden 512, 8 layers, random weights) generates from a fresh process
twice: with an empty `HF_TPU_CACHE_DIR`, then with the one the first filled; each makes one token, then
nine. A third fresh process makes nine tokens in its first call, as a user's first call usually does: there
the decode loop compiles while the prefill does. Each reports its first `generate()`'s seconds, split per
JAX program into trace, lowering and XLA compile (JAX times these), and the rest, which for a
`torch.compile` graph is Dynamo and AOT autograd's capture; then its time to first token once warm against
a compiled forward of the same prompt. `generate()` traces its prefill and decode
loop straight from Python (`hf_tpu.jit`: `trace_*` is that Python trace, `traced_*` and `loop_*` the
programs made of it); `--compare` runs the pair of processes again with `HF_TPU_DIRECT_TRACE=0`, where
`generate()` compiles them with `torch.compile` (`_trace`, `_loop`), alternating the two so that both see
the same machine load.

Run: python -m benchmarks.first_generate [--hidden 512 --layers 8 --prompt 128 --lengths 128,1024] [--compare]
     python -m benchmarks.first_generate --size 1b --lengths 128,1024,4096   (on a TPU: the chip benchmark's model)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


# `--size 1b` is the chip benchmark's 1.1B Llama in bfloat16 (`benchmarks.chip`); `custom` the one of
# --hidden, --layers and --vocab in float32
_DTYPES = {"custom": None, "1b": "bfloat16"}


def _config(args):
    from transformers import LlamaConfig

    if args.size == "1b":
        from benchmarks.chip import _LLAMA_1B

        return LlamaConfig(**_LLAMA_1B, attn_implementation="sdpa")
    return LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab,
                       max_position_embeddings=8192)


# what a worker reports of its first calls: programs compiled, loaded from the disk cache, and loaded from it while
# their trace ran (`hf_tpu.disk_cache`)
_COUNTED = ("xla_compiles", "disk_cache_hits", "disk_cache_prefetched")


def _worker(args) -> None:
    import torch

    import hf_tpu
    from benchmarks.common import jax_compile_phases, static_compiled, timeit_alternating
    from transformers import LlamaForCausalLM

    phases = jax_compile_phases()
    torch.manual_seed(0)
    dtype = getattr(torch, _DTYPES[args.size]) if _DTYPES[args.size] else None
    model = LlamaForCausalLM._from_config(_config(args), dtype=dtype).eval().to("tpu")
    vocab = model.config.vocab_size
    sync = torch.tpu.synchronize

    def generate(ids, new_tokens):
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        return out.cpu()

    ids = torch.randint(0, vocab, (1, args.prompt)).to("tpu")
    hf_tpu.reset_metrics()
    if args.decode_first:  # the first call decodes: its loop compiles while its prefill does
        start = time.perf_counter()
        generate(ids, 9)
        print("RESULT " + json.dumps({"first_token": None, "decode_first": time.perf_counter() - start,
                                      **{k: hf_tpu.metrics()[k] for k in _COUNTED}}), flush=True)
        return
    start = time.perf_counter()
    generate(ids, 1)
    first_token = time.perf_counter() - start
    start = time.perf_counter()
    generate(ids, 9)  # the decode loop compiles here
    decode_first = time.perf_counter() - start
    metrics = hf_tpu.metrics()
    print(f"first generate(): first token {first_token:.2f} s, first 9-token decode {decode_first:.2f} s, "
          f"{metrics['xla_compiles']} XLA compiles, {metrics['disk_cache_hits']} from the disk cache",
          file=sys.stderr, flush=True)  # at once: the time-to-first-token rows after it compile more
    first_call_phases = {name: dict(p) for name, p in phases.items()}  # not the compiles timed below
    compiled = static_compiled(model)
    ttft = []
    for length in args.lengths:
        prompt = torch.randint(0, vocab, (1, length)).to("tpu")

        def forward():
            with torch.no_grad():
                logits = compiled(prompt, use_cache=False, return_dict=False)[0]
            sync()
            return logits

        # taking turns: the ratio is what is read, and the machine's speed drifts between separate medians
        ttft.append((length, *timeit_alternating([lambda: generate(prompt, 1), forward], warmup=1, iters=10)))
    print("RESULT " + json.dumps({"first_token": first_token, "decode_first": decode_first,
                                  **{k: metrics[k] for k in _COUNTED}, "phases": first_call_phases, "ttft": ttft}),
          flush=True)


def _run(args, cache: str, direct: bool = True, lengths=None, decode_first: bool = False) -> dict:
    lengths = args.lengths if lengths is None else lengths
    command = [sys.executable, "-m", "benchmarks.first_generate", "--worker", "--size", args.size, "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--vocab", str(args.vocab), "--prompt", str(args.prompt),
               "--lengths", ",".join(map(str, lengths))] + (["--decode-first"] if decode_first else [])
    env = {**os.environ, "HF_TPU_CACHE_DIR": cache, "HF_TPU_DIRECT_TRACE": "1" if direct else "0"}
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(_DTYPES), default="custom",
                        help="1b: the chip benchmark's 1.1B Llama in bfloat16 (--hidden, --layers, --vocab unused)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--lengths", type=lambda text: [int(x) for x in text.split(",") if x], default=[128, 1024])
    parser.add_argument("--compare", action="store_true",
                        help="also run generate() with torch.compile (HF_TPU_DIRECT_TRACE=0)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--decode-first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    from benchmarks.common import table

    paths = {"hf_tpu.jit": True, "torch.compile": False} if args.compare else {"hf_tpu.jit": True}
    runs = {path: [] for path in paths}
    with tempfile.TemporaryDirectory() as root:
        for process in range(2):  # first processes, then second ones: each path with its own cache folder
            for path, direct in paths.items():
                # the warm time to first token is the same program either way, and in either process: measured
                # once, by the first process of hf_tpu.jit
                lengths = args.lengths if direct and process == 0 else []
                runs[path].append(_run(args, os.path.join(root, path), direct, lengths))
        # a user's first call decodes several tokens: one more fresh process whose first call is the 9-token one
        runs["hf_tpu.jit"].append(_run(args, os.path.join(root, "decode first"), lengths=[], decode_first=True))
    config = _config(args)
    print(f"Llama hidden {config.hidden_size}, {config.num_hidden_layers} layers, prompt {args.prompt}"
          f"{', bfloat16' if _DTYPES[args.size] else ''}")
    print(table(["generate() traced by", "process", "first token s", "first 9-token decode s", "XLA compiles",
                 "disk cache hits", "of them loaded during the trace"],
                [[path, name, "-" if r["first_token"] is None else f"{r['first_token']:.2f}",
                  f"{r['decode_first']:.2f}", r["xla_compiles"], r["disk_cache_hits"], r["disk_cache_prefetched"]]
                 for path, (cold, warm, *decoding) in runs.items()
                 for name, r in (("first (cache empty)", cold), ("second (disk cache)", warm),
                                 *(("first, 9 tokens first", d) for d in decoding))]) + "\n")
    for path, (cold, *_) in runs.items():
        rows = sorted(cold["phases"].items(), key=lambda item: -sum(item[1].values()))
        print(table([f"JAX program ({path}, first process, first calls)", "trace s", "lowering s", "XLA s"],
                    [[name, f"{p.get('trace', 0):.2f}", f"{p.get('lowering', 0):.2f}", f"{p.get('XLA', 0):.2f}"]
                     for name, p in rows]) + "\n")
    cold = runs["hf_tpu.jit"][0]
    print(table(["prompt", "generate(1 token) ms", "compiled forward ms", "ratio"],
                [[length, f"{g * 1e3:.1f}", f"{f * 1e3:.1f}", f"{g / f:.2f}x"] for length, g, f in cold["ttft"]]))


if __name__ == "__main__":
    main()
