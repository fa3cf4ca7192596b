"""Bad input gets PyTorch's exception types and messages a user can act on."""

import pytest
import torch

import hf_tpu
from hf_tpu import dispatch
from tests.util import differential


def test_cpu_and_tpu_tensors_in_one_op():
    with pytest.raises(RuntimeError, match=r"found at least two devices, tpu:0 and cpu"):
        torch.ones(3, device="tpu") + torch.ones(3)


def test_cpu_scalar_tensor_joins_like_on_cuda():
    assert (torch.ones(3, device="tpu") * torch.tensor(2.0)).cpu().tolist() == [2.0, 2.0, 2.0]


def test_cpu_index_tensors_index_a_tpu_tensor_like_on_cuda():
    x = torch.arange(30.0).reshape(2, 3, 5)
    rows, cols = torch.arange(2), torch.tensor([1, 4])
    assert torch.equal(x.to("tpu")[:, rows, cols].cpu(), x[:, rows, cols])  # Transformers' speculative sampling
    written, expected = x.to("tpu"), x.clone()
    written[:, torch.tensor([0, 2])] = -1.0
    expected[:, torch.tensor([0, 2])] = -1.0
    written.index_put_((torch.tensor([1]),), torch.tensor(5.0, device="tpu"), accumulate=True)
    expected.index_put_((torch.tensor([1]),), torch.tensor(5.0), accumulate=True)
    assert torch.equal(written.cpu(), expected)
    with pytest.raises(RuntimeError, match="found at least two devices"):  # only as indices
        torch.ones(2, 5, device="tpu") + torch.ones(5)


def test_shape_mismatch_raises_runtime_error_like_cpu():
    with pytest.raises(RuntimeError, match="must match the size|broadcast"):
        torch.ones(3, device="tpu") + torch.ones(4, device="tpu")


def test_unsupported_op_names_op_dtypes_shapes_and_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_TPU_CPU_FALLBACK", "0")
    sig = dispatch.signature(torch.ops.aten._fft_r2c.default)
    x = torch.ones(8, device="tpu")
    with pytest.raises(NotImplementedError) as info:
        dispatch.run_unlowered(sig, [x, [0], 0, True])
    msg = str(info.value)
    assert "aten::_fft_r2c" in msg and "float32[8]" in msg
    assert "HF_TPU_CPU_FALLBACK" in msg and "docs/compatibility.md" in msg


def test_cpu_fallback_runs_and_is_counted():
    import hf_tpu

    hf_tpu.reset_metrics()
    sig = dispatch.signature(torch.ops.aten._fft_r2c.default)
    x = torch.arange(8.0, device="tpu")
    out = dispatch.cpu_fallback(sig, [x, [0], 0, True])
    assert out.device.type == "tpu"
    assert torch.allclose(out.cpu(), torch.fft.rfft(torch.arange(8.0)))
    assert hf_tpu.metrics()["cpu_fallbacks"]["aten::_fft_r2c"] == 1


def test_in_place_on_expanded_tensor_raises_like_cpu():
    x = torch.zeros(1, 4, device="tpu").expand(3, 4)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        x.add_(1)


_PARTIAL_OVERLAPS = [
    ("shifted add_", lambda x: x[1:].add_(x[:-1])),
    ("shifted copy_", lambda x: x[1:].copy_(x[:-1])),
    ("out= overlapping an input", lambda x: torch.add(x[:-1], 1, out=x[1:])),
    ("transposed input", lambda x: x[:4].view(2, 2).add_(x[:4].view(2, 2).t())),
    ("broadcast row of itself", lambda x: x.view(2, 3).mul_(x.view(2, 3)[0])),
]


_INDEX_OP_OVERLAPS = [  # these kernels reject a full overlap too (at::assert_no_overlap)
    ("index_add_ of its own tail", lambda x: x[:4].index_add_(0, _pair(x), x[2:4])),
    ("index_copy_ of itself", lambda x: x.index_copy_(0, torch.arange(6, device=x.device), x)),
    ("index_put_ of its own tail", lambda x: x[:4].index_put_((_pair(x),), x[1:3])),
    ("setitem from itself", lambda x: x.__setitem__(_pair(x), x[1:3])),
    ("scatter_add_ of its own tail", lambda x: x[:4].scatter_add_(0, _pair(x), x[2:4])),
    ("index_fill_ indexed by itself", lambda x: (y := x.long()).index_fill_(0, y[:2], 1)),
    ("put_ of its own tail", lambda x: x[:4].put_(_pair(x), x[2:4])),
    ("cat into an input", lambda x: torch.cat([x[:2], x[2:3]], out=x[1:4])),
    ("index_select into its input", lambda x: torch.index_select(x, 0, _pair(x), out=x[1:3])),
    ("cumsum out= partly its input", lambda x: torch.cumsum(x[:4], 0, out=x[2:])),
]


