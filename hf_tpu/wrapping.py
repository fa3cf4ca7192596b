"""How hf-tpu puts a wrapper in place of a library's function: once, keeping the original. The core wraps
PyTorch's (torch.compile's entry, the checkpoint's recomputation); the adapters and patches, Hugging Face's.

An adapter installs when its library's module is imported, and again after a reload or when a class is
defined later; a wrapper is put in place only where none of hf-tpu's is (`wrap_once`), so a function is never
wrapped twice. The wrapper keeps the function it replaced in one attribute, `ORIGINAL`, which says both that a
function is hf-tpu's wrapper and what it wraps (`original_of`); tests call the original through it.
"""

from __future__ import annotations

import inspect

import torch

ORIGINAL = "_hf_tpu_original"


def original_of(function):
    """The function that `function` (a function, a classmethod, a property) replaced, or None where it is no
    wrapper of hf-tpu's. For a property, its getter's."""
    if isinstance(function, property):
        function = function.fget
    return getattr(function, ORIGINAL, None)


def keeping_original(wrapper, original):
    """`wrapper`, marked as hf-tpu's wrapper of `original` (for a wrapper that `wrap_once` does not place)."""
    setattr(wrapper, ORIGINAL, original)
    return wrapper


def wrap_once(owner, name: str, wrap) -> bool:
    """Put `wrap(function)` in place of `owner.name`, unless that is hf-tpu's wrapper already; True when it did.

    On a class, the function is what the class holds, as it holds it (a classmethod stays one, and a function
    it inherits is wrapped on the class itself); on a module or an object, the attribute as it reads (an
    object's method is bound). A property keeps its setter: `wrap` is given its getter and returns the new one.
    """
    function = inspect.getattr_static(owner, name) if isinstance(owner, type) else getattr(owner, name)
    if original_of(function) is not None:
        return False
    if isinstance(function, property):
        getter = keeping_original(wrap(function.fget), function.fget)
        wrapper = property(getter, function.fset, function.fdel, function.__doc__)
    else:
        wrapper = keeping_original(wrap(function), function)
    setattr(owner, name, wrapper)
    return True


def is_tpu(device) -> bool:
    """Whether a device argument (a `torch.device`, a string, a `device_map`, None) names `tpu`:
    what most wrappers ask before they change anything."""
    try:
        return device is not None and torch.device(device).type == "tpu"
    except (TypeError, RuntimeError):
        return False


def module_on_tpu(module) -> bool:
    """Whether a module's first parameter is on `tpu` (a module without parameters is not): what a wrapper of a
    module's call asks before it changes anything."""
    parameter = next(module.parameters(), None)
    return parameter is not None and parameter.device.type == "tpu"
