"""A whole training step traced by `hf_tpu.jit` (forward, backward, AdamW) over 8 simulated chips with the data
split over them: one program over the mesh, the gradients combined by XLA, the parameters and AdamW's moments
replicated (data parallel) or split over the chips (`fully_shard`); the losses and parameters are the CPU's. The
test runs this file as a script with 8 simulated chips."""

import os
import subprocess
import sys
from pathlib import Path

import torch

import hf_tpu  # noqa: F401 - the tpu device
from tests.util import causal_lm_step

STEPS, BATCH, LENGTH = 3, 8, 8


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def _train(model, batches, jit):
    """Losses and final parameters of `STEPS` AdamW steps over `batches`, each step traced whole where `jit`."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)

    step = causal_lm_step(model, opt, jit)
    losses = torch.stack([step(ids).cpu() for ids in batches])
    return losses, {name: p.detach().cpu() for name, p in model.named_parameters()}, opt


def test_a_traced_step_over_eight_chips_trains_as_the_cpu():
    env = dict(os.environ, HF_TPU_NUM_DEVICES="8", HF_TPU_PLATFORM="cpu")
    done = subprocess.run([sys.executable, "-m", "tests.test_traced_data_parallel"], cwd=Path(__file__).parents[1],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for layout in ("replicated", "fully sharded"):
        assert f"a traced step over 8 chips, {layout}, matches the CPU" in done.stdout


def _check_eight_chips(cpu_losses, cpu_params, data, fully_sharded: bool):
    import hf_tpu.distributed as dist

    mesh = dist.mesh(8, "dp")
    model = _tiny_llama().to("tpu")
    if fully_sharded:
        dist.fully_shard(model, mesh)
    else:
        for p in model.parameters():
            p.data = dist.replicate(p.data, mesh)
    hf_tpu.reset_metrics()
    for chip in range(8):
        torch.tpu.reset_peak_memory_stats(chip)
    losses, params, opt = _train(model, [dist.shard(ids, mesh, ("dp", None)) for ids in data], jit=True)
    metrics = hf_tpu.metrics()
    # one program traced, by the first layout: the second's reuses its trace (XLA compiles it for the new layout)
    traced = metrics["compiles_by_mode"].get("COMPILE", 0)
    assert traced == (0 if fully_sharded else 1) and not metrics["cpu_fallbacks"], metrics
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-5, atol=1e-5)
    for name, value in cpu_params.items():  # AdamW's step on float32 noise moves by a part of the learning rate
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-3, msg=name)
    def laid_out(t, spec):
        sharding = dist.sharding(t)
        return sharding is not None and sharding.mesh == mesh and sharding.spec == spec

    for p in model.parameters():
        # every dim of the tiny Llama's weights divides by 8: each splits along its first
        spec = ("dp",) * fully_sharded + (None,) * (p.dim() - fully_sharded)
        assert laid_out(p, spec), (tuple(p.shape), dist.sharding(p))
        assert all(laid_out(t, spec) for t in opt.state[p].values() if t.dim()), "AdamW's moments follow the weight"
    chip_bytes = [torch.tpu.memory_allocated(i) for i in range(8)]
    state_bytes = sum(t.nbytes for p in model.parameters() for t in (p, *opt.state[p].values()))
    assert max(chip_bytes) < state_bytes / (8 if fully_sharded else 1) * 1.1, (chip_bytes, state_bytes)
    # at its peak too (the first step makes AdamW's moments, as the parameters are split): parameters, moments and
    # the batches, each chip's share
    peaks = [torch.tpu.max_memory_allocated(i) for i in range(8)]
    assert max(peaks) < state_bytes / (8 if fully_sharded else 1) * 1.25, (peaks, state_bytes)
    print(f"a traced step over 8 chips, {'fully sharded' if fully_sharded else 'replicated'}, matches the CPU")


if __name__ == "__main__":
    assert torch.tpu.device_count() == 8, "run with HF_TPU_NUM_DEVICES=8"
    batches = torch.randint(0, 64, (STEPS, BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    cpu_run = _train(_tiny_llama(), batches, jit=False)[:2]
    for fully in (False, True):
        _check_eight_chips(*cpu_run, batches, fully)
