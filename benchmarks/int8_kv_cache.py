"""The int8 KV cache (`hf_tpu.integrations.transformers.Int8StaticCache`) against Transformers' bfloat16
`StaticCache`, on one bfloat16 model side by side: the error it adds to the logits (the prompt, then decode steps
fed the same tokens in both, the bfloat16 cache's greedy choices), how often the greedy token changes, the caches'
bytes, and `generate()`'s decode tokens/s with each.

The error is measured against the logits' own spread (their standard deviation over the vocabulary), since a
model of random weights has logits far flatter than a trained one: read it as the size of the perturbation, not as
a quality figure. Beside it, the error bfloat16 itself makes: the same steps with the model and cache in float32,
against the bfloat16 cache's logits. On the CPU the times are the CPU's; on a TPU they show what the halved cache
costs or saves in decode at long context.

Run: python -m benchmarks.int8_kv_cache [--model 1.1b] [--layers 4] [--prompt 2048] [--new 32] [--batch 1]
"""

from __future__ import annotations

import argparse
import time


def _model(name: str, layers: int | None, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks import chip, training

    config = dict(chip._LLAMA_1B if name == "1.1b" else training.TINY)
    if layers:
        config["num_hidden_layers"] = layers
    torch.manual_seed(0)
    llama = LlamaConfig(**config, attn_implementation="sdpa")
    return LlamaForCausalLM._from_config(llama, dtype=torch.bfloat16).eval().to(device)


def _teacher_forced_logits(model, prompt, fed, cache) -> list:
    """The float32 logits of the prompt's last position, then of each of `fed`'s tokens in turn."""
    import torch

    length = prompt.shape[1]
    logits = []
    with torch.no_grad():
        out = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1].float().cpu())
        for k in range(fed.shape[1] - 1):
            position = torch.full((prompt.shape[0], 1), length + k, device=prompt.device)
            out = model(input_ids=fed[:, k:k + 1], position_ids=position, cache=cache, use_cache=True)
            logits.append(out.logits[:, -1].float().cpu())
    return logits


def _compared(logits: list, reference: list):
    """Each step's largest absolute difference from `reference` (steps x batch), the reference's spread (std over
    the vocabulary), and how many greedy tokens agree."""
    import torch

    error = torch.stack([(a - b).abs().amax(-1) for a, b in zip(logits, reference)])
    spread = torch.stack([b.std(-1) for b in reference])
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(logits, reference))
    return error, spread, agree


def _cache_bytes(cache) -> int:
    import torch

    return sum(t.nbytes for layer in cache.layers for t in vars(layer).values()
               if isinstance(t, torch.Tensor) and t.dim() == 4)


def _decode_seconds(model, prompt, new: int, make_cache) -> float:
    """Seconds of `generate()`'s decode steps alone: a run of `new` tokens less a run of one, each timed after a
    first run of the same shapes (compiles out of the way)."""
    import hf_tpu

    def run(tokens):
        start = time.perf_counter()
        out = model.generate(prompt, cache=make_cache(), max_new_tokens=tokens, do_sample=False, eos_token_id=None)
        hf_tpu.to_cpu([out])
        return time.perf_counter() - start

    for tokens in (1, new):
        run(tokens)
    return run(new) - run(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "1.1b"), default="1.1b")
    parser.add_argument("--layers", type=int, help="fewer layers than the model's (a faster run on the CPU)")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--no-time", action="store_true", help="the error and the bytes only")
    args = parser.parse_args()

    import torch
    from transformers import StaticCache

    import hf_tpu  # noqa: F401 - the tpu device
    from hf_tpu.integrations.transformers import Int8StaticCache

    model = _model(args.model, args.layers, args.device)
    config = model.config
    length = args.prompt + args.new
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt), generator=generator).to(args.device)
    caches = {"bfloat16": lambda: StaticCache(config=config, max_cache_len=length),
              "int8": lambda: Int8StaticCache(config=config, max_cache_len=length)}

    # the bfloat16 cache's greedy tokens, fed to both
    reference = model.generate(prompt, cache=caches["bfloat16"](), max_new_tokens=args.new, do_sample=False,
                               eos_token_id=None)[:, args.prompt:]
    filled = {name: make() for name, make in caches.items()}
    logits = {name: _teacher_forced_logits(model, prompt, reference, cache) for name, cache in filled.items()}
    bytes_ = {name: _cache_bytes(cache) for name, cache in filled.items()}
    error, spread, agree = _compared(logits["int8"], logits["bfloat16"])
    steps = len(logits["int8"]) * args.batch
    print(f"{args.model}{f' ({args.layers} layers)' if args.layers else ''}, bfloat16 weights, batch {args.batch}, "
          f"a {args.prompt}-token prompt and {args.new} decode steps, on {args.device}")
    print(f"logits' error of the int8 cache: largest {float(error.max()):.4f}, mean of each step's largest "
          f"{float(error.mean()):.4f}; the logits' spread (std over the vocabulary) {float(spread.mean()):.4f}: "
          f"largest error / spread {float((error / spread).max()):.3f}")
    print(f"greedy token the same as the bfloat16 cache's at {agree} of {steps} positions")
    model.to(torch.float32)
    wide = _teacher_forced_logits(model, prompt, reference, StaticCache(config=config, max_cache_len=length))
    model.to(torch.bfloat16)
    wide_error, _, wide_agree = _compared(logits["bfloat16"], wide)
    print(f"bfloat16's own error (its logits against the float32 model's and cache's): largest "
          f"{float(wide_error.max()):.4f}, mean {float(wide_error.mean()):.4f}: largest / spread "
          f"{float((wide_error / spread).max()):.3f}; greedy token the same at {wide_agree} of {steps}")
    print("cache | bytes allocated for the positions | vs bfloat16" + ("" if args.no_time else " | decode tokens/s"))
    for name, make in caches.items():
        row = f"{name} | {bytes_[name] / 2**20:.1f} MiB | {bytes_[name] / bytes_['bfloat16']:.3f}"
        if not args.no_time:
            seconds = _decode_seconds(model, prompt, args.new, make)
            row += f" | {args.batch * (args.new - 1) / seconds:.1f}"
        print(row)


if __name__ == "__main__":
    main()
