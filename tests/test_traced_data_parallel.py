"""A whole training step traced by `hf_tpu.jit` (forward, backward, AdamW) over 8 simulated chips with the data
split over them: one program over the mesh, the parameters and AdamW's moments replicated, the gradients combined
by XLA; the losses and parameters are the CPU's. The test runs this file as a script with 8 simulated chips."""

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
    assert "a traced step over 8 chips matches the CPU" in done.stdout


def _check_eight_chips():

    import hf_tpu.distributed as dist

    data = torch.randint(0, 64, (STEPS, BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    cpu_losses, cpu_params, _ = _train(_tiny_llama(), data, jit=False)

    mesh = dist.mesh(8, "dp")
    model = _tiny_llama().to("tpu")
    for p in model.parameters():
        p.data = dist.replicate(p.data, mesh)
    hf_tpu.reset_metrics()
    losses, params, opt = _train(model, [dist.shard(ids, mesh, ("dp", None)) for ids in data], jit=True)
    metrics = hf_tpu.metrics()
    assert metrics["compiles_by_mode"].get("COMPILE") == 1 and not metrics["cpu_fallbacks"], metrics
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-5, atol=1e-5)
    for name, value in cpu_params.items():  # AdamW's step on float32 noise moves by a part of the learning rate
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-3, msg=name)
    def replicated(t):
        sharding = dist.sharding(t)
        return sharding is not None and sharding.mesh == mesh and all(axes is None for axes in sharding.spec)

    assert all(map(replicated, model.parameters()))
    assert all(replicated(t) for state in opt.state.values() for t in state.values())
    print("a traced step over 8 chips matches the CPU")


if __name__ == "__main__":
    assert torch.tpu.device_count() == 8, "run with HF_TPU_NUM_DEVICES=8"
    _check_eight_chips()
