"""Accelerate on `tpu` (docs/design/accelerate-device.md, docs/design/accelerate-launch.md), one module a job:

- `device.py`: one process trains on `tpu` (Accelerate's device choice, the tpu random state in
  checkpoints, the `tpu` dynamo backend);
- `precision.py`: `mixed_precision="fp16"` (autocast with a GradScaler on tpu) and `"bf16"`;
- `optimizer.py`: the optimizer's step (`AcceleratedOptimizer.step`) as one traced program;
- `data_parallel.py`: `DistributedType.MULTI_TPU`, what a torchrun-style `accelerate launch` gives: every
  chip of every process trains one replicated model on its part of the batch, the processes joined
  through JAX's distributed runtime.

`install(module)` is called by the adapters' post-import hook (`hf_tpu.integrations.ADAPTERS`) with each
Accelerate module it is registered for, just after that module is executed.
"""

from __future__ import annotations

from . import data_parallel, device, optimizer, precision


def install(module) -> None:
    """Patch the Accelerate module that was just imported; `accelerate.accelerator` comes last (it imports
    the others), so what patches names other modules imported happens there."""
    device.install(module)
    data_parallel.install(module)
    precision.install(module)
    optimizer.install(module)
