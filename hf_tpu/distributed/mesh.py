"""Meshes: `tpu` chips arranged in named axes, the coordinate system shardings are written in."""

from __future__ import annotations

import math

import jax
import numpy as np
import torch
from jax.experimental import mesh_utils
from jax.sharding import Mesh as JaxMesh

from .. import platform


class Mesh:
    """Chips in a grid with named axes (e.g. 2 x 4 as ("dp", "tp")), wrapping the `jax.sharding.Mesh`
    that XLA's partitioner reads. Tensors sharded over a mesh report `mesh.device` (its first chip in
    this process) as their device, so they mix with ordinary tensors on that chip."""

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
        """The number of each chip, laid out in the mesh's shape: its `tpu` index in a single process,
        its place among every process's chips (process by process) in a multi-process run."""
        return np.vectorize(platform.global_devices().index, otypes=[int])(self.jax_mesh.devices)

    @property
    def device(self) -> torch.device:
        local = platform.devices()
        chip = next((chip for chip in self.jax_mesh.devices.flat if chip in local), None)
        if chip is None:
            raise ValueError(f"the mesh {self} has no chip in this process (process {jax.process_index()}), "
                             "so no tensor of this process can live on it; build meshes over every process's chips")
        return torch.device("tpu", local.index(chip))

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and other.jax_mesh == self.jax_mesh

    def __hash__(self) -> int:
        return hash(self.jax_mesh)

    def __repr__(self) -> str:
        axes = ", ".join(f"{name}={size}" for name, size in self.shape.items())
        return f"Mesh({axes}; chips {self.device_indices.tolist()})"


def mesh(shape, axis_names, devices=None) -> Mesh:
    """A mesh of `shape` (an int or a tuple) with one name per axis, over the chips numbered `devices`
    (default: the first ones). In a single process the numbers are `tpu` indices; in a multi-process
    run they count every process's chips, process by process, and the default mesh spans them all.
    On a TPU the chips are ordered by the physical topology, so neighbours on a mesh axis are
    neighbours on the interconnect."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {shape} has {len(shape)} axes but {len(axis_names)} axis names {axis_names}")
    if len(set(axis_names)) != len(axis_names):
        raise ValueError(f"mesh axis names must be distinct, got {axis_names}")
    if any(not isinstance(n, int) or n < 1 for n in shape):
        raise ValueError(f"mesh shape {shape}: every axis needs a positive number of chips")
    wanted = math.prod(shape)
    chips = platform.global_devices()
    if devices is None:
        if wanted > len(chips):
            where = "this process has" if jax.process_count() == 1 else f"the {jax.process_count()} processes have"
            raise ValueError(
                f"a mesh of shape {shape} needs {wanted} chips but {where} {len(chips)} tpu device(s) "
                f"(platform {platform.name()}). On the CPU, HF_TPU_NUM_DEVICES=N simulates N chips."
            )
        devices = range(wanted)
    devices = [int(i) for i in devices]
    if len(devices) != wanted:
        raise ValueError(f"a mesh of shape {shape} needs {wanted} chips, got {len(devices)}: {devices}")
    if len(set(devices)) != len(devices) or any(not 0 <= i < len(chips) for i in devices):
        raise ValueError(f"mesh chips {devices}: expected distinct numbers below {len(chips)} (the chip count)")
    grid = mesh_utils.create_device_mesh(shape, devices=[chips[i] for i in devices], allow_split_physical_axes=True)
    return Mesh(JaxMesh(grid, axis_names))
