"""`hf-tpu demo`: tensors, a module and a causal LM on `tpu`, against CPU."""

from __future__ import annotations

import time

from . import env


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


def _save_tiny_llama(directory: str) -> str:
    """A tiny Llama built from a config (seed 0), saved under `directory`; its folder."""
    import os

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(directory, "tiny-llama")
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _demo_llama(path=None) -> None:
    """Generation on tpu against CPU, from the checkpoint at `path`, or from a tiny Llama saved in a
    temporary folder that is removed afterwards (nothing stays in the temp dir)."""
    import tempfile

    print("\n== A causal LM loaded with device_map='tpu', generating against CPU ==")
    if path is not None:
        _generate_against_cpu(path)
        return
    with tempfile.TemporaryDirectory(prefix="hf_tpu_demo_") as directory:
        path = _save_tiny_llama(directory)
        print(f"built a tiny Llama from a config (seed 0) and saved it to {path} (removed after the demo)")
        _generate_against_cpu(path)


def _generate_against_cpu(path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

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


def run(args) -> int:
    import torch

    import hf_tpu

    print("== hf-tpu env ==")
    print(env.env_report())
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
