"""torchao's quantized tensors on tpu: int4 weights without CUDA, int8 products on the int8 matrix unit, and each
quantized linear layer one program in strict eager.

torchao keeps a quantized weight as a tensor subclass over plain tensors (`Int8Tensor`: int8 data and its scales)
and implements `F.linear` on it in PyTorch ops (dequantize, or quantize the activation, then a product). Traced
(`generate()`'s programs, `hf_tpu.jit`, `torch.compile`) those ops are one XLA program, where the int8 data's
conversion fuses into the product and no dequantized copy of the weight is ever made; the core's `hf_tpu.jit`
sees through the subclass (its inner tensors are the program's inputs). What the adapter adds:

- in strict eager, where each op would be a program of its own (the conversion writing a bfloat16 copy of the
  weight), each torchao `F.linear` and each weight's quantization (`from_hp`) run through `hf_tpu.jit`: one
  program per shape;
- torchao's int8 weight-only product on tpu with the int8 data converted as it lies, not through a transposed
  view (`_int8_weight_only_linear`);
- torchao's int8 activation product on tpu computed as its CPU path computes it (`_int_mm`, then the scales),
  without the host read of the activation its other path makes;
- torchao's default int4 layout (`Int4Tensor`) quantized and multiplied without mslk, its CUDA-only kernels.

See docs/design/quantization.md.
"""

from __future__ import annotations

import functools

import torch

import hf_tpu


def _subclasses(cls):
    for subclass in cls.__subclasses__():
        yield subclass
        yield from _subclasses(subclass)


def _strict_eager() -> bool:
    return not torch.compiler.is_compiling() and torch.tpu.eager_mode == hf_tpu.EagerMode.DEFER_NEVER


def _one_program_on_tpu(implementation):
    """torchao's `F.linear` of a quantized weight (called as `implementation(func, types, args, kwargs)`), run
    through `hf_tpu.jit` where the weight is on tpu in strict eager; as it is everywhere else (traced, on the CPU,
    under defer-and-fuse, whose graphs fuse the same ops)."""
    traced = hf_tpu.jit(implementation)

    def linear(func, types, args, kwargs):
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if weight is not None and weight.device.type == "tpu" and _strict_eager():
            return traced(func, types, args, kwargs)
        return implementation(func, types, args, kwargs)

    linear.hf_tpu_wraps = implementation
    return linear


# --- Int4 weights (`Int4WeightOnlyConfig`, torchao's default "plain" layout: `Int4Tensor`) where mslk, the CUDA
# kernel library torchao quantizes and multiplies them with, is not installed (no CPU or TPU build exists)


def _int4_row_quantize_zp(x: torch.Tensor, group_size: int = 128):
    """mslk's asymmetric int4 quantization of each row's groups, in PyTorch ops (so on any device): the group's
    range in 16 steps, the values stored as `q` in [-8, 7] with `w = q * scale + zero_point`. Returns (q int8,
    scale, zero_point), the latter two (groups, rows) float32, as mslk does; `Int4Tensor.from_hp` casts them to
    the weight's dtype."""
    groups = x.reshape(-1, group_size).float()
    low = groups.amin(dim=1, keepdim=True)
    scale = (groups.amax(dim=1, keepdim=True) - low).clamp(min=1e-6) / 15
    zero_point = low + scale * 8
    q = (groups.sub(low).div(scale).round().clamp_(0, 15) - 8).to(torch.int8).reshape(x.shape)
    return q, scale.view(x.shape[0], -1).t().contiguous(), zero_point.view(x.shape[0], -1).t().contiguous()


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """mslk's packing of int4 pairs: column 2j in byte j's low nibble, 2j + 1 in its high one."""
    return torch.bitwise_or(torch.bitwise_and(q[:, ::2], 0xF), torch.bitwise_left_shift(q[:, 1::2], 4)).contiguous()


def _int4_linear(func, types, args, kwargs):
    """`F.linear` of an `Int4Tensor` weight: the core's `int4_linear`, which takes its layout as it is."""
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if weight.activation_dtype != torch.bfloat16:
        raise NotImplementedError(f"an Int4Tensor with {weight.activation_dtype} activations needs mslk's CUDA "
                                  "kernels; without mslk, hf_tpu multiplies int4 weights by bfloat16 activations only")
    if weight.act_pre_scale is not None:
        x = x * weight.act_pre_scale
    y = torch.ops.hf_tpu.int4_linear(x, weight.qdata, weight.scale, weight.zero_point, weight.block_size[-1])
    return y if bias is None else y + bias


def _int4_without_mslk() -> None:
    """Without mslk, torchao's `Int4Tensor` can neither be made (its quantizer is mslk's) nor multiplied by: give it
    mslk's quantizer in PyTorch ops and the core's `int4_linear`, on every device. The layout and the numbers
    are mslk's, so a checkpoint saved here loads where mslk runs, and the other way round."""
    from torchao.quantization.quantize_.workflows.int4 import int4_tensor

    if int4_tensor.int4_row_quantize_zp is not None:  # mslk is installed: its kernels serve its devices
        return
    int4_tensor.int4_row_quantize_zp = _int4_row_quantize_zp
    int4_tensor.pack_int4 = _pack_int4
    int4_tensor.Int4Tensor.implements(torch.ops.aten.linear.default)(_int4_linear)
    int4_tensor.Int4Tensor.implements_torch_function(torch.nn.functional.linear)(_int4_linear)


