"""Handlers of the ops that manage storage rather than compute: allocation, views, transfers, host reads.

Views are PyTorch's own: the CPU kernels of `as_strided`, `view`, `set_`, ... only compute sizes
and strides over a shared storage, so they are reused as they are (redispatched with the CPU key).
Every other view op (transpose, slice, select, expand, ...) is composite over these.
"""

from __future__ import annotations

import math

import jax
import torch

from .. import dispatch, modes, platform
from ..device_state import current
from ..dispatch import handler, lowering, reuse_cpu_kernel
from ..dtypes import to_jax
from ..memory import buffer, host_transfers, placement, tensor_views
from ..memory.out_of_memory import check_allocation

aten = torch.ops.aten
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


reuse_cpu_kernel(
    aten.view.default,
    aten.as_strided.default,
    aten._reshape_alias.default,
    aten.unfold.default,
    aten.view_as_real.default,  # complex <-> real views reinterpret the buffer's bytes when read
    aten.view_as_complex.default,
    aten.set_.source_Storage,
    aten.set_.source_Storage_storage_offset,
    aten.set_.source_Tensor,
    aten.is_set_to.default,
)


def _contiguous(shape):
    return torch.empty(shape, device="meta").stride()


@handler(aten.empty.memory_format)
def empty(sig, values):
    size, dtype, _layout, device = values[:4]
    dtype = dtype or torch.get_default_dtype()
    index = current.current_index_for(torch.device(device) if device is not None else torch.device("tpu"))
    check_allocation(math.prod(size) * dtype.itemsize, index, lambda: f"torch.empty({tuple(size)}, dtype={dtype})")
    return buffer.new_tensor(size, dtype, index)


_COMPOSITE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


# what each `_like` factory fills its result with (`full_like`: its argument; `empty_like`: zeros, as a sharded
# array must hold something)
_FILLS = {aten.empty_like.default: 0, aten.zeros_like.default: 0, aten.ones_like.default: 1}


@handler(aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default)
def filled_like(sig, values):
    """PyTorch's `empty_like`, `zeros_like`, `ones_like` and `full_like` (their composite kernels: `empty_strided`
    with the strides the memory format asks for, then a fill), and for a tensor split over chips a result split
    the same way. An optimizer's state is made with them (AdamW's moments are `zeros_like(param)`): a fill's
    result is made on one chip, so the moments of parameters split over N chips (`fully_shard`) would sit whole
    on the first chip, N times its share. The split is kept where `self` reads its storage's sharded array whole
    and the result is contiguous (the layout is the array's); `empty_like`'s result then holds zeros."""
    self, fill = values[0], _FILLS.get(sig.op, values[1] if sig.op is aten.full_like.default else None)
    dtype, layout, device, pin_memory, memory_format = values[-5:]
    array = buffer.buffer_of(self)._array if self.device.type == "tpu" and buffer.sharded_arrays_exist else None
    dtype = dtype or self.dtype
    if (placement.is_sharded(array) and tuple(self.shape) == tuple(array.shape) and self.storage_offset() == 0
            and self.is_contiguous() and memory_format in (None, torch.preserve_format, torch.contiguous_format)
            and (device is None or torch.device(device) == self.device) and layout in (None, torch.strided)
            and (dtype.is_floating_point or sig.op is not aten.full_like.default)):  # PyTorch's range checks
        return buffer.new_tensor(tuple(self.shape), dtype, self.device.index,
                                 jax.numpy.full(array.shape, fill, to_jax(dtype), device=array.sharding))
    return sig.op.redispatch(_COMPOSITE, *values[:len(values) - 5], dtype=dtype, layout=layout, device=device,
                             pin_memory=pin_memory, memory_format=memory_format)


@handler(aten.empty_strided.default)
def empty_strided(sig, values):
    size, stride, dtype, _layout, device = values[:5]
    dtype = dtype or torch.get_default_dtype()
    index = current.current_index_for(torch.device(device) if device is not None else torch.device("tpu"))
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if math.prod(size) else 0
    check_allocation(extent * dtype.itemsize, index,
                     lambda: f"torch.empty_strided({tuple(size)}, dtype={dtype})")
    if tuple(stride) == _contiguous(size):
        return buffer.new_tensor(size, dtype, index)
    base = buffer.new_tensor((extent,), dtype, index)
    return aten.as_strided.default.redispatch(_CPU, base, size, stride, 0)


