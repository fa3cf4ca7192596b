"""`Module.to("tpu")` keeps each Parameter object, as `Module.to("cuda")` does.

PyTorch moves a parameter across devices in place (`param.data = moved`) only when the two tensor
types are "compatible for a shallow copy", and its C++ list of such types holds the built-in dense
backends, not PrivateUse1. Moving to or from `tpu` therefore made new Parameter objects: an optimizer
built before `model.to("tpu")` kept updating the old CPU tensors, and weights tied across modules
(GPT-2's `lm_head` and `wte`, T5's shared embedding) came out as two separate Parameters, trained apart.

PyTorch's own answer for such types is `torch.__future__.set_swap_module_params_on_conversion`:
`Module._apply` then swaps each parameter's contents for the moved tensor's (`torch.utils.swap_tensors`),
so the Python object, and every reference to it, stays. It is switched on here for the conversions
that involve `tpu` only. A swap refuses a parameter that something holds a weak reference to (or that
a pending autograd graph still uses); such a module converts PyTorch's default way, with new objects.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch

from ..dynamo_frames import hide_from_dynamo

_swap = torch.__future__.get_swap_module_params_on_conversion
_set_swap = torch.__future__.set_swap_module_params_on_conversion


def _swaps_for(module: torch.nn.Module, device) -> list | None:
    """The module's parameters when converting it to `device` should swap them (it involves `tpu` and
    every parameter can be swapped), else None. One pass: this runs on every `Module.to`."""
    parameters = list(module.parameters())
    involves_tpu = (device is not None and torch.device(device).type == "tpu") or any(
        t.device.type == "tpu" for ts in (parameters, module.buffers()) for t in ts)
    if not involves_tpu or any(weakref.getweakrefs(p) for p in parameters):
        return None
    return parameters


@contextlib.contextmanager
def _swapping(parameters: list):
    """Swap parameters while converting; a swap also exchanges the Python attributes (`__dict__`), and
    those a user or a library set on a parameter are put back, as an in-place move keeps them. Those the moved
    tensor has itself stay: a tensor subclass keeps its data in attributes (torchao's `qdata` and `scale`)."""
    attributes = [(p, dict(p.__dict__)) for p in parameters if p.__dict__]
    _set_swap(True)
    try:
        yield
    finally:
        _set_swap(False)
        for p, kept in attributes:
            for name, value in kept.items():
                p.__dict__.setdefault(name, value)


def _keeping_parameters(convert, device_of):
    """`convert` (a Module method), run with swapping when it moves parameters to or from `tpu`."""

    @functools.wraps(convert)
    def wrapper(self, *args, **kwargs):
        parameters = None if _swap() else _swaps_for(self, device_of(*args, **kwargs))
        if parameters is None:
            return convert(self, *args, **kwargs)
        try:
            with _swapping(parameters):
                return convert(self, *args, **kwargs)
        except RuntimeError as e:
            if "Couldn't swap" not in str(e):
                raise
            # the parameters swapped before the refusal are on their device already: PyTorch's default
            # way rebinds those in place and gives the others new objects
            return convert(self, *args, **kwargs)

    return wrapper


def _to_device(*args, **kwargs):
    return torch._C._nn._parse_to(*args, **kwargs)[0]


def install() -> None:
    module = torch.nn.Module
    devices_of = {"to": _to_device, "cpu": lambda: "cpu", "to_empty": lambda *, device, recurse=True: device}
    for name, device_of in devices_of.items():
        setattr(module, name, _keeping_parameters(getattr(module, name), device_of))
    # run as PyTorch's methods do under torch.compile, not traced by Dynamo as functions of their own
    hide_from_dynamo(module.to.__code__, recursive=False)  # the code of every wrapper
    hide_from_dynamo(_swaps_for.__code__, *(device_of.__code__ for device_of in devices_of.values()))