# --- Int8 weights (`Int8WeightOnlyConfig`): the conversion of the int8 data, not of its transposed view


def _int8_weight_only_linear(implementation):
    """torchao's `F.linear` of an `Int8Tensor` (`implementation`), with its weight-only product of per-row scales
    on tpu as `F.linear(x, qdata.to(x.dtype)) * scale`: the same numbers as torchao's `mm(x, qdata.t().to(x.dtype))
    * scale`, with the conversion of the int8 data as it lies. The core reads a transposed view taken whole
    (`qdata.t()`, which the conversion reads) through an optimization barrier (`tensor_views.read`): a transposed
    int8 copy of every weight, which in a decode loop XLA hoists out of the loop (once a chunk of steps, and a
    second copy of the weights in memory) and in a prefill writes at every call. The linear layer's product takes
    its weight's transposition in the product's own dimensions, so the weight is read as int8 in place. Every other
    case (activations quantized too, a pre-scale, groups, other devices) is torchao's."""

    @functools.wraps(implementation)
    def linear(func, types, args, kwargs):
        x, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if (weight.device.type != "tpu" or weight.act_quant_kwargs is not None or weight.act_pre_scale is not None
                or weight.block_size[-1] < weight.qdata.shape[-1]):
            return implementation(func, types, args, kwargs)
        y = torch.nn.functional.linear(x, weight.qdata.to(x.dtype)) * weight.scale.to(x.dtype).flatten()
        return (y if bias is None else y + bias).to(x.dtype)

    linear.hf_tpu_int8_linear = True
    return linear


def _int8_weight_only_on_tpu() -> None:
    """`Int8Tensor`'s `F.linear` (and `aten.linear`) replaced by `_int8_weight_only_linear` over torchao's own, once."""
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    implementation = Int8Tensor._TORCH_FN_TABLE[Int8Tensor][torch.nn.functional.linear]
    if getattr(getattr(implementation, "hf_tpu_wraps", implementation), "hf_tpu_int8_linear", False):
        return
    linear = _int8_weight_only_linear(getattr(implementation, "hf_tpu_wraps", implementation))
    Int8Tensor.implements(torch.ops.aten.linear.default)(linear)
    Int8Tensor.implements_torch_function(torch.nn.functional.linear)(linear)


def _int_scaled_matmul_on_tpu(int_scaled_matmul):
    """torchao's `int_scaled_matmul(a, b, scales)` (int8 activations times int8 weights, rows scaled), as its CPU
    path computes it where the operands are on tpu: `_int_mm` (the int8 matrix unit) then the scales. torchao's
    own path off the CPU, `safe_int_mm`, tests `repr(input)` for fake tensors: a host read of the activation at
    every call, which under defer-and-fuse also cuts the graph (2596 host reads in a one-layer Llama's forward)."""

    @functools.wraps(int_scaled_matmul)
    def product(a, b, scales):
        if a.device.type != "tpu":
            return int_scaled_matmul(a, b, scales)
        return torch._int_mm(a, b).to(scales.dtype) * scales

    product.hf_tpu_wraps = int_scaled_matmul
    return product


def _quantized_as_one_program(from_hp):
    """A torchao tensor's `from_hp` (the quantization of a weight: twenty-odd ops), run through `hf_tpu.jit` where
    the weight is on tpu in strict eager: one program per weight shape, compiled once, where each op would be a
    program of its own (on a TPU, a model's load would compile each of them for each shape). Elsewhere as it is."""
    traced = hf_tpu.jit(from_hp)

    @functools.wraps(from_hp)
    def quantize(cls, hp_tensor, *args, **kwargs):
        if hp_tensor.device.type == "tpu" and _strict_eager():
            with torch.no_grad():
                return traced(cls, hp_tensor, *args, **kwargs)
        return from_hp(cls, hp_tensor, *args, **kwargs)

    quantize.hf_tpu_wraps = from_hp
    return classmethod(quantize)


def install(module) -> None:
    """Give torchao's `Int4Tensor` what it lacks without mslk (`_int4_without_mslk`), its int8 weight-only product
    the int8 data as it lies (`_int8_weight_only_on_tpu`), its int8 product a tpu path
    (`_int_scaled_matmul_on_tpu`), then wrap the `F.linear` and
    `from_hp` of every torchao tensor subclass defined so far (`_one_program_on_tpu`, `_quantized_as_one_program`);
    what is wrapped already is left as it is."""
    from torchao.quantization.quantize_.workflows.int8 import int8_tensor
    from torchao.utils import TorchAOBaseTensor

    _int4_without_mslk()
    _int8_weight_only_on_tpu()
    if not hasattr(int8_tensor.int_scaled_matmul, "hf_tpu_wraps"):
        int8_tensor.int_scaled_matmul = _int_scaled_matmul_on_tpu(int8_tensor.int_scaled_matmul)

    for cls in _subclasses(TorchAOBaseTensor):
        table = cls.__dict__.get("_TORCH_FN_TABLE", {}).get(cls, {})
        implementation = table.get(torch.nn.functional.linear)
        if implementation is not None and not hasattr(implementation, "hf_tpu_wraps"):
            table[torch.nn.functional.linear] = _one_program_on_tpu(implementation)
        from_hp = cls.__dict__.get("from_hp")
        if isinstance(from_hp, classmethod) and not hasattr(from_hp.__func__, "hf_tpu_wraps"):
            cls.from_hp = _quantized_as_one_program(from_hp.__func__)
