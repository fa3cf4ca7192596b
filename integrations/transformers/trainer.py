"""The Trainer on `tpu`: each micro-batch's forward and backward is one traced program, which also filters a NaN or
infinite loss out of the logged loss (the Trainer read each micro-batch's loss on the host for it), a causal LM's
batches are padded to their length bucket (a batch of another length in the same bucket runs the same program), its
checkpoints hold the `tpu` random state, its logged loss is gathered across processes under Accelerate's data
parallelism, and `torch_compile=True` compiles with the `tpu` backend, the model traced into the micro step's
program."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
from collections.abc import Mapping

import torch

import hf_tpu
from hf_tpu import settings as _environment

from .compiled_buckets import _lengths_from, _model_pads, _pad

log = logging.getLogger("hf_tpu.integrations")

_environment.register(
    _environment.Setting("HF_TPU_TRAINER_TRACE", "bool", True, "Transformers Trainer: trace each micro-batch's forward "
                         "and backward into one program with hf_tpu.jit (off: run them eagerly)"),
)


# --- The Trainer's training step: one traced program a micro-batch


def _untraced_because(trainer) -> str | None:
    """Why the Trainer's micro-steps on tpu run eagerly (None: they run traced): the model is compiled with a
    backend other than `tpu` (`torch_compile_backend`, the user's choice of Dynamo's graphs), `HF_TPU_TRAINER_TRACE`
    is off, or Accelerate's `MULTI_TPU` data parallelism over several processes, whose traced step is not tested yet
    (one process driving every chip of its host, replicated or fully sharded, traces its steps as one chip does).

    `torch_compile=True` (the `tpu` backend) runs the traced micro step too: the model, wrapped by
    `torch.compile(backend="tpu")`, is traced as part of the micro step's program (a module compiled with the `tpu`
    backend is, inside a trace: `hf_tpu/compiled_modules.py`), so each micro-batch's forward and backward is one
    program, what compiling the model asks for. Run eagerly around Dynamo's graphs, the 0.44B's step of 4
    micro-batches took 564.9 ms on a v5e against the traced micro step's 318.8 ms, its first step 178.6 s against
    58.0 s (docs/benchmarks.md)."""
    backend = trainer.args.torch_compile_backend
    if trainer.args.torch_compile and str(backend).lower() != "tpu":
        return f"torch_compile_backend={backend!r} compiles the model with Dynamo instead"
    if not _environment.get("HF_TPU_TRAINER_TRACE"):
        return "HF_TPU_TRAINER_TRACE is off"
    if trainer.accelerator.distributed_type != "NO" and not (
            trainer.accelerator.distributed_type == "MULTI_TPU" and hf_tpu.distributed.process_count() == 1):
        return f"Accelerate's {trainer.accelerator.distributed_type} over processes runs each one's steps eagerly"
    return None


def _gradients_made(parameters: list) -> None:
    """A zero `.grad` for each parameter, all made by one program: the Trainer's `zero_grad()` leaves none, and
    made one by one (`torch.zeros_like`) they were an op each. The program reads no input, so its results are not
    committed to their device: `hf_tpu.jit` commits them where they lie when the micro step takes them."""
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)


_traced_gradients_made = hf_tpu.jit(_gradients_made)


def _micro_step(training_step, model, inputs, num_items_in_batch, logged_loss=None, steps_since_logged=None):
    """The Trainer's `training_step`; with `logged_loss`, its loss as the Trainer adds it to the loss it logs
    (`logging_nan_inf_filter`): a NaN or infinite loss replaced by the mean of the logged loss so far,
    `logged_loss / steps_since_logged`, the value the Trainer adds in its place."""
    loss = training_step(model, inputs, num_items_in_batch)
    if logged_loss is None:
        return loss
    return torch.where(torch.isfinite(loss), loss, logged_loss / steps_since_logged)


_traced_micro_step = hf_tpu.jit(_micro_step)


def _wrap_training_step(original):
    @functools.wraps(original)
    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's own `training_step` (forward, loss, `accelerator.backward`), traced by `hf_tpu.jit` into one
        program: a checkpointed layer is recomputed in it, and the gradients stay on the device, never read on the
        host. Without accumulation each micro-batch is its optimizer step's only one: `zero_grad()` left no `.grad`,
        and the program sets them (its outputs). With accumulation every trainable parameter gets a zero `.grad`
        before the first micro-batch of each window (`_gradients_made`), so that micro-batch runs the program the
        others run, which adds to them in place: one trace and one compile of the forward and backward. Inside the
        Trainer's loop, where the loss filter runs on the device (`_run_epoch`), the program also filters the loss it
        returns. A step the trace cannot take (a subclass's `compute_loss` that reads a value on the host) runs as
        the Trainer runs it, with a log line saying why."""
        if self.args.device.type != "tpu":
            return original(self, model, inputs, num_items_in_batch)
        reason = _untraced_because(self)
        if reason is not None:
            if self.__dict__.get("_hf_tpu_untraced") != reason:
                self._hf_tpu_untraced = reason
                log.info("hf_tpu: the Trainer's training_step runs eagerly on tpu, not as one traced program: %s", reason)
            return original(self, model, inputs, num_items_in_batch)
        if self.args.gradient_accumulation_steps > 1:
            missing = [p for p in model.parameters() if p.requires_grad and p.grad is None]
            if missing:
                # made eagerly beside parameters split over chips, split as they are (`zeros_like`): a program that
                # reads nothing makes its results on one chip, and the micro step would add to them there
                made = _gradients_made if hf_tpu.distributed.sharding(missing[0]) else _traced_gradients_made
                made(missing)
        step = functools.partial(original, self)
        if not self.__dict__.get("_hf_tpu_filters_losses"):
            return _traced_micro_step(step, model, inputs, num_items_in_batch)
        steps_since_logged = 1 + self.state.global_step - self._globalstep_last_logged
        return _traced_micro_step(step, model, inputs, num_items_in_batch, self._tr_loss,
                                  torch.tensor(float(steps_since_logged), device=self._tr_loss.device))

    return training_step


