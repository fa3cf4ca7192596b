"""Lowerings op_db covers only in part, run on tpu without the CPU fallback and compared with CPU:
antialiased bicubic resize (op_db has only the bilinear one), fractional max pooling given its
random samples (op_db's samples draw them on the device, so CPU and tpu pool different windows),
least squares on rank-deficient, empty and complex systems; and linalg.eig's error without the
fallback. Also what op_db leaves out of rrelu (training values), cdist (its matrix-product path),
embedding_bag (ties, padding with every mode, frequency scaling) and resize (uint8 images); and
`nn.LSTM`/`nn.GRU`, whose fused cells op_db does not sample."""

import functools

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


def test_rrelu_training_scales_negatives_by_drawn_slopes():
    """The slopes are random, so training is checked against its definition and the backward
    against CPU's given the same noise; eval mode against CPU directly."""
    torch.manual_seed(0)
    x = torch.randn(6, 7)
    x[0, 0] = 0.0
    tpu_x = x.to("tpu").requires_grad_()
    output = F.rrelu(tpu_x, 0.1, 0.3, training=True)
    (grad,) = torch.autograd.grad(output.sum(), tpu_x)
    slopes = (output.detach().cpu() / x).where(x != 0, grad.cpu())
    assert torch.equal(slopes[x > 0], torch.ones_like(slopes[x > 0]))
    assert ((slopes[x <= 0] >= 0.1) & (slopes[x <= 0] <= 0.3)).all()
    assert slopes[x <= 0].unique().numel() > 1
    expected_grad = torch.ops.aten.rrelu_with_noise_backward(torch.ones_like(x), x, grad.cpu(), 0.1, 0.3, True, False)
    torch.testing.assert_close(grad.cpu(), expected_grad, rtol=0, atol=0)

    in_place = x.to("tpu")
    F.rrelu(in_place, 0.1, 0.3, training=True, inplace=True)
    ratio = in_place.cpu() / x
    assert ((ratio[x < 0] >= 0.1) & (ratio[x < 0] <= 0.3)).all() and torch.equal(in_place.cpu()[x > 0], x[x > 0])
    torch.testing.assert_close(F.rrelu(x.to("tpu"), 0.1, 0.3).cpu(), F.rrelu(x, 0.1, 0.3), rtol=0, atol=0)


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")])
def test_cdist_and_pdist_with_coincident_points(p):
    """30 rows take PyTorch's matrix-product path for p = 2; coincident points have zero
    distances, where the gradient is zero by PyTorch's convention."""
    torch.manual_seed(0)
    x1, x2 = torch.randn(2, 30, 4), torch.randn(1, 7, 4)
    x2[0, 0] = x1[0, 3]
    x2[0, 1, 0] = x1[1, 2, 0]
    for compute_mode in ["use_mm_for_euclid_dist_if_necessary", "donot_use_mm_for_euclid_dist"]:
        (expected, expected_grad), (actual, actual_grad) = _on_both(
            lambda a, b: torch.cdist(a, b, p, compute_mode=compute_mode), x1, x2)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-4, atol=1e-4)
    expected = torch.ops.aten._cdist_forward(x1, x2, p, 1)
    torch.testing.assert_close(torch.ops.aten._cdist_forward(x1.to("tpu"), x2.to("tpu"), p, 1).cpu(), expected,
                               rtol=1e-5, atol=1e-5)

    points = torch.randn(6, 3)
    points[4] = points[1]
    (expected, expected_grad), (actual, actual_grad) = _on_both(lambda x: torch.pdist(x, p), points)
    torch.testing.assert_close(actual, expected, **TOLERANCE)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 4])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag(mode, padding_idx, include_last_offset):
    """An empty bag, a padded index, equal rows (max ties: the first wins); with frequency scaling
    where every index occurs equally often (PyTorch's CPU kernel divides by the count of another
    index when the counts differ)."""
    torch.manual_seed(0)
    weight = torch.randn(10, 3)
    weight[7] = weight[2]
    indices = torch.tensor([1, 2, 4, 7, 4, 3, 2, 9, 0, 7])
    offsets = torch.tensor([0, 0, 4, 6, 10])
    sample_weights = torch.rand(10) if mode == "sum" else None

    def bag(weight, *sample_weights, indices=indices, offsets=offsets, scale_grad_by_freq=False):
        return F.embedding_bag(indices.to(weight.device), weight, offsets.to(weight.device), mode=mode,
                               padding_idx=padding_idx, include_last_offset=include_last_offset,
                               per_sample_weights=sample_weights[0] if sample_weights else None,
                               scale_grad_by_freq=scale_grad_by_freq)

    constants = (sample_weights,) if sample_weights is not None else ()
    (expected, expected_grad), (actual, actual_grad) = _on_both(bag, weight, *constants)
    torch.testing.assert_close(actual, expected, **TOLERANCE)
    torch.testing.assert_close(actual_grad, expected_grad, **TOLERANCE)
    if sample_weights is not None:
        (_, expected_grad), (_, actual_grad) = _on_both(lambda w, x: bag(x, w), sample_weights, weight)
        torch.testing.assert_close(actual_grad, expected_grad, **TOLERANCE)
    if mode != "max":  # (max rejects frequency scaling)
        each_thrice = torch.tensor([1, 2, 3, 3, 2, 1, 2, 1, 3])
        scaled = functools.partial(bag, indices=each_thrice, offsets=torch.tensor([0, 2, 5, 9]),
                                   scale_grad_by_freq=True)
        (_, expected_grad), (_, actual_grad) = _on_both(scaled, weight, *(c[:9] for c in constants))
        torch.testing.assert_close(actual_grad, expected_grad, **TOLERANCE)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [False, True])
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("channels", [3, 5])  # PyTorch's CPU kernel takes a SIMD path up to 4 channels
def test_uint8_resize_is_bit_exact(mode, antialias, align_corners, channels):
    torch.manual_seed(0)
    image = torch.randint(0, 256, (2, channels, 10, 11), dtype=torch.uint8)
    for size in [(7, 9), (13, 17), (10, 4), (3, 11)]:
        resize = lambda x: F.interpolate(x, size=size, mode=mode, antialias=antialias,  # noqa: E731
                                         align_corners=align_corners)
        torch.testing.assert_close(resize(image.to("tpu")).cpu(), resize(image), rtol=0, atol=0)


