"""PyTorch's checks of the tensors an op writes: not through an expanded tensor, no overlap with
another operand where its CPU kernel rejects one (`check_writable`), and an `out=` tensor's dtype
(`check_out_dtypes`). The rules per op are read once into its signature (`signatures.write_rules`).
"""

from __future__ import annotations

import torch

from .. import dtypes
from .call import Call, flatten_returns, to_meta

def check_writable(call: Call):
    expanded_ok, overlap, wholly = call.sig.write_rules
    for i in call.sig.mutated:
        v = call.values[i]
        if not isinstance(v, torch.Tensor) or v.numel() == 0:
            continue  # PyTorch finds no overlap in a tensor without elements (it is contiguous)
        if not expanded_ok and any(n > 1 and s == 0 for n, s in zip(v.shape, v.stride())):
            raise RuntimeError(
                "unsupported operation: more than one element of the written-to tensor refers to a "
                "single memory location. Please clone() the tensor before performing the operation."
            )
        if overlap is not None:
            _check_no_overlap(v, call.operands, overlap == "any", [call.values[k] for k in wholly] if wholly else ())


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some order of its dims is contiguous."""
    expected = 1
    for stride, n in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= n
    return True


def _check_no_overlap(written: torch.Tensor, operands, full_too: bool, wholly_ok=()):
    """Raise PyTorch's error when another operand shares memory with the written tensor (its own
    operand, the first one that is it, aside): computed functionally here, the op would give the answer
    of a clone, where CPU and CUDA raise. PyTorch's rules (at::get_overlap_status): only dense tensors
    are compared, and equal byte ranges overlap fully when the strides are equal too, partially when
    not; a full overlap is an error only with `full_too`, and never for the tensors in `wholly_ok`."""
    buf = next((op.buf for op in operands if op.tensor is written), None)
    if buf is None or not written.numel():
        return
    own_skipped = False
    for op in operands:
        other = op.tensor
        if other is written and not own_skipped:
            own_skipped = True
            continue
        if op.buf is not buf or not other.numel():
            continue
        if other is written:
            full = True
        elif not (_dense(written) and _dense(other)):
            continue
        else:
            begin, other_begin = written.data_ptr(), other.data_ptr()
            end = begin + written.numel() * written.element_size()
            other_end = other_begin + other.numel() * other.element_size()
            if (begin, end) == (other_begin, other_end):
                full = written.stride() == other.stride()
            elif begin < other_end and other_begin < end:
                full = False
            else:
                continue
        if not full or (full_too and not any(other is t for t in wholly_ok)):
            raise RuntimeError(
                "unsupported operation: some elements of the input tensor and the written-to tensor refer "
                "to a single memory location. Please clone() the tensor before performing the operation."
            )


# How PyTorch's CPU kernels take an out= tensor of another dtype than the result. Most cast to it, the
# elementwise ones with type promotion only when the cast is safe (TensorIterator). These functional
# ops or overloads want the result's dtype exactly: structured kernels' outputs, and the elementwise
# ops TensorIterator builds with check_all_same_dtype (`neg`, `clamp` of Python numbers).
_OUT_EXACT_DTYPE = frozenset((
    "abs", "sign", "sgn", "floor", "ceil", "round", "trunc", "frac", "neg", "bitwise_not", "nan_to_num", "where",
    "conj_physical", "clamp.default", "clamp_min.default", "clamp_max.default", "heaviside",
    "mm", "bmm", "addmm", "baddbmm", "mv", "gather", "index_select", "index_add", "index_copy", "take",
    "scatter.src", "scatter.value", "scatter_add", "scatter_reduce.two", "masked_select", "nonzero",
    "sort", "sort.stable", "topk", "max.dim", "min.dim", "amax", "amin", "aminmax", "all", "any", "isin",
    "tril", "triu",
    "slice_scatter", "_softmax", "_log_softmax", "logcumsumexp", "linalg_vector_norm", "linalg_cross",
    "renorm", "searchsorted", "bucketize", "multinomial", "histc", "softplus", "softshrink", "hardshrink",
    "gelu", "avg_pool3d", "_linalg_eigh", "_linalg_solve_ex", "linalg_lu_solve", "linalg_ldl_solve",
    "linalg_solve_triangular", "ormqr", "complex",
))


def check_out_dtypes(call: Call):
    """Raise PyTorch's error for an out= tensor whose dtype the CPU kernel would not write (PyTorch's
    meta kernels leave most of these checks to the kernels)."""
    sig = call.sig
    meta_values = to_meta(call.values, sig)
    try:
        results = flatten_returns(sig.functional(**{n: v for n, v in zip(sig.names, meta_values) if n in sig.inputs}))
    except NotImplementedError:  # no meta kernel
        return
    name = sig.functional._schema.name.split("::")[1]
    overload = sig.functional._overloadname
    exact = name in _OUT_EXACT_DTYPE or f"{name}.{overload}" in _OUT_EXACT_DTYPE
    elementwise = sig.lowering.promote is not None
    for result, i in zip(results, sig.returns_mutated):
        out = None if i is None else call.values[i]
        if result is None or not isinstance(out, torch.Tensor) or out.dtype == result.dtype:
            continue
        want, got = dtypes.scalar_type_name(result.dtype), dtypes.scalar_type_name(out.dtype)
        if exact:
            raise RuntimeError(f"{sig.name}: expected out tensor to have dtype {want}, but got {got} instead")
        if elementwise and not torch.can_cast(result.dtype, out.dtype):
            raise RuntimeError(f"{sig.name}: result type {want} can't be cast to the desired output type {got}")
