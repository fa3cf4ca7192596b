"""`accelerate launch` on tpu (docs/design/accelerate-launch.md): the configs in examples/accelerate/ start
real processes, which train a small model with gradient accumulation and clipping, save and load their
state and their model, and give a single CPU process's losses and weights. Each launched process runs
this file as a script; the CPU's simulated chips stand for a host's chips. `one-chip.yaml` launches a
plain single process, which the one-chip and mixed-precision tests run in this process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jax._src.lib import _jax

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "accelerate"
ACCELERATE = Path(sys.executable).with_name("accelerate")
ROWS_PER_PROCESS = 4  # a micro-batch, per process
MICRO_STEPS = 4  # two optimizer steps of two accumulated micro-batches
LR = 0.5


def tiny_model():
    """Two norm layers: parameters created equal (weights of ones, biases of zeros), which once made replicas
    over the same chip memory that the optimizer's step donated twice (tests/test_equal_parameters.py)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(),
                               torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))


def data(processes):
    generator = torch.Generator().manual_seed(1)
    rows = ROWS_PER_PROCESS * processes * MICRO_STEPS
    x = torch.randn(rows, 8, generator=generator)
    return x, x.sum(1, keepdim=True).sin()


def cpu_reference(processes):
    """One CPU process on the whole batch of every step: the data-parallel run's losses and weights."""
    model, (x, y) = tiny_model(), data(processes)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, batch = [], ROWS_PER_PROCESS * processes
    for step in range(MICRO_STEPS):
        rows = slice(step * batch, (step + 1) * batch)
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        (loss / 2).backward()
        losses.append(loss.item())
        if step % 2 == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    return losses, {name: p.detach() for name, p in model.state_dict().items()}


def launch(config, out, *options, chips=2, timeout=240, **variables):
    env = dict(os.environ, HF_TPU_PLATFORM="cpu", HF_TPU_NUM_DEVICES=str(chips), OMP_NUM_THREADS="1", **variables)
    command = [str(ACCELERATE), "launch", "--config_file", str(CONFIGS / config), *options, __file__, str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads(path.read_text()) for path in sorted(out.glob("process*.json"))]


def check_against_cpu(reports, processes):
    losses, weights = cpu_reference(processes)
    assert len(reports) == processes
    for report in reports:
        assert report["distributed_type"] == ("MULTI_TPU" if report["launcher"] == "torchrun" else "NO")
        torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        for name, value in report["weights"].items():
            torch.testing.assert_close(torch.tensor(value), weights[name], rtol=1e-5, atol=1e-6, msg=name)
        assert report["reloaded_equal"] and report["state_restored"]


def train_in_this_process(out, monkeypatch, precision="no"):
    """`train` in the test process (one chip, `distributed_type: 'NO'`, as `one-chip.yaml` launches it): what
    `accelerate launch --mixed_precision` passes to the script is ACCELERATE_MIXED_PRECISION."""
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", precision)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        train(out)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return json.loads((out / "process0.json").read_text())


def test_one_chip(tmp_path, monkeypatch):
    report = train_in_this_process(tmp_path, monkeypatch)
    assert report["device"] == "tpu:0" and report["chips_holding_a_weight"] == 1
    check_against_cpu([report], processes=1)


def test_one_process_drives_every_chip(tmp_path):
    (report,) = launch("all-chips.yaml", tmp_path)
    assert report["chips_holding_a_weight"] == 2 and report["batch_rows_per_chip"] == ROWS_PER_PROCESS // 2
    check_against_cpu([report], processes=1)


@pytest.mark.parametrize("how", ["fully_shard before prepare", "fsdp.yaml"])
def test_fully_sharded_data_parallel_splits_the_parameters_and_trains_as_the_cpu(tmp_path, how):
    if how == "fsdp.yaml":
        (report,) = launch("fsdp.yaml", tmp_path)
    else:
        (report,) = launch("all-chips.yaml", tmp_path, FULLY_SHARD="1")
    assert report["distributed_type"] == "MULTI_TPU"
    assert report["weight_split"] == "('dp', None)" and report["batch_rows_per_chip"] == ROWS_PER_PROCESS // 2
    check_against_cpu([report], processes=1)


