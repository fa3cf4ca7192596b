"""`cross_entropy` on tpu (`hf_tpu.ops.cross_entropy`): the loss and the logits' gradient equal the CPU's for every
option the fused op takes, in each way a program runs (strict eager, defer-and-fuse, `torch.compile`, a traced
step); calls it leaves to PyTorch's decomposition give the CPU's results too; and a traced training step keeps
neither the log-probabilities nor a float32 copy of bfloat16 logits for the backward.

Tolerances: float64, 1e-7; float32, 1e-5 (the same operations in another order); bfloat16 logits, where CPU rounds the
log-probabilities and their gradient to bfloat16 and the fused op rounds only its results, 2 units in the last
place of the loss (rtol 1.6e-2) and 4e-3 on gradients of magnitude below 1."""

import pytest
import torch
import torch.nn.functional as F

import hf_tpu

_TOLERANCES = {torch.float64: dict(rtol=1e-7, atol=1e-7), torch.float32: dict(rtol=1e-5, atol=1e-5),
               torch.bfloat16: dict(rtol=1.6e-2, atol=4e-3)}

_OPTIONS = {
    "mean": dict(),
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "ignore_index 3": dict(ignore_index=3),
    "smoothing": dict(label_smoothing=0.1),
    "weights": dict(weight=True),
    "weights, smoothing, none": dict(weight=True, label_smoothing=0.2, reduction="none"),
    "weights, smoothing, mean": dict(weight=True, label_smoothing=0.2),
    "weights, smoothing, sum": dict(weight=True, label_smoothing=1.0, reduction="sum"),
}


def _case(dtype, options, rows=6, classes=7):
    torch.manual_seed(0)
    logits = torch.randn(rows, classes, dtype=dtype) * 3
    ignored = options.get("ignore_index", -100)
    target = torch.tensor([0, 6, ignored, 3, 2, ignored])[:rows]
    options = dict(options)
    if options.get("weight"):
        options["weight"] = torch.rand(classes, dtype=dtype)
    return logits, target, options


def _loss_and_grad(logits, target, options, device, fn=F.cross_entropy):
    x = logits.to(device).detach().requires_grad_()
    loss = fn(x, target.to(device), **{k: v.to(device) if torch.is_tensor(v) else v for k, v in options.items()})
    loss.backward(torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape).to(device, loss.dtype))
    return loss, x.grad


def _assert_like_cpu(logits, target, options, fn=F.cross_entropy, fused=True):
    expected_loss, expected_grad = _loss_and_grad(logits, target, options, "cpu", fn)
    loss, grad = _loss_and_grad(logits, target, options, "tpu", fn)
    assert ("hf_tpu_cross_entropy" in type(loss.grad_fn).__name__) == fused, loss.grad_fn
    tolerance = _TOLERANCES[logits.dtype]
    torch.testing.assert_close(loss.cpu(), expected_loss, equal_nan=True, **tolerance)
    torch.testing.assert_close(grad.cpu(), expected_grad, equal_nan=True, **tolerance)


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(_OPTIONS))
def test_the_fused_loss_and_gradient_equal_the_cpus(name, dtype, mode):
    with torch.tpu.use_eager_mode(mode):
        _assert_like_cpu(*_case(dtype, _OPTIONS[name]))


def test_a_float32_upcast_of_bfloat16_logits_as_a_language_models_loss_makes_it():
    logits, target, _ = _case(torch.bfloat16, {})
    _assert_like_cpu(logits, target, {}, fn=lambda x, t: F.cross_entropy(x.float(), t))


def test_float64_logits_give_the_cpus_loss_and_gradient():
    _assert_like_cpu(*_case(torch.float64, _OPTIONS["weights, smoothing, mean"]))


def test_under_autocast_the_loss_of_bfloat16_logits_is_float32_as_pytorchs_composite_makes_it():
    logits, target, _ = _case(torch.bfloat16, {})
    expected_loss, expected_grad = _loss_and_grad(logits, target, {}, "cpu", lambda x, t: F.cross_entropy(x.float(), t))
    with torch.autocast("tpu", dtype=torch.bfloat16):
        loss, grad = _loss_and_grad(logits, target, {}, "tpu")
    assert loss.dtype == torch.float32 and "hf_tpu_cross_entropy" in type(loss.grad_fn).__name__
    torch.testing.assert_close(loss.cpu(), expected_loss, **_TOLERANCES[torch.float32])
    torch.testing.assert_close(grad.cpu(), expected_grad, **_TOLERANCES[torch.bfloat16])


def test_every_target_ignored_gives_the_cpus_nan_loss_and_zero_gradient():
    logits, _, _ = _case(torch.float32, {})
    for options in (dict(), dict(label_smoothing=0.1)):
        _assert_like_cpu(logits, torch.full((6,), -100), options)