def _pair(x):
    return torch.tensor([0, 1], device=x.device)


@pytest.mark.parametrize("name, fn", _PARTIAL_OVERLAPS + _INDEX_OP_OVERLAPS,
                         ids=[c[0] for c in _PARTIAL_OVERLAPS + _INDEX_OP_OVERLAPS])
def test_inputs_sharing_memory_with_the_written_tensor_raise_like_cpu(name, fn):
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to tensor"):
            fn(torch.arange(6.0, device=device))


def test_inputs_overlapping_the_written_tensor_whole_or_not_at_all_are_fine():
    def writes(d):
        x = torch.arange(6.0, device=d).view(2, 3)
        x.add_(x)
        x[0].add_(x[1])
        x[:, 0].mul_(x[:, 1])
        x.view(-1)[:3].sub_(x[0])
        torch.cumsum(x, 1, out=x)  # a scan may overwrite its input whole
        x[:1].index_add_(0, torch.tensor([0], device=d), x[1:])  # disjoint
        return x

    differential(writes)


_BAD_RANDOM_ARGUMENTS = [
    ("randint low >= high", lambda d: torch.randint(5, 2, (2,), device=d), "expects 'from' to be less than 'to'"),
    ("random_ from >= to", lambda d: torch.empty(2, device=d).random_(5, 2), "expects 'from' to be less than 'to'"),
    ("random_ to = 0", lambda d: torch.empty(2, device=d).random_(0), "expects 'from' to be less than 'to'"),
    ("random_ beyond uint8", lambda d: torch.empty(2, dtype=torch.uint8, device=d).random_(0, 300),
     "to - 1 is out of bounds for unsigned char"),
    ("uniform_ from > to", lambda d: torch.empty(2, device=d).uniform_(5, 2), r"expects to return a \[from, to\) range"),
    ("uniform_ to inf", lambda d: torch.empty(2, device=d).uniform_(0, float("inf")), "to is out of bounds for float"),
    ("uniform_ of integers", lambda d: torch.empty(2, dtype=torch.int64, device=d).uniform_(), "not implemented for 'Long'"),
    ("bernoulli_ p > 1", lambda d: torch.empty(2, device=d).bernoulli_(1.5), r"expects p to be in \[0, 1\]"),
    ("bernoulli p < 0", lambda d: torch.bernoulli(torch.empty(2, device=d), -0.1), r"expects p to be in \[0, 1\]"),
]


@pytest.mark.parametrize("name, fn, message", _BAD_RANDOM_ARGUMENTS, ids=[c[0] for c in _BAD_RANDOM_ARGUMENTS])
def test_random_ops_check_their_arguments_like_cpu(name, fn, message):
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match=message):  # NotImplementedError is one
            fn(device)


def _ints(d):
    return torch.tensor([3, 5], device=d)


