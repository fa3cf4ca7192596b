"""`DistributedType.MULTI_TPU`: data parallelism over every chip of every process, under Accelerate.

`accelerate launch` with `distributed_type: MULTI_GPU` in its config (examples/accelerate/) starts its
processes through torchrun, which gives each one RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT. Accelerate finds no device it knows and would run each process alone; with `tpu` as the
accelerator it now picks `MULTI_TPU` (docs/design/accelerate-launch.md):

- **Joining**: Accelerate opens its torch.distributed group (gloo, for its CPU-side bookkeeping:
  barriers, pickled objects, the data loaders' seeds); process 0 picks a free port for JAX's coordinator
  on MASTER_ADDR and tells the others through that group, and every process calls
  `hf_tpu.distributed.initialize` (one process: nothing to join).
- **The model**: `prepare` puts every parameter and buffer on every chip of a one-axis mesh "dp" over all
  processes' chips (process 0's values, as DDP broadcasts rank 0's). With FSDP asked for (an FSDP launch config,
  ACCELERATE_USE_FSDP) or parameters split by `hf_tpu.distributed.fully_shard` before `prepare`, each parameter is
  split over "dp" instead, and stays split through `load_state`.
- **The batches**: each process's data loader gives its own rows (Accelerate's sharding by process); they
  become one tensor split over "dp" (`hf_tpu.distributed.from_process_parts`), each chip holding its rows.
  The forward and backward are then one program over the mesh: XLA combines the gradients, so no
  DistributedDataParallel wrapper and no gradient all-reduce of ours exist.
- **gather / reduce / broadcast** of tpu tensors go through `hf_tpu.distributed.all_gather` (an XLA
  collective over every process's chips); CPU tensors and objects keep Accelerate's torch.distributed path.
  A tensor split over "dp" (model outputs) counts as its rows in each process, as its process's batch did.
"""

from __future__ import annotations

import functools
import os
import socket
import sys

import torch

import hf_tpu.distributed as dist
from hf_tpu.wrapping import wrap_once

from .device import add_member

MULTI_TPU = "MULTI_TPU"
DP_AXIS = "dp"


def install(module) -> None:
    name = module.__name__
    if name == "accelerate.utils.dataclasses":
        add_member(module.DistributedType, MULTI_TPU)
    elif name == "accelerate.state":
        state = module.PartialState
        wrap_once(state, "_prepare_backend", _choose_multi_tpu)
        wrap_once(state, "set_device", _join_and_pick_chip)
        wrap_once(state, "wait_for_everyone", _barrier)
    elif name == "accelerate.accelerator":
        _install_into_the_library(module)


def _install_into_the_library(accelerator_module) -> None:
    operations = sys.modules["accelerate.utils.operations"]
    if MULTI_TPU not in operations.TORCH_DISTRIBUTED_OPERATION_TYPES:
        # objects and CPU tensors take Accelerate's torch.distributed (gloo) path
        operations.TORCH_DISTRIBUTED_OPERATION_TYPES.append(MULTI_TPU)
    for function_name, wrap in (("gather", _gather), ("reduce", _reduce), ("broadcast", _broadcast)):
        wrap_everywhere(operations, function_name, wrap)
    wrap_everywhere(sys.modules["accelerate.utils.random"], "synchronize_rng_state", _synchronize_rng_state)
    wrap_once(sys.modules["accelerate.data_loader"], "send_to_device", _batches_over_the_mesh)
    wrap_once(accelerator_module.Accelerator, "prepare_model", _replicate_prepared_model)
    wrap_once(accelerator_module.Accelerator, "load_state", _replicate_loaded_models)


def wrap_everywhere(module, name: str, wrap) -> None:
    """Wraps the function `module.name` once (`wrap_once`), and rebinds `name` to the wrapper in every loaded
    Accelerate module that imported the function."""
    original = getattr(module, name)
    if wrap_once(module, name, wrap):
        for other_name, other in list(sys.modules.items()):
            if (other_name == "accelerate" or other_name.startswith("accelerate.")) and \
                    getattr(other, name, None) is original:
                setattr(other, name, getattr(module, name))


def _state():
    from accelerate.state import PartialState

    return PartialState()


def _is_multi_tpu() -> bool:
    state = _state()
    return state.initialized and state.distributed_type == MULTI_TPU


def _launched_by_torchrun() -> bool:
    return int(os.environ.get("LOCAL_RANK", -1)) != -1


# --- The state: choosing MULTI_TPU, joining JAX's runtime, the chip, barriers.


def _choose_multi_tpu(original):
    @functools.wraps(original)
    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        from accelerate.utils import DistributedType

        chosen, distributed_type = original(self, cpu, sagemaker_dp, backend)
        accelerator = torch.accelerator.current_accelerator()  # (creates no JAX backend, unlike is_available)
        if (distributed_type == DistributedType.NO and not cpu and _launched_by_torchrun()
                and accelerator is not None and accelerator.type == "tpu"):
            return backend or "gloo", DistributedType.MULTI_TPU
        return chosen, distributed_type

    return _prepare_backend


