"""`torch.autocast(device_type="tpu", dtype=torch.bfloat16)`.

PyTorch's autocast for a device is a dispatch key (`AutocastPrivateUse1` here) whose kernels cast
arguments and redispatch; its C++ policy tables exist only for built-in devices. This module
registers the same policy as CUDA's in Python: matmul-like ops run in the autocast dtype, ops that
lose accuracy in low precision run in float32, everything else falls through unchanged.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

# Ops that run in the autocast dtype (CUDA's "lower_precision_fp" list).
LOWER_PRECISION = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
    "convolution", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linear", "addbmm", "baddbmm",
    "bmm", "chain_matmul", "linalg_multi_dot", "_grouped_mm", "scaled_dot_product_attention", "prelu",
)
# Ops that run in float32 (CUDA's "fp32" list, the ones models use).
FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "norm.Scalar", "norm.ScalarOpt_dim", "cosine_similarity", "nll_loss",
    "nll_loss2d", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "binary_cross_entropy_with_logits",
    "cdist", "logsumexp", "softmax.int", "log_softmax.int", "cumsum", "cumprod", "prod", "sum",
)

# hf_tpu's own matmul-like ops, in the autocast dtype as SDPA is (Transformers' `attn_implementation="tpu"` calls
# `hf_tpu::flash_attention`: under autocast it computed the attention in float32, at a fraction of the bfloat16 speed)
OWN_LOWER_PRECISION = ("flash_attention",)

_KEY = torch._C.DispatchKey.AutocastPrivateUse1
_libraries: list = []


def _cast_args(args, kwargs, dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == "tpu" and x.dtype != torch.float64:
            return x.to(dtype)
        if isinstance(x, (list, tuple)):
            return type(x)(cast(y) for y in x)
        return x

    return cast(args), {k: cast(v) for k, v in kwargs.items()}


def _policy_kernel(op, dtype_of):
    def kernel(*args, **kwargs):
        args, kwargs = _cast_args(args, kwargs, dtype_of())
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
            return op(*args, **kwargs)

    return kernel


def _resolve(name):
    packet_name, _, overload = name.partition(".")
    packet = getattr(aten, packet_name, None)
    if packet is None:
        return []
    if overload:
        return [getattr(packet, overload)] if overload in packet.overloads() else []
    return [getattr(packet, o) for o in packet.overloads() if not getattr(packet, o)._schema.is_mutable
            and "out" not in o]


def install() -> None:
    lib = torch.library.Library("aten", "IMPL")
    for names, dtype_of in ((LOWER_PRECISION, lambda: torch.get_autocast_dtype("tpu")), (FLOAT32, lambda: torch.float32)):
        for name in names:
            for op in _resolve(name):
                lib.impl(op, _policy_kernel(op, dtype_of), "AutocastPrivateUse1")
    own = torch.library.Library("hf_tpu", "IMPL")
    for name in OWN_LOWER_PRECISION:
        op = getattr(torch.ops.hf_tpu, name).default
        own.impl(op, _policy_kernel(op, lambda: torch.get_autocast_dtype("tpu")), "AutocastPrivateUse1")
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    _libraries.extend([lib, own, fallthrough])
