"""Sharded `tpu` tensors: ordinary `tpu` tensors whose buffer holds a `jax.Array` split over a mesh.

Every op reads and writes buffers through jitted programs, and XLA's SPMD partitioner (GSPMD) carries
the shardings of a program's inputs through it, inserting the collectives it needs; so ops, views,
in-place writes and all execution modes work on sharded tensors unchanged, and `.cpu()` gathers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import torch
from jax.sharding import NamedSharding, PartitionSpec

from ..memory import buffer
from .mesh import Mesh


class Sharding(NamedTuple):
    """How a tensor's storage is laid out: per dimension, the mesh axis (or tuple of axes) it is split
    over, or None where every chip of the mesh holds the whole dimension."""

    mesh: Mesh
    spec: tuple


def _check_spec(shape: tuple, mesh: Mesh, spec) -> tuple:
    spec = tuple(spec)
    if len(spec) > len(shape):
        raise ValueError(f"sharding spec {spec} has {len(spec)} entries for a tensor of {len(shape)} dims {shape}")
    spec = spec + (None,) * (len(shape) - len(spec))
    used = []
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        if axes is None:
            continue
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in names if a not in mesh.shape]
        if unknown:
            raise ValueError(f"sharding spec {spec} names axes {unknown} that the mesh {mesh} does not have")
        used.extend(names)
        parts = math.prod(mesh.shape[a] for a in names)
        if size % parts:
            raise ValueError(
                f"dim {dim} of a tensor of shape {shape} has size {size}, which does not split evenly over "
                f"{parts} chips (mesh axes {names}); pick a mesh axis whose size divides it"
            )
    if len(set(used)) != len(used):
        raise ValueError(f"sharding spec {spec} uses a mesh axis twice")
    return spec


def shard(t: torch.Tensor, mesh: Mesh, spec) -> torch.Tensor:
    """A new `tpu` tensor with `t`'s values split over `mesh`: `spec[d]` names the mesh axis (or axes)
    dim d is split over, None (or a shorter spec) keeps a dim whole on every chip. `t` may be on the
    CPU (each chip then receives only its shard) or on a `tpu` chip. In a multi-process run every
    process passes the same values and its chips receive their shards of them. Like `.to()`, the
    result has no autograd history: shard leaves and inputs (see `shard_model`), not intermediate
    results."""
    if t.device.type not in ("cpu", "tpu"):
        raise ValueError(f"shard() takes a cpu or tpu tensor, got one on {t.device}")
    shape = tuple(t.shape)
    spec = _check_spec(shape, mesh, spec)
    if t.device.type == "cpu":
        value = buffer.host_array(t)
    else:
        buf = buffer.buffer_of(t)
        value = buffer.read(buf.value(), buffer.view_of(t, buf))
    device = mesh.device  # raises for a mesh with no chip in this process
    array = buffer.place(value, NamedSharding(mesh.jax_mesh, PartitionSpec(*spec)))
    buffer.sharded_arrays_exist = True
    return buffer.new_tensor(shape, t.dtype, device.index, array)


def from_process_parts(t: torch.Tensor, mesh: Mesh, spec) -> torch.Tensor:
    """A new `tpu` tensor laid out as `spec` over `mesh` whose split dims join every process's `t` in
    process order: the layout of a batch each process loaded its own part of (a data loader that
    gives each process different rows). Dims that `spec` keeps whole must hold the same values in
    every process, as with `shard`. A mesh within this process makes it `shard(t, mesh, spec)`. Like
    `shard`, a collective in a multi-process run: every process calls it at the same point."""
    if t.device.type not in ("cpu", "tpu"):
        raise ValueError(f"from_process_parts() takes a cpu or tpu tensor, got one on {t.device}")
    if not mesh.jax_mesh.is_multi_process:
        return shard(t, mesh, spec)
    spec = tuple(spec) + (None,) * (t.dim() - len(tuple(spec)))
    layout = NamedSharding(mesh.jax_mesh, PartitionSpec(*spec))
    try:
        array = jax.make_array_from_process_local_data(layout, buffer.host_array(t.detach().cpu()))
    except ValueError as e:
        raise ValueError(f"this process's part of shape {tuple(t.shape)} does not split as {spec} over the "
                         f"chips the mesh {mesh} has in this process: {e}") from None
    buffer.sharded_arrays_exist = True
    return buffer.new_tensor(array.shape, t.dtype, mesh.device.index, array)


def replicate(t: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """A new `tpu` tensor holding all of `t` on every chip of `mesh`."""
    return shard(t, mesh, ())


def sharding(t: torch.Tensor) -> Sharding | None:
    """How `t`'s storage is split over a mesh, or None when it lives on one chip (views share their
    base's storage, so they report the base's sharding). Reading it waits for deferred work."""
    if t.device.type != "tpu":
        return None
    array = buffer.buffer_of(t).value()
    if not buffer.is_sharded(array):
        return None
    layout = array.sharding
    if not isinstance(layout, NamedSharding):
        raise NotImplementedError(f"a tensor sharded as {layout} (not over a named mesh) has no readable spec")
    spec = tuple(layout.spec) + (None,) * (array.ndim - len(layout.spec))
    spec = tuple(axes[0] if isinstance(axes, tuple) and len(axes) == 1 else axes for axes in spec)
    return Sharding(Mesh(layout.mesh), spec)
