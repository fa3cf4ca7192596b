"""Foreach ops (what optimizers step parameters with) run as one op per list, matching CPU."""

import pytest
import torch

import hf_tpu

F32_AND_BF16 = [(3, 4), (5,), (2, 2)]


def _lists(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype) for s in F32_AND_BF16]


def _tpu(tensors):
    return [t.to("tpu") for t in tensors]


def _assert_lists_equal(cpu, tpu, atol=1e-6):
    assert len(cpu) == len(tpu)
    for c, t in zip(cpu, tpu):
        assert t.device.type == "tpu" and t.dtype == c.dtype and t.shape == c.shape
        torch.testing.assert_close(t.cpu(), c, atol=atol, rtol=1e-5)


CASES = {
    "add.List alpha": lambda xs, ys: torch._foreach_add(xs, ys, alpha=2),
    "sub.Scalar": lambda xs, ys: torch._foreach_sub(xs, 0.5),
    "mul.ScalarList": lambda xs, ys: torch._foreach_mul(xs, [1.0, -2.0, 3.0]),
    "mul.Tensor": lambda xs, ys: torch._foreach_mul(xs, ys[1].sum()),
    "div.List": lambda xs, ys: torch._foreach_div(xs, [y.abs() + 1 for y in ys]),
    "maximum.List": lambda xs, ys: torch._foreach_maximum(xs, ys),
    "clamp_min.Scalar": lambda xs, ys: torch._foreach_clamp_min(xs, 0.1),
    "pow.Scalar": lambda xs, ys: torch._foreach_pow([x.abs() for x in xs], 1.5),
    "pow.ScalarAndTensor": lambda xs, ys: torch._foreach_pow(2.0, xs),
    "lerp.Scalar": lambda xs, ys: torch._foreach_lerp(xs, ys, 0.3),
    "lerp.List": lambda xs, ys: torch._foreach_lerp(xs, ys, [y.sigmoid() for y in ys]),
    "addcmul.Scalar": lambda xs, ys: torch._foreach_addcmul(xs, ys, ys, 0.1),
    "addcdiv.ScalarList": lambda xs, ys: torch._foreach_addcdiv(xs, ys, [y.abs() + 1 for y in ys], [0.1, 0.2, 0.3]),
    "sqrt": lambda xs, ys: torch._foreach_sqrt([x.abs() for x in xs]),
    "exp": lambda xs, ys: torch._foreach_exp(xs),
    "neg": lambda xs, ys: torch._foreach_neg(xs),
    "norm": lambda xs, ys: torch._foreach_norm(xs),
    "norm inf": lambda xs, ys: torch._foreach_norm(xs, float("inf")),
    "max": lambda xs, ys: torch._foreach_max(xs),
}


@pytest.mark.parametrize("case", CASES)
def test_functional_foreach_matches_cpu(case):
    fn = CASES[case]
    xs, ys = _lists(0), _lists(1)
    expected = fn(xs, ys)
    actual = fn(_tpu(xs), _tpu(ys))
    _assert_lists_equal(expected, actual)


@pytest.mark.parametrize("case", ["add.List alpha", "mul.ScalarList", "lerp.Scalar", "addcdiv.ScalarList", "sqrt"])
def test_in_place_foreach_writes_every_element(case):
    name = CASES[case].__code__.co_names[1]  # e.g. "_foreach_add"
    xs, ys = _lists(0), _lists(1)
    if case == "sqrt":
        xs = [x.abs() for x in xs]
    ys_tpu, xs_tpu = _tpu(ys), _tpu(xs)
    args = {"add.List alpha": lambda y: ((y,), {"alpha": 2}), "mul.ScalarList": lambda y: (([1.0, -2.0, 3.0],), {}),
            "lerp.Scalar": lambda y: ((y, 0.3), {}),
            "addcdiv.ScalarList": lambda y: ((y, [v.abs() + 1 for v in y], [0.1, 0.2, 0.3]), {}),
            "sqrt": lambda y: ((), {})}[case]
    cpu_args, cpu_kwargs = args(ys)
    tpu_args, tpu_kwargs = args(ys_tpu)
    getattr(torch, name + "_")(xs_tpu, *tpu_args, **tpu_kwargs)
    getattr(torch, name + "_")(xs, *cpu_args, **cpu_kwargs)
    _assert_lists_equal(xs, xs_tpu)


def test_in_place_foreach_through_views_of_one_buffer():
    base = torch.randn(4, 4)
    tpu = base.to("tpu")
    torch._foreach_mul_([base[0], base[1:, 1], base[2:, 2:]], [2.0, 3.0, 4.0])
    torch._foreach_mul_([tpu[0], tpu[1:, 1], tpu[2:, 2:]], [2.0, 3.0, 4.0])
    torch.testing.assert_close(tpu.cpu(), base)


def test_bfloat16_in_place_matches_the_per_tensor_op():
    xs = _lists(0, torch.bfloat16)
    tpu = _tpu(xs)
    torch._foreach_mul_(tpu, 0.9)
    _assert_lists_equal([x.mul(0.9) for x in xs], tpu)


def test_adamw_steps_are_one_op_per_list_and_compile_once():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    tpu_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to("tpu")
    tpu_model.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    tpu_opt = torch.optim.AdamW(tpu_model.parameters(), lr=1e-2, foreach=True)
    for step in range(4):
        for m, o, inp in ((model, opt, x), (tpu_model, tpu_opt, x.to("tpu"))):
            m(inp).square().sum().backward()
            if step == 3:
                hf_tpu.reset_metrics()
            if m is tpu_model:
                o.step()
                if step == 3:  # the step sizes change every step: traced, never compiled in
                    metrics = hf_tpu.metrics()
                    assert metrics["compiles"] == 0
                    assert metrics["ops_dispatched"] <= 12  # one per foreach op, not one per parameter
            else:
                o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), tpu_model.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("order", [2.0, float("inf"), 3.0])
def test_a_foreach_norm_of_an_order_with_its_own_case_compiles_that_case_alone(order):
    """`clip_grad_norm_`'s `_foreach_norm(grads, 2.0)` traced its order, as dispatch traces a Scalar: each
    tensor's norm was a switch over every order, which kept the tensor's magnitudes in float32 for it (on a v5e,
    six times the gradients' bytes moved, and six branches a tensor to compile). An order with a case of its own
    (`linalg_vector_norm`'s) is compiled in, as there; any other is still an input of one program."""
    from hf_tpu import direct

    xs = _lists(1, torch.bfloat16)
    tpu = _tpu(xs)
    text = direct.lower(lambda tensors: torch._foreach_norm(tensors, order), (tpu,), {}).as_text()
    assert ("stablehlo.case" in text) == (order == 3.0)
    _assert_lists_equal(torch._foreach_norm(xs, order), torch._foreach_norm(tpu, order), atol=1e-2)