@pytest.mark.skipif(not hasattr(_jax, "make_gloo_tcp_collectives"), reason="this jaxlib has no gloo collectives")
def test_two_processes_on_localhost(tmp_path):
    # with no HF_TPU_EAGER_MODE: several processes on the CPU platform start launch-blocking
    # (modes.default_mode), since their cross-process collectives can hang with several programs in flight
    reports = launch("multi-process.yaml", tmp_path, "--main_process_port", str(_free_port()))
    assert [r["process_index"] for r in reports] == [0, 1]
    assert {r["eager_mode"] for r in reports} == {"DEFER_NEVER_AND_LAUNCH_BLOCKING"}
    assert all(r["chips_holding_a_weight"] == 4 and r["gathered"] == [0.0, 1.0] for r in reports)
    assert all(r["broadcast"] == 0.0 and r["reduced_sum"] == 1.0 for r in reports)
    check_against_cpu(reports, processes=2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision(tmp_path, monkeypatch, precision):
    report = train_in_this_process(tmp_path, monkeypatch, precision)
    assert report["hidden_dtype"] == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    assert report["scaler"] == ("GradScaler" if precision == "fp16" else None)
    assert report["reloaded_equal"] and report["state_restored"]
    losses, _ = cpu_reference(1)
    torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(losses), rtol=2e-2, atol=2e-2)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# --- Run by every launched process.


def train(out_dir: Path):
    import hf_tpu  # noqa: F401
    import hf_tpu.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(gradient_accumulation_steps=2)
    set_seed(0)
    processes = accelerator.num_processes
    x, y = data(processes)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=ROWS_PER_PROCESS)
    model = tiny_model()
    if os.environ.get("FULLY_SHARD") == "1":  # FSDP: the parameters split over the chips before `prepare`
        dist.fully_shard(model, dist.mesh(dist.device_count(), "dp"))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    hidden_dtypes = []
    model[0].register_forward_hook(lambda module, args, output: hidden_dtypes.append(str(output.dtype)))
    losses, rows_per_chip = [], None
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            layout = dist.sharding(inputs)
            rows_per_chip = inputs.shape[0] // (layout.mesh.size if layout else 1)
            loss = torch.nn.functional.mse_loss(model(inputs).float(), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    weight = accelerator.unwrap_model(model)[0].weight
    layout = dist.sharding(weight)
    rank = torch.tensor(float(accelerator.process_index), device=accelerator.device)
    report = {
        "launcher": "torchrun" if "LOCAL_RANK" in os.environ else "simple",
        "distributed_type": str(accelerator.distributed_type.value), "device": str(accelerator.device),
        "process_index": accelerator.process_index, "losses": losses, "batch_rows_per_chip": rows_per_chip,
        "eager_mode": __import__("hf_tpu").modes.get_eager_mode().name,
        "chips_holding_a_weight": layout.mesh.size if layout else 1, "weight_split": str(layout and layout.spec),
        "gathered": accelerator.gather(rank).cpu().tolist(),
        "broadcast": __import__("accelerate").utils.broadcast(rank.clone(), from_process=0).item(),
        "reduced_sum": accelerator.reduce(rank, "sum").item(),
        "hidden_dtype": hidden_dtypes[0], "scaler": type(accelerator.scaler).__name__ if accelerator.scaler else None,
        "weights": {name: p.detach().cpu().tolist() for name, p in accelerator.get_state_dict(model).items()},
    }
    # the model to safetensors and back
    accelerator.save_model(model, out_dir / "model")
    accelerator.wait_for_everyone()
    from safetensors.torch import load_file

    reloaded = tiny_model()
    reloaded.load_state_dict(load_file(out_dir / "model" / "model.safetensors"))
    report["reloaded_equal"] = all(torch.equal(reloaded.state_dict()[name].float(), torch.tensor(value))
                                   for name, value in report["weights"].items())
    # the training state: saved, changed, restored
    accelerator.save_state(out_dir / "state")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    accelerator.load_state(out_dir / "state")
    restored = {name: p.detach().cpu() for name, p in accelerator.get_state_dict(model).items()}
    report["state_restored"] = all(torch.equal(restored[name], torch.tensor(value))
                                   for name, value in report["weights"].items())
    restored_layout = dist.sharding(accelerator.unwrap_model(model)[0].weight)
    assert (restored_layout.mesh.size if restored_layout else 1) == report["chips_holding_a_weight"]
    assert str(restored_layout and restored_layout.spec) == report["weight_split"]
    (out_dir / f"process{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.end_training()
    accelerator.free_memory()


if __name__ == "__main__":
    train(Path(sys.argv[1]))