@handler(aten.resize_.default)
def resize_(sig, values):
    self, size = values[0], values[1]
    size = tuple(size)
    needed = (self.storage_offset() + math.prod(size)) * self.element_size()
    if needed > self.untyped_storage().nbytes():
        old = buffer.buffer_of(self)
        fresh = buffer.new_tensor((self.storage_offset() + math.prod(size),), self.dtype, old.device_index)
        if old.array is not None:  # PyTorch keeps the old bytes at the front of the new storage
            kept = old.nbytes // self.element_size()
            flat = tensor_views.read(old.value(), tensor_views.View((kept,), (1,), 0, self.dtype))
            buffer.buffer_of(fresh).array = jax.numpy.pad(flat, (0, fresh.numel() - kept))
        aten.set_.source_Storage_storage_offset.redispatch(
            _CPU, self, fresh.untyped_storage(), self.storage_offset(), size, _contiguous(size)
        )
        return self
    return aten.resize_.default.redispatch(_CPU, self, size)


@handler(aten._local_scalar_dense.default)
def local_scalar_dense(sig, values):
    t = values[0]
    modes.host_read("item()")
    return host_transfers.to_numpy(tensor_views.array_of(t)).item()


def _copy_to_host(t) -> torch.Tensor:
    """A tpu tensor's values as a new CPU tensor of its dtype: a counted host read."""
    modes.host_read("copy to cpu")
    return host_transfers.host_copy(t)


def to_cpu(tensors) -> list:
    """`[t.detach().cpu() for t in tensors]`, with the tpu tensors' transfers started together, so that the
    host waits for the device once, not once per tensor: copying a model's weights to the host
    (`hf_tpu.to_cpu(model.parameters())`) takes one round trip to the chip. Tensors on other devices are
    copied as `.cpu()` copies them (a CPU tensor is returned detached, not copied)."""
    tensors = [t.detach() for t in tensors]
    on_tpu = [t for t in tensors if t.device.type == "tpu"]
    if on_tpu:
        modes.host_read("copy to cpu")
    copies = iter(host_transfers.host_copies(on_tpu))
    return [next(copies) if t.device.type == "tpu" else t.cpu() for t in tensors]


