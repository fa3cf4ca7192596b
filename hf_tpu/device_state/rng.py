"""RNG for `tpu`: a (seed, offset) pair per device, turned into a JAX key inside each program.

`torch.manual_seed(s)` reaches `torch.tpu.manual_seed_all(s)`. Each random op takes the next offset,
so a sequence of random ops is reproducible run to run, and the seed and offset travel into the
compiled program as data: a new offset never recompiles. A `torch.compile` graph's random ops take
the offsets the same ops would take eagerly, one each, and a graph without any takes none
(docs/design/compiled-rng-offsets.md). A `torch.Generator` passed to an op (a CPU
one, or one made with `torch.Generator("tpu")`) instead gives the op a seed drawn from its own stream.
"""

from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import platform

DEFAULT_SEED = 67280421310721  # PyTorch's default seed on every device
_MASK32 = (1 << 32) - 1

_state: dict[int, list] = {}


def _device_state(index: int) -> list:
    st = _state.get(index)
    if st is None:
        st = _state[index] = [DEFAULT_SEED, 0]
    return st


def manual_seed(seed: int, index: int) -> None:
    """PyTorch's seeding: any int from -2**63 to 2**64 - 1, a negative one taken modulo 2**64; beyond,
    CPU's `torch.manual_seed` raises (instead of wrapping 2**70 to 0)."""
    seed = int(seed)
    if not -(1 << 63) <= seed < (1 << 64):
        raise ValueError("Overflow when unpacking long long")
    _state[index] = [seed & ((1 << 64) - 1), 0]


def manual_seed_all(seed: int) -> None:
    for index in range(platform.device_count()):
        manual_seed(seed, index)


def initial_seed(index: int) -> int:
    return _device_state(index)[0]


def get_state(index: int, ahead: int = 0) -> torch.Tensor:
    """The device's state as `torch.tpu.get_rng_state()` gives it (16 bytes: seed, offset), `ahead` offsets on."""
    seed, offset = _device_state(index)
    return torch.from_numpy(np.array([seed, offset + ahead], dtype=np.uint64).view(np.uint8).copy())


def state_values(state: torch.Tensor) -> tuple[int, int]:
    """(seed, offset) of a state `get_state` gave."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.numel() != 16:
        raise RuntimeError("RNG state must be a torch.ByteTensor of 16 bytes from torch.tpu.get_rng_state()")
    seed, offset = state.cpu().numpy().view(np.uint64)
    return int(seed), int(offset)


def set_state(state: torch.Tensor, index: int) -> None:
    _state[index] = list(state_values(state))


def set_key_state(data, index: int) -> None:
    """Make `data` (key data, as `current_key` gives it) the device's next key."""
    seed_low, seed_high, offset_low, offset_high = (int(word) for word in data)
    _state[index] = [seed_low | seed_high << 32, offset_low | offset_high << 32]


def random_seed() -> int:
    return secrets.randbits(63)


def next_key(index: int, generator=None) -> np.ndarray:
    """Key data for one random op: (seed lo, seed hi, offset lo, offset hi) as uint32."""
    if generator is not None:
        # a user's generator: draw a seed from its host stream, so it advances as on CPU
        seed = int(torch.randint(0, 2**62, (), generator=generator, device=_stream_device(generator)))
        return _key_data(seed, 0)
    key = current_key(index)
    advance(index, 1)
    return key


def current_key(index: int) -> np.ndarray:
    """Key data for the device's next offset, not taken yet: a compiled program draws its random ops'
    keys from it (`offset_key`) and the caller then `advance`s past as many as the program drew."""
    seed, offset = _device_state(index)
    return _key_data(seed, offset)


def advance(index: int, n: int) -> None:
    _device_state(index)[1] += n


def offset_key(data, n: int):
    """Inside a program: the key data `n` offsets after `data`, as `n` more `next_key`s would give it
    (the 64-bit offset carries from its low word into its high one)."""
    low = data[2] + jnp.uint32(n)
    return data.at[2].set(low).at[3].add((low < data[2]).astype(jnp.uint32))


def _key_data(seed: int, offset: int) -> np.ndarray:
    return np.array([seed & _MASK32, seed >> 32, offset & _MASK32, offset >> 32], dtype=np.uint32)


def example_key() -> np.ndarray:
    return np.zeros(4, np.uint32)


def key_from_data(data):
    """The JAX PRNG key for key data (inside a program)."""
    key = jax.random.key(data[0])
    for word in (data[1], data[2], data[3]):
        key = jax.random.fold_in(key, word)
    return key


# --- `tpu` generators: a host random stream whose `device` reads `tpu:N` (`torch.Generator("tpu")` makes
# them, hf_tpu/device/generator.py). See docs/design/tpu-generator.md.


_stream_device = torch._C.Generator.device.__get__  # the device of a generator's C++ implementation


class TpuGenerator(torch._C.Generator):
    """A `torch.Generator("tpu")`: a host random stream that `tpu` ops draw their seeds from."""

    def __new__(cls, device):
        generator = super().__new__(cls, "cpu")
        generator._device = device
        return generator

    @property
    def device(self) -> torch.device:
        return self._device

    def __repr__(self) -> str:
        return f"<torch.Generator device={self._device}>"

    def __reduce__(self):  # copies and pickles stay tpu generators, with the same state
        _, _, state = super().__reduce__()
        return TpuGenerator, (self._device,), state
