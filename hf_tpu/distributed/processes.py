"""Multi-process runs (one process per host, docs/design/multi-host.md): every process runs the same
program on its own chips, `tpu:i` is this process's chip i, and meshes span every process's chips."""

from __future__ import annotations

import jax

from .. import platform

initialize = platform.initialize_distributed


def process_count() -> int:
    """How many processes the run has (1 unless `initialize` joined several)."""
    return jax.process_count()


def process_index() -> int:
    """This process's number in the run, 0 for the coordinator."""
    return jax.process_index()


def device_count() -> int:
    """The chips of every process together (`torch.tpu.device_count()` counts this process's)."""
    return len(platform.global_devices())
