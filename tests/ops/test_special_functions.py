"""`torch.special` Bessel, Airy and orthogonal-polynomial functions on tpu without the CPU fallback,
against CPU over grids with the edge cases op_db's random samples miss: 0 and -0, the branch points
of the Cephes approximations, large |x|, infinities and NaN; for the polynomials |x| == 1 (0 and 1
for the shifted ones), negative, fractional and non-finite degrees, degrees past the closed-form
thresholds and past the Hermite limits, and the Scalar overloads."""

import pytest
import torch

NAN, INF = float("nan"), float("inf")
TOLERANCE = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.float64: {"rtol": 1e-7, "atol": 1e-7}}

BESSEL_AND_AIRY = [
    "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_k0", "modified_bessel_k1",
    "scaled_modified_bessel_k0", "scaled_modified_bessel_k1", "airy_ai",
]
POLYNOMIALS = [
    "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
    "legendre_polynomial_p",
]


@pytest.fixture(autouse=True)
def no_cpu_fallback(monkeypatch):
    monkeypatch.setenv("HF_TPU_CPU_FALLBACK", "0")


def _on_tpu(value):
    return value.to("tpu") if isinstance(value, torch.Tensor) else value


def _assert_matches_cpu(fn, *args):
    expected = fn(*args)
    actual = fn(*map(_on_tpu, args)).cpu()
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, equal_nan=True, **TOLERANCE[expected.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", BESSEL_AND_AIRY)
def test_bessel_and_airy_match_cpu(name, dtype):
    edges = [0.0, -0.0, 1e-6, -1e-6, 2.0, -2.0, 2.09, -2.09, 5.0, -5.0, 8.3203353, 103.0, 104.0, 1e4, -1e4,
             INF, -INF, NAN]
    x = torch.cat([torch.linspace(-30, 30, 601, dtype=dtype), torch.tensor(edges, dtype=dtype)])
    _assert_matches_cpu(getattr(torch.special, name), x)


def _polynomial_grid(dtype, largest_degree):
    """Every x with every degree, flattened; NaN x only with degrees -1, 0 and 1: beyond, PyTorch's
    U, V, W, Laguerre and Legendre kernels return a variable they never assigned (the recurrence
    stops at once on NaN), so their value there is whatever the register held."""
    xs = [-1.5, -1.0, -0.999, -0.75, -0.5, -0.1, 0.0, 1e-9, 0.1, 0.25, 0.5, 0.75, 0.999, 1.0, 1.5, 3.0, -3.0,
          INF, -INF]
    degrees = [-3.0, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 2.5, -0.5, NAN, INF, -INF]
    degrees += [20.0, 129.0, 513.0, 1025.0] if largest_degree > 10 else []
    x, n = torch.meshgrid(torch.tensor(xs, dtype=dtype), torch.tensor(degrees, dtype=dtype), indexing="ij")
    x = torch.cat([x.flatten(), torch.tensor([NAN, NAN, NAN], dtype=dtype)])
    n = torch.cat([n.flatten(), torch.tensor([-1.0, 0.0, 1.0], dtype=dtype)])
    return x, n


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomials_match_cpu(name):
    """float64, up to degree 1025: past every closed-form threshold and both Hermite limits (in
    float32 the closed forms at degree > 100 amplify an ulp of acos beyond the tolerance)."""
    _assert_matches_cpu(getattr(torch.special, name), *_polynomial_grid(torch.float64, 1025))


@pytest.mark.parametrize("name", ["chebyshev_polynomial_v", "shifted_chebyshev_polynomial_w", "hermite_polynomial_h"])
def test_polynomials_match_cpu_in_float32(name):
    """float32 has its own Hermite limit (128) and reaches the closed forms' fallbacks next to +-1."""
    x, n = _polynomial_grid(torch.float32, 10)
    next_to_ends = torch.tensor([1 - 2**-24, -1 + 2**-24, 2**-25, 1 - 2**-23], dtype=torch.float32)
    x = torch.cat([x, next_to_ends.repeat_interleave(4)])
    n = torch.cat([n, torch.tensor([9.0, 10.0, 129.0, 128.0]).repeat(4)])
    _assert_matches_cpu(getattr(torch.special, name), x, n)


def test_polynomial_scalar_overloads():
    degrees = torch.tensor([-1.0, 0.0, 1.0, 3.0, 7.0, 12.0])
    _assert_matches_cpu(torch.special.legendre_polynomial_p, 0.3, degrees)
    _assert_matches_cpu(torch.special.chebyshev_polynomial_u, torch.linspace(-2, 2, 9), 9)


def test_integers_promote_to_float():
    _assert_matches_cpu(torch.special.bessel_y1, torch.arange(-3, 12))
    _assert_matches_cpu(torch.special.hermite_polynomial_he, torch.arange(-3, 4)[:, None], torch.arange(-1, 6))