def prefetch_to_cpu(tensors) -> None:
    """Start copying tpu tensors' values to the host without waiting for them: a later `.cpu()` (or `to_cpu`)
    of them reads values already there or on their way, where it would wait for the whole transfer (on a
    v5e 0.5-0.7 ms for a small array already computed). For a result the host reads after other work: the
    first token's logits, which `generate()` reads after its bookkeeping. Nothing else changes: tensors on other
    devices, views of part of a buffer, and values not computed yet (in DEFER_AND_FUSE, where this would
    compute them) are left alone."""
    host_transfers.start_host_copies([t for t in tensors if t.device.type == "tpu"])


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are known to hold equal values without asking the device: both on tpu, of one shape
    and dtype, reading one computed device array whole (views of one buffer, or two uploads of the same small
    values, which share the array hf_tpu keeps of them). False means not known, not unequal; nothing waits and
    nothing is computed (a value still deferred is not known). For a caller that launched device work ahead,
    from the inputs it expected, and takes its results when the inputs then made are those."""
    return a.device.type == "tpu" and b.device.type == "tpu" and tensor_views.read_one_array(a, b)


@handler(aten.copy_.default)
def copy_(sig, values):
    dst, src = values[0], values[1]  # non_blocking: every transfer is already asynchronous
    if dst.device.type != "tpu":
        # tpu -> host
        with torch.no_grad():
            return dst.copy_(_copy_to_host(src))
    index = dst.device.index
    if src.device.type != "tpu":
        if src.device.type != "cpu":
            raise dispatch.device_mismatch(sig, dst.device, src.device)
        host = src.to(dst.dtype)
        if tuple(host.shape) != tuple(dst.shape):
            host = host.expand(dst.shape)
        src = buffer.new_tensor(host.shape, host.dtype, index, host_transfers.from_host(host, index))
    elif src.device.index != index:
        src_buf = buffer.buffer_of(src)
        moved = placement.place(tensor_views.array_of(src, src_buf), platform.jax_device(index))
        src = buffer.new_tensor(src.shape, src.dtype, index, moved)
    dst_buf = buffer.buffer_of(dst)
    if (
        tensor_views.view_of(dst, dst_buf) is None
        and tuple(src.shape) == tuple(dst.shape)
        and src.dtype == dst.dtype
        and tensor_views.view_of(src, buffer.buffer_of(src)) is None
    ):
        src_buf = buffer.buffer_of(src)
        # jax arrays are immutable, so sharing one is a copy (a deferred result is shared the same way)
        value = src_buf.array if src_buf.array is not None else src_buf.value()
        if buffer.sharded_arrays_exist and placement.is_sharded(dst_buf.array) and type(value) is not buffer.Lazy:
            # loading weights into a sharded model (load_state_dict) keeps each chip's shard
            value = placement.place(value, dst_buf.array.sharding)
        dst_buf.array = value
        return dst
    return dispatch.run_lowered(dispatch.signature(aten.copy_.default), [dst, src, False])


@lowering(aten.copy.default)
def copy(self, src, non_blocking=False):
    return src


@handler(aten._to_copy.default)
def to_copy(sig, values):
    self = values[0]
    dtype, device = values[1], values[3]  # layout: tpu tensors are strided
    dtype = dtype or self.dtype
    target = torch.device(device) if device is not None else self.device
    if target.type == "cpu":
        return _copy_to_host(self).to(dtype)
    if target.type != "tpu":
        raise RuntimeError(f"cannot copy a tpu tensor to {target} directly; go through .cpu()")
    index = current.current_index_for(target)
    if self.device.type == "cpu":
        host = self.to(dtype)
        return buffer.new_tensor(host.shape, dtype, index, host_transfers.from_host(host, index))
    if index != self.device.index:  # another chip: the values move, then the cast runs there
        value = placement.place(tensor_views.array_of(self), platform.jax_device(index))
        self = buffer.new_tensor(self.shape, self.dtype, index, value)
    # a cast on the device is an op like any other: recorded in DEFER_AND_FUSE, never a sync
    result = dispatch.run_lowered(dispatch.signature(aten._to_copy.default), [self, dtype] + [None] * 5)
    mode = modes.current()
    if mode.kind is modes.ModeKind.TRACE and _widens(self.dtype, dtype):
        mode.note_widening(buffer.buffer_of(result).value(), tensor_views.array_of(self))
    return result


def _widens(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether a cast from `source` to `target` is a widening one, which keeps every value exactly in more bytes
    (bfloat16 or float16 to float32, float32 to float64)."""
    return source.is_floating_point and target.is_floating_point and target.itemsize > source.itemsize


@lowering(aten._to_copy.default)
def _to_copy(self, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    return self  # the cast to `dtype` is applied to every result from its meta dtype


@handler(aten.equal.default)
def equal(sig, values):
    a, b = values
    if a.shape != b.shape:
        return False
    return bool(torch.eq(a, b).all().item())


@handler(aten._assert_async.default, aten._assert_async.msg)
def assert_async(sig, values):
    """Checked at the next host read, as CUDA checks it (`modes.check_on_device`), on a copy: the
    condition is the one at the call even if the tensor is written before the check runs."""
    self, message = values[0], values[1] if len(values) > 1 else None
    if self.numel() != 1:  # PyTorch's error for an ambiguous truth value, at once
        aten._assert_async(torch.zeros(self.shape, dtype=self.dtype))

    def raise_if_false(value):
        if message is None:
            aten._assert_async(value)
        else:
            aten._assert_async.msg(value, message)

    modes.check_on_device(self.detach().clone(), raise_if_false)


@handler(aten.record_stream.default)
def record_stream(sig, values):
    return None
