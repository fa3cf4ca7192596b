"""Meshes: `tpu` chips arranged in named axes, the coordinate system shardings are written in."""

from __future__ import annotations

import math

import numpy as np
import torch
from jax.experimental import mesh_utils
from jax.sharding import Mesh as JaxMesh

from .. import platform


class Mesh:
    """Chips in a grid with named axes (e.g. 2 x 4 as ("dp", "tp")), wrapping the `jax.sharding.Mesh`
    that XLA's partitioner reads. Tensors sharded over a mesh report `mesh.device` (its first chip)
    as their device, so they mix with ordinary tensors on that chip."""

    def __init__(self, jax_mesh: JaxMesh):
        self.jax_mesh = jax_mesh

    @property
    def axis_names(self) -> tuple:
        return tuple(self.jax_mesh.axis_names)

    @property
    def shape(self) -> dict:
        """{axis name: number of chips along it}, in axis order."""
        return dict(self.jax_mesh.shape)

    @property
    def size(self) -> int:
        return self.jax_mesh.devices.size

    @property
    def device_indices(self) -> np.ndarray:
        """The `tpu` index of each chip, laid out in the mesh's shape."""
        return np.vectorize(platform.devices().index, otypes=[int])(self.jax_mesh.devices)

    @property
    def device(self) -> torch.device:
        return torch.device("tpu", int(self.device_indices.flat[0]))

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and other.jax_mesh == self.jax_mesh

    def __hash__(self) -> int:
        return hash(self.jax_mesh)

    def __repr__(self) -> str:
        axes = ", ".join(f"{name}={size}" for name, size in self.shape.items())
        return f"Mesh({axes}; chips {self.device_indices.tolist()})"


def mesh(shape, axis_names, devices=None) -> Mesh:
    """A mesh of `shape` (an int or a tuple) with one name per axis, over the `tpu` chips `devices`
    (indices; default: the first ones). On a TPU the chips are ordered by the physical topology, so
    neighbours on a mesh axis are neighbours on the interconnect."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {shape} has {len(shape)} axes but {len(axis_names)} axis names {axis_names}")
    if len(set(axis_names)) != len(axis_names):
        raise ValueError(f"mesh axis names must be distinct, got {axis_names}")
    if any(not isinstance(n, int) or n < 1 for n in shape):
        raise ValueError(f"mesh shape {shape}: every axis needs a positive number of chips")
    wanted = math.prod(shape)
    available = platform.device_count()
    if devices is None:
        if wanted > available:
            raise ValueError(
                f"a mesh of shape {shape} needs {wanted} chips but this process has {available} tpu device(s) "
                f"(platform {platform.name()}). On the CPU, HF_TPU_NUM_DEVICES=N simulates N chips."
            )
        devices = range(wanted)
    devices = [int(i) for i in devices]
    if len(devices) != wanted:
        raise ValueError(f"a mesh of shape {shape} needs {wanted} chips, got {len(devices)}: {devices}")
    if len(set(devices)) != len(devices) or any(not 0 <= i < available for i in devices):
        raise ValueError(f"mesh chips {devices}: expected distinct indices below {available} (the tpu device count)")
    jax_devices = [platform.jax_device(i) for i in devices]
    grid = mesh_utils.create_device_mesh(shape, devices=jax_devices, allow_split_physical_axes=True)
    return Mesh(JaxMesh(grid, axis_names))
