"""Where a warm `generate()` of one token spends its time: host timestamps at each of its steps.

The chip benchmark's Llama (`--size`, as in `benchmarks.chip`) makes one token after a prompt of `--length`
tokens, warm (its prefill compiled), `--calls` times, each call with the next of 8 prompts; each mark is the
median over the calls of the milliseconds from the call's start:

- `config resolved`: Transformers' `_prepare_generation_config` returned (the adapter's wrapper calls it first);
- `prefill entered`: Transformers' `_prefill` entered (its setup: special tokens, mask, cache, processors);
- `traced call made`: the prefill's `hf_tpu.jit` function called (Transformers' `prepare_inputs_for_generation`
  done: the step's inputs moved to the chip);
- `launch started` / `launched`: its launch of the prefill's program began (its key and inputs found) and
  returned;
- `logits computed` / `logits on the host`: the first read of a device array after the launch found it computed,
  then had its values on the host;
- `returned`: `generate()` returned; `synchronized`: `torch.accelerator.synchronize()` returned.

The time between `launched` and `logits computed` holds the device's program; the rest is the host's. A mark a
call did not reach (a prefill that ran eagerly: no launch) is left out. The marks print in the order the calls
reached them: a call of a kind seen before launches its prefill ahead of Transformers' setup, before `prefill
entered`.

Run: python -m benchmarks.first_token_timeline [--size 1b --length 128 --calls 40]   (on a TPU)
     python -m benchmarks.first_token_timeline --size tiny --length 16 --calls 5      (the CPU: what CI runs)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import statistics
import time

MARKS = ("config resolved", "prefill entered", "traced call made", "launch started", "launched", "logits computed",
         "logits on the host", "returned", "synchronized")
_PROMPTS = 8


def timeline(size: str, length: int, calls: int) -> dict:
    """{mark: median milliseconds from the call} over `calls` warm calls, the earliest first."""
    import torch

    import hf_tpu  # noqa: F401  (registers tpu)
    from benchmarks.chip import SIZES, _ids, _llama
    from hf_tpu import direct
    from hf_tpu.memory import host_transfers

    spec = SIZES[size]
    model = _llama(spec).to("tpu")
    prompts = itertools.cycle([_ids(spec["model"]["vocab_size"], 1, length, variant).to("tpu")
                               for variant in range(_PROMPTS)])
    marks: dict = {}

    def mark(name: str) -> None:
        marks.setdefault(name, time.perf_counter())

    def marked(function, before: str | None = None, after: str | None = None):
        @functools.wraps(function)
        def call(*args, **kwargs):
            if before:
                mark(before)
            try:
                return function(*args, **kwargs)
            finally:
                if after:
                    mark(after)
        return call

    # Transformers' methods are wrapped on the model's class, not on the model (whose attributes `hf_tpu.jit`'s key
    # walks), and not `prepare_inputs_for_generation`, whose identity the adapter checks
    model_type = type(model)
    launching, to_numpy, traced_call = direct.launching, host_transfers.to_numpy, direct.call

    @contextlib.contextmanager
    def marked_launch(*args, **kwargs):
        mark("launch started")
        with launching(*args, **kwargs):
            yield
        mark("launched")

    def marked_read(array):
        if "launched" in marks and "logits computed" not in marks and hasattr(array, "block_until_ready"):
            array.block_until_ready()
            mark("logits computed")
            values = to_numpy(array)
            mark("logits on the host")
            return values
        return to_numpy(array)

    patched = {"_prepare_generation_config": marked(model_type._prepare_generation_config, after="config resolved"),
               "_prefill": marked(model_type._prefill, before="prefill entered")}
    samples: list = []
    with torch.no_grad():
        for _ in range(2):  # compiles the prefill, then takes the kept static cache
            model.generate(next(prompts), max_new_tokens=1, do_sample=False)
        saved = {name: model_type.__dict__.get(name) for name in patched}
        try:
            for name, function in patched.items():
                setattr(model_type, name, function)
            direct.launching, host_transfers.to_numpy = marked_launch, marked_read
            direct.call = marked(traced_call, before="traced call made")
            for _ in range(calls):
                marks.clear()
                ids = next(prompts)
                start = time.perf_counter()
                model.generate(ids, max_new_tokens=1, do_sample=False)
                mark("returned")
                torch.accelerator.synchronize()
                mark("synchronized")
                samples.append({name: (at - start) * 1e3 for name, at in marks.items()})
        finally:
            direct.launching, host_transfers.to_numpy, direct.call = launching, to_numpy, traced_call
            for name, function in saved.items():
                if function is None:
                    delattr(model_type, name)
                else:
                    setattr(model_type, name, function)
    medians = {name: statistics.median(s[name] for s in samples) for name in MARKS if all(name in s for s in samples)}
    return dict(sorted(medians.items(), key=lambda item: item[1]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1b", choices=("tiny", "small", "1b"))
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args(argv)
    medians = timeline(args.size, args.length, args.calls)
    print(f"warm generate() of one token after {args.length} tokens, --size {args.size}, medians of {args.calls} "
          "calls (ms from the call; the step before each mark in brackets)")
    previous = 0.0
    for name, at in medians.items():
        print(f"  {name:<20} {at:8.3f}  (+{at - previous:.3f})")
        previous = at


if __name__ == "__main__":
    main()
