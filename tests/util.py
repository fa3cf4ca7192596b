"""Differential testing: the same function on cpu and on tpu, compared with tolerances per dtype."""

from __future__ import annotations

import os

import torch

import hf_tpu

TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.complex64: dict(rtol=1e-5, atol=1e-5),
}


def to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(y) for y in x)
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    return x


def assert_same(actual, expected):
    """`actual` (from tpu) equals `expected` (from cpu): same dtypes, shapes and values."""
    actual, expected = to_cpu(actual), to_cpu(expected)
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), type(actual)
        assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
        assert actual.shape == expected.shape, (actual.shape, expected.shape)
        tol = TOLERANCES.get(expected.dtype, dict(rtol=0, atol=0))
        torch.testing.assert_close(actual, expected, equal_nan=True, **tol)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for k in expected:
            assert_same(actual[k], expected[k])
    else:
        assert actual == expected, (actual, expected)


def differential(fn):
    """Run `fn(device)` on cpu and on tpu and assert the results are the same."""
    expected = fn("cpu")
    actual = fn("tpu")
    assert_same(actual, expected)
    return actual


def on_tpu() -> bool:
    """Whether `tpu` tensors live on a real TPU (HF_TPU_PLATFORM=tpu) rather than XLA:CPU."""
    return hf_tpu.platform_name() == "tpu"


def transcendental_tolerance(**on_cpu) -> dict:
    """The float32 tolerance of a result computed through exp, log or tanh: `on_cpu` (by default the float32
    one) on XLA:CPU, and 1e-4 on a real TPU, whose float32 transcendentals differ from the CPU's in the last
    bits (v5e, 2026-12-05: a cross entropy 8e-6 off relatively, six tanh layers 3e-5)."""
    if on_tpu():
        return dict(rtol=1e-4, atol=1e-4)
    return on_cpu or dict(TOLERANCES[torch.float32])


def cpu_process_env(**env) -> dict:
    """The environment of a Python process a test starts: this one's, on the CPU platform. While this
    process holds a chip, another that starts JAX on it fails on libtpu's lock; the process's own
    variables (`env`) come last."""
    return {**os.environ, "HF_TPU_PLATFORM": "cpu", "JAX_PLATFORMS": "cpu", **env}


def causal_lm_step(model, opt, jit: bool):
    """A user's training step of a causal LM (forward with labels, backward, the optimizer's step, its gradients
    cleared), returning the loss detached; traced whole by `hf_tpu.jit` where `jit`."""

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return hf_tpu.jit(step) if jit else step
