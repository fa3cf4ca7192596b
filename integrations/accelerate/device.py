"""One process on `tpu` under Accelerate: `Accelerator()`, and with it the Trainer, trains on `tpu`, and its checkpoints (`save_state`/`load_state`) hold the `tpu` random state as they hold CUDA's.

Accelerate picks its device from a list of backends it knows (CUDA, MPS, XPU, ...), and without one
of them it picks the CPU. The Trainer already put its inputs on `tpu` (Transformers asks
`torch.accelerator`), so `accelerator.prepare(model)` moved the model back to the CPU and the first
forward failed on the two devices. Here, a single process whose accelerator is `tpu` gets
`tpu:<current>`, as one with CUDA gets `cuda`; `cpu=True` (`use_cpu=True`) and
`ACCELERATE_TORCH_DEVICE` decide first. A run that a configuration sends to the CPU
while a `tpu` is there says so once (`accelerate config default` writes `use_cpu: true` on a machine
without CUDA, and training then ran on the CPU without a word).
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch

from hf_tpu.wrapping import wrap_once


def _tpu_is_the_accelerator() -> bool:
    accel = torch.accelerator.current_accelerator()
    return accel is not None and accel.type == "tpu" and torch.accelerator.is_available()


def install(module) -> None:
    if module.__name__ == "accelerate.state":
        wrap_once(module.PartialState, "default_device", _pick_tpu)
        wrap_once(module.PartialState, "__init__", _say_when_sent_to_the_cpu)
    elif module.__name__ == "accelerate.utils.dataclasses":
        add_member(module.DynamoBackend, "TPU")
    elif module.__name__ == "accelerate.accelerator":
        # Accelerator.save_state/load_state call these through the names this module imported
        for name, action in (("save_accelerator_state", _save_tpu_rng), ("load_accelerator_state", _load_tpu_rng)):
            wrap_once(module, name, functools.partial(_then_on_the_rng_file, action=action))


# the key beside Accelerate's own `torch_cuda_manual_seed`, `torch_xpu_manual_seed`, ...
_TPU_RNG_KEY = "torch_tpu_manual_seed"


def _rng_file(function, args, kwargs):
    """The file Accelerate keeps a process's random states in, from a save/load call's arguments."""
    from pathlib import Path

    from accelerate.utils import RNG_STATE_NAME

    bound = inspect.signature(function).bind(*args, **kwargs)
    folder = bound.arguments.get("output_dir", bound.arguments.get("input_dir"))
    return Path(folder) / f"{RNG_STATE_NAME}_{bound.arguments['process_index']}.pkl"


def _then_on_the_rng_file(original, action):
    """`original` (Accelerate's save or load of a checkpoint), then `action(path)` on the file it keeps
    the process's random states in, when tpu is the accelerator."""
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        path = _rng_file(original, args, kwargs)
        if _tpu_is_the_accelerator() and path.is_file():
            action(path)
        return result

    return wrapper


def _save_tpu_rng(path) -> None:
    states = torch.load(path, weights_only=False)  # Accelerate's own pickle (Python's random state)
    states[_TPU_RNG_KEY] = torch.tpu.get_rng_state_all()
    torch.save(states, path)


def _load_tpu_rng(path) -> None:
    states = torch.load(path, weights_only=False)
    if _TPU_RNG_KEY in states:
        torch.tpu.set_rng_state_all(states[_TPU_RNG_KEY])


def _pick_tpu(original):
    """`PartialState.default_device`'s getter: `tpu:<current>` when tpu is the accelerator."""
    @functools.wraps(original)
    def default_device(self) -> torch.device:
        if _tpu_is_the_accelerator():
            return torch.device("tpu", torch.accelerator.current_device_index())
        return original(self)

    return default_device


_CPU_WHILE_TPU = (
    "Accelerate runs on the CPU although a tpu is available: it was asked for the CPU (`cpu=True`, "
    "`use_cpu=True`, `use_cpu: true` in the accelerate config, which `accelerate config default` writes on "
    "a machine without CUDA, or ACCELERATE_USE_CPU). To train on tpu, drop that setting (answer 'no' to "
    "'CPU only' in `accelerate config`)."
)
_told = []


def _say_when_sent_to_the_cpu(original):
    """`PartialState.__init__`, warning once per process when a configuration puts Accelerate on the CPU while
    `tpu` is the accelerator."""
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        device = getattr(self, "device", None)
        if (not _told and getattr(self, "_cpu", False) and getattr(device, "type", None) == "cpu"
                and _tpu_is_the_accelerator()):
            _told.append(True)
            warnings.warn(_CPU_WHILE_TPU, UserWarning, stacklevel=2)

    return __init__


def add_member(enum, name: str) -> None:
    """Adds the member `name` (its value the same string, Accelerate's convention) to one of Accelerate's
    closed string enums, as Python's `Enum` makes members. `DynamoBackend.TPU` makes
    `TorchDynamoPlugin(backend="tpu")`, `ACCELERATE_DYNAMO_BACKEND=tpu` and the Trainer's
    `torch_compile_backend="tpu"` compile through `torch.compile(backend="tpu")` (Inductor's `torch_tpu`
    lookup fails on tpu); `DistributedType.MULTI_TPU` is data_parallel.py's."""
    if name in enum._member_map_:
        return
    member = str.__new__(enum, name)
    member._name_ = member._value_ = name
    member.__objclass__ = enum
    member._sort_order_ = len(enum._member_names_)
    type.__setattr__(enum, name, member)
    enum._member_names_.append(name)
    enum._member_map_[name] = member
    enum._value2member_map_[name] = member
