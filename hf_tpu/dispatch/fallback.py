"""Ops with no lowering: PyTorch's decompositions, then the CPU fallback (or NotImplementedError
with HF_TPU_CPU_FALLBACK=0)."""

from __future__ import annotations

import functools
import threading
import warnings

import torch

from .. import counters, modes, settings
from ..device_state import current
from .call import call_with, checked_by_assert, flatten_returns, wrapped_numbers
from .signatures import TENSOR_LIST, Signature

_counters = counters.counters


def cpu_fallback_enabled() -> bool:
    return settings.get("HF_TPU_CPU_FALLBACK")


def describe_call(sig: Signature, values) -> str:
    parts = []
    for name, v in zip(sig.names, values):
        if isinstance(v, torch.Tensor):
            parts.append(f"{name}: {str(v.dtype).replace('torch.', '')}{list(v.shape)} on {v.device}")
        elif isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
            parts.append(f"{name}: [{', '.join(str(t.dtype).replace('torch.', '') + str(list(t.shape)) for t in v)}]")
    return ", ".join(parts)


def unsupported(sig: Signature, values) -> NotImplementedError:
    return NotImplementedError(
        f"The operator '{sig.name}' has no tpu lowering yet ({describe_call(sig, values)}). "
        "Set HF_TPU_CPU_FALLBACK=1 to run it on the CPU (slow: data moves to the host and back), "
        "and see docs/compatibility.md for what is supported."
    )


_warned_fallbacks: set = set()


def cpu_fallback(sig: Signature, values):
    """Run the op on the CPU: operands to the host, results (and in-place writes) back to `tpu`."""
    modes.current().sync("cpu fallback " + sig.name)
    name = sig.name
    _counters["cpu_fallbacks"][name] += 1
    if name not in _warned_fallbacks:
        _warned_fallbacks.add(name)
        warnings.warn(
            f"The operator '{name}' has no tpu lowering; it runs on the CPU (data moves to the host and "
            "back). Set HF_TPU_CPU_FALLBACK=0 to raise instead.",
            stacklevel=3,
        )
    device_index = None

    def to_cpu(v):
        nonlocal device_index
        if isinstance(v, torch.Tensor) and v.device.type == "tpu":
            device_index = v.device.index
            return v.cpu()
        if isinstance(v, (list, tuple)):
            return type(v)(to_cpu(x) for x in v)
        if isinstance(v, torch.device) and v.type == "tpu":
            device_index = current.current_index_for(v)
            return torch.device("cpu")
        return v

    cpu_values = [to_cpu(v) for v in wrapped_numbers(values, sig, "cpu")]
    if device_index is None:
        device_index = current.current_device_index()
    result = call_with(sig, sig.op, cpu_values)
    for i in sig.mutated:  # a written Tensor[] (a fused optimizer's lists) element by element
        written = zip(values[i], cpu_values[i]) if sig.kinds[i] == TENSOR_LIST else [(values[i], cpu_values[i])]
        for target, value in written:
            if target is None:
                continue
            if target.shape != value.shape:
                target.resize_(value.shape)
            target.copy_(value)
    returns = flatten_returns(result) if sig.op._schema.returns else []
    outs = []
    for j, r in enumerate(returns):
        target = sig.returns_mutated[j] if j < len(sig.returns_mutated) else None
        if target is not None:
            outs.append(values[target])
        elif isinstance(r, torch.Tensor):
            outs.append(r.to(f"tpu:{device_index}"))
        else:
            outs.append(r)
    if not sig.op._schema.returns:
        return None
    if len(sig.op._schema.returns) == 1 and not isinstance(result, (tuple, list)):
        return outs[0]
    return type(result)(outs) if isinstance(result, tuple) else outs


_decomposing = threading.local()


@functools.cache
def _decompositions() -> dict:
    """PyTorch's ATen-to-ATen decompositions (not the `torch._refs` ones, which lower to prims)."""
    from torch._decomp import decomposition_table

    return {op: fn for op, fn in decomposition_table.items() if fn.__module__.startswith("torch._decomp")}


def run_unlowered(sig: Signature, values):
    decomp = _decompositions().get(sig.op)
    active = getattr(_decomposing, "ops", None)
    if active is None:
        active = _decomposing.ops = set()
    if decomp is not None and sig.op not in active:
        active.add(sig.op)
        try:
            return call_with(sig, decomp, values)
        except AssertionError as e:
            raise checked_by_assert(sig, e) from e
        finally:
            active.discard(sig.op)
    if cpu_fallback_enabled():
        return cpu_fallback(sig, values)
    raise unsupported(sig, values)
