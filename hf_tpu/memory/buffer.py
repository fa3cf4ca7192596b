"""How a `tpu` tensor's data lives in JAX: one buffer per PyTorch storage, and the allocator.

PyTorch's own memory model is kept exactly: a tensor is (storage, sizes, strides, storage_offset) and
views share their base's storage. Each `tpu` storage is a range of fake device addresses created
through DLPack (so PyTorch sees a real storage with a size, a data pointer and a deleter) and maps to
one `Buffer` holding a single `jax.Array` in the shape the storage was allocated with. How a tensor reads
and writes its buffer through its view is `tensor_views.py`; where an array sits over chips, `placement.py`; the
copies between the host and the device, `host_transfers.py`. See docs/design/memory-model.md.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import torch
from jax._src.array import ArrayImpl

from .. import dtypes, platform
from ._capsule import storage_capsule as _storage_capsule
from .placement import is_sharded, shard_bytes

# --- A new storage: a range of fake addresses, handed to PyTorch as a DLPack capsule made in C
# (`_capsule.c`), whose deleter calls the allocator back with the address when the storage dies.

_from_dlpack = torch._C._from_dlpack
_ALIGN = 256


class _Layout(NamedTuple):
    """What every tensor of one shape and dtype shares: its size, its address span and its DLPack
    dtype code and bits."""

    nbytes: int
    span: int
    code: int
    bits: int


_LAYOUTS: dict = {}  # (shape, dtype) -> _Layout
_LAYOUTS_CACHED = 4096


def _layout(shape: tuple, dtype: torch.dtype) -> _Layout:
    nbytes = math.prod(shape) * dtype.itemsize
    if len(_LAYOUTS) >= _LAYOUTS_CACHED:
        _LAYOUTS.clear()
    layout = _LAYOUTS[(shape, dtype)] = _Layout(nbytes, (nbytes + 2 * _ALIGN - 1) // _ALIGN * _ALIGN,
                                                 *dtypes.dlpack_code(dtype))
    return layout


_FIRST_ADDRESS = 1 << 48  # above every user-space address: never a real pointer, 2**63 bytes of room


class Lazy:
    """A result of a deferred op, not computed yet: the shape and dtype of the array it will be, where
    it comes from (`edge`: result `index` of node `node` in `graph`), and once its graph ran, the array
    (`concrete`) for an op that read it before that flush."""

    __slots__ = ("shape", "dtype", "graph", "node", "index", "edge", "concrete")

    def __init__(self, shape, dtype, graph, node, index):
        self.shape = shape
        self.dtype = dtype
        self.graph = graph
        self.node = node
        self.index = index
        self.edge = ("n", node, index)
        self.concrete = None


# Buffers that took a Lazy value since the last flush, so a flush knows which results are still
# referenced: held (a buffer is a few slots; its storage's memory is not), listed once per value taken,
# and read once by the flush (`take_pending`). A buffer released meanwhile holds None.
pending: list = []


def take_pending() -> list:
    """The buffers that took a Lazy value since the last call; the list starts anew."""
    global pending
    taken, pending = pending, []
    return taken


# Set by the execution modes: computes every pending value (a sync point).
flush = None
# Set once an array sharded over several chips exists (hf_tpu.distributed): until then no buffer
# needs its placement looked at, so single-chip programs pay nothing for sharding support.
sharded_arrays_exist = False


class Buffer:
    """The data of one storage: `array` (a jax.Array, a `Lazy` deferred result, or None while
    uninitialised) and its layout. `counted` says whether its bytes are in the memory statistics:
    a deferred result occupies no device memory until a flush materialises it. `chip_bytes` is None
    while all its bytes sit on `tpu:device_index`, else {chip index: bytes} of a sharded array."""

    __slots__ = ("_array", "shape", "dtype", "device_index", "nbytes", "address", "counted", "chip_bytes")

    def __init__(self, shape, dtype, device_index, nbytes, address):
        self._array = None
        self.shape = shape
        self.dtype = dtype
        self.device_index = device_index
        self.nbytes = nbytes
        self.address = address
        self.counted = False
        self.chip_bytes = None

    @property
    def array(self):
        return self._array

    @array.setter
    def array(self, value):
        old = self._array
        if old is not None and type(old) is not Lazy:
            allocator.let_go(old)
        self._array = value
        if type(value) is Lazy:
            pending.append(self)
            return
        if value is None:
            return
        allocator.hold(value)
        if isinstance(value, jax.core.Tracer):
            # standing in for an array while a program is traced, in no device memory: the bytes of an input's
            # array stay counted where it put them, and a tensor the trace makes counts nothing (counted, every
            # traced call's first run peaked at its intermediates' bytes, and an input split over chips counted
            # whole on the first)
            return
        if sharded_arrays_exist and (self.chip_bytes is not None or is_sharded(value)):
            allocator.count(self, value)  # where the bytes sit may have changed with the new array
        elif not self.counted:
            allocator.count(self)

    def value(self):
        """The buffer's concrete array (flushing deferred work first); an uninitialised buffer reads
        as zeros (PyTorch leaves it undefined)."""
        if type(self._array) is Lazy:
            flush(f"a value was read ({tuple(self.shape)} {self.dtype})")
            if type(self._array) is Lazy:  # the flush that was to compute it failed (out of memory)
                raise RuntimeError(
                    f"this tpu tensor ({tuple(self.shape)} {self.dtype}) has no value: the deferred work "
                    "that computes it failed at an earlier sync point (see that error); compute it again"
                )
        if self._array is None:
            self.array = jax.device_put(
                jnp.zeros(self.shape, dtypes.to_jax(self.dtype)), platform.jax_device(self.device_index)
            )
        return self._array


class _Allocator:
    """Hands out address ranges, keeps the buffer of each live storage, and counts memory per device."""

    def __init__(self):
        # re-entrant: allocating can run the garbage collector, which releases dead buffers
        self.lock = threading.RLock()
        self.next_address = _FIRST_ADDRESS
        self.live: dict[int, Buffer] = {}  # address -> the buffer of the storage there
        self.allocated: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.num_allocs: dict[int, int] = {}
        self.holding: dict[int, int] = {}  # id(array) -> how many live buffers hold that concrete array

    def new_tensor(self, shape: tuple, dtype: torch.dtype, device_index: int, array=None):
        """A new contiguous tpu tensor and its buffer, holding `array` (None: uninitialised, counted
        as PyTorch counts an empty tensor's memory); `shape` a tuple of ints. This runs once per op
        result, so an op's concrete single-chip result is held and counted here under the one lock
        rather than through `Buffer.array`."""
        layout = _LAYOUTS.get((shape, dtype))
        if layout is None:
            layout = _layout(shape, dtype)
        nbytes = layout.nbytes
        with self.lock:
            address = self.next_address
            self.next_address += layout.span
            buf = Buffer(shape, dtype, device_index, nbytes, address)
            self.live[address] = buf
            self.num_allocs[device_index] = self.num_allocs.get(device_index, 0) + 1
            if type(array) is not ArrayImpl or sharded_arrays_exist:  # none, deferred, traced, or maybe split
                plain = False
            else:
                plain = True
                buf._array = array
                self._change_holders(array, 1)
                buf.counted = True
                self._add(device_index, nbytes)
        if not plain:
            if array is None:
                self.count(buf)
            elif type(array) is Lazy:  # a deferred result: no memory counted until a flush computes it
                buf._array = array
                pending.append(buf)
            else:
                buf.array = array
        capsule = _storage_capsule(address, device_index, layout.code, layout.bits, shape, self._release)
        return _from_dlpack(capsule), buf

    def _release(self, address: int):
        with self.lock:
            buf = self.live.pop(address, None)
            if buf is not None:
                if buf.counted:
                    self._uncount(buf)
                array = buf._array
                if array is not None and type(array) is not Lazy:
                    self._change_holders(array, -1)
                buf._array = None

    def count(self, buf: Buffer, sharded_array=None):
        """Add a buffer's bytes to its device's statistics (once it holds or reserves memory); the
        buffer of a sharded array counts on each chip the bytes of the shard that chip holds."""
        if buf.counted:
            self._uncount(buf)
        buf.counted = True
        if sharded_array is not None and is_sharded(sharded_array):
            buf.chip_bytes = shard_bytes(sharded_array, buf.nbytes)
            for index, nbytes in buf.chip_bytes.items():
                self._add(index, nbytes)
        else:
            buf.chip_bytes = None
            self._add(buf.device_index, buf.nbytes)

    def _add(self, index: int, nbytes: int):
        used = self.allocated.get(index, 0) + nbytes
        self.allocated[index] = used
        if used > self.peak.get(index, 0):
            self.peak[index] = used

    def _uncount(self, buf: Buffer):
        if buf.chip_bytes is None:
            self.allocated[buf.device_index] -= buf.nbytes
        else:
            for index, nbytes in buf.chip_bytes.items():
                self.allocated[index] -= nbytes

    def buffer(self, address: int) -> Buffer:
        return self.live[address]

    def live_now(self) -> dict:
        """A copy of `live` to iterate over. Iterating `live` itself fails when the garbage collector runs in the
        middle (any allocation can start it) and frees a tpu tensor, whose release removes its buffer; `dict.copy`
        allocates nothing per entry, so no collection runs inside it, and the lock holds off other threads."""
        with self.lock:
            return self.live.copy()

    def hold(self, array):
        with self.lock:
            self._change_holders(array, 1)

    def let_go(self, array):
        with self.lock:
            self._change_holders(array, -1)

    def _change_holders(self, array, change: int):
        """Under the lock: one more (or one fewer) live buffer holds `array`."""
        key = id(array)
        left = self.holding.get(key, 0) + change
        if left:
            self.holding[key] = left
        else:
            del self.holding[key]

    def holders(self, array) -> int:
        """How many live buffers hold `array`: one that none or only the overwritten buffer holds can be
        donated to a program that overwrites it. (A held array is alive, so its id is its own.)"""
        return self.holding.get(id(array), 0)


allocator = _Allocator()


def new_tensor(shape, dtype: torch.dtype, device_index: int, array=None) -> torch.Tensor:
    """A contiguous `tpu` tensor with a fresh storage whose buffer holds `array` (None: uninitialised)."""
    if type(shape) is not tuple:  # torch.Size, a list of ints from a schema
        shape = tuple(map(int, shape))
    return allocator.new_tensor(shape, dtype, device_index, array)[0]


def live_buffers(device_index: int) -> list:
    """The live buffers on `tpu:device_index`."""
    return [buf for buf in allocator.live_now().values() if buf.device_index == device_index]


def device_arrays(device_index: int) -> list:
    """The concrete arrays the live buffers on `tpu:device_index` hold, for `synchronize` to wait on.
    `type(...) is ArrayImpl` rather than `isinstance(..., jax.Array)`: jax.Array's own instance check
    costs 0.3-0.4 us per buffer, ten times the comparison."""
    return [array for buf in live_buffers(device_index) if type(array := buf._array) is ArrayImpl]


def buffer_of(t: torch.Tensor) -> Buffer:
    """The buffer behind a `tpu` tensor's storage (shared by all of its views)."""
    try:
        return allocator.live[t.untyped_storage().data_ptr()]
    except KeyError:
        raise RuntimeError(
            f"tpu tensor of shape {tuple(t.shape)} has no device buffer (its storage was not created "
            "by hf_tpu); create tpu tensors with factories or .to('tpu')"
        ) from None


def may_be_sharded(value) -> bool:
    """Whether an operand's array may live on more than one chip: a concrete one that does, or a deferred
    result (`Lazy`) of a graph that reads one (a graph's values are laid out over the chips of its inputs)."""
    if type(value) is Lazy:
        if value.concrete is not None:
            return is_sharded(value.concrete)
        return any(is_sharded(array) for array in value.graph.inputs)
    return is_sharded(value)
