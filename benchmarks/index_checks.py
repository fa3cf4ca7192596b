"""What the device-side index checks cost (docs/design/device-checks.md): the same work with the checks on (the
default) and off (programs built as before the checks existed), side by side.

(a) decode tokens/s of the tiny Llama's `generate()`: the adapter's default (the prefill traced, every later token
in one `hf_tpu.while_loop` on the device: the loop carries the record of errors, read once after it) and token by
token (`configure(device_loop=False)`: a host read per token, each reading the record); prefill and decode
measured as in `benchmarks.generation`. (b) ms per AdamW training step of the tiny Llama (cross_entropy's targets
and the embedding's ids checked forward, the loss read every step) in strict, deferred and compiled mode. (c) us
of host time per strict-eager embedding lookup of 8 ids, 200 in a row and then one read: the dispatch cost of a
checked op (its program takes and returns the record, its call site is looked up).

Off means: the checked ops' signatures lose their rules and every cache of built programs is emptied, so that
each program is built again without the check. The configurations take turns (`--rounds` of off then on); each
row is the median over the rounds of each round's median.

Run: python -m benchmarks.index_checks [--rounds 2] [--iters 5] [--only a,b,c] [--clock wall|process]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import hf_tpu
from benchmarks.common import table, timeit, timeit_alternating, tiny_llama
from hf_tpu import direct
from hf_tpu.dispatch import index_checks, signatures
from hf_tpu.dispatch.program import PROGRAMS
from hf_tpu.integrations import transformers as adapter


def set_index_checks(on: bool) -> None:
    """The checks on or off for every program built from now on; every built program forgotten."""
    for name, rule in index_checks.RULES.items():
        for packet_name in (name, name + "_"):
            packet = getattr(torch.ops.aten, packet_name, None)
            for overload in packet.overloads() if packet is not None else ():
                signatures.signature(getattr(packet, overload)).index_rule = rule if on else None
    PROGRAMS.clear()
    direct.reset()
    torch._dynamo.reset()


def decode_rate(model, prompt, new_tokens: int, iters: int, clock) -> float:
    """Decode tokens/s: (a generate of 1 + new_tokens) - (a generate of 1), per new token; the two take turns."""
    def run(tokens):
        return lambda: model.generate(prompt, max_new_tokens=tokens, do_sample=False).cpu()

    for tokens in (1, 1 + new_tokens, 1, 1 + new_tokens):  # compiles, then the calls as timed
        run(tokens)()
    prefill, full = timeit_alternating([run(1), run(1 + new_tokens)], warmup=0, iters=iters, clock=clock)
    return prompt.shape[0] * new_tokens / max(full - prefill, 1e-9)


def train_step_ms(model, ids, mode: str, iters: int, clock) -> float:
    model = copy.deepcopy(model).to("tpu").train()
    run = torch.compile(model, backend="tpu") if mode == "compile" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    update = torch.compile(opt.step, backend="tpu") if mode == "compile" else opt.step
    inputs = ids.to("tpu")

    def step():
        loss = run(input_ids=inputs, labels=inputs).loss
        loss.backward()
        update()
        opt.zero_grad()
        return loss.item()

    with torch.tpu.use_eager_mode("DEFER_NEVER" if mode == "compile" else mode):
        return timeit(step, warmup=3, iters=iters, clock=clock) * 1e3


def lookup_us(weight, ids, iters: int, clock) -> float:
    def lookups():
        out = None
        for _ in range(200):
            out = torch.nn.functional.embedding(ids, weight)
        out.cpu()

    with torch.tpu.use_eager_mode("DEFER_NEVER"):
        return timeit(lookups, warmup=2, iters=iters, clock=clock) / 200 * 1e6


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2, help="turns of off then on")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--only", default="a,b,c", help="comma-separated workload letters")
    p.add_argument("--clock", choices=["wall", "process"], default="wall",
                   help="process: the CPU seconds of this process's threads, for the development CPU shared with "
                        "other work (on a chip the device's time is in the wall time only)")
    args = p.parse_args(argv)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    only = args.only.split(",")
    model = tiny_llama().eval()
    model.generation_config.eos_token_id = None  # every call generates exactly the tokens asked for
    prompt = torch.randint(3, 1000, (1, 32)).to("tpu")
    train_ids = torch.randint(0, 1000, (2, 64))
    weight, lookup_ids = torch.randn(1000, 64, device="tpu"), torch.randint(0, 1000, (8,), device="tpu")
    # (workload, unit, higher is better, measure)
    rows = []
    if "a" in only:
        device_model = copy.deepcopy(model).to("tpu")
        for name, device_loop in (("device loop (default)", True), ("token by token", False)):
            def measure(device_loop=device_loop):
                adapter.configure(device_loop=device_loop)
                try:
                    return decode_rate(device_model, prompt, args.new_tokens, args.iters, clock)
                finally:
                    adapter.configure(device_loop=True)
            rows.append((f"(a) decode, {name}", "tok/s", True, measure))
    if "b" in only:
        for mode in ("DEFER_NEVER", "DEFER_AND_FUSE", "compile"):
            rows.append((f"(b) train step, {mode}", "ms", False,
                         lambda mode=mode: train_step_ms(model, train_ids, mode, args.iters, clock)))
    if "c" in only:
        rows.append(("(c) embedding lookup, DEFER_NEVER", "us/op", False,
                     lambda: lookup_us(weight, lookup_ids, args.iters, clock)))
    results = {name: {False: [], True: []} for name, _, _, _ in rows}
    started = time.perf_counter()
    try:
        for _ in range(args.rounds):
            for on in (False, True):
                set_index_checks(on)
                for name, _, _, measure in rows:
                    results[name][on].append(measure())
    finally:
        set_index_checks(True)
    out = []
    for name, unit, higher, _ in rows:
        off, on = (statistics.median(results[name][k]) for k in (False, True))
        cost = (off / on - 1) if higher else (on / off - 1)
        out.append([name, unit, f"{off:.1f}", f"{on:.1f}", f"{cost * 100:+.1f}%"])
    print(f"index checks off and on, {args.rounds} round(s) of each, {hf_tpu.platform_name()}, {args.clock} clock, "
          f"{time.perf_counter() - started:.0f} s")
    print(table(["workload", "unit", "checks off", "checks on", "cost"], out))


if __name__ == "__main__":
    main()
