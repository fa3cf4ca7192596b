"""Handing XLA the arrays a program overwrites. `jax.jit` donates whole arguments, so every caller that
donates (strict eager's in-place ops, a deferred flush, a compiled graph's mutated inputs) splits its
input arrays into (donated, kept) arguments, and its traced function joins them back in order."""

from __future__ import annotations


def split(arrays: list, positions: tuple) -> tuple:
    """(the arrays at `positions`, the others), each in order; `positions` ascending."""
    chosen = set(positions)
    return [arrays[i] for i in positions], [a for i, a in enumerate(arrays) if i not in chosen]


def join(positions: tuple, donated, kept) -> list:
    """The arrays as they were before `split`."""
    arrays = list(kept)
    for position, array in zip(positions, donated):
        arrays.insert(position, array)
    return arrays
