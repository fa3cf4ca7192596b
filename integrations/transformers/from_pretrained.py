"""`from_pretrained` on `tpu`: the wrapper Transformers' `PreTrainedModel` and Auto classes get. A load
for `tpu` is checked before any weight is read, placed on the current chip (`loading`), or sharded over
the chips when it asks for tensor parallelism (`tensor_parallel`), and prepared once loaded."""

from __future__ import annotations

import functools

from . import tensor_parallel
from .loading import _current_chip, _on_tpu, _targets_tpu, _tpu_device, check_before_loading, prepare_model


def wrap(original):
    """For `PreTrainedModel` and the Auto classes (which read the config first, so they check first)."""

    @functools.wraps(original.__func__)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if device_map is None or not _targets_tpu(device_map):
            return original.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)
        if any(kwargs.get(name) is not None for name in tensor_parallel.ARGUMENTS):
            return tensor_parallel.load_sharded(original, cls, pretrained_model_name_or_path, args, kwargs)
        check_before_loading(pretrained_model_name_or_path, kwargs.get("dtype", kwargs.get("torch_dtype")))
        if device_map == "auto" and kwargs.get("max_memory") is None:
            kwargs["device_map"] = {"": _tpu_device()}
        else:
            kwargs["device_map"] = _current_chip(device_map)
        model = original.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)
        if _on_tpu(model):
            prepare_model(model)
        return model

    return classmethod(from_pretrained)
