"""Copies between the host and the device: a CPU tensor's values uploaded (small values that recur kept
uploaded, Python numbers too), and a tpu tensor's values read back (their transfers started together)."""

from __future__ import annotations

import collections
import functools
import warnings
import weakref

import jax
import numpy as np
import torch
from jax._src.array import ArrayImpl
from jax._src.interpreters import pxla
from jax.experimental import multihost_utils

from .. import dtypes, platform
from .buffer import Lazy, allocator, buffer_of
from .placement import chip_index
from .tensor_views import array_of, is_whole_buffer, view_of


def _uploaded_values(array) -> np.ndarray | None:
    """The host values `array` was uploaded from, where they are kept (`_uploads`): reading it back waits for
    no device."""
    uploaded = _uploads.get(id(array))
    return uploaded[1] if uploaded is not None and uploaded[0]() is array else None


def to_numpy(array) -> np.ndarray:
    uploaded = _uploaded_values(array)
    if uploaded is not None:
        return uploaded.copy()  # the caller's to write to
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        # split over other processes' chips too (a multi-process run): every process gets all of it
        if array.is_fully_replicated:
            return np.asarray(array.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(jax.device_get(array))


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a NumPy array of its own (bit-exact, bfloat16 and float8 included), for JAX to
    upload. Not a view of the tensor: XLA on the CPU may alias host memory, and a TPU's transfer reads it after
    the upload call has returned, where PyTorch lets the CPU tensor be written or freed at once (on a v5e an
    in-place op on a CPU tensor right after its `.to("tpu")` reached the chip's copy)."""
    t = t.detach().resolve_conj().resolve_neg()
    bits = dtypes.HOST_BITS.get(t.dtype)
    if bits is not None:
        return np.array(t.view(bits).numpy(), copy=True, order="C").view(dtypes.to_jax(t.dtype))
    return np.array(t.numpy(), copy=True, order="C")


def from_host(t: torch.Tensor, device_index: int):
    """A CPU tensor's values as a jax.Array on `tpu:device_index`. Small values that recur (a
    scheduler's timestep every denoising step, `torch.tensor([...], device="tpu")` constants, the positions of a
    prompt of a length seen before) are uploaded once: the arrays of the last few hundred are kept, held (so no
    program is ever donated one), and shared by the buffers made from equal values; a jax.Array never changes,
    and an in-place op gives its buffer a new one. An upload waited for takes about 0.6 ms on a v5e, 0.17 ms of
    it the host's.

    Values equal to those of an array just read back from the chip (`to_host`) are that array: a tpu prompt's
    ids, which `generate()` reads to the host for its bookkeeping and Transformers then uploads again (on a v5e
    0.17 ms of the host's time before the prefill starts)."""
    host = host_array(t)
    key = None
    if host.nbytes <= _KEPT_UPLOAD_BYTES:
        key = _values_key(host, device_index)
        array = _recurring_array(key)
        if array is None and host.nbytes <= _READ_BACK_BYTES:
            array = _read_back_array(key)
        if array is not None:
            return array
    array = _upload(host, jax.core.ShapedArray(host.shape, host.dtype), device_index)
    if host.nbytes <= _UPLOADS_KEPT_BYTES:
        ident = id(array)
        _uploads[ident] = (weakref.ref(array, lambda _: _uploads.pop(ident, None)), host)
    if key is not None:
        _keep_recurring(key, array)
    return array


# the dtype NumPy gives a Python number, before JAX's canonicalisation (float32 and int32 without 64-bit types)
_NUMBER_DTYPES = {bool: np.bool_, int: np.int64, float: np.float64, complex: np.complex128}


def from_number(v, device_index: int):
    """A Python number as the array JAX makes of it when a jitted call is given it (its canonical dtype; weakly
    typed, but for a bool), on `tpu:device_index`, kept as `from_host` keeps recurring values: a jitted call given
    it traces the same program, and uploads nothing. Its type and bits are its key: 1, 1.0 and True differ, -0.0
    is not 0.0, a NaN finds itself. An int beyond int64 raises OverflowError, as the jitted call would."""
    kind = type(v)
    bits = v.hex() if kind is float else (v.real.hex(), v.imag.hex()) if kind is complex else v
    key = (kind, bits, device_index)  # read without NumPy: a kept number is found in about 1 us
    array = _recurring_array(key)
    if array is None:
        weak = kind is not bool
        host = np.asarray(v, dtype=jax.dtypes.canonicalize_dtype(_NUMBER_DTYPES[kind]))
        array = _upload(host, jax.core.ShapedArray((), host.dtype, weak_type=weak), device_index)
        _keep_recurring(key, array)
    return array


def _upload(host: np.ndarray, aval, device_index: int):
    """The transfer jax.device_put ends in, without its ~40 us of argument handling per call: small
    host-to-device copies happen every decoding step (jax is pinned to 0.10.x in pyproject.toml)."""
    device = platform.jax_device(device_index)
    return pxla.batched_device_put(aval, _sharding(device), [host], [device])


def _recurring_array(key):
    """The kept array of a recurring value, now the most recently used; None if it is not kept."""
    with allocator.lock:
        array = _recurring.get(key)
        if array is not None:
            _recurring.move_to_end(key)
        return array


def _keep_recurring(key, array) -> None:
    with allocator.lock:
        if key not in _recurring:  # another thread may have uploaded the same value meanwhile
            allocator.hold(array)
            _recurring[key] = array
            if len(_recurring) > _RECURRING_KEPT:
                allocator.let_go(_recurring.popitem(last=False)[1])


# id(uploaded array) -> (a weak reference to it, the host values it was made from), for arrays of at most
# `_UPLOADS_KEPT_BYTES`: reading one back (a prompt's ids, a tokenized batch) then waits for no device (on a v5e a
# read of a batch's ids just uploaded took 7.7 ms, behind the chip's queue). A jax.Array never changes, and a
# buffer written in place holds another one.
_UPLOADS_KEPT_BYTES = 1 << 16
_uploads: dict = {}

# values of at most this many bytes are kept once uploaded, the last `_RECURRING_KEPT` of them (tensors' and the
# Python numbers ops pass to their programs, `from_number`): at most 1 MiB of values
_KEPT_UPLOAD_BYTES = 4096
_RECURRING_KEPT = 256
# (dtype, shape, bytes, chip) of a tensor's values, or (type, bits, chip) of a Python number -> jax.Array
_recurring: collections.OrderedDict = collections.OrderedDict()


# values of at most this many bytes read back from the chip (`to_host`) -> a weak reference to the array they were
# read from, the last `_READ_BACK_KEPT` of them: an upload of the same values is that array (`from_host`). Weak: an
# array no tensor holds any more is not kept for it, and one a program was donated is deleted and not handed out.
_READ_BACK_BYTES = 4096
_READ_BACK_KEPT = 16
_read_back: collections.OrderedDict = collections.OrderedDict()


def _values_key(host: np.ndarray, device_index: int) -> tuple:
    """Host values and a chip, as the kept uploads and read-backs find an array by them."""
    return host.dtype, host.shape, host.tobytes(), device_index


def _keep_read_back(host: np.ndarray, array) -> None:
    """Remember that `array` (one chip's) holds the values `host` was read into."""
    if type(array) is not ArrayImpl or type(array.sharding) is not jax.sharding.SingleDeviceSharding:
        return
    try:
        chip = chip_index(next(iter(array.sharding.device_set)))
    except ValueError:  # an array of another JAX backend's (the host's CPU beside a TPU)
        return
    key = _values_key(host, chip)
    with allocator.lock:
        _read_back[key] = weakref.ref(array)
        _read_back.move_to_end(key)
        if len(_read_back) > _READ_BACK_KEPT:
            _read_back.popitem(last=False)


def _read_back_array(key):
    """The array the values of `key` were last read back from, while it is alive and not donated; else None."""
    with allocator.lock:
        ref = _read_back.get(key)
    array = None if ref is None else ref()
    return None if array is None or array.is_deleted() else array


def let_go_of_kept_uploads() -> None:
    """`torch.tpu.empty_cache()`: the kept uploads are the only memory hf_tpu keeps that no tensor holds."""
    with allocator.lock:
        while _recurring:
            allocator.let_go(_recurring.popitem()[1])


@functools.cache
def _sharding(device):
    return jax.sharding.SingleDeviceSharding(device)


def _host_source(t: torch.Tensor):
    """The array a host copy of `t` transfers: the buffer's own where `t` reads it whole (reshaped on the host
    then: no device program makes a copy to transfer, and a transfer `start_host_copies` began is the one
    read), else its view's values."""
    buf = buffer_of(t)
    return buf.value() if is_whole_buffer(view_of(t, buf), buf) else array_of(t, buf)


def _start_transfer(array) -> None:
    """Start `array`'s copy to the host, unless its values are kept on the host already (an upload)."""
    if _uploaded_values(array) is None and isinstance(array, jax.Array) and array.is_fully_addressable:
        array.copy_to_host_async()


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A tpu tensor's value as a new CPU tensor, for a caller at a sync point already: no host sync
    is counted (a check on a device value, the copy behind `.cpu()`)."""
    return to_host(_host_source(t), t.dtype).reshape(t.shape)


def host_copies(tensors) -> list:
    """`host_copy` of each of `tensors`, their transfers started together (`start_host_copies`): a model's weights
    then wait for the device once, not once per tensor (on a v5e, 1.7 ms a read)."""
    tensors = list(tensors)
    start_host_copies(tensors)
    return [host_copy(t) for t in tensors]


def start_host_copies(tensors) -> None:
    """Start copying each of `tensors` that reads its buffer whole to the host, without waiting: its later host
    copy then finds the values there or on their way. A value still deferred (DEFER_AND_FUSE) is not computed
    for it, and a view of part of a buffer (whose copy a device program makes when it is read) is skipped."""
    for t in tensors:
        buf = buffer_of(t)
        if type(buf.array) is not Lazy and buf.array is not None and is_whole_buffer(view_of(t, buf), buf):
            _start_transfer(buf.array)


def to_host(array, dtype: torch.dtype) -> torch.Tensor:
    """A jax.Array's values as a new CPU tensor of `dtype` (bit-exact); a small one's array is remembered for an
    upload of the same values (`from_host`)."""
    host = to_numpy(array)
    if host.nbytes <= _READ_BACK_BYTES:
        _keep_read_back(host, array)
    bits = dtypes.HOST_BITS.get(dtype)
    if bits is not None:
        host = host.view(dtypes.to_jax(bits))
    with warnings.catch_warnings():  # the array is read-only; it is only read from, once
        warnings.simplefilter("ignore", UserWarning)
        shared = torch.from_numpy(host)
    # a fresh tensor rather than the NumPy-backed one: PyTorch cannot resize that one's storage
    out = torch.empty(host.shape, dtype=shared.dtype).copy_(shared)
    return out if bits is None else out.view(dtype)
