"""Multi-process runs (docs/design/multi-host.md): two processes on this host, two simulated chips
each, joined through JAX's distributed runtime, run one sharded program over the four chips and get
the single-process CPU results. Each process runs this file as a script."""

import os
import socket
import subprocess
import sys

import pytest
import torch
from jax._src.lib import _jax
from transformers import LlamaConfig, LlamaForCausalLM

import hf_tpu.distributed as dist

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)
PROCESSES = 2
CHIPS_PER_PROCESS = 2


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).eval()


def token_ids():
    return torch.randint(0, CONFIG.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))


def train_step(model, ids):
    """Logits and loss of one SGD step's forward, and the parameters it leaves, all on the CPU."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    output = model(ids, labels=ids)
    output.loss.backward()
    optimizer.step()
    params = {name: p.detach().cpu() for name, p in model.named_parameters()}
    return output.logits.detach().cpu(), output.loss.detach().cpu(), params


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not hasattr(_jax, "make_gloo_tcp_collectives"), reason="this jaxlib has no gloo collectives")
def test_two_processes_run_one_sharded_model_like_one_process(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "checkpoint")
    port = free_port()
    workers = []
    for process in range(PROCESSES):
        env = dict(os.environ, HF_TPU_PLATFORM="cpu", HF_TPU_NUM_DEVICES=str(CHIPS_PER_PROCESS),
                   HF_TPU_COORDINATOR_ADDRESS=f"localhost:{port}", HF_TPU_NUM_PROCESSES=str(PROCESSES),
                   HF_TPU_PROCESS_ID=str(process))
        workers.append(subprocess.Popen([sys.executable, __file__, str(tmp_path)], env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    with torch.no_grad():  # meanwhile
        expected_loaded = tiny_llama()(token_ids()).logits
    expected_logits, expected_loss, expected_params = train_step(tiny_llama().train(), token_ids())
    try:
        outputs = [worker.communicate(timeout=240)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    for process, (worker, output) in enumerate(zip(workers, outputs)):
        assert worker.returncode == 0, f"process {process}:\n{output}"
        logits, loss, params, loaded = torch.load(tmp_path / f"process{process}.pt")
        torch.testing.assert_close(loaded, expected_loaded, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
        for name, value in expected_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_initialize_called_after_import_joins_the_run():
    program = (f"import hf_tpu, torch; import hf_tpu.distributed as dist; "
               f"dist.initialize('localhost:{free_port()}', num_processes=1, process_id=0); "
               "assert dist.process_count() == 1; print(torch.ones(2, device='tpu').sum().item())")
    env = dict(os.environ, HF_TPU_PLATFORM="cpu")
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "2.0", done.stderr


def test_initialize_errors_say_what_to_do():
    with pytest.raises(ValueError, match=r"needs num_processes \(HF_TPU_NUM_PROCESSES\), process_id"):
        dist.initialize("localhost:1234")
    torch.ones(1, device="tpu")  # JAX's backends exist from here on
    with pytest.raises(RuntimeError, match="set HF_TPU_COORDINATOR_ADDRESS, HF_TPU_NUM_PROCESSES and HF_TPU_PROCESS_ID before"):
        dist.initialize("localhost:1234", num_processes=2, process_id=0)
    env = dict(os.environ, HF_TPU_PLATFORM="cpu", HF_TPU_NUM_PROCESSES="2")
    env.pop("HF_TPU_COORDINATOR_ADDRESS", None)
    env.pop("HF_TPU_PROCESS_ID", None)
    done = subprocess.run([sys.executable, "-c", "import hf_tpu"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "needs coordinator_address (HF_TPU_COORDINATOR_ADDRESS)" in done.stderr, done.stderr


# --- Run as a script by each process of the test above.


def run_one_process(out_dir):
    """The same program in every process: the model and batch are built whole on each host, each
    process's chips receive their shards, and every process reads back the whole results."""
    assert dist.process_count() == PROCESSES and torch.tpu.device_count() == CHIPS_PER_PROCESS
    assert dist.device_count() == PROCESSES * CHIPS_PER_PROCESS
    mesh = dist.mesh((PROCESSES, CHIPS_PER_PROCESS), ("dp", "tp"))  # data parallel across the processes
    assert mesh.device_indices.tolist() == [[0, 1], [2, 3]] and mesh.device == torch.device("tpu", 0)
    model = tiny_llama().train()
    dist.shard_model(model, model.tp_plan, mesh)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_chip = [torch.tpu.memory_allocated(i) for i in range(CHIPS_PER_PROCESS)]  # this process's chips
    assert all(weights / 2 <= used < weights * 0.55 for used in per_chip), (per_chip, weights)
    result = train_step(model, dist.shard(token_ids(), mesh, ("dp", None)))
    # Transformers' tensor-parallel load: tp over every process's chips, each placing its own shards
    loaded = LlamaForCausalLM.from_pretrained(os.path.join(out_dir, "checkpoint"), device_map="tpu", tp_plan="auto")
    assert dist.sharding(loaded.model.layers[0].self_attn.q_proj.weight).mesh.size == PROCESSES * CHIPS_PER_PROCESS
    with torch.no_grad():
        logits = loaded(token_ids().to("tpu")).logits.cpu()
    torch.save((*result, logits), os.path.join(out_dir, f"process{dist.process_index()}.pt"))


if __name__ == "__main__":
    with torch.tpu.use_eager_mode("DEFER_AND_FUSE"):  # a few programs per step: quick to compile
        run_one_process(sys.argv[1])
