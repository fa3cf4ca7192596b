"""Histograms, segment reductions, CTC loss and Householder QR on tpu without the CPU fallback,
compared with CPU on what op_db samples leave out: values outside the histogram's range and NaN,
weights with density, a range taken from the data, empty segments and ties in segment reductions
(with negative gradients, which the CPU kernel does not share among ties), offsets that start
past 0, impossible CTC alignments with and without zero_infinity, concatenated targets and length
tensors, and complex QR."""

import pytest
import torch
import torch.nn.functional as F

import hf_tpu


@pytest.fixture(autouse=True)
def no_cpu_fallback(monkeypatch):
    monkeypatch.setenv("HF_TPU_CPU_FALLBACK", "0")


def _tpu(x):
    return x.to("tpu") if isinstance(x, torch.Tensor) else x


def _tensors(result):
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for r in result for t in _tensors(r)]


def _assert_same(fn, *args, rtol=1e-5, atol=1e-5, **kwargs):
    """fn on cpu and on tpu (every tensor argument moved) give the same results."""
    expected = _tensors(fn(*args, **kwargs))
    actual = _tensors(fn(*map(_tpu, args), **{k: _tpu(v) for k, v in kwargs.items()}))
    assert len(actual) == len(expected)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a.cpu(), e, rtol=rtol, atol=atol, equal_nan=True)


def test_histogram_leaves_out_values_outside_its_range_and_nan():
    x = torch.tensor([-3.0, 0.0, 0.5, 1.0, 2.0, 2.0, 7.0, float("nan")])
    _assert_same(torch.histogram, x, bins=4, range=(0.0, 2.0))


def test_weighted_density_histogram_over_the_datas_range():
    torch.manual_seed(0)
    x, weight = torch.randn(50), torch.rand(50)
    _assert_same(torch.histogram, x, bins=7, weight=weight, density=True)
    _assert_same(torch.histogram, x, torch.tensor([-2.0, -0.5, 0.0, 0.1, 3.0]), weight=weight)


def test_histogramdd_of_a_constant_widens_its_range_like_numpy():
    points = torch.ones(6, 2)
    _assert_same(torch.histogramdd, points, bins=[3, 2])
    torch.manual_seed(0)
    _assert_same(torch.histogramdd, torch.randn(4, 5, 3), bins=[2, 3, 4], weight=torch.rand(4, 5), density=True)