def _join_and_pick_chip(original):
    @functools.wraps(original)
    def set_device(self):
        if self.device is not None or self.distributed_type != MULTI_TPU:
            return original(self)
        if self.num_processes > 1:
            _join_jax(self.num_processes, self.process_index)
        self.device = torch.device("tpu", 0)  # the mesh's first chip in this process (Mesh.device)

    return set_device


def _join_jax(num_processes: int, process_index: int) -> None:
    """Joins JAX's distributed runtime as process `process_index` of `num_processes`, its coordinator on
    MASTER_ADDR at a port process 0 found free (torch's store already holds MASTER_PORT)."""
    port = [None]
    if process_index == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port[0] = s.getsockname()[1]
    torch.distributed.broadcast_object_list(port, src=0)
    address = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port[0]}"
    try:
        dist.initialize(address, num_processes=num_processes, process_id=process_index)
    except RuntimeError as e:
        if dist.process_count() == num_processes and dist.process_index() == process_index:
            return  # joined already (the HF_TPU_* variables), as Accelerate's launcher numbered it
        raise RuntimeError(
            f"Accelerate runs {num_processes} processes on tpu, which join through JAX's distributed runtime "
            f"before the first tpu tensor: create the Accelerator (or the Trainer's TrainingArguments) before "
            f"putting anything on tpu. ({e})"
        ) from None


def _barrier(original):
    @functools.wraps(original)
    def wait_for_everyone(self):
        if self.distributed_type == MULTI_TPU and self.num_processes > 1:
            torch.distributed.barrier()
        else:
            original(self)

    return wait_for_everyone


@functools.cache
def data_parallel_mesh():
    """One axis, "dp", over every chip of every process."""
    return dist.mesh(dist.device_count(), DP_AXIS)


def _data_parallel() -> bool:
    return _is_multi_tpu() and dist.device_count() > 1


# --- The model and the batches.


def _same_on_every_chip(t: torch.Tensor) -> torch.Tensor:
    mesh = data_parallel_mesh()
    if dist.process_count() == 1:
        return dist.replicate(t, mesh)
    value = t.detach().cpu()
    torch.distributed.broadcast(value, src=0)  # process 0's values, as DDP starts from rank 0's
    return dist.replicate(value, mesh)


def _split_over_the_mesh(t: torch.Tensor) -> tuple | None:
    """The layout of a tensor split over the data-parallel mesh (parameters `hf_tpu.distributed.fully_shard` laid
    out before `prepare`: FSDP), or None."""
    layout = dist.sharding(t)
    if layout is not None and layout.mesh == data_parallel_mesh() and any(axes is not None for axes in layout.spec):
        return layout.spec
    return None


def replicate_model(model: torch.nn.Module, layouts: dict | None = None) -> None:
    """Every `tpu` parameter and buffer of `model` on every chip of the data-parallel mesh, except parameters split
    over it, which keep their split: `layouts` (a parameter's id -> its split, `_split_over_the_mesh`) or, by
    default, the split each has now. Parameters keep their identity (an optimizer made before stays valid)."""
    if layouts is None:
        layouts = {id(p): _split_over_the_mesh(p) for p in model.parameters()}
    done = set()
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.device.type == "tpu" and id(param) not in done:
                done.add(id(param))
                spec = layouts.get(id(param))
                param.data = _same_on_every_chip(param.data) if spec is None else \
                    dist.shard(param.data, data_parallel_mesh(), spec)
        for name, buf in module._buffers.items():
            if buf is not None and buf.device.type == "tpu":
                module._buffers[name] = _same_on_every_chip(buf)


