"""The optimizer's step on `tpu` as one traced program.

`AcceleratedOptimizer.step` (an Accelerate loop's `optimizer.step()`, and the Trainer's) calls the step of the
PyTorch optimizer it wraps. Run eagerly on tpu, AdamW's foreach step is a dozen list ops over every parameter, each
a program of its own that reads and writes the whole state. Traced by `hf_tpu.jit` it is one program that updates
the parameters and moments in place (donated: no second copy of the state), with the step counts and learning rates
on the device (a schedule's new rate is a new value of an input, not a new program).

The step is traced where it is the optimizer's own step: without a GradScaler (fp16's `scaler.step` reads on the host
whether the gradients overflowed, and skips the step then) and without a closure (a closure evaluates the model
again). `HF_TPU_OPTIMIZER_TRACE=0` runs it eagerly.

`Accelerator.clip_grad_norm_` (the Trainer's `max_grad_norm`, every step) is one traced program too: PyTorch's
`clip_grad_norm_` over the gradients (after an fp16 GradScaler's unscaling, which stays eager), where it ran as a dozen
eager ops, `_foreach_norm` and `_foreach_mul_` among them, each walking every gradient on the host (18 ms of a 24-layer
Llama's step on the development CPU). Under FSDP, DeepSpeed or torch_xla Accelerate clips its own way.
"""

from __future__ import annotations

import functools
import sys

import torch

import hf_tpu
from hf_tpu import settings as _environment
from hf_tpu.wrapping import wrap_once

_environment.register(
    _environment.Setting("HF_TPU_OPTIMIZER_TRACE", "bool", True, "Accelerate: run the optimizer's step "
                         "(AcceleratedOptimizer.step, the Trainer's) and the gradients' clipping "
                         "(Accelerator.clip_grad_norm_) each as one hf_tpu.jit program (off: eagerly)"),
)


def install(module) -> None:
    if module.__name__ == "accelerate.accelerator":  # it imports accelerate.optimizer
        wrap_once(sys.modules["accelerate.optimizer"].AcceleratedOptimizer, "step", _wrap_step)
        wrap_once(module.Accelerator, "clip_grad_norm_", _wrap_clip_grad_norm)


def _optimizer_step(optimizer) -> None:
    """The optimizer class's own step, not an instance's wrapper of it: a learning-rate scheduler's wrapper records
    the call on the optimizer, Python state a program cannot replay, and `step` below records it instead."""
    type(optimizer).step(optimizer)


_traced_optimizer_step = hf_tpu.jit(_optimizer_step)


def _on_tpu(optimizer) -> bool:
    return any(p.device.type == "tpu" for group in optimizer.param_groups for p in group["params"])


def _wrap_step(original):
    @functools.wraps(original)
    def step(self, closure=None):
        inner = self.optimizer
        if (closure is not None or self.scaler is not None or not self.gradient_state.sync_gradients
                or not _environment.get("HF_TPU_OPTIMIZER_TRACE") or not _on_tpu(inner)):
            return original(self, closure)
        if getattr(inner.step, "_wrapped_by_lr_sched", False):
            inner._opt_called = True  # what the scheduler's wrapper of `step` records (it warns on its first step without)
        _traced_optimizer_step(inner)

    return step


def _clip(parameters: list, max_norm: float, norm_type: float):
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


_traced_clip = hf_tpu.jit(_clip)

# Accelerate's distributed types that clip their own way (`Accelerator.clip_grad_norm_`)
_CLIPPING_THEIR_OWN_WAY = ("FSDP", "DEEPSPEED", "XLA")


def _wrap_clip_grad_norm(original):
    @functools.wraps(original)
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The gradients' clipping and their norm as one traced program on tpu (see the module's docstring)."""
        if self.distributed_type in _CLIPPING_THEIR_OWN_WAY or not _environment.get("HF_TPU_OPTIMIZER_TRACE"):
            return original(self, parameters, max_norm, norm_type)
        parameters = list(parameters)  # a generator (`model.parameters()`), read twice
        if not parameters or any(p.device.type != "tpu" or p.grad is not None and type(p.grad) is not torch.Tensor
                                 for p in parameters):  # DTensor gradients: Accelerate clips each mesh's apart
            return original(self, parameters, max_norm, norm_type)
        self.unscale_gradients()
        return _traced_clip(parameters, float(max_norm), float(norm_type))

    return clip_grad_norm_
