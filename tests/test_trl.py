"""TRL's `SFTTrainer` on tpu: a tiny Llama fine-tuned on a small chat dataset built here, against the same run on
the CPU."""

import torch

import hf_tpu

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def _sft_losses(tmp_path, device):
    """The logged losses of 3 `SFTTrainer` steps over question-and-answer chats, and the trained model's device."""
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from examples.tiny_llama import save_tiny_llama

    AcceleratorState._reset_state(reset_partial_state=True)  # one Accelerate state per process
    path = save_tiny_llama(str(tmp_path / "model"), small=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    chats = Dataset.from_list([
        {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                      {"role": "assistant", "content": f"{a + b}."}]}
        for a in range(4) for b in range(3)])
    args = SFTConfig(output_dir=str(tmp_path / device), max_steps=3, per_device_train_batch_size=4,
                     learning_rate=1e-3, max_length=64, logging_steps=1, report_to=[], save_strategy="no",
                     use_cpu=device == "cpu", seed=0, disable_tqdm=True, dataloader_pin_memory=False)
    trainer = SFTTrainer(model=path, args=args, train_dataset=chats, processing_class=tokenizer)
    trainer.train()
    losses = torch.tensor([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
    return losses, trainer.model.device.type


def test_sft_trainer_fine_tunes_on_tpu_with_the_cpu_losses(tmp_path, caplog):
    """The chats go through TRL's chat template, tokenization and collator as on any device. TRL's `compute_loss`
    reads its entropy and token accuracy on the host at every micro-batch, so the Trainer's traced micro step
    falls back to running eagerly, and says why; the losses are the CPU's."""
    cpu, on = _sft_losses(tmp_path, "cpu")
    assert on == "cpu"
    with caplog.at_level("WARNING"):
        tpu, on = _sft_losses(tmp_path, "tpu")
    assert on == "tpu"
    assert len(tpu) == 3 and ((tpu - cpu).abs() / cpu.abs()).max().item() < 1e-3, (tpu, cpu)
    assert tpu[-1] < tpu[0]
    assert "Untraceable: item()" in caplog.text
    assert not hf_tpu.metrics()["cpu_fallbacks"]
