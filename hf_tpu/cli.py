"""`hf-tpu`: the command line. `hf-tpu env` describes the device; `hf-tpu demo` shows it working."""

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
    m = hf_tpu.metrics()
    print(f"\nmetrics: {m['ops_dispatched']} ops dispatched, {m['compiles']} compiles, "
          f"{m['compile_cache_hits']} cache hits, {m['host_syncs']} host syncs, "
          f"cpu fallbacks: {dict(m['cpu_fallbacks']) or 'none'}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hf-tpu", description="A native tpu device for PyTorch, backed by JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print the platform, devices, versions and execution mode")
    sub.add_parser("demo", help="run the demo: tensors, an nn.Module on tpu against cpu")
    args = parser.parse_args(argv)
    if args.command == "env":
        print(env_report())
        return 0
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
