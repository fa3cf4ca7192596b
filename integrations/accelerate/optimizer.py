"""The optimizer's step on `tpu` as one traced program.

`AcceleratedOptimizer.step` (an Accelerate loop's `optimizer.step()`, and the Trainer's) calls the step of the
PyTorch optimizer it wraps. Run eagerly on tpu, AdamW's foreach step is a dozen list ops over every parameter, each
a program of its own that reads and writes the whole state. Traced by `hf_tpu.jit` it is one program that updates
the parameters and moments in place (donated: no second copy of the state), with the step counts and learning rates
on the device (a schedule's new rate is a new value of an input, not a new program).

The step is traced where it is the optimizer's own step: without a GradScaler (fp16's `scaler.step` reads on the host
whether the gradients overflowed, and skips the step then) and without a closure (a closure evaluates the model
again). `HF_TPU_OPTIMIZER_TRACE=0` runs it eagerly.
"""

from __future__ import annotations

import functools
import sys

import hf_tpu
from hf_tpu import settings as _environment
from hf_tpu.wrapping import wrap_once

_environment.register(
    _environment.Setting("HF_TPU_OPTIMIZER_TRACE", "bool", True, "Accelerate: run the optimizer's step "
                         "(AcceleratedOptimizer.step, the Trainer's) as one hf_tpu.jit program (off: eagerly)"),
)


def install(module) -> None:
    if module.__name__ == "accelerate.accelerator":  # it imports accelerate.optimizer
        wrap_once(sys.modules["accelerate.optimizer"].AcceleratedOptimizer, "step", _wrap_step)


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
