"""Sharding across `tpu` chips: one controller and sharded arrays, the collectives inserted by XLA's
SPMD partitioner from the layouts of the inputs (GSPMD). See docs/design/sharding.md.

    mesh = hf_tpu.distributed.mesh((2, 4), ("dp", "tp"))
    hf_tpu.distributed.shard_model(model, config.base_model_tp_plan, mesh)
    batch = hf_tpu.distributed.shard(input_ids, mesh, ("dp", None))
"""

from .mesh import Mesh, mesh
from .model import STYLES, shard_model
from .tensors import Sharding, replicate, shard, sharding

__all__ = ["Mesh", "STYLES", "Sharding", "mesh", "replicate", "shard", "shard_model", "sharding"]
