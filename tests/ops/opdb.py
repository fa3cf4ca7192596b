"""Conformance against PyTorch's own op database: every OpInfo sample run on `cpu` and on `tpu`.

Used by `tests/ops/test_opdb.py` (a bounded sample in CI) and by `tests/ops/report.py`
(the full sweep with the figures quoted in docs/conformance.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import torch
from torch.testing._internal.common_methods_invocations import op_db

import hf_tpu  # noqa: F401

TOLERANCES = {  # (rtol, atol) per dtype; XLA's transcendental and reduction orders differ slightly
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
    torch.complex64: (1e-4, 1e-5),
}
GRAD_TOLERANCE = (1e-3, 1e-4)

# Ops whose values are random or uninitialised: only shapes and dtypes can be compared.
UNCOMPARABLE_VALUES = {
    "bernoulli", "normal", "normal_in_place", "uniform", "rand_like", "randn_like", "randint_like",
    "randint", "randn", "rand", "multinomial", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "empty_permuted", "nn.functional.dropout", "nn.functional.dropout2d",
    "nn.functional.dropout3d", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
    "cauchy", "exponential", "geometric", "log_normal", "randperm", "nn.functional.rrelu",
    "torch.empty", "bernoulli_",
}


def opinfo_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def all_ops():
    return sorted(op_db, key=opinfo_id)


def _to_tpu(x):
    if isinstance(x, torch.Tensor):
        t = x.detach().to("tpu")
        return t.requires_grad_(x.requires_grad) if x.is_floating_point() or x.is_complex() else t
    if isinstance(x, (list, tuple)):
        return type(x)(_to_tpu(y) for y in x)
    if isinstance(x, dict):
        return {k: _to_tpu(v) for k, v in x.items()}
    if isinstance(x, torch.device) and x.type == "cpu":
        return torch.device("tpu")
    if isinstance(x, str) and x == "cpu":
        return "tpu"
    return x


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu() if x.device.type == "tpu" else x.detach()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(y) for y in x)
    return x


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return []


def _compare(actual, expected, dtype, values: bool, tol=None):
    actual, expected = _to_cpu(actual), _to_cpu(expected)
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"expected a tensor, got {type(actual).__name__}")
        if actual.dtype != expected.dtype:
            raise AssertionError(f"dtype {actual.dtype} != {expected.dtype}")
        if actual.shape != expected.shape:
            raise AssertionError(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
        if not values:
            return
        rtol, atol = tol or TOLERANCES.get(expected.dtype, (0, 0))
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    elif isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise AssertionError(f"expected a sequence of {len(expected)}, got {type(actual).__name__}")
        for a, e in zip(actual, expected):
            _compare(a, e, dtype, values, tol)
    elif isinstance(expected, float) and math.isnan(expected):
        if not (isinstance(actual, float) and math.isnan(actual)):
            raise AssertionError(f"{actual} != nan")
    elif isinstance(expected, (int, float, bool, complex)):
        if values and not math.isclose(complex(actual).real, complex(expected).real, rel_tol=1e-4, abs_tol=1e-5):
            raise AssertionError(f"{actual} != {expected}")


@dataclasses.dataclass
class Outcome:
    op: str
    dtype: str
    kind: str  # forward | grad | inplace
    samples: int = 0
    passed: int = 0
    skipped: int = 0
    first_error: str = ""

    @property
    def ok(self) -> bool:
        return self.samples > 0 and self.passed == self.samples


def _differentiable_outputs(out):
    return [t for t in _tensors(out) if t.requires_grad and (t.is_floating_point() or t.is_complex())]


def _grads(fn, sample_args, sample_kwargs, inputs, process):
    out = process(fn(*sample_args, **sample_kwargs))
    outs = _differentiable_outputs(out)
    if not outs:
        return None
    total = sum((o.float() * (1 + torch.arange(o.numel(), device=o.device).reshape(o.shape) % 3)).sum()
                if o.numel() else o.sum() for o in [x.real if x.is_complex() else x for x in outs])
    wrt = [t for t in inputs if t.requires_grad]
    return torch.autograd.grad(total, wrt, allow_unused=True)


def run(op, dtype: torch.dtype, kind: str = "forward", max_samples: int | None = None) -> Outcome:
    """Run `op`'s samples for `dtype` on cpu and tpu and compare (kind: forward, grad or inplace)."""
    result = Outcome(opinfo_id(op), str(dtype).replace("torch.", ""), kind)
    if dtype not in op.supported_dtypes("cpu"):
        return result
    if kind == "grad" and not op.supports_autograd:
        return result
    if kind == "inplace" and op.inplace_variant is None:
        return result
    values = op.name not in UNCOMPARABLE_VALUES
    torch.manual_seed(0)  # the same samples in every process and order, so known failures are stable
    try:
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=(kind == "grad")))
    except Exception:
        return result
    if max_samples is not None:
        samples = samples[:max_samples]
    for sample in samples:
        # PyTorch's own CPU-against-device comparison (test_ops.py, test_compare_cpu) passes both results
        # through this: it removes what a decomposition leaves free, such as the signs of singular vectors
        process = sample.output_process_fn_grad
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                cpu_args = [sample.input, *sample.args]
                cpu_kwargs = dict(sample.kwargs)
                if kind == "inplace":
                    cpu_args[0] = cpu_args[0].clone()
                    expected = op.inplace_variant(*cpu_args, **cpu_kwargs)
                elif kind == "grad":
                    expected = _grads(op, cpu_args, cpu_kwargs, _tensors(cpu_args) + _tensors(cpu_kwargs), process)
                else:
                    expected = process(op(*cpu_args, **cpu_kwargs))
            except Exception:
                result.skipped += 1
                continue
            if kind == "grad" and expected is None:
                result.skipped += 1
                continue
            result.samples += 1
            try:
                tpu_args = _to_tpu([sample.input, *sample.args])
                tpu_kwargs = _to_tpu(dict(sample.kwargs))
                if kind == "inplace":
                    actual = op.inplace_variant(*tpu_args, **tpu_kwargs)
                elif kind == "grad":
                    actual = _grads(op, tpu_args, tpu_kwargs, _tensors(tpu_args) + _tensors(tpu_kwargs), process)
                else:
                    actual = process(op(*tpu_args, **tpu_kwargs))
                if kind == "grad":
                    expected = [e if e is not None else None for e in expected]
                    actual = [a for a in actual]
                    for a, e in zip(actual, expected):
                        if (a is None) != (e is None):
                            if a is None and e is not None and not e.any():
                                continue
                            raise AssertionError("gradient missing on one side")
                        if a is not None:
                            _compare(a, e, dtype, values, GRAD_TOLERANCE)
                else:
                    _compare(actual, expected, dtype, values)
                result.passed += 1
            except Exception as e:  # noqa: BLE001 - every failure is reported, none is fatal
                if not result.first_error:
                    result.first_error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return result


def load_known_failures(path=None) -> dict:
    """`tests/ops/known_failures.txt`: 'op dtype kind  # reason' per line."""
    path = path or os.path.join(os.path.dirname(__file__), "known_failures.txt")
    known = {}
    if not os.path.exists(path):
        return known
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            entry, _, reason = line.partition("#")
            parts = entry.split()
            if len(parts) == 3:
                known[tuple(parts)] = reason.strip()
    return known
