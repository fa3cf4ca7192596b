"""The Trainer on `tpu`: its checkpoints hold the `tpu` random state, and `torch_compile=True` compiles
with the `tpu` backend."""

from __future__ import annotations

import functools
import os

import torch


# --- The Trainer's checkpoints: the tpu random state beside the CUDA one


def _trainer_rng_file(trainer, folder: str) -> str:
    name = "rng_state.pth" if trainer.args.world_size <= 1 else f"rng_state_{trainer.args.process_index}.pth"
    return os.path.join(folder, name)


def _wrap_save_rng_state(original):
    @functools.wraps(original)
    def _save_rng_state(self, output_dir):
        """A checkpoint holds the random states of the devices Transformers knows; the tpu's is added, so
        a resumed run draws the dropout masks the uninterrupted run would have drawn."""
        original(self, output_dir)
        path = _trainer_rng_file(self, output_dir)
        if self.args.device.type == "tpu" and os.path.isfile(path):
            states = torch.load(path, weights_only=False)  # the Trainer's own file (Python's random state)
            states["tpu"] = torch.tpu.get_rng_state_all()
            torch.save(states, path)

    return _save_rng_state


def _wrap_load_rng_state(original):
    @functools.wraps(original)
    def _load_rng_state(self, checkpoint):
        original(self, checkpoint)
        path = _trainer_rng_file(self, checkpoint) if checkpoint is not None else None
        if path is not None and self.args.device.type == "tpu" and os.path.isfile(path):
            states = torch.load(path, weights_only=False)
            if "tpu" in states:
                torch.tpu.set_rng_state_all(states["tpu"])

    return _load_rng_state


# --- The Trainer's `torch_compile=True`: the tpu backend, as Transformers picks HPU's and Neuron's


def _wrap_training_args_post_init(original):
    @functools.wraps(original)
    def __post_init__(self):
        """`TrainingArguments(torch_compile=True)` names no backend, and Transformers then picks its
        accelerator's (`hpu_backend`, `neuron`) or Inductor, which cannot compile for tpu (it imports a
        `torch_tpu` module). With tpu as PyTorch's accelerator the Trainer compiles with
        `backend="tpu"` (`integrations/accelerate.py` makes it one of Accelerate's backends)."""
        accelerator = torch.accelerator.current_accelerator()
        if ((self.torch_compile or self.torch_compile_mode is not None) and self.torch_compile_backend is None
                and not self.use_cpu and accelerator is not None and accelerator.type == "tpu"):
            self.torch_compile_backend = "tpu"
        original(self)

    return __post_init__