_TRANSPOSED_MATMULS = [
    ("mm", lambda x, w, b, q, k: torch.mm(x, w.t())),
    ("mm, both transposed", lambda x, w, b, q, k: torch.mm(w.t().t().t().t(), x.t())),
    ("addmm", lambda x, w, b, q, k: torch.addmm(b, x, w.t(), beta=0.5, alpha=2)),
    ("bmm", lambda x, w, b, q, k: torch.bmm(q, k.transpose(1, 2))),
    ("baddbmm", lambda x, w, b, q, k: torch.baddbmm(torch.ones(2, q.shape[1], 7, device=q.device), q, k.transpose(1, 2))),
    ("linear", lambda x, w, b, q, k: F.linear(x, w, b)),
]


@pytest.mark.parametrize("eager_mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
@pytest.mark.parametrize("rows", [1, 5])
def test_matmuls_contract_transposed_operands_in_place(eager_mode, rows, monkeypatch):
    """`x @ w.t()` and friends equal CPU, and their programs hold no transpose: the operand is
    contracted where it lies (XLA:CPU would copy a transposed weight before a matrix-vector product)."""
    import jax

    from hf_tpu import modes

    torch.manual_seed(0)
    operands = (torch.randn(rows, 6), torch.randn(4, 6), torch.randn(4), torch.randn(2, rows, 3), torch.randn(2, 7, 3))
    device_operands = tuple(t.to("tpu") for t in operands)
    programs = []
    execute = modes._Eager.execute
    monkeypatch.setattr(modes._Eager, "execute", lambda self, program, key, arrays, scalars, rng, index: (
        programs.append((program.name, program, arrays, scalars)), execute(self, program, key, arrays, scalars, rng, index))[1])
    with torch.tpu.use_eager_mode(eager_mode):
        for name, fn in _TRANSPOSED_MATMULS:
            torch.testing.assert_close(fn(*device_operands).cpu(), fn(*operands), **TOLERANCE, msg=name)
    products = [p for p in programs if p[0] in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")]
    assert len(products) == (len(_TRANSPOSED_MATMULS) if eager_mode == "DEFER_NEVER" else 0)
    for op, program, arrays, scalars in products:
        jaxpr = str(jax.make_jaxpr(program.fn)(arrays, scalars, None))
        assert "dot_general" in jaxpr and "transpose" not in jaxpr, (op, jaxpr)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
@pytest.mark.parametrize("options", [dict(num_layers=2, batch_first=True), dict(bidirectional=True, bias=False)],
                         ids=["two layers", "bidirectional without bias"])
def test_recurrent_layers_forward_and_gradients_as_cpu(cell, options):
    """On every device but the CPU, PyTorch runs LSTM and GRU through fused cells (`_thnn_fused_*_cell`)
    that have no CPU kernel, so the CPU fallback could not run them either: nn.LSTM raised on tpu."""
    torch.manual_seed(0)
    cpu = getattr(torch.nn, cell)(4, 8, **options)
    tpu = getattr(torch.nn, cell)(4, 8, **options)
    tpu.load_state_dict(cpu.state_dict())
    tpu.to("tpu")
    x = torch.randn(3, 5, 4)

    def run(module, x):
        output = module(x.requires_grad_())[0]
        weights = torch.arange(output.numel(), dtype=output.dtype).reshape(output.shape).to(output.device) % 5
        return output, torch.autograd.grad((output * weights).sum(), [x, *module.parameters()])

    expected, expected_grads = run(cpu, x)
    actual, actual_grads = run(tpu, x.detach().to("tpu"))
    torch.testing.assert_close(actual.cpu(), expected, **TOLERANCE)
    for a, e in zip(actual_grads, expected_grads):
        torch.testing.assert_close(a.cpu(), e, **TOLERANCE)
