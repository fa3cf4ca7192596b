"""A program's traced scalars passed as device arrays, each value uploaded once.

An op's Python numbers that are not compiled into its program (`x * 0.5`, an optimizer's step size: the
call's `scalars`) are arguments of the jitted call. Given as Python numbers, JAX uploads each one at every
call: on a TPU v5e's host 158 us a number (raw JAX, 2026-12-06: a call with 141 of them took 22.3 ms, with
the same values as device arrays 0.23 ms), where the rest of a strict op costs about 160 us. A fused
training step of the tiny Llama passes 141 (its AdamW's constants, and per-parameter step sizes).

`on_device` replaces each number by the array JAX would make of it (`host_transfers.from_number`: the same dtype and
weak type, so the program traced is the same) on the op's device, kept as recurring small uploads are: a
constant of the model's code or an optimizer's hyperparameter is uploaded once per process. A value met for the
first time is uploaded as the call would have uploaded it. Programs over sharded arrays keep Python numbers,
which JAX places with the program's sharding.
"""

from __future__ import annotations

from ..memory import buffer, host_transfers

_NUMBERS = (bool, int, float, complex)


def _replaced(values, device_index: int):
    replaced = []
    for v in values:
        kind = type(v)
        if kind in _NUMBERS:
            v = host_transfers.from_number(v, device_index)
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