def _fully_sharded() -> bool:
    """Whether the run asks for FSDP: `distributed_type: FSDP` in the launch config, `--use_fsdp`, or the Trainer's
    `fsdp` argument, each of which Accelerate passes on as ACCELERATE_USE_FSDP. On tpu that is
    `hf_tpu.distributed.fully_shard` over the data-parallel mesh; FSDP's wrapping, prefetch and offload settings
    have nothing to set (one XLA program over the mesh places the gathers)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _replicate_prepared_model(original):
    @functools.wraps(original)
    def prepare_model(self, model, *args, **kwargs):
        model = original(self, model, *args, **kwargs)
        if _data_parallel():
            if not _fully_sharded() or dist.process_count() > 1:
                replicate_model(model)  # every process's values made process 0's, as DDP and FSDP start
            if _fully_sharded():  # split from where the parameters are, not from a replica on every chip
                dist.fully_shard(model, data_parallel_mesh())
        return model

    return prepare_model


def _replicate_loaded_models(original):
    @functools.wraps(original)
    def load_state(self, *args, **kwargs):
        layouts = [{id(p): _split_over_the_mesh(p) for p in model.parameters()} for model in self._models] \
            if _data_parallel() else None
        result = original(self, *args, **kwargs)
        if layouts is not None:  # load_state_dict copies into the parameters, which leaves them on one chip
            for model, model_layouts in zip(self._models, layouts):
                replicate_model(model, model_layouts)
        return result

    return load_state


def split_batch(t: torch.Tensor) -> torch.Tensor:
    """This process's rows of a batch (`t`, on the CPU or tpu), split with every other process's over
    the data-parallel mesh. Rows this process's chips cannot share evenly stay whole on every chip in a
    single process; with several processes they cannot (each chip must hold rows of its own process)."""
    mesh = data_parallel_mesh()
    chips = torch.tpu.device_count()
    if t.dim() > 0 and t.shape[0] % chips == 0:
        return dist.from_process_parts(t, mesh, (DP_AXIS,))
    if dist.process_count() == 1:
        return dist.replicate(t, mesh)
    raise ValueError(
        f"a batch of {t.shape[0] if t.dim() else 'no'} rows in process {dist.process_index()} cannot be split over "
        f"its {chips} chips: use a per-process batch size that is a multiple of {chips}, and drop_last=True "
        "(TrainingArguments(dataloader_drop_last=True)) when the data set does not divide into whole batches"
    )


def _batches_over_the_mesh(original):
    from accelerate.utils.operations import is_torch_tensor, recursively_apply

    @functools.wraps(original)
    def send_to_device(tensor, device, non_blocking=False, skip_keys=None):
        if not _data_parallel() or torch.device(device).type != "tpu":
            return original(tensor, device, non_blocking=non_blocking, skip_keys=skip_keys)
        return recursively_apply(split_batch, tensor, test_type=is_torch_tensor)

    return send_to_device


# --- Accelerate's operations on tpu tensors.


def _process_part(t: torch.Tensor) -> torch.Tensor:
    """What `t` is in this process, as a tensor on one of its chips: the rows it gave for a tensor split
    over the data-parallel mesh (a batch, a model output), the whole value otherwise."""
    layout = dist.sharding(t)
    whole = t if layout is None else t.detach().cpu()  # spanning processes: every process reads it
    if layout is not None and layout.mesh == data_parallel_mesh() and layout.spec[:1] == (DP_AXIS,):
        rows = whole.shape[0] // dist.process_count()
        whole = whole[dist.process_index() * rows:(dist.process_index() + 1) * rows]
    return whole.to(t.device)


def _on_tpu_tensors(original, on_tpu, alone):
    """`original` (an Accelerate operation over nested tensors) with `on_tpu` for each tpu tensor under
    MULTI_TPU (`alone` in a single process); every other tensor and distributed type keeps Accelerate's
    path."""
    from accelerate.utils.operations import recursively_apply

    @functools.wraps(original)
    def operation(data, *args, **kwargs):
        if not _is_multi_tpu():
            return original(data, *args, **kwargs)

        def one(t):
            if t.device.type != "tpu":
                return original(t, *args, **kwargs)
            return on_tpu(t, *args, **kwargs) if dist.process_count() > 1 else alone(t, *args, **kwargs)

        return recursively_apply(one, data, error_on_other_type=True)

    return operation


def _gather(original):
    def on_tpu(t):
        layout = dist.sharding(t)
        if layout is not None and layout.mesh == data_parallel_mesh() and layout.spec[:1] == (DP_AXIS,):
            return t.detach().cpu().to(t.device)  # already every process's rows, in process order
        return dist.all_gather(_process_part(t))

    return _on_tpu_tensors(original, on_tpu, alone=lambda t: t if t.dim() else t.reshape(1))


def _reduce(original):
    def on_tpu(t, reduction="mean", scale=1.0):
        if reduction == "none":
            return t.clone()
        return dist.all_reduce(_process_part(t), reduction) * scale

    return _on_tpu_tensors(original, on_tpu, alone=lambda t, reduction="mean", scale=1.0: t.clone() * scale)


def _broadcast(original):
    def on_tpu(t, from_process=0):
        return dist.broadcast(_process_part(t), from_process)

    return _on_tpu_tensors(original, on_tpu, alone=lambda t, from_process=0: t)


def _synchronize_rng_state(original):
    @functools.wraps(original)
    def synchronize_rng_state(rng_type=None, generator=None):
        from accelerate.utils import RNGType

        if not _is_multi_tpu() or _state().num_processes == 1 or rng_type not in (RNGType.TORCH, RNGType.GENERATOR):
            return original(rng_type, generator)
        source = torch if rng_type == RNGType.TORCH else generator
        rng_state = source.get_rng_state() if rng_type == RNGType.TORCH else source.get_state()
        torch.distributed.broadcast(rng_state, 0)  # a CPU tensor: the gloo group Accelerate opened
        source.set_rng_state(rng_state) if rng_type == RNGType.TORCH else source.set_state(rng_state)

    return synchronize_rng_state
