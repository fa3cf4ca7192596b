"""Loading onto `tpu`: `from_pretrained(..., device_map="tpu"|"auto"|{...})`.

`device_map="auto"` means the current `tpu` (Accelerate cannot size a `tpu` yet and would place
everything on the CPU), and "tpu" the current chip; a missing local checkpoint, an unreadable safetensors
file or a dtype `tpu` cannot hold is reported before any weight is read; the loaded model gets its
per-architecture patches (`hf_tpu.model_patches`) and the output-capturing hooks. The wrapper of
`from_pretrained` that uses these (and hands `tp_plan=`/`tp_size=` loads to `tensor_parallel`) is in
`from_pretrained.py`.
"""

from __future__ import annotations

import os

import torch

from hf_tpu import model_patches

from ..output_capturing import install_output_capturing_hooks
from . import scanned_layers


def _on_tpu(model) -> bool:
    try:
        return model.device.type == "tpu"
    except (AttributeError, StopIteration):
        return False


def _tpu_device() -> torch.device:
    return torch.device("tpu", torch.tpu.current_device())


def _targets_tpu(device_map) -> bool:
    if isinstance(device_map, dict):
        return any(_targets_tpu(d) for d in device_map.values())
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return torch.accelerator.current_accelerator().type == "tpu"
    if device_map == "auto":
        return torch.accelerator.current_accelerator().type == "tpu"
    try:
        return torch.device(device_map).type == "tpu"
    except (TypeError, RuntimeError):
        return False


def _current_chip(device_map):
    """`device_map="tpu"` means the current chip, as "cuda" means the current CUDA device. Transformers
    moves weights with `.to("tpu")`, which PyTorch gives index 0 (it fills a missing index from the
    device guard, and a Python backend's guard always answers 0), while buffers made by factories
    with `device="tpu"` went to the current chip: one model on two chips."""
    if isinstance(device_map, dict):
        return {name: _current_chip(device) for name, device in device_map.items()}
    if isinstance(device_map, (str, torch.device)) and device_map != "auto":
        try:
            device = torch.device(device_map)
        except (TypeError, RuntimeError):  # "disk"
            return device_map
        if device.type == "tpu" and device.index is None:
            return _tpu_device()
    return device_map


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
}


def _looks_like_local_path(path) -> bool:
    if isinstance(path, os.PathLike):
        return True
    return isinstance(path, str) and (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1)


def _safetensors_dtypes(files) -> set:
    """Check each file's header (cheap: no tensor is read) and return the dtypes the files hold."""
    from safetensors import SafetensorError, safe_open

    found = set()
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                names = list(f.keys())
                found.update(f.get_slice(name).get_dtype() for name in names)
        except (SafetensorError, OSError) as e:
            raise OSError(
                f"{file} is not a readable safetensors file ({e}). It is truncated or corrupt: download or "
                "save the checkpoint again. Nothing was loaded."
            ) from e
    return {_SAFETENSORS_DTYPES.get(name, name) for name in found}


def _check_dtype(dtype, where: str) -> None:
    supported = torch.tpu.supported_dtypes()
    if isinstance(dtype, torch.dtype) and dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise TypeError(
            f"{where} is {dtype}, which tpu tensors cannot hold on this platform "
            f"({torch.tpu.get_device_name()}). Pass dtype= one of: {names}. Nothing was loaded."
        )


def check_before_loading(pretrained_model_name_or_path, dtype) -> None:
    """The errors a `tpu` load should raise before anything is read: a missing local checkpoint, a
    corrupt safetensors file, a dtype the platform lacks."""
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype, dtype)
    if isinstance(dtype, torch.dtype):
        _check_dtype(dtype, "The requested dtype")
    if pretrained_model_name_or_path is None:
        return
    path = os.path.expanduser(os.fspath(pretrained_model_name_or_path))
    if not os.path.exists(path):
        if _looks_like_local_path(pretrained_model_name_or_path):
            raise FileNotFoundError(
                f"No checkpoint at {path}: the directory does not exist. Pass the directory that "
                "save_pretrained wrote (it holds config.json and the weights). Nothing was loaded."
            )
        return  # a Hub id: Transformers resolves it
    if not os.path.isdir(path):
        return
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    checkpoint_dtypes = _safetensors_dtypes(files)
    if dtype in (None, "auto"):
        for stored in checkpoint_dtypes:
            if isinstance(stored, torch.dtype) and stored.is_floating_point:
                _check_dtype(stored, "The checkpoint's weight dtype (dtype='auto' keeps it)")


def prepare_model(model) -> None:
    """Per-architecture patches, the output-capturing hooks and the scannable layer lists (`scanned_layers`) for a
    model on `tpu`, once per model."""
    if getattr(model, "_hf_tpu_prepared", False):
        return
    model._hf_tpu_prepared = True
    model_patches.warn_if_failing(getattr(model.config, "model_type", ""))
    model_patches.apply(model)
    install_output_capturing_hooks(model)
    scanned_layers.arrange(model)
