"""Where an array's bytes sit over the chips: arrays sharded over several chips (hf_tpu.distributed), the
arrays of one program placed on one set of chips, and a value placed for a buffer to keep."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from .. import platform


def is_sharded(array) -> bool:
    """Whether a concrete array (not a value being traced) lives on more than one chip."""
    return isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer) \
        and type(array.sharding) is not jax.sharding.SingleDeviceSharding and len(array.sharding.device_set) > 1


def traced_over_chips(*arrays) -> bool:
    """Whether a value being traced is laid out over a mesh of several chips (GSPMD carries the input's mesh in its
    abstract value; a replicated value counts)."""
    return any(jax.typeof(a).sharding.mesh.size > 1 for a in arrays)


@functools.cache
def chip_index(device) -> int:
    """The index of a jax Device among the chips (`tpu:index`)."""
    return platform.devices().index(device)


def shard_bytes(array, nbytes: int) -> dict:
    """{chip index: bytes of `array` that chip holds}, for a buffer of `nbytes` in all."""
    numel = math.prod(array.shape)
    per_chip = nbytes * math.prod(array.sharding.shard_shape(array.shape)) // numel if numel else 0
    return {chip_index(device): per_chip for device in array.sharding.addressable_devices}


def place_together(arrays: list) -> list:
    """The arrays of one program, with single-chip ones replicated over the mesh of a sharded one:
    a jitted program runs on one set of chips (a tensor on `tpu:0` meeting a sharded activation is
    copied to every chip of its mesh for that program, its own buffer is unchanged)."""
    sharded = next((a for a in arrays if is_sharded(a)), None)
    if sharded is None:
        return arrays
    replicated = jax.sharding.NamedSharding(_mesh_of(sharded.sharding), jax.sharding.PartitionSpec())
    return [put_sharded(a, replicated) if isinstance(a, jax.Array) and not is_sharded(a) else a for a in arrays]


def _mesh_of(sharding):
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding.mesh
    return jax.sharding.Mesh(np.array(sharding._device_assignment), ("chips",))


def put_sharded(value, sharding):
    """`value` (a NumPy array or a jax.Array) laid out as `sharding`, for one program's arguments: it may
    share device memory with `value` (what a buffer keeps is made by `place`). Where the sharding spans other
    processes' chips, each process writes its own chips from its own copy of the value: every process runs
    the same program, so holds the same value (JAX cannot send it between processes' chips)."""
    if sharding.is_fully_addressable or (isinstance(value, jax.Array) and not value.is_fully_addressable):
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def place(value, placement):
    """`value` (a NumPy array or a jax.Array) laid out as `placement` (a sharding, or one jax Device), for a
    buffer to keep: in device memory of its own unless it is `value` itself.

    Buffers may hold one jax.Array together: the allocator counts its holders, and no program is donated an
    array another buffer holds. Two arrays over the same memory look unshared to that count, and donating
    either deletes the other's data (XLA: "Attempt to donate the same buffer twice", "Buffer has been
    deleted or donated"). `jax.device_put` makes such arrays: it keeps each part of the value already on its
    target chip (a weight on `tpu:0` replicated over a mesh keeps its memory on chip 0, two LayerNorm weights
    uploaded as one kept array of ones then shared it), and `may_alias=False` does not stop it for a
    multi-chip sharding (jax 0.10.2). So the parts of a placement on the chips the source is on are copied
    once, by a program, whose results never alias arguments it is not donated (a weight replicated from
    `tpu:0` over 8 chips: chip 0's copy)."""
    if isinstance(placement, jax.Device):
        placed = jax.device_put(value, placement)
    else:
        placed = put_sharded(value, placement)
    if placed is value or not isinstance(value, jax.Array):
        return placed
    source_chips = value.sharding.device_set
    if source_chips.isdisjoint(placed.sharding.device_set):
        return placed
    if len(placed.sharding.device_set) == 1:
        return _copy(placed)
    shards = [_copy(shard.data) if shard.device in source_chips else shard.data for shard in placed.addressable_shards]
    return jax.make_array_from_single_device_arrays(placed.shape, placed.sharding, shards)


_copy = jax.jit(lambda array: array)