@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bounds", [dict(min=0, max=3), dict()])
def test_histc_counts_integers_as_cuda_does(dtype, bounds):
    """Transformers' MoE layers count tokens per expert with an integer `histc` on accelerators; the
    CPU kernel takes only floats, so the counts are compared with the float histogram's."""
    import warnings

    x = torch.tensor([0, 1, 1, 3, 7, -2], dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the data-range bounds started from inf cast to an integer
        counts = torch.histc(x.to("tpu"), bins=5, **bounds).cpu()
    assert counts.dtype == dtype
    torch.testing.assert_close(counts, torch.histc(x.float(), bins=5, **bounds).to(dtype))

@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod"])
def test_segment_reduce_with_empty_segments_ties_and_negative_gradients(reduce):
    data = torch.tensor([[1.0, 3.0, 3.0, 0.0, -2.0, 5.0], [2.0, 2.0, -1.0, 4.0, 0.0, 0.0]])
    lengths = torch.tensor([[3, 0, 2, 1], [1, 2, 0, 3]])
    grad = torch.tensor([[-1.0, 2.0, 3.0, -4.0], [1.5, -2.5, 1.0, -1.0]])

    def forward_and_grad(data, lengths, grad, **kwargs):
        data = data.detach().requires_grad_()
        out = torch.segment_reduce(data, reduce, lengths=lengths, axis=1, **kwargs)
        return out, torch.autograd.grad(out, data, grad)[0]

    _assert_same(forward_and_grad, data, lengths, grad)
    _assert_same(forward_and_grad, data, lengths, grad, initial=2.0)


def test_segment_reduce_offsets_starting_past_zero():
    torch.manual_seed(0)
    data = torch.randn(7, 3)
    _assert_same(torch.segment_reduce, data, "max", offsets=torch.tensor([2, 4, 4, 6]))
    _assert_same(torch.segment_reduce, data, "sum", lengths=torch.tensor([2, 3]), unsafe=True)


def _ctc_inputs(targets_concatenated):
    torch.manual_seed(0)
    log_probs = torch.randn(6, 3, 5).log_softmax(2)
    # the second sequence cannot be aligned: 4 labels with a repeat need 5 steps, it has 4
    targets = torch.tensor([[1, 2, 2, 0], [3, 3, 1, 4], [2, 0, 0, 0]])
    input_lengths, target_lengths = [6, 4, 5], [3, 4, 1]
    if targets_concatenated:
        targets = torch.cat([t[:n] for t, n in zip(targets, target_lengths)])
    return log_probs, targets, input_lengths, target_lengths


@pytest.mark.parametrize("targets_concatenated", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_loss_with_an_impossible_alignment(targets_concatenated, reduction, zero_infinity):
    log_probs, targets, input_lengths, target_lengths = _ctc_inputs(targets_concatenated)

    def loss_and_grad(log_probs, targets):
        log_probs = log_probs.detach().requires_grad_()
        loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=reduction,
                          zero_infinity=zero_infinity)
        return loss, torch.autograd.grad(loss.sum(), log_probs)[0]

    _assert_same(loss_and_grad, log_probs, targets)


def test_ctc_loss_with_length_tensors_and_another_blank():
    log_probs, targets, input_lengths, target_lengths = _ctc_inputs(targets_concatenated=True)
    lengths = torch.tensor(input_lengths), torch.tensor(target_lengths)
    _assert_same(F.ctc_loss, log_probs, targets + 1 - (targets == 4).long() * 5, *lengths, blank=4,
                 zero_infinity=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_geqrf_and_ormqr(dtype):
    torch.manual_seed(0)
    a, c = torch.randn(2, 5, 3, dtype=dtype), torch.randn(2, 5, 4, dtype=dtype)
    _assert_same(torch.geqrf, a, rtol=1e-4, atol=1e-5)
    reflectors, tau = torch.geqrf(a)
    _assert_same(torch.ormqr, reflectors, tau, c, transpose=True, rtol=1e-4, atol=1e-5)
    _assert_same(torch.ormqr, reflectors, tau, c.mT.conj(), left=False, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_ldl_factor_takes_lapacks_pivots_and_solves(dtype):
    torch.manual_seed(0)
    indefinite = torch.randn(3, 7, 7, dtype=dtype)
    indefinite = indefinite + indefinite.mT
    indefinite[0].diagonal().zero_()  # small diagonals: 2x2 pivots
    indefinite[1, 2:4, 2:4] = 0  # and an interchange past a zero block
    _assert_same(torch.linalg.ldl_factor_ex, indefinite, rtol=1e-4, atol=1e-4)
    LD, pivots = torch.linalg.ldl_factor(indefinite)
    _assert_same(torch.linalg.ldl_solve, LD, pivots, torch.randn(3, 7, 2, dtype=dtype), rtol=1e-4, atol=1e-4)


def test_ldl_factor_reports_a_singular_column_in_info():
    singular = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 2.0]])
    _assert_same(torch.linalg.ldl_factor_ex, singular)


@pytest.mark.parametrize("dim", [-1, 0])
def test_safe_softmax_rows_of_only_minus_inf_nan_and_empty(dim):
    """SDPA's softmax: a fully masked row gives zeros (not NaN), a row holding NaN stays NaN, and an
    empty dim gives an empty result."""
    inf = float("inf")
    x = torch.tensor([[-inf, -inf, -inf], [0.5, -inf, 2.0], [float("nan"), -inf, -inf], [inf, -inf, 1.0]])
    _assert_same(torch._safe_softmax, x, dim)
    _assert_same(torch._safe_softmax, torch.empty(0, 3), dim)
    _assert_same(torch._safe_softmax, torch.empty(3, 0), dim)


def test_vector_norms_of_the_common_orders_compute_that_order_alone():
    """F.normalize's `norm(2, dim)` passes its order as a Scalar with no default: traced, its program held a
    six-way switch over every order's computation. The common orders are compiled in; any other is traced,
    one program for all of them."""
    import math

    import jax
    import jax.numpy as jnp

    from hf_tpu.ops import reduce

    torch.manual_seed(0)
    x = torch.randn(4, 5)
    for order in (2, 1, 0, math.inf, -math.inf, 3, 0.5):
        _assert_same(lambda t: t.norm(order, dim=1, keepdim=True), x)
        _assert_same(lambda t: torch.linalg.vector_norm(t, order, dim=0), x)
    _assert_same(F.normalize, x)
    jaxpr = jax.make_jaxpr(lambda a: reduce._vector_norm(a, 2, (1,), True, None))(jnp.ones((4, 5)))
    assert all(e.primitive.name != "cond" for e in jaxpr.eqns)
    on_tpu = x.to("tpu")
    torch.linalg.vector_norm(on_tpu, 3.0).cpu()
    hf_tpu.reset_metrics()
    for order in (4.0, 5.0, 0.25):
        torch.linalg.vector_norm(on_tpu, order).cpu()
    assert hf_tpu.metrics()["xla_compiles"] == 0
