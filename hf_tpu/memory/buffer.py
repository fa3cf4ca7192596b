"""How a `tpu` tensor's data lives in JAX: one buffer per PyTorch storage.

PyTorch's own memory model is kept exactly: a tensor is (storage, sizes, strides, storage_offset) and
views share their base's storage. Each `tpu` storage is a range of fake device addresses created
through DLPack (so PyTorch sees a real storage with a size, a data pointer and a deleter) and maps to
one `Buffer` holding a single `jax.Array` in the shape the storage was allocated with.

Reading a tensor derives its value from the buffer through its strides; writing through a tensor
(an in-place op on a view) computes the buffer's new value with a scatter. Both are pure functions of
static view metadata, so they fuse into the jitted computation of the op that needs them, and into
a deferred graph just the same. See docs/design/memory-model.md.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
import warnings
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax._src.array import ArrayImpl
from jax._src.interpreters import pxla
from jax.experimental import multihost_utils

from .. import dtypes, platform
from ._capsule import storage_capsule as _storage_capsule

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
            if array is None or type(array) is Lazy or sharded_arrays_exist:
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
    return [buf for buf in list(allocator.live.values()) if buf.device_index == device_index]


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


# --- Arrays sharded over several chips (hf_tpu.distributed).


def is_sharded(array) -> bool:
    """Whether a concrete array (not a value being traced) lives on more than one chip."""
    return isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer) \
        and type(array.sharding) is not jax.sharding.SingleDeviceSharding and len(array.sharding.device_set) > 1


def may_be_sharded(value) -> bool:
    """Whether an operand's array may live on more than one chip: a concrete one that does, or a deferred
    result (`Lazy`) of a graph that reads one (a graph's values are laid out over the chips of its inputs)."""
    if type(value) is Lazy:
        if value.concrete is not None:
            return is_sharded(value.concrete)
        return any(is_sharded(array) for array in value.graph.inputs)
    return is_sharded(value)


@functools.cache
def _chip_index(device) -> int:
    return platform.devices().index(device)


def shard_bytes(array, nbytes: int) -> dict:
    """{chip index: bytes of `array` that chip holds}, for a buffer of `nbytes` in all."""
    numel = math.prod(array.shape)
    per_chip = nbytes * math.prod(array.sharding.shard_shape(array.shape)) // numel if numel else 0
    return {_chip_index(device): per_chip for device in array.sharding.addressable_devices}


def place_together(arrays: list) -> list:
    """The arrays of one program, with single-chip ones replicated over the mesh of a sharded one:
    a jitted program runs on one set of chips (a tensor on `tpu:0` meeting a sharded activation is
    copied to every chip of its mesh for that program, its own buffer is unchanged)."""
    sharded = next((a for a in arrays if is_sharded(a)), None)
    if sharded is None:
        return arrays
    replicated = jax.sharding.NamedSharding(_mesh_of(sharded.sharding), jax.sharding.PartitionSpec())
    return [put_sharded(a, replicated) if isinstance(a, jax.Array) and not is_sharded(a) else a for a in arrays]


def _mesh_of(sharding):
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding.mesh
    return jax.sharding.Mesh(np.array(sharding._device_assignment), ("chips",))


# --- Views: static metadata and the pure read/write functions over a buffer's array.


class View(NamedTuple):
    """How a tensor sits in its buffer, when it is anything but the buffer itself."""

    shape: tuple
    strides: tuple
    offset: int
    dtype: torch.dtype
    conj: bool = False  # PyTorch's lazy conjugate / negative bits on complex views
    neg: bool = False


class Transposed(NamedTuple):
    """A matrix operand whose last two dims are swapped from its buffer's (`w.t()`, `k.transpose(-1, -2)`),
    handed as the buffer's own array to a lowering that contracts it in place: XLA:CPU copies a
    transposed matrix before a matrix-vector product instead of folding the transpose into the dot,
    which in a decode step rewrote every weight on every token."""

    array: object


class Flattened(NamedTuple):
    """A matrix operand that is its whole buffer of 3 or more dims with the leading ones flattened (a linear
    layer's input, `x.view(-1, x.shape[-1])`), handed in the buffer's own shape to a lowering that contracts
    it there: the product keeps the (batch, tokens) dims XLA lays out the rest of the model in. With bfloat16
    products asked for in bfloat16 (`ops.linalg._product_dtype`) the 1.1B Llama's compiled forward at 8x1024
    took 125.63 ms a call on the v5e (2026-12-06) against 133.20 ms."""

    array: object


def flattened_shape(view: View | None, shape: tuple, dtype: torch.dtype) -> tuple | None:
    """Where `view` is its whole contiguous buffer (of `shape` and `dtype`) as a matrix whose rows flatten two
    or more leading dims and whose columns flatten the rest: those leading dims and the columns' count (the
    shape a `buffer.Flattened` operand takes); else None."""
    if view is None or view.offset or view.conj or view.neg or view.dtype != dtype or len(view.shape) != 2:
        return None
    rows, columns = view.shape
    if view.strides != (columns, 1):
        return None
    for j in range(2, len(shape)):
        if math.prod(shape[:j]) == rows and math.prod(shape[j:]) == columns:
            return (*shape[:j], columns)
    return None


def swaps_last_two(view: View | None, shape: tuple, dtype: torch.dtype) -> bool:
    """Whether `view` is its whole buffer (of `shape` and `dtype`) with the last two dims swapped."""
    if view is None or view.offset or view.conj or view.neg or view.dtype != dtype or len(shape) < 2:
        return False
    swapped = shape[:-2] + (shape[-1], shape[-2])
    strides = _contiguous_strides(shape)
    return view.shape == swapped and view.strides == strides[:-2] + (strides[-1], strides[-2])


def view_of(t: torch.Tensor, buf: Buffer):
    """None when `t` is exactly its buffer (the common case, read for free), else its `View`."""
    dtype = t.dtype
    if t.is_neg() or t.is_conj():  # the negative bit also marks real views: `z.conj().imag`, `_neg_view`
        return View(tuple(t.shape), tuple(t.stride()), t.storage_offset(), dtype, t.is_conj(), t.is_neg())
    offset = t.storage_offset()
    if offset == 0 and t.is_contiguous():
        shape = t.shape  # a torch.Size: equal to the buffer's tuple when the sizes are
        if dtype == buf.dtype and shape == buf.shape:
            return None
        if dtype != buf.dtype and dtype != torch.bool and math.prod(shape) * dtype.itemsize == buf.nbytes:
            # e.g. bytes restored by torch.load, read as float32; never as bool, which keeps only 0 or 1
            # of a byte whose other views (`x.view(torch.bool)` of uint8) still see all its bits
            _adopt_layout(buf, tuple(shape), dtype)
            return None
    return View(tuple(t.shape), tuple(t.stride()), offset, dtype)


def _adopt_layout(buf: Buffer, shape, dtype):
    """Re-express a whole buffer in the layout of the tensor that covers it, so later reads of that
    tensor are free instead of reinterpreting bytes every time (the bytes do not change)."""
    if buf.array is not None:
        array = buf.value()
        view = View(shape, _contiguous_strides(shape), 0, dtype)
        buf.array = _reinterpret_jit(array.shape, array.dtype, view)(array)
    buf.shape, buf.dtype = shape, dtype


_REINTERPRETERS: dict = {}


def _reinterpret_jit(shape, dtype, view):
    key = (shape, dtype, view)
    fn = _REINTERPRETERS.get(key)
    if fn is None:
        fn = _REINTERPRETERS[key] = jax.jit(lambda a: read(a, view))
    return fn


def _contiguous_strides(shape):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


class _Dense(NamedTuple):
    """A strided view expressed as slice -> reshape -> slice -> transpose (no gather)."""

    dims: tuple  # the view's dims of size > 1 and stride > 0, outermost first
    block: tuple  # reshape of the flat segment
    take: tuple  # per block dim: how many to keep (a last dim of the innermost stride: 1)
    length: int  # flat segment length


def _dense_plan(view: View):
    dims = [d for d, n in enumerate(view.shape) if n > 1 and view.strides[d] != 0]
    dims.sort(key=lambda d: -view.strides[d])
    if not dims:
        return _Dense((), (1,), (1,), 1)
    strides = [view.strides[d] for d in dims]
    sizes = [view.shape[d] for d in dims]
    for i in range(len(dims) - 1):
        if strides[i] % strides[i + 1] or strides[i] < strides[i + 1] * sizes[i + 1]:
            return None
    block = [sizes[0]] + [strides[i] // strides[i + 1] for i in range(len(dims) - 1)]
    take = tuple(sizes)
    if strides[-1] != 1:  # every strides[-1]-th element: a last dim to take the first of
        block.append(strides[-1])
        take += (1,)
    # A contiguous innermost dim gets no trailing dim of size 1: on a TPU such a dim is the minor one of
    # its (8, 128) tiles, and the 1.1B model's forward at 8x1024 ran 1.7 ms longer on the v5e's device
    # with it (141.2 against 139.5 ms, profiles of 2026-12-06).
    return _Dense(tuple(dims), tuple(block), take, sizes[0] * strides[0])


def _as_bytes(flat):
    if flat.dtype == jnp.bool_:
        return flat.astype(jnp.uint8)
    if jnp.issubdtype(flat.dtype, jnp.complexfloating):
        flat = jnp.stack([flat.real, flat.imag], -1).reshape(-1)
    return lax.bitcast_convert_type(flat, jnp.uint8).reshape(-1)


def _from_bytes(data, dtype):
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return data != 0
    if jnp.issubdtype(dtype, jnp.complexfloating):
        parts = _from_bytes(data, jnp.finfo(dtype).dtype).reshape(-1, 2)
        return lax.complex(parts[:, 0], parts[:, 1])
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(data, dtype)
    return lax.bitcast_convert_type(data.reshape(-1, dtype.itemsize), dtype)


def _reinterpret(flat, dtype):
    """The same bytes seen as another dtype (PyTorch's `view(dtype)`, and storages read as bytes)."""
    dtype = jnp.dtype(dtype)
    if flat.dtype == dtype:
        return flat
    plain = (jnp.bool_, jnp.complex64, jnp.complex128)
    if flat.dtype.itemsize == dtype.itemsize and flat.dtype not in plain and dtype not in plain:
        return lax.bitcast_convert_type(flat, dtype)
    return _from_bytes(_as_bytes(flat), dtype)


def _flat(array, dtype):
    return _reinterpret(array.reshape(-1), dtypes.to_jax(dtype))


def _blocks(plan: _Dense, total: int):
    """The buffer of `total` elements in the plan's block shape, or None where it does not divide."""
    outer = math.prod(plan.block[1:])
    return None if total % outer else (total // outer,) + plan.block[1:]


def _aligned(plan: _Dense, offset: int, total: int):
    """The plan's block laid over the whole buffer instead of over a segment starting at `offset`:
    (the buffer's shape as blocks, the view's start in it), or None when the view's range crosses a
    block boundary there. Reads and writes then reshape and slice the buffer's own array, which XLA's
    partitioner follows through a sharded array; a flat segment of it would make it gather the whole."""
    whole = _blocks(plan, total)
    if whole is None:
        return None
    start, rest = [], offset
    for i in range(len(whole)):
        radix = math.prod(whole[i + 1:])
        start.append(rest // radix)
        rest %= radix
        if start[-1] + plan.take[i] > whole[i]:
            return None
    return whole, tuple(start)


# `View.offset` of a view that a program reads at a start it is given (`keyed_view`)
START_IS_AN_INPUT = -1
# offsets of one view shape compiled into programs before the next ones are given as inputs
_OFFSETS_COMPILED_IN = 2

_KEYED_VIEWS: dict = {}  # (view, the buffer's shape and dtype) -> `keyed_view`'s answer
_OFFSETS_SEEN: dict = {}  # (the view keyed without its offset, the buffer's shape and dtype) -> offsets keyed
_KEYED_VIEWS_CACHED = 4096


def keyed_view(view: View | None, buffer_shape: tuple, buffer_dtype: torch.dtype):
    """(the view as a program is keyed by it, the start the program is given or None).

    A loop over `w[i]` (Transformers' eager Mixture-of-Experts layer takes each expert's weights so) compiled
    one program per i for the row and for every op that read it, each offset compiled in. So once views of
    one shape and strides have come at `_OFFSETS_COMPILED_IN` offsets, a view at a further one whose range
    the aligned read covers (a row, a column, a narrow) is keyed with its offset as `START_IS_AN_INPUT`, and
    its program reads it with `lax.dynamic_slice` at the start per block dim (an int32 or int64 array) it is
    given: one program for every later i. The first offsets stay compiled in, since a start given costs each
    call an input (a few microseconds in strict eager on the development CPU), which a view always taken at the same
    offset (`logits[:, -1]`, the second half of a `chunk`) would pay for nothing. Views stay compiled in
    once sharded arrays exist: XLA's partitioner follows a constant slice of a sharded array, where a
    slice at a start known only when the program runs may gather the whole array."""
    if view is None or not view.offset or sharded_arrays_exist:
        return view, None
    key = (view, buffer_shape, buffer_dtype)
    entry = _KEYED_VIEWS.get(key)
    if entry is None:
        if len(_KEYED_VIEWS) >= _KEYED_VIEWS_CACHED:
            _KEYED_VIEWS.clear()
            _OFFSETS_SEEN.clear()
        entry = _KEYED_VIEWS[key] = _keyed_view(view, buffer_shape, buffer_dtype)
    return entry


def _keyed_view(view: View, buffer_shape: tuple, buffer_dtype: torch.dtype):
    total = math.prod(buffer_shape)
    plain = view.dtype == buffer_dtype and not view.conj and not view.neg and math.prod(view.shape)
    plan = _dense_plan(view) if plain else None
    aligned = None if plan is None else _aligned(plan, view.offset, total)
    if aligned is None:
        return view, None
    movable = view._replace(offset=START_IS_AN_INPUT)
    family = (movable, buffer_shape, buffer_dtype)
    seen = _OFFSETS_SEEN.get(family, 0)
    if seen < _OFFSETS_COMPILED_IN:
        _OFFSETS_SEEN[family] = seen + 1
        return view, None
    return movable, np.asarray(aligned[1], np.int32 if total < 2**31 else np.int64)


def _shaped(array, flat, shape):
    """The buffer's values (`flat`, in the view's dtype) in `shape`, reshaped from the array itself when
    no reinterpretation was needed: one reshape the partitioner can follow, not two."""
    return array.reshape(shape) if flat.dtype == array.dtype else flat.reshape(shape)


def _segment(flat, offset, length):
    """flat[offset:offset+length], padded with zeros where the range runs past the end."""
    end = min(flat.shape[0], offset + length)
    seg = lax.slice(flat, (offset,), (end,))
    if end - offset < length:
        seg = jnp.pad(seg, (0, length - (end - offset)))
    return seg


def _gather_index(view: View, limit: int):
    idx_dtype = jnp.int32 if limit < 2**31 else jnp.int64
    idx = jnp.full(view.shape, view.offset, idx_dtype)
    for d, stride in enumerate(view.strides):
        if view.shape[d] > 1 and stride:
            idx = idx + lax.broadcasted_iota(idx_dtype, view.shape, d) * stride
    return idx


def read(array, view: View | None, start=None):
    """The value of a tensor given its buffer's array (inside or outside jit); `start`: the view's start
    where its offset is `START_IS_AN_INPUT` (`keyed_view`)."""
    if view is None:
        return array
    if view.conj or view.neg:
        value = read(array, view._replace(conj=False, neg=False))
        value = jnp.conj(value) if view.conj else value
        return -value if view.neg else value
    flat = _flat(array, view.dtype)
    numel = math.prod(view.shape)
    if numel == 0:
        return jnp.zeros(view.shape, flat.dtype)
    if view.offset == 0 and numel == flat.shape[0] and view.strides == _contiguous_strides(view.shape):
        return _shaped(array, flat, view.shape)
    plan = _dense_plan(view)
    if plan is None:
        return flat[_gather_index(view, flat.shape[0])]
    if start is not None:  # a start given: the view is aligned (`keyed_view`)
        blocks, begin = _shaped(array, flat, _blocks(plan, flat.shape[0])), list(start)
    elif (aligned := _aligned(plan, view.offset, flat.shape[0])) is not None:
        whole, begin = aligned
        blocks, begin = _shaped(array, flat, whole), list(begin)
    else:
        blocks, begin = _segment(flat, view.offset, plan.length).reshape(plan.block), [0] * len(plan.block)
    # the block dims in the view's order (a last dim of the innermost stride stays last)
    order = sorted(range(len(plan.dims)), key=lambda i: plan.dims[i])
    order += range(len(plan.dims), len(plan.block))
    take = list(plan.take)
    # A view taking half its blocks or more is transposed before the slice, not after it: views of one buffer
    # in one order then slice one transposed array, which XLA computes once, and the optimization barrier keeps
    # that array whole (without it, XLA on a TPU folds the transpose into each consumer again). Rotary
    # embeddings read q whole and as its two halves. On the v5e (2026-12-06, 4 attention blocks of the 1.1B
    # model at 8x1024, `benchmarks.rotary_layouts`) transposing each slice took 14.9 ms, slicing the transposed
    # q 13.2 ms, slicing it behind the barrier 12.3 ms, no rotary embeddings 10.9 ms; the whole model's forward
    # at 8x1024 ran 4.4 ms less device time with the barrier. XLA:CPU drops the barrier and fuses as before. A
    # smaller view keeps the slice first: XLA:CPU transposed the whole buffer for it (y.permute(3, 2, 1, 0)[1]
    # of a 64**4 float32 buffer: 0.5-7 ms against 0.1 ms).
    transposed_first = order != sorted(order) and 2 * math.prod(take) >= math.prod(blocks.shape)
    if transposed_first:
        blocks = lax.optimization_barrier(jnp.transpose(blocks, order))
        begin, take = [begin[i] for i in order], [take[i] for i in order]
    if start is not None:
        value = lax.dynamic_slice(blocks, begin, take)
    else:
        value = lax.slice(blocks, begin, [a + n for a, n in zip(begin, take)])
    if not transposed_first:  # sorted dims -> the view's order
        value = jnp.transpose(value.reshape([view.shape[d] for d in plan.dims]), order[:len(plan.dims)])
    # size-1 and broadcast dims back in
    kept = [n if (n > 1 and view.strides[d] != 0) else 1 for d, n in enumerate(view.shape)]
    return jnp.broadcast_to(value.reshape(kept), view.shape)


_READERS: dict = {}  # view -> jitted read: a tensor read outside a program is one launch


def array_of(t: torch.Tensor, buf: Buffer | None = None):
    """A tpu tensor's value as one array: its buffer's, read through the tensor's view (inside a trace
    too, where the buffer holds a tracer)."""
    buf = buffer_of(t) if buf is None else buf
    view, start = keyed_view(view_of(t, buf), buf.shape, buf.dtype)
    if view is None:
        return buf.value()
    reader = _READERS.get(view)
    if reader is None:
        reader = _READERS[view] = jax.jit(functools.partial(read, view=view))
    return reader(buf.value()) if start is None else reader(buf.value(), start=start)


def write(array, view: View | None, value, start=None):
    """The buffer's new array after writing `value` (of the view's shape and dtype) through `view` (`start` as
    in `read`)."""
    if view is None:
        return value.reshape(array.shape).astype(array.dtype)
    if view.conj or view.neg:  # what is stored is the conjugate / negation of what the view shows
        value = -value if view.neg else value
        value = jnp.conj(value) if view.conj else value
        view = view._replace(conj=False, neg=False)
    flat = _flat(array, view.dtype)
    numel = math.prod(view.shape)
    if numel == 0:
        return array
    value = value.astype(flat.dtype)
    broadcast = [d for d, (n, s) in enumerate(zip(view.shape, view.strides)) if n > 1 and s == 0]
    if broadcast:  # one memory location per expanded dim: its first value is written
        value = value[tuple(slice(0, 1) if d in broadcast else slice(None) for d in range(value.ndim))]
        shape = tuple(1 if d in broadcast else n for d, n in enumerate(view.shape))
        view = View(shape, view.strides, view.offset, view.dtype)
        numel = math.prod(shape)
    plan = _dense_plan(view)
    if plan is None:
        flat = flat.at[_gather_index(view, flat.shape[0]).reshape(-1)].set(value.reshape(-1))
        return _reinterpret(flat, array.dtype).reshape(array.shape)
    squeezed = value.reshape([view.shape[d] for d in sorted(plan.dims)])
    rank = {d: i for i, d in enumerate(sorted(plan.dims))}
    sorted_value = jnp.transpose(squeezed, [rank[d] for d in plan.dims]) if plan.dims else squeezed
    aligned = (_blocks(plan, flat.shape[0]), start) if start is not None else _aligned(plan, view.offset, flat.shape[0])
    if aligned is not None:
        whole, start = aligned
        written = lax.dynamic_update_slice(_shaped(array, flat, whole), sorted_value.reshape(plan.take), start)
        return _reinterpret(written.reshape(-1), array.dtype).reshape(array.shape)
    block = _segment(flat, view.offset, plan.length).reshape(plan.block)
    block = lax.dynamic_update_slice(block, sorted_value.reshape(plan.take), (0,) * len(plan.block))
    valid = min(plan.length, flat.shape[0] - view.offset)
    flat = lax.dynamic_update_slice(flat, block.reshape(-1)[:valid], (view.offset,))
    return _reinterpret(flat, array.dtype).reshape(array.shape)


# --- Host transfer.


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


def put_sharded(value, sharding):
    """`value` (a NumPy array or a jax.Array) laid out as `sharding`, for one program's arguments: it may
    share device memory with `value` (what a buffer keeps is made by `place`). Where the sharding spans other
    processes' chips, each process writes its own chips from its own copy of the value: every process runs
    the same program, so holds the same value (JAX cannot send it between processes' chips)."""
    if sharding.is_fully_addressable or (isinstance(value, jax.Array) and not value.is_fully_addressable):
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def place(value, placement):
    """`value` (a NumPy array or a jax.Array) laid out as `placement` (a sharding, or one jax Device), for a
    buffer to keep: in device memory of its own unless it is `value` itself.

    Buffers may hold one jax.Array together: the allocator counts its holders, and no program is donated an
    array another buffer holds. Two arrays over the same memory look unshared to that count, and donating
    either deletes the other's data (XLA: "Attempt to donate the same buffer twice", "Buffer has been
    deleted or donated"). `jax.device_put` makes such arrays: it keeps each part of the value already on its
    target chip (a weight on `tpu:0` replicated over a mesh keeps its memory on chip 0, two LayerNorm weights
    uploaded as one kept array of ones then shared it), and `may_alias=False` does not stop it for a
    multi-chip sharding (jax 0.10.2). So the parts of a placement on the chips the source is on are copied
    once, by a program, whose results never alias arguments it is not donated (a weight replicated from
    `tpu:0` over 8 chips: chip 0's copy)."""
    if isinstance(placement, jax.Device):
        placed = jax.device_put(value, placement)
    else:
        placed = put_sharded(value, placement)
    if placed is value or not isinstance(value, jax.Array):
        return placed
    source_chips = value.sharding.device_set
    if source_chips.isdisjoint(placed.sharding.device_set):
        return placed
    if len(placed.sharding.device_set) == 1:
        return _copy(placed)
    shards = [_copy(shard.data) if shard.device in source_chips else shard.data for shard in placed.addressable_shards]
    return jax.make_array_from_single_device_arrays(placed.shape, placed.sharding, shards)


_copy = jax.jit(lambda array: array)


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
        chip = _chip_index(next(iter(array.sharding.device_set)))
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


def _whole_buffer(view: View | None, buf: Buffer) -> bool:
    """Whether a tensor of `view` reads its buffer's elements in order (none: the buffer itself; or the buffer
    under another shape, as `logits[:, -1]` of logits shaped [batch, 1, vocab])."""
    return view is None or (not view.offset and not view.conj and not view.neg and view.dtype == buf.dtype
                            and math.prod(view.shape) == math.prod(buf.shape)
                            and view.strides == _contiguous_strides(view.shape))


def _host_source(t: torch.Tensor):
    """The array a host copy of `t` transfers: the buffer's own where `t` reads it whole (reshaped on the host
    then: no device program makes a copy to transfer, and a transfer `start_host_copies` began is the one
    read), else its view's values."""
    buf = buffer_of(t)
    return buf.value() if _whole_buffer(view_of(t, buf), buf) else array_of(t, buf)


def _start_transfer(array) -> None:
    """Start `array`'s copy to the host, unless its values are kept on the host already (an upload)."""
    if _uploaded_values(array) is None and isinstance(array, jax.Array) and array.is_fully_addressable:
        array.copy_to_host_async()


def read_one_array(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether tpu tensors `a` and `b` of one shape and dtype each read a computed array whole, the same one
    (one buffer's, or the kept upload of equal values that `from_host` gives every buffer made from them)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    buf_a, buf_b = buffer_of(a), buffer_of(b)
    array = buf_a.array
    return (isinstance(array, jax.Array) and buf_b.array is array
            and _whole_buffer(view_of(a, buf_a), buf_a) and _whole_buffer(view_of(b, buf_b), buf_b))


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
        if type(buf.array) is not Lazy and buf.array is not None and _whole_buffer(view_of(t, buf), buf):
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