# --- The Trainer's NaN filter of the logged loss, on the device


def _filters_losses_on_the_device(trainer) -> bool:
    """Whether the micro steps filter the logged loss (`_micro_step`) in place of the Trainer's own check: on tpu,
    traced, with `logging_nan_inf_filter` on."""
    return (trainer.args.device.type == "tpu" and trainer.args.logging_nan_inf_filter
            and _untraced_because(trainer) is None and isinstance(getattr(trainer, "_tr_loss", None), torch.Tensor))


@contextlib.contextmanager
def _arguments_as_given(trainer):
    """The user's `logging_nan_inf_filter` back on `trainer.args` for the block (`_run_epoch` turned it off)."""
    if not trainer.__dict__.get("_hf_tpu_filters_losses"):
        yield
        return
    trainer.args.logging_nan_inf_filter = True
    try:
        yield
    finally:
        trainer.args.logging_nan_inf_filter = False


def _wrap_run_epoch(original):
    @functools.wraps(original)
    def _run_epoch(self, *args, **kwargs):
        """The Trainer's loop over an epoch's micro-batches, whose check of each loss for NaN or infinity
        (`logging_nan_inf_filter`, on by default: `torch.isnan(loss) or torch.isinf(loss)`) read every micro-batch's
        loss on the host: the host then waited for each micro step's program before it launched the next, the chip
        idle meanwhile (under torch_xla the Trainer skips the check). On tpu the traced micro step filters the loss
        it returns as the check would (`_micro_step`: the same logged loss), and `args.logging_nan_inf_filter` is off
        while the loop runs, but for its logging, evaluation and checkpoints (`_maybe_log_save_evaluate`: the saved
        arguments are the user's)."""
        if not _filters_losses_on_the_device(self):
            return original(self, *args, **kwargs)
        self._hf_tpu_filters_losses = True
        self.args.logging_nan_inf_filter = False
        try:
            return original(self, *args, **kwargs)
        finally:
            self.args.logging_nan_inf_filter = True
            self._hf_tpu_filters_losses = False

    return _run_epoch


def _wrap_maybe_log_save_evaluate(original):
    @functools.wraps(original)
    def _maybe_log_save_evaluate(self, *args, **kwargs):
        with _arguments_as_given(self):
            return original(self, *args, **kwargs)

    return _maybe_log_save_evaluate


# --- The Trainer's batches: a causal LM's padded to its length bucket

# what a training batch may hold for its padding to change nothing the loss sees
_PADDABLE = frozenset(("input_ids", "labels", "attention_mask"))


