"""The Transformers `Trainer` under `accelerate launch --config_file examples/accelerate/fsdp.yaml`: one process
driving 2 simulated chips, the parameters, gradients and AdamW's moments split over them, each micro-batch's step
one traced program as on one chip, with gradient accumulation; its losses are the CPU's Trainer's. The launched
process runs this file as a script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
STEPS, BATCH, ACCUMULATION, LENGTH = 3, 4, 2, 16


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _train(out: Path, use_cpu: bool) -> dict:
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, 64, (STEPS * BATCH * ACCUMULATION, LENGTH), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=1e-2,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=use_cpu, seed=0)
    trainer = Trainer(model=_model(), args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "trainer": trainer}


def test_the_trainer_trains_fully_sharded_in_traced_steps_with_the_cpus_losses(tmp_path):
    env = dict(os.environ, HF_TPU_PLATFORM="cpu", HF_TPU_NUM_DEVICES="2", OMP_NUM_THREADS="1")
    command = [str(ACCELERATE), "launch", "--config_file", str(ROOT / "examples" / "accelerate" / "fsdp.yaml"),
               __file__, str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    expected = _train(tmp_path / "cpu", use_cpu=True)["losses"]
    assert len(report["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(expected), rtol=1e-4, atol=1e-4)
    assert report["distributed_type"] == "MULTI_TPU"
    assert report["weight_split"] == ["dp", None] and report["moment_split"] == ["dp", None]
    # the micro step, the clipping and the optimizer's step: three programs, each traced once
    assert report["programs_traced"] == 3, report


if __name__ == "__main__":
    import hf_tpu
    import hf_tpu.distributed as dist

    out = Path(sys.argv[1])
    run = _train(out / "tpu", use_cpu=False)
    trainer = run["trainer"]
    weight = trainer.model.model.layers[0].mlp.up_proj.weight
    moment = trainer.optimizer.state[weight]["exp_avg"]
    (out / "report.json").write_text(json.dumps({
        "losses": run["losses"], "distributed_type": str(trainer.accelerator.distributed_type.value),
        "weight_split": list(dist.sharding(weight).spec), "moment_split": list(dist.sharding(moment).spec),
        "programs_traced": hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0),
    }))
