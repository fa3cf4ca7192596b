"""`hf-tpu`: the command line. `hf-tpu env` describes the device; `hf-tpu demo` shows it working;
`hf-tpu compat` prints the per-architecture compatibility table; `hf-tpu sweep` checks architectures."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def env_report() -> str:
    import jax
    import torch

    import hf_tpu

    lines = [
        f"hf-tpu        {hf_tpu.__version__}",
        f"platform      {hf_tpu.platform_name()} (JAX default backend: {jax.default_backend()})",
        f"devices       {torch.tpu.device_count()}: "
        + ", ".join(f"tpu:{i} = {torch.tpu.get_device_properties(i).jax_device}" for i in range(torch.tpu.device_count())),
        f"device name   {torch.tpu.get_device_name()}",
        f"eager mode    {torch.tpu.eager_mode.name}" if hasattr(torch.tpu, "eager_mode") else "",
        f"accelerator   {torch.accelerator.current_accelerator()}",
    ]
    for pkg in ("torch", "jax", "jaxlib", "transformers", "diffusers", "accelerate", "safetensors"):
        lines.append(f"{pkg:<13} {_version(pkg)}")
    return "\n".join(line for line in lines if line)


def _demo_module() -> None:
    import torch

    print("\n== A small nn.Module on tpu against cpu ==")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    )
    x = torch.randn(8, 16)
    expected = model(x)
    start = time.perf_counter()
    actual = model.to("tpu")(x.to("tpu"))
    elapsed = time.perf_counter() - start
    diff = (actual.cpu() - expected).abs().max().item()
    print(f"output {tuple(actual.shape)} on {actual.device}; max |tpu - cpu| = {diff:.2e} ({elapsed * 1e3:.0f} ms incl. compile)")
    loss = actual.square().mean()
    loss.backward()
    grad = model[0].weight.grad
    print(f"backward: grad of first layer {tuple(grad.shape)} on {grad.device}, norm {grad.norm().item():.4f}")
    if diff > 1e-4:
        raise SystemExit(f"demo failed: tpu and cpu differ by {diff}")


def _demo_llama(path=None) -> None:
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    print("\n== A causal LM loaded with device_map='tpu', generating against CPU ==")
    if path is None:
        path = tempfile.mkdtemp(prefix="hf_tpu_demo_")
        config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
        print(f"built a tiny Llama from a config (seed 0) and saved it to {path}")
    cpu_model = AutoModelForCausalLM.from_pretrained(path)
    tpu_model = AutoModelForCausalLM.from_pretrained(path, device_map="tpu")
    print(f"loaded with device_map='tpu': parameters on {next(tpu_model.parameters()).device}")
    prompt = torch.tensor([[1, 17, 42, 7, 99, 3]]) % cpu_model.config.vocab_size
    new_tokens = 16
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    cpu_model.generate(prompt, **kwargs)  # warm-up, as for tpu below
    start = time.perf_counter()
    expected = cpu_model.generate(prompt, **kwargs)
    cpu_rate = new_tokens / (time.perf_counter() - start)
    rows = [("torch cpu eager, dynamic cache", cpu_rate)]
    for mode in ("DEFER_NEVER", "DEFER_AND_FUSE"):
        with torch.tpu.use_eager_mode(mode):
            tpu_model.generate(prompt.to("tpu"), **kwargs)  # warm-up: compiles
            start = time.perf_counter()
            actual = tpu_model.generate(prompt.to("tpu"), **kwargs).cpu()
            # the Transformers adapter's default on tpu: a static cache, and the tokens after the first
            # decoded in one device loop of the torch.compile'd step
            rows.append((f"tpu static cache, device loop ({mode})", new_tokens / (time.perf_counter() - start)))
        if not torch.equal(actual, expected):
            raise SystemExit(f"demo failed: greedy tokens differ in {mode}: {actual.tolist()} vs {expected.tolist()}")
    print(f"greedy tokens identical to CPU: {actual[0, prompt.shape[1]:].tolist()}")
    for name, rate in rows:
        print(f"  {name:<44} {rate:7.1f} tokens/s")


def demo(args) -> int:
    import torch

    import hf_tpu

    print("== hf-tpu env ==")
    print(env_report())
    x = torch.arange(6.0, device="tpu").reshape(2, 3)
    print(f"\n== A tensor on tpu ==\n{x}\nx.t()[0].mul_(10) writes through the view:")
    x.t()[0].mul_(10)
    print(x)
    _demo_module()
    _demo_llama(args.model)
    m = hf_tpu.metrics()
    print(f"\nmetrics: {m['ops_dispatched']} ops dispatched, {m['compiles']} compiles, "
          f"{m['compile_cache_hits']} cache hits, {m['host_syncs']} host syncs, "
          f"cpu fallbacks: {dict(m['cpu_fallbacks']) or 'none'}")
    return 0


GENERATED_BEGIN = "<!-- BEGIN ARCHITECTURES: generated from model_patches/table.json by `hf-tpu compat --write-docs` -->"
GENERATED_END = "<!-- END ARCHITECTURES -->"


def _docs_path():
    from pathlib import Path

    from hf_tpu import model_patches

    return Path(model_patches.__file__).resolve().parents[1] / "docs" / "compatibility.md"


def docs_with_table(text: str, table_markdown: str) -> str:
    """The compatibility page with its generated section replaced by `table_markdown`."""
    head, begin, rest = text.partition(GENERATED_BEGIN)
    _, end, tail = rest.partition(GENERATED_END)
    if not begin or not end:
        raise SystemExit(f"the compatibility page lacks the markers {GENERATED_BEGIN!r} ... {GENERATED_END!r}")
    return f"{head}{GENERATED_BEGIN}\n{table_markdown}{GENERATED_END}{tail}"


def compat(args) -> int:
    from hf_tpu import model_patches

    table_markdown = model_patches.render_markdown()
    if args.write_docs:
        path = args.docs or _docs_path()
        with open(path, encoding="utf-8") as f:
            text = f.read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(docs_with_table(text, table_markdown))
        print(f"wrote the architecture table to {path}")
    elif args.markdown:
        print(table_markdown, end="")
    else:
        table = model_patches.load_table()
        for model_type, entry in sorted(table["architectures"].items()):
            patches = f" [patches: {', '.join(entry['patches'])}]" if entry["patches"] else ""
            limits = f"  {entry['limits']}" if entry["limits"] else ""
            print(f"{model_type:<28} {entry['status']:<19} {entry['checked']}{patches}{limits}")
        print(f"({len(table['not_checked'])} not checked: their tiny config fails on CPU; see --markdown)")
    return 0


def sweep_command(args) -> int:
    from . import sweep as sweeping

    only = args.only.split(",") if args.only else None
    jobs = sweeping.architectures(only=only, limit=args.limit)
    print(f"checking {len(jobs)} architectures on cpu and tpu ({args.jobs} worker(s), {args.timeout:.0f} s each)")

    def record(result):
        print(sweeping.format_result(result), flush=True)
        if args.write:
            sweeping.write_table([result])

    results = sweeping.run_sweep(jobs, jobs=args.jobs, timeout=args.timeout, on_result=record)
    print(sweeping.summary(results))
    if args.write:
        print("updated model_patches/table.json; run `hf-tpu compat --write-docs` to regenerate the docs")
    if args.json:
        import dataclasses
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return 0 if all(r.outcome in ("passes", "skipped-cpu-fails") for r in results) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hf-tpu", description="A native tpu device for PyTorch, backed by JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print the platform, devices, versions and execution mode")
    demo_parser = sub.add_parser("demo", help="run the demo: tensors, a module and a causal LM on tpu against cpu")
    demo_parser.add_argument("--model", help="a local Transformers causal-LM checkpoint to use instead of a tiny Llama")
    compat_parser = sub.add_parser("compat", help="print the per-architecture compatibility table")
    compat_parser.add_argument("--markdown", action="store_true", help="print the table as the docs' markdown")
    compat_parser.add_argument("--write-docs", action="store_true",
                               help="regenerate the table section of docs/compatibility.md from the table")
    compat_parser.add_argument("--docs", help="the page to write instead of the repository's docs/compatibility.md")
    sweep_parser = sub.add_parser("sweep", help="run tiny models of every Transformers architecture on cpu and tpu")
    sweep_parser.add_argument("--only", help="comma-separated model types, e.g. llama,mistral")
    sweep_parser.add_argument("--limit", type=int, help="check only the first N architectures")
    sweep_parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    sweep_parser.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture (default 120)")
    sweep_parser.add_argument("--write", action="store_true", help="record the results in model_patches/table.json")
    sweep_parser.add_argument("--json", help="also write every result to this JSON file")
    args = parser.parse_args(argv)
    if args.command == "env":
        print(env_report())
        return 0
    if args.command == "compat":
        return compat(args)
    if args.command == "sweep":
        return sweep_command(args)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