class BucketPadded:
    """The Trainer's collator, with each batch of a causal LM's token ids padded on the right to its length bucket
    (`compiled_buckets.buckets()`, `HF_TPU_COMPILED_BUCKETS`): every length in a bucket then makes the same traced
    program, where each length made a compile of its own (tens of seconds on a chip). Padding there changes no loss
    and no gradient: a real position attends to the positions up to it only, so the appended ones (token 0, mask 1
    where a mask is given, as `torch.compile`'s buckets pad) reach nothing real, and their labels are the ignored
    -100, so the loss's mean and `num_items_in_batch` count the same tokens. A batch holding anything else
    (positions, token types, images) is left as it is. A class, not a closure, so a dataloader's workers can take
    it."""

    def __init__(self, collate, longest: int | None):
        self.collate, self.longest = collate, longest

    def __call__(self, features):
        batch = self.collate(features)
        if not isinstance(batch, Mapping) or "labels" not in batch or set(batch) - _PADDABLE:
            return batch
        ids = batch.get("input_ids")
        if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point
                or any(not isinstance(batch[k], torch.Tensor) or batch[k].shape != ids.shape for k in batch)):
            return batch
        rows, length = ids.shape
        lengths = _lengths_from(length, self.longest)
        if not lengths or lengths[0] == length:
            return batch
        padded = copy.copy(batch)
        for name, value in (("input_ids", 0), ("labels", -100), ("attention_mask", 1)):
            if name in batch:
                padded[name] = _pad(batch[name], rows, lengths[0], value)
        return padded


def _pads_batches(trainer) -> bool:
    """Whether the Trainer's training batches are padded to their bucket (`BucketPadded`): on tpu, for a causal LM
    whose prompts `torch.compile`'s buckets pad (`compiled_buckets._model_pads`; a PEFT model's base model), trained
    with the Trainer's own loss (a subclass's `compute_loss`, a `compute_loss_func` or label smoothing may read
    every position's logits), without a router's balancing loss (which counts every token)."""
    from transformers import Trainer

    model = trainer.model
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (trainer.args.device.type == "tpu" and type(trainer).compute_loss is Trainer.compute_loss
            and trainer.compute_loss_func is None and trainer.label_smoother is None
            and hasattr(model, "config") and not getattr(model.config, "output_router_logits", False)
            and _model_pads(model))


def _wrap_get_train_dataloader(original):
    @functools.wraps(original)
    def get_train_dataloader(self):
        if not _pads_batches(self):
            return original(self)
        collate = self.data_collator
        self.data_collator = BucketPadded(collate, getattr(self.model.config, "max_position_embeddings", None))
        try:
            return original(self)
        finally:
            self.data_collator = collate

    return get_train_dataloader


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


# --- The Trainer's logged loss with several chips or processes


def _wrap_nested_gather(original):
    @functools.wraps(original)
    def nested_gather(tensors, parallel_mode, name=None):
        """The Trainer gathers its loss across processes with `torch.distributed.all_gather`, which has no
        backend for tpu tensors; under Accelerate's data parallelism on tpu (`MULTI_TPU`) Accelerate's
        `gather` does it (hf_tpu.distributed's collectives, integrations/accelerate/data_parallel.py)."""
        from transformers.training_args import ParallelMode

        if parallel_mode == ParallelMode.DISTRIBUTED and _holds_tpu_tensors(tensors):
            from accelerate.utils import gather

            return gather(tensors)
        return original(tensors, parallel_mode, name)

    return nested_gather


def _wrap_broadcast_scalars(original):
    @functools.wraps(original)
    def distributed_broadcast_scalars(scalars, num_total_examples=None, device=torch.device("cuda")):
        """Python numbers (the floating-point operation count) gathered across processes through the
        process group Accelerate opened, on the CPU: it has no backend for tpu tensors."""
        if torch.device(device).type == "tpu":
            return original(scalars, num_total_examples, device=torch.device("cpu")).to(device)
        return original(scalars, num_total_examples, device=device)

    return distributed_broadcast_scalars


def _holds_tpu_tensors(tensors) -> bool:
    if isinstance(tensors, (list, tuple)):
        return any(_holds_tpu_tensors(t) for t in tensors)
    if isinstance(tensors, dict):
        return any(_holds_tpu_tensors(t) for t in tensors.values())
    return isinstance(tensors, torch.Tensor) and tensors.device.type == "tpu"


# --- The Trainer's `torch_compile=True`: the tpu backend, as Transformers picks HPU's and Neuron's


def _wrap_training_args_post_init(original):
    @functools.wraps(original)
    def __post_init__(self):
        """`TrainingArguments(torch_compile=True)` names no backend, and Transformers then picks its
        accelerator's (`hpu_backend`, `neuron`) or Inductor, which cannot compile for tpu (it imports a
        `torch_tpu` module). With tpu as PyTorch's accelerator the Trainer compiles with
        `backend="tpu"` (`integrations/accelerate/device.py` makes it one of Accelerate's backends)."""
        accelerator = torch.accelerator.current_accelerator()
        if ((self.torch_compile or self.torch_compile_mode is not None) and self.torch_compile_backend is None
                and not self.use_cpu and accelerator is not None and accelerator.type == "tpu"):
            self.torch_compile_backend = "tpu"
        original(self)

    return __post_init__