_BAD_DTYPES = [  # PyTorch's meta kernels let these through; its CPU kernels raise
    ("bitwise_and of floats", lambda d: torch.bitwise_and(_ints(d).float(), 1.0), NotImplementedError),
    ("shift of floats", lambda d: torch.bitwise_left_shift(_ints(d).float(), 1), NotImplementedError),
    ("gcd of floats", lambda d: torch.gcd(_ints(d).float(), _ints(d).float()), NotImplementedError),
    ("abs of bools", lambda d: (_ints(d) > 4).abs(), NotImplementedError),
    ("argmax of bools", lambda d: (_ints(d) > 4).argmax(), RuntimeError),
    ("argmin of an empty tensor", lambda d: torch.empty(0, device=d).argmin(), IndexError),
    ("integers to a negative power", lambda d: _ints(d) ** -2, RuntimeError),
    ("in-place integer negative power", lambda d: _ints(d).pow_(-3), RuntimeError),
    ("neg into another dtype", lambda d: torch.neg(_ints(d), out=torch.empty(2, device=d)), RuntimeError),
    ("clamp into another dtype", lambda d: torch.clamp(_ints(d), 0, 4, out=torch.empty(2, device=d)), RuntimeError),
    ("mm into another dtype", lambda d: torch.mm(torch.ones(2, 2, device=d), torch.ones(2, 2, device=d),
                                                 out=torch.empty(2, 2, dtype=torch.float64, device=d)), RuntimeError),
    ("add into a narrower dtype", lambda d: torch.add(_ints(d).float(), 1, out=torch.empty(2, dtype=torch.int64,
                                                                                             device=d)), RuntimeError),
    ("angle into integers", lambda d: torch.angle(_ints(d).float(), out=torch.empty(2, dtype=torch.int64, device=d)),
     RuntimeError),
    ("fill_ beyond int8", lambda d: _ints(d).to(torch.int8).fill_(1000), RuntimeError),
    ("full beyond int32", lambda d: torch.full((2,), 10**10, dtype=torch.int32, device=d), RuntimeError),
    ("masked_fill beyond float16", lambda d: _ints(d).half().masked_fill(_ints(d) > 4, -1e9), RuntimeError),
    ("index_fill NaN into ints", lambda d: _ints(d).index_fill(0, _ints(d) // 5, float("nan")), RuntimeError),
    ("clamp beyond int8", lambda d: _ints(d).to(torch.int8).clamp(max=300), RuntimeError),
    ("int8 to a power beyond int8", lambda d: _ints(d).to(torch.int8) ** 1000, RuntimeError),
    ("alpha beyond int32", lambda d: _ints(d).int().add(_ints(d).int(), alpha=2**40), RuntimeError),
    ("alpha beyond int64", lambda d: _ints(d).add(_ints(d), alpha=2**63), RuntimeError),
    ("addcmul value beyond int8", lambda d: torch.addcmul(*[_ints(d).to(torch.int8)] * 3, value=2**40), RuntimeError),
    ("bools plus a number beyond int64", lambda d: (_ints(d) > 4) + 2**63, RuntimeError),
    ("a bool tensor subtracted", lambda d: (_ints(d) > 4) - 1, RuntimeError),
    ("subtracting from a bool tensor", lambda d: 1 - (_ints(d) > 4), RuntimeError),
    ("subtracting True", lambda d: _ints(d) - True, RuntimeError),
]


@pytest.mark.parametrize("name, fn, error", _BAD_DTYPES, ids=[c[0] for c in _BAD_DTYPES])
def test_dtypes_the_cpu_kernel_rejects_raise_like_cpu(name, fn, error):
    for device in ("cpu", "tpu"):
        with pytest.raises(error) as raised:
            fn(device)
        assert type(raised.value) is error


def test_out_dtypes_the_cpu_kernel_takes_are_taken():
    def into_other_dtypes(d):
        ints, floats = _ints(d), _ints(d).float()
        return [
            torch.bitwise_and(ints, 1, out=torch.empty(2, device=d)),  # computed in int64, then cast
            torch.add(ints, ints, out=torch.empty(2, dtype=torch.float64, device=d)),
            torch.clamp(floats, torch.zeros(2, device=d), out=torch.empty(2, dtype=torch.float64, device=d)),
            torch.sum(floats, 0, out=torch.empty((), dtype=torch.float64, device=d)),
            torch.cumsum(floats, 0, out=torch.empty(2, dtype=torch.int64, device=d)),
            torch.cat([floats, floats], out=torch.empty(4, dtype=torch.float64, device=d)),
            torch.eq(ints, 3, out=torch.empty(2, device=d)),
            _ints(d) ** torch.tensor([-1, 2], device=d),  # a tensor exponent: 0 where negative, no error
        ]

    differential(into_other_dtypes)


def test_python_numbers_that_fit_the_dtype_are_taken():
    def numbers_that_fit(d):  # c10's overflows(): infinities fit a float type, negatives an unsigned one
        halves, masked = _ints(d).half(), _ints(d) > 4
        return [
            halves.masked_fill(masked, float("-inf")),
            halves.masked_fill(masked, torch.finfo(torch.float16).min),
            torch.full((2,), -255, dtype=torch.uint8, device=d),
            _ints(d).to(torch.int8) + 1000,  # a wrapped number: cast, not converted, so it wraps
            _ints(d).to(torch.int8).clamp(0.5, 300.0),  # float bounds make the result float
            _ints(d) + 2**63,  # beyond int64, PyTorch wraps the number as uint64: it wraps in an int64 op
            _ints(d).int() - (2**64 - 5),
            _ints(d).float() + 2**63,  # and is a float in a float op
            _ints(d).float().add(_ints(d).float(), alpha=2**63),
            (_ints(d) > 4).add(_ints(d) > 4, alpha=2**63),  # a bool op takes the truth value
            _ints(d) / 2**63,  # a float op of integers: a float
            _ints(d) == 2**63,
            _ints(d).int() == 2**40,  # not an alpha: no overflow check
        ]

    differential(numbers_that_fit)


def test_masks_must_match_the_shape_they_index_like_cpu():
    for device in ("cpu", "tpu"):
        x = torch.arange(10, device=device).view(2, 5)
        with pytest.raises(IndexError, match=r"The shape of the mask \[2\] at index 0 does not match the shape "
                                             r"of the indexed tensor \[2, 5\] at index 1"):
            x[:, torch.tensor([True, False], device=device)]
        with pytest.raises(IndexError, match=r"The shape of the mask \[3\] at index 0"):
            x[torch.tensor([True, False, True], device=device)] = 9
        with pytest.raises(IndexError, match="too many indices for tensor of dimension 2"):
            x[torch.ones(2, 5, 1, dtype=torch.bool, device=device)]
        for dtype in (torch.float32, torch.int8):
            with pytest.raises(IndexError, match="tensors used as indices must be long, int, byte or bool tensors"):
                x[torch.tensor([1], dtype=dtype, device=device)]
        with pytest.raises(RuntimeError, match=r"The size of tensor a \(2\) must match the size of tensor b \(5\)"):
            x[0].masked_select(torch.tensor([True, False], device=device))


def test_a_uint8_index_is_a_mask_as_on_cpu():
    with pytest.warns(UserWarning, match="indexing with dtype torch.uint8 is now deprecated"):
        differential(lambda d: torch.arange(6, device=d).view(3, 2)[torch.tensor([1, 0, 1], dtype=torch.uint8, device=d)])


_DEVICE_CHECKS = [
    ("linalg.solve", lambda d: torch.linalg.solve(torch.zeros(3, 3, device=d), torch.ones(3, device=d)),
     torch.linalg.LinAlgError),
    ("cholesky", lambda d: torch.linalg.cholesky(-torch.eye(2, device=d)), torch.linalg.LinAlgError),
    ("_assert_async", lambda d: torch._assert_async(torch.tensor(0, device=d)), RuntimeError),
    ("_assert_async.msg", lambda d: torch._assert_async(torch.tensor(0.0, device=d), "the mask is empty"),
     RuntimeError),
]


@pytest.mark.parametrize("name, fn, error", _DEVICE_CHECKS, ids=[c[0] for c in _DEVICE_CHECKS])
def test_checks_on_device_values_raise_at_the_next_read_like_cuda(name, fn, error):
    """A check whose outcome is on the device (LAPACK's `info`, `_assert_async`) does not sync: it raises
    CPU's error at the next host read, or at once under launch-blocking mode."""
    with pytest.raises(error) as cpu_error:
        fn("cpu")
    torch.tpu.synchronize()
    syncs = hf_tpu.metrics()["host_syncs"]
    fn("tpu")
    assert hf_tpu.metrics()["host_syncs"] == syncs
    with pytest.raises(error) as tpu_error:
        torch.ones(1, device="tpu").item()
    assert str(tpu_error.value) == str(cpu_error.value)
    torch.ones(1, device="tpu").item()  # reported once
    with torch.tpu.use_eager_mode("DEFER_NEVER_AND_LAUNCH_BLOCKING"), pytest.raises(error):
        fn("tpu")


def test_passing_device_checks_stay_silent_and_values_are_right():
    a, b = torch.randn(4, 4) + 4 * torch.eye(4), torch.randn(4)
    x = torch.linalg.solve(a.to("tpu"), b.to("tpu"))
    torch._assert_async(torch.tensor(True, device="tpu"))
    torch.tpu.synchronize()
    torch.testing.assert_close(x.cpu(), torch.linalg.solve(a, b))
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
        torch._assert_async(torch.ones(2, device="tpu"))  # a shape error needs no read: raised at once


_COMPILED_CHECKS = [  # (name, a function of one input, a bad input, the error)
    ("linalg.solve", lambda a: torch.linalg.solve(a, torch.ones(3, device=a.device)), torch.zeros(3, 3),
     torch.linalg.LinAlgError),
    ("cholesky", torch.linalg.cholesky, -torch.eye(2), torch.linalg.LinAlgError),
    # (AOT autograd drops a plain `_assert_async` from graphs as dead code, on every device; Dynamo turns
    # an `assert` on a tensor into this overload, which it keeps)
    ("_assert_async.msg", lambda a: torch._assert_async(a.sum(), "the mask is empty"), torch.zeros(2), RuntimeError),
]


@pytest.mark.parametrize("name, fn, bad, error", _COMPILED_CHECKS, ids=[c[0] for c in _COMPILED_CHECKS])
def test_compiled_graphs_with_device_checks_stay_compiled(name, fn, bad, error):
    """Inside `torch.compile` the checked value is an output of the program, checked after the call as
    the eager op checks it: the graph neither runs eagerly nor syncs, and the error is CPU's."""
    with pytest.raises(error) as cpu_error:
        fn(bad)

    @torch.compile(backend="tpu")
    def checked(a):
        fn(a)
        return a + 1

    for call in range(2):  # the first call compiles (tracing dispatches the graph's ops)
        torch.tpu.synchronize()
        hf_tpu.reset_metrics()
        y = checked(bad.to("tpu"))
        if call:
            assert hf_tpu.metrics()["ops_dispatched"] == 0  # not one op ran eagerly
            assert hf_tpu.metrics()["host_syncs"] == 0
        with pytest.raises(error) as tpu_error:
            y.cpu()
        assert str(tpu_error.value) == str(cpu_error.value)
    torch._dynamo.reset()


def test_an_assert_checks_the_condition_at_the_call():
    condition = torch.tensor(False, device="tpu")
    torch._assert_async(condition, "false at the call")
    condition.fill_(True)
    with pytest.raises(RuntimeError, match="false at the call"):
        torch.tpu.synchronize()


# ops whose CPU kernels are compiled for floating dtypes only: an integer, bool or complex input raises there
_FLOATING_ONLY = {
    "cross_entropy": lambda x: torch.nn.functional.cross_entropy(x, torch.tensor([0, 1], device=x.device)),
    "nll_loss": lambda x: torch.nn.functional.nll_loss(x, torch.tensor([0, 1], device=x.device)),
    "softmax": lambda x: torch.softmax(x, 1), "softmax_dim0": lambda x: torch.softmax(x, 0),
    "log_softmax": lambda x: torch.log_softmax(x, -1), "log_softmax_dim0": lambda x: torch.log_softmax(x, 0),
    "layer_norm": lambda x: torch.nn.functional.layer_norm(x, (3,)),
    "group_norm": lambda x: torch.nn.functional.group_norm(x, 1),
    "batch_norm": lambda x: torch.nn.functional.batch_norm(x, None, None, training=True),
    "gelu": torch.nn.functional.gelu, "softplus": torch.nn.functional.softplus, "mish": torch.nn.functional.mish,
    "elu": torch.nn.functional.elu, "leaky_relu": torch.nn.functional.leaky_relu,
    "hardsigmoid": torch.nn.functional.hardsigmoid, "hardswish": torch.nn.functional.hardswish,
    "hardshrink": torch.nn.functional.hardshrink, "softshrink": torch.nn.functional.softshrink,
    "glu": lambda x: torch.nn.functional.glu(torch.cat([x, x], 1)), "logsigmoid": torch.nn.functional.logsigmoid,
    "prelu": lambda x: torch.nn.functional.prelu(x, torch.ones(1, dtype=x.dtype, device=x.device)),
    "rrelu": lambda x: torch.nn.functional.rrelu(x, training=True),
    "mse_loss": lambda x: torch.nn.functional.mse_loss(x, x),
    "binary_cross_entropy": lambda x: torch.nn.functional.binary_cross_entropy(x, x),
    "binary_cross_entropy_with_logits": lambda x: torch.nn.functional.binary_cross_entropy_with_logits(x, x),
    "smooth_l1_loss": lambda x: torch.nn.functional.smooth_l1_loss(x, x),
    "huber_loss": lambda x: torch.nn.functional.huber_loss(x, x),
}


def _raised(fn, device, dtype):
    try:
        fn(torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=dtype, device=device))
    except Exception as e:  # noqa: BLE001 - the type and message are what is compared
        return type(e), str(e)
    return None


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("op", sorted(_FLOATING_ONLY))
def test_floating_only_ops_refuse_other_dtypes_as_cpu_does(op, dtype):
    """`cross_entropy` of Long logits, and the other ops whose CPU kernel takes floating dtypes only: the CPU's
    NotImplementedError naming its kernel, where tpu computed an answer in the input's dtype."""
    expected = _raised(_FLOATING_ONLY[op], "cpu", dtype)
    assert expected is not None and expected[0] is NotImplementedError, expected
    assert _raised(_FLOATING_ONLY[op], "tpu", dtype) == expected


def test_silu_takes_complex_as_cpu_does():
    x = torch.tensor([1 + 1j, -2j], dtype=torch.complex64)
    torch.testing.assert_close(torch.nn.functional.silu(x.to("tpu")).cpu(), torch.nn.functional.silu(x))
    assert _raised(torch.nn.functional.silu, "tpu", torch.int64) == _raised(torch.nn.functional.silu, "cpu", torch.int64)
