"""`generate()` of the tiny Llama on tpu in each execution mode beside Transformers on CPU (eager, its
default dynamic cache): prefill and decode tokens/s measured separately, and compiles per call.

Prefill time is a `generate()` of one new token; decode time per token is the difference to a
`generate()` of 1 + N new tokens, divided by N. On tpu, "strict" and "deferred" keep Transformers'
dynamic cache (eager decoding, `configure(static_cache=False)`); "compiled static cache, device loop" is
the adapter's default: a static cache, and every token after the first decoded in one `hf_tpu.while_loop`
of the `torch.compile(backend="tpu")`-compiled step; "token by token" decodes the same compiled
forward once per token from Transformers' Python loop (`configure(device_loop=False)`).

Each tpu row is timed in turns with Transformers on CPU (`benchmarks.common.timeit_alternating`), and
its ratio is to those CPU calls; the CPU row gives the median of all of them.

Run: python -m benchmarks.generation [--prompt 64] [--new-tokens 32] [--batch 1] [--iters 5] [--cpu-threads N]
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

import hf_tpu
from benchmarks.common import table, timeit_alternating, tiny_llama
from hf_tpu.integrations import transformers as adapter

# (name, eager mode, static cache, device loop)
TPU_MODES = [("strict (DEFER_NEVER)", "DEFER_NEVER", False, False),
             ("deferred (DEFER_AND_FUSE)", "DEFER_AND_FUSE", False, False),
             ("compiled static cache, token by token", "DEFER_NEVER", True, False),
             ("compiled static cache, device loop", "DEFER_NEVER", True, True)]


def _generator(model, prompt, new_tokens):
    def run():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        return out.cpu()

    return run


def _runs(model, prompt, new_tokens):
    """A prefill (`generate()` of one token) and a full `generate()` of 1 + new_tokens."""
    return _generator(model, prompt, 1), _generator(model, prompt, 1 + new_tokens)


def _rates(prefill: float, full: float, prompt, new_tokens: int) -> tuple:
    """(prefill, decode) tokens per second from the two calls' seconds."""
    batch, length = prompt.shape
    return batch * length / prefill, batch * new_tokens / max(full - prefill, 1e-9)


def _compiles_per_call(model, prompt, new_tokens):
    counts = []
    for _ in range(2):
        hf_tpu.reset_metrics()
        _generator(model, prompt, new_tokens)()
        counts.append(hf_tpu.metrics()["compiles"])
    return counts


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--cpu-threads", type=int, default=0, help="torch CPU threads (0: PyTorch's default)")
    args = p.parse_args(argv)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    model = tiny_llama().eval()
    model.generation_config.eos_token_id = None  # every call generates exactly the tokens asked for
    prompt = torch.randint(3, 1000, (args.batch, args.prompt))

    cpu_runs = _runs(model, prompt, args.new_tokens)
    rows, cpu_rates = [None], []
    saved = adapter.settings.static_cache, adapter.settings.device_loop
    try:
        for name, mode, static, device_loop in TPU_MODES:
            adapter.configure(static_cache=static, device_loop=device_loop)
            device_model = copy.deepcopy(model).to("tpu")
            device_prompt = prompt.to("tpu")
            with torch.tpu.use_eager_mode(mode):
                first, second = _compiles_per_call(device_model, device_prompt, args.new_tokens)
                seconds = timeit_alternating([*cpu_runs, *_runs(device_model, device_prompt, args.new_tokens)],
                                             warmup=1, iters=args.iters)
            cpu_rates.append(_rates(*seconds[:2], prompt, args.new_tokens))
            prefill, decode = _rates(*seconds[2:], prompt, args.new_tokens)
            rows.append([name, f"{prefill:.0f}", f"{decode:.1f}", f"{decode / cpu_rates[-1][1]:.2f}x", str(first),
                         str(second)])
            del device_model
    finally:
        adapter.configure(static_cache=saved[0], device_loop=saved[1])
    cpu_prefill, cpu_decode = (statistics.median(r[k] for r in cpu_rates) for k in range(2))
    rows[0] = ["torch cpu eager, dynamic cache", f"{cpu_prefill:.0f}", f"{cpu_decode:.1f}", "1.00x", "", ""]
    print(f"tiny Llama, batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens (greedy), "
          f"{torch.get_num_threads()} torch CPU threads")
    print(table(["run", "prefill tok/s", "decode tok/s", "decode vs cpu", "compiles 1st call",
                 "compiles 2nd call"], rows))


if __name__ == "__main__":
    main()