_LEFT_TO_PYTORCH = {
    "probability targets": lambda d: (torch.randn(4, 5, device=d), torch.softmax(torch.randn(4, 5), 1).to(d), {}),
    "spatial dims": lambda d: (torch.randn(2, 5, 3, device=d), torch.randint(0, 5, (2, 3)).to(d), {}),
    "one row, no batch": lambda d: (torch.randn(5, device=d), torch.tensor(2).to(d), {}),
}


@pytest.mark.parametrize("name", list(_LEFT_TO_PYTORCH))
def test_calls_the_fused_op_does_not_take_give_the_cpus_results(name):
    torch.manual_seed(0)
    logits, target, options = _LEFT_TO_PYTORCH[name]("cpu")
    _assert_like_cpu(logits, target, options, fused=False)


def test_weights_that_require_grad_take_pytorchs_path_and_its_error():
    logits, target, _ = _case(torch.float32, {})
    for device in ("cpu", "tpu"):
        weight = torch.rand(7, device=device, requires_grad=True)
        with pytest.raises(RuntimeError, match="not differentiable with respect to argument 'weight'"):
            F.cross_entropy(logits.to(device).requires_grad_(), target.to(device), weight=weight)


def test_smoothing_outside_zero_to_one_raises_the_cpus_error():
    logits, target, _ = _case(torch.float32, {})
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="label_smoothing must be between 0.0 and 1.0"):
            F.cross_entropy(logits.to(device), target.to(device), label_smoothing=1.5)


def test_the_cpu_kernels_of_the_op_are_pytorchs_loss_and_gradient():
    logits, target, options = _case(torch.float32, _OPTIONS["weights, smoothing, mean"])
    loss, logsumexp = torch.ops.hf_tpu.cross_entropy(logits, target, options["weight"], 1, -100, 0.2)
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, **options))
    torch.testing.assert_close(logsumexp, torch.logsumexp(logits, 1))
    grad = torch.ops.hf_tpu.cross_entropy_backward(torch.tensor(0.5), logits, target, options["weight"], 1, -100,
                                                    0.2, logsumexp)
    torch.testing.assert_close(grad, _loss_and_grad(logits, target, options, "cpu")[1])


def test_torch_compile_gives_the_cpus_loss_and_gradient():
    logits, target, options = _case(torch.bfloat16, _OPTIONS["weights"])

    def loss_fn(x, t, weight):
        return F.cross_entropy(x.float(), t, weight=weight.float(), label_smoothing=0.2)

    expected_loss, expected_grad = _loss_and_grad(logits, target, options, "cpu", loss_fn)
    loss, grad = _loss_and_grad(logits, target, options, "tpu", torch.compile(loss_fn, backend="tpu"))
    torch.testing.assert_close(loss.cpu(), expected_loss, **_TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(grad.cpu(), expected_grad, **_TOLERANCES[torch.bfloat16])


def test_a_traced_step_saves_the_bfloat16_logits_and_no_float32_rows_by_classes():
    """A language model's loss (bfloat16 logits upcast to float32, then `cross_entropy`) in a traced step: what the
    forward keeps for the backward passes an optimization barrier (`hf_tpu.remat.saved_values_materialized`), and
    that is the bfloat16 logits alone, with no float32 value of the logits' shape (PyTorch's composite saved the
    float32 log-probabilities). The step's loss and gradient equal the CPU's."""
    rows, hidden, classes = 16, 8, 24
    torch.manual_seed(0)
    head = torch.randn(classes, hidden, dtype=torch.bfloat16)
    x, target = torch.randn(rows, hidden, dtype=torch.bfloat16), torch.randint(0, classes, (rows,))

    def run(device, jit):
        weight = head.to(device).requires_grad_()

        def step(x, target):
            loss = F.cross_entropy((x @ weight.T).float(), target)
            loss.backward()
            return loss.detach()

        step = hf_tpu.jit(step) if jit else step
        return step(x.to(device), target.to(device)), weight.grad, step

    loss, grad, step = run("tpu", jit=True)
    barriers = [line for line in step.lower(x.to("tpu"), target.to("tpu")).as_text().splitlines()
                if "optimization_barrier" in line]
    assert any(f"tensor<{rows}x{classes}xbf16>" in line for line in barriers), barriers
    assert not any(f"tensor<{rows}x{classes}xf32>" in line for line in barriers), barriers
    expected_loss, expected_grad, _ = run("cpu", jit=False)
    torch.testing.assert_close(loss.cpu(), expected_loss, **_TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(grad.cpu(), expected_grad, rtol=1.6e-2, atol=1e-2)
