"""An op's traced Python numbers reach its program as device arrays kept by value (`hf_tpu/modes/scalars.py`):
each value uploaded once, with the dtype and weak type JAX gives the number itself, so the results are the
CPU's."""

import math

import pytest
import torch

from hf_tpu.memory import host_transfers


@pytest.fixture
def uploads(monkeypatch):
    """The numbers uploaded, in order, from no kept value on."""
    seen = []
    upload = host_transfers._upload

    def counted(host, aval, device_index):
        if aval.shape == () and not isinstance(host, torch.Tensor):
            seen.append(host.item())
        return upload(host, aval, device_index)

    host_transfers.let_go_of_kept_uploads()
    monkeypatch.setattr(host_transfers, "_upload", counted)
    return seen


def test_a_number_is_uploaded_once_for_every_call_that_passes_it(uploads):
    x = torch.randn(4, 3, device="tpu")
    results = [(x * 0.37).cpu() for _ in range(3)]
    assert uploads == [0.37]
    for r in results:
        torch.testing.assert_close(r, x.cpu() * 0.37)


def test_the_numbers_of_an_optimizer_step_are_uploaded_once_each_and_step_sizes_once_per_value(uploads):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    reference = torch.nn.Linear(8, 4)
    reference.load_state_dict(model.state_dict())
    model.to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x = torch.randn(5, 8)
    for step in range(3):
        for m, o, inp in ((model, opt, x.to("tpu")), (reference, ref_opt, x)):
            m(inp).square().mean().backward()
            o.step()
            o.zero_grad()
        torch.tpu.synchronize()  # defer-and-fuse: the step's fused program runs here
        if step == 0:
            first = len(uploads)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    # after the first step only the values that depend on the step count are new: AdamW's step size and bias
    # correction, two a step (the first step uploads its hyperparameters and the loss's divisor, ten)
    assert len(uploads) - first <= 2 * 2
    assert len(uploads) == len(set(map(repr, uploads)))


def test_equal_numbers_of_other_types_or_signs_are_kept_apart(uploads):
    ints = torch.arange(3, device="tpu")
    as_float = ints + 1.0
    as_int = ints + 1
    as_bool = torch.tensor([True, False], device="tpu") & True
    assert (as_float.dtype, as_int.dtype, as_bool.dtype) == (torch.float32, torch.int64, torch.bool)
    assert as_int.cpu().tolist() == [1, 2, 3] and as_float.cpu().tolist() == [1.0, 2.0, 3.0]
    assert as_bool.cpu().tolist() == [True, False]
    ones = torch.ones(2, device="tpu")
    assert (1 / (ones * -0.0)).cpu().tolist() == [-math.inf, -math.inf]
    assert (1 / (ones * 0.0)).cpu().tolist() == [math.inf, math.inf]
    for _ in range(2):
        assert torch.isnan((ones * math.nan).cpu()).all()
    assert sum(v != v for v in uploads) == 1  # a NaN finds its own array
    assert sorted(math.copysign(1, v) for v in uploads if type(v) is float and v == 0) == [-1, 1]  # two zeros


def test_a_bfloat16_tensor_times_a_number_stays_bfloat16():
    x = torch.randn(8, dtype=torch.bfloat16)
    result = x.to("tpu") * 0.1
    assert result.dtype == torch.bfloat16
    torch.testing.assert_close(result.cpu(), x * 0.1)


def test_the_least_recently_used_value_is_let_go_first(uploads, monkeypatch):
    monkeypatch.setattr(host_transfers, "_RECURRING_KEPT", 2)
    x = torch.randn(3, device="tpu")
    for k in (0.5, 1.5, 0.5, 2.5, 0.5, 1.5):
        torch.testing.assert_close((x * k).cpu(), x.cpu() * k)
    # 0.5 stays kept as it is used again; 1.5 was let go for 2.5
    assert uploads == [0.5, 1.5, 2.5, 1.5]


def test_a_number_beyond_int64_raises_overflow_error():
    with pytest.raises(OverflowError):
        host_transfers.from_number(2**63, 0)
