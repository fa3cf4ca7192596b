"""Lowerings op_db covers only in part, run on tpu without the CPU fallback and compared with CPU:
antialiased bicubic resize (op_db has only the bilinear one), fractional max pooling given its
random samples (op_db's samples draw them on the device, so CPU and tpu pool different windows),
least squares on rank-deficient, empty and complex systems; and linalg.eig's error without the
fallback."""

import pytest
import torch
import torch.nn.functional as F

import hf_tpu

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True)
def no_cpu_fallback(monkeypatch):
    monkeypatch.setenv("HF_TPU_CPU_FALLBACK", "0")


def _forward_and_grad(fn, x, *constants):
    """fn's output, and the gradient with respect to x of a weighted sum of it."""
    output = fn(x, *constants)
    weights = torch.arange(output.numel(), dtype=output.dtype).reshape(output.shape).to(output.device) % 5
    (grad,) = torch.autograd.grad((output * weights).sum(), x)
    return output, grad


def _on_both(fn, x, *constants):
    """fn's output and gradient with respect to x, on cpu and on tpu (brought back)."""
    cpu = _forward_and_grad(fn, x.detach().requires_grad_(), *constants)
    tpu = _forward_and_grad(fn, x.detach().to("tpu").requires_grad_(), *(c.to("tpu") for c in constants))
    return cpu, [t.cpu() for t in tpu]


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize(
    "shape, kwargs",
    [
        ((2, 3, 19, 23), {"size": (7, 9)}),  # downscaling: the filter widens
        ((1, 2, 5, 6), {"size": (11, 3)}),  # up one dim, down the other
        ((1, 1, 10, 7), {"scale_factor": (0.37, 2.5)}),
        ((1, 2, 9, 9), {"size": (4, 3), "align_corners": True}),  # (not width 1: PyTorch 2.13 repeats the first row)
    ],
)
def test_antialiased_resize(mode, shape, kwargs):
    torch.manual_seed(0)
    resize = lambda x: F.interpolate(x, mode=mode, antialias=True, **kwargs)  # noqa: E731
    (expected, expected_grad), (actual, actual_grad) = _on_both(resize, torch.randn(shape))
    torch.testing.assert_close(actual, expected, **TOLERANCE)
    torch.testing.assert_close(actual_grad, expected_grad, **TOLERANCE)


@pytest.mark.parametrize(
    "pool, shape, kernel_size, kwargs",
    [
        (F.fractional_max_pool2d, (2, 3, 9, 11), (3, 2), {"output_size": (4, 5)}),
        (F.fractional_max_pool2d, (3, 10, 7), 2, {"output_ratio": (0.5, 0.6)}),  # no batch dim
        (F.fractional_max_pool3d, (2, 2, 7, 6, 9), (2, 3, 2), {"output_size": (3, 2, 4)}),
        (F.fractional_max_pool3d, (2, 6, 5, 7), 2, {"output_size": (3, 3, 3)}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fractional_max_pool(pool, shape, kernel_size, kwargs, dtype):
    torch.manual_seed(0)
    dims = 2 if pool is F.fractional_max_pool2d else 3
    batch = shape[0] if len(shape) == dims + 2 else 1
    samples = torch.rand(batch, shape[-dims - 1], dims, dtype=dtype)

    def pool_given_samples(x, samples):
        return pool(x, kernel_size, _random_samples=samples, **kwargs)

    x = torch.randn(shape, dtype=dtype)
    expected = pool(x, kernel_size, return_indices=True, _random_samples=samples, **kwargs)
    actual = pool(x.to("tpu"), kernel_size, return_indices=True, _random_samples=samples.to("tpu"), **kwargs)
    torch.testing.assert_close(actual[0].cpu(), expected[0], rtol=0, atol=0)
    torch.testing.assert_close(actual[1].cpu(), expected[1], rtol=0, atol=0)
    (_, expected_grad), (_, actual_grad) = _on_both(pool_given_samples, x, samples)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=0, atol=0)


def _rank_deficient(rows, columns):
    a = torch.randn(rows, columns)
    a[:, -1] = a[:, 0] + a[:, 1]
    return a


@pytest.mark.parametrize(
    "a, b",
    [
        (lambda: torch.randn(2, 6, 3), lambda: torch.randn(1, 6, 2)),  # broadcast batch
        (lambda: torch.randn(6, 3), lambda: torch.randn(6)),  # vector right-hand side
        (lambda: torch.randn(3, 5), lambda: torch.randn(3, 2)),  # underdetermined: minimum norm
        (lambda: _rank_deficient(6, 3), lambda: torch.randn(6, 2)),
        (lambda: torch.randn(4, 0), lambda: torch.randn(4, 2)),
        (lambda: torch.randn(0, 4, 3), lambda: torch.randn(0, 4, 2)),
        (lambda: torch.randn(5, 3, dtype=torch.complex64), lambda: torch.randn(5, 2, dtype=torch.complex64)),
    ],
)
def test_lstsq(a, b):
    torch.manual_seed(0)
    a, b = a(), b()
    full_rank = bool((torch.linalg.matrix_rank(a) == min(a.shape[-2:])).all())
    for driver in ["gels", "gelsy", "gelsd", "gelss"] if full_rank else ["gelsy", "gelsd", "gelss"]:
        expected = torch.linalg.lstsq(a, b, driver=driver)  # (gels assumes full rank)
        actual = torch.linalg.lstsq(a.to("tpu"), b.to("tpu"), driver=driver)
        for name in ("solution", "residuals", "rank", "singular_values"):
            torch.testing.assert_close(getattr(actual, name).cpu(), getattr(expected, name), rtol=1e-4, atol=1e-5)


def test_lstsq_rejects_unknown_driver():
    with pytest.raises(RuntimeError, match="driver"):
        torch.linalg.lstsq(torch.randn(4, 3, device="tpu"), torch.randn(4, 1, device="tpu"), driver="gesv")


def test_eig_without_fallback_says_why():
    hf_tpu.reset_metrics()
    with pytest.raises(NotImplementedError, match="no non-symmetric eigensolver.*eigh"):
        torch.linalg.eigvals(torch.randn(3, 3, device="tpu"))
    assert hf_tpu.metrics()["cpu_fallbacks"] == {}
