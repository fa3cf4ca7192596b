"""A program's traced scalars passed as device arrays, each value uploaded once.

An op's Python numbers that are not compiled into its program (`x * 0.5`, an optimizer's step size: the
call's `scalars`) are arguments of the jitted call. Given as Python numbers, JAX uploads each one at every
call: on a TPU v5e's host 158 us a number (raw JAX, 2026-12-06: a call with 141 of them took 22.3 ms, with
the same values as device arrays 0.23 ms), where the rest of a strict op costs about 160 us. A fused
training step of the tiny Llama passes 141 (its AdamW's constants, and per-parameter step sizes).

`on_device` replaces each number by the array JAX would make of it (`jax.device_put` of the number: the
same dtype and weak type, so the program traced is the same) on the op's device, kept by value: a constant
of the model's code or an optimizer's hyperparameter is uploaded once per process. A value met for the first
time is uploaded as the call would have uploaded it. Programs over sharded arrays keep Python numbers, which
JAX places with the program's sharding.
"""

from __future__ import annotations

from jax import device_put

from .. import platform
from ..memory import buffer

_NUMBERS = (bool, int, float, complex)
# (device index, the number's type, its value's bits) -> its committed array on that device
_KEPT: dict = {}
# values kept before the table starts again (a loop's step-dependent values are new at every step)
KEPT_VALUES = 4096


def _value_key(device_index: int, v) -> tuple:
    t = type(v)
    if t is float:  # by its bits: -0.0 is not 0.0, and a NaN finds itself
        return device_index, t, v.hex()
    if t is complex:
        return device_index, t, v.real.hex(), v.imag.hex()
    return device_index, t, v


def _array(device_index: int, v):
    key = _value_key(device_index, v)
    array = _KEPT.get(key)
    if array is None:
        if len(_KEPT) >= KEPT_VALUES:
            _KEPT.clear()
        array = _KEPT[key] = device_put(v, platform.jax_device(device_index))
    return array


def _replaced(values, device_index: int):
    replaced = []
    for v in values:
        kind = type(v)
        if kind in _NUMBERS:
            v = _array(device_index, v)
        elif (kind is list or kind is tuple) and v:
            v = _replaced(v, device_index)
        replaced.append(v)
    return replaced if type(values) is list else tuple(replaced)


def on_device(scalars, device_index: int | None):
    """`scalars` (a list of Python numbers, and of lists and tuples of them) with every number replaced by
    its kept array on device `device_index`; as they are where there is nothing to replace or the
    program may run over sharded arrays."""
    if not scalars or device_index is None or buffer.sharded_arrays_exist:
        return scalars
    return _replaced(scalars, device_index)
