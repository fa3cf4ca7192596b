"""Multi-process runs (one process per host, docs/design/multi-host.md): every process runs the same
program on its own chips, `tpu:i` is this process's chip i, and meshes span every process's chips."""

from __future__ import annotations

import jax
import torch
from jax.experimental import multihost_utils

from .. import modes, platform
from ..memory import host_transfers


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    platform.initialize_distributed(coordinator_address, num_processes, process_id)
    if modes.default_mode() is modes.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING:
        modes.set_eager_mode(modes.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING)  # see modes.default_mode


initialize.__doc__ = platform.initialize_distributed.__doc__


def process_count() -> int:
    """How many processes the run has (1 unless `initialize` joined several)."""
    return jax.process_count()


def process_index() -> int:
    """This process's number in the run, 0 for the coordinator."""
    return jax.process_index()


def device_count() -> int:
    """The chips of every process together (`torch.tpu.device_count()` counts this process's)."""
    return len(platform.global_devices())


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Every process's `t` (the same shape and dtype in each) joined along dim 0 in process order (a
    0-d `t` gives one value per process), as a new tensor on `t`'s device in this process. The
    values travel by an XLA collective over every process's chips. A collective: every process calls
    it at the same point, as with `torch.distributed`. In a single process, a copy of `t` as 1-d or more."""
    local = t.detach().reshape(1) if t.dim() == 0 else t.detach()
    if process_count() == 1:
        return local.clone()
    joined = multihost_utils.process_allgather(host_transfers.host_array(local.cpu()), tiled=True)
    return host_transfers.to_host(joined, t.dtype).to(t.device)


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """The elementwise `op` ("sum", "mean", "max" or "min") of every process's `t` (same shape and
    dtype in each), as a new tensor on `t`'s device. A collective, as `all_gather`."""
    reductions = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}
    if op not in reductions:
        raise ValueError(f"all_reduce op {op!r}: expected one of {', '.join(reductions)}")
    stacked = all_gather(t.detach().unsqueeze(0))
    return reductions[op](stacked, dim=0).to(t.dtype)


def broadcast(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Process `src`'s `t` (every process passes a tensor of the same shape and dtype), as a new
    tensor on `t`'s device in every process. A collective, as `all_gather`."""
    if not 0 <= src < process_count():
        raise ValueError(f"broadcast from process {src}: the run has processes 0 to {process_count() - 1}")
    return all_gather(t.detach().unsqueeze(0))[src]
