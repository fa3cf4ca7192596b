"""Sharding across `tpu` chips: one controller and sharded arrays, the collectives inserted by XLA's
SPMD partitioner from the layouts of the inputs (GSPMD). See docs/design/sharding.md.

    mesh = hf_tpu.distributed.mesh((2, 4), ("dp", "tp"))
    hf_tpu.distributed.shard_model(model, config.base_model_tp_plan, mesh)
    batch = hf_tpu.distributed.shard(input_ids, mesh, ("dp", None))

`fully_shard(model, mesh)` splits the parameters over the data-parallel axis instead (FSDP): the parameters,
gradients and optimizer state of a model too big to train on one chip take 1/N of their bytes on each chip.

Several processes (one per host) join one run with `initialize()` or the HF_TPU_COORDINATOR_ADDRESS,
HF_TPU_NUM_PROCESSES and HF_TPU_PROCESS_ID variables; the same code then shards over every process's
chips (docs/design/multi-host.md). Each process may also hold its own part of a tensor
(`from_process_parts`, a batch split between processes), and `all_gather`, `all_reduce` and
`broadcast` exchange process-local tensors.
"""

from .mesh import Mesh, mesh
from .model import STYLES, fully_shard, shard_model
from .processes import all_gather, all_reduce, broadcast, device_count, initialize, process_count, process_index
from .tensors import Sharding, from_process_parts, replicate, shard, sharding

__all__ = ["Mesh", "STYLES", "Sharding", "all_gather", "all_reduce", "broadcast", "device_count", "from_process_parts",
           "fully_shard", "initialize", "mesh", "process_count", "process_index", "replicate", "shard", "shard_model",
           "sharding"]
