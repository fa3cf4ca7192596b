"""Out-of-range indices raise CPU's exception on tpu by default, found on the device without a host sync per op
and raised at the next host read, naming the op and the user's line (as CUDA reports a device-side assert);
at the call with HF_TPU_CHECK_INDICES=1 and in launch-blocking mode. Valid indices never raise."""

import os

import pytest
import torch
import torch.nn.functional as F

import hf_tpu
from tests.util import differential

THIS_FILE = os.path.basename(__file__)


def _t(values, d, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=d)


def _x(d):
    return torch.arange(6.0, device=d).reshape(2, 3)


# (name, the op as PyTorch's errors name it, a call with an index out of range). Each lambda is one line: the
# error names that line.
_BAD = [
    ("cross_entropy", "hf_tpu::cross_entropy", lambda d: F.cross_entropy(_x(d), _t([10, 1], d))),
    ("cross_entropy -1", "hf_tpu::cross_entropy", lambda d: F.cross_entropy(_x(d), _t([-1, 1], d))),
    ("cross_entropy smoothing", "hf_tpu::cross_entropy",
     lambda d: F.cross_entropy(_x(d), _t([1, 3], d), label_smoothing=0.1)),
    ("nll_loss2d", "aten::nll_loss2d_forward",
     lambda d: F.nll_loss(torch.zeros(1, 3, 2, 2, device=d), _t([[[0, 3], [0, 0]]], d))),
    ("embedding", "aten::embedding", lambda d: F.embedding(_t([1, 7], d), _x(d))),
    ("embedding -1", "aten::embedding", lambda d: F.embedding(_t([-1], d), _x(d))),
    ("embedding_bag", "aten::_embedding_bag_forward_only",
     lambda d: F.embedding_bag(_t([1, 7, 4], d), _x(d), _t([0], d))),
    ("index_select", "aten::index_select", lambda d: _x(d).index_select(0, _t([2], d))),
    ("index_select -1", "aten::index_select", lambda d: _x(d).index_select(0, _t([-1], d))),
    ("index_select dim 1", "aten::index_select", lambda d: _x(d).index_select(1, _t([0, 3], d))),
    ("getitem", "aten::index.Tensor", lambda d: _x(d)[_t([5], d)]),
    ("getitem -3", "aten::index.Tensor", lambda d: _x(d)[_t([-3], d)]),
    ("getitem two indices", "aten::index.Tensor", lambda d: _x(d)[_t([1, 1], d), _t([0, 5], d)]),
    ("getitem after a slice", "aten::index.Tensor", lambda d: _x(d)[:, _t([[0], [4]], d)]),
    ("setitem", "aten::index_put_", lambda d: _x(d).__setitem__(_t([2], d), 1.0)),
    ("index_put_", "aten::index_put_", lambda d: _x(d).index_put_((_t([7], d),), torch.tensor(1.0, device=d))),
    ("index_put_ accumulate", "aten::index_put_",
     lambda d: _x(d).index_put_((_t([0], d), _t([3], d)), torch.tensor(1.0, device=d), accumulate=True)),
    ("gather", "aten::gather", lambda d: _x(d).gather(0, _t([[0, 1, 0], [5, 7, 0]], d))),
    ("gather -1", "aten::gather", lambda d: _x(d).gather(1, _t([[-1]], d))),
    ("scatter_", "aten::scatter_.value", lambda d: _x(d).scatter_(0, _t([[2, 0, 0]], d), 1.0)),
    ("scatter_ -1", "aten::scatter_.value", lambda d: _x(d).scatter_(0, _t([[-1, 0, 0]], d), 1.0)),
    ("scatter_add", "aten::scatter_add", lambda d: _x(d).scatter_add(1, _t([[3]], d), _x(d))),
    ("scatter_reduce", "aten::scatter_reduce.two", lambda d: _x(d).scatter_reduce(1, _t([[3]], d), _x(d), "amax")),
    ("index_add 1-d", "aten::index_add", lambda d: _x(d)[0].index_add(0, _t([3], d), _x(d)[0, :1])),
    ("index_add 2-d", "aten::index_add", lambda d: _x(d).index_add(0, _t([5], d), torch.ones(1, 3, device=d))),
    ("index_add alpha", "aten::index_add",
     lambda d: _x(d).index_add(0, _t([5], d), torch.ones(1, 3, device=d), alpha=2)),
    ("index_copy", "aten::index_copy", lambda d: _x(d).index_copy(1, _t([3], d), torch.ones(2, 1, device=d))),
    ("index_copy_ -1", "aten::index_copy_", lambda d: _x(d).index_copy_(0, _t([-1], d), torch.ones(1, 3, device=d))),
    ("index_fill", "aten::index_fill.int_Scalar", lambda d: _x(d).index_fill(1, _t([-4], d), 1.0)),
    ("index_reduce", "aten::index_reduce",
     lambda d: _x(d).index_reduce(0, _t([2], d), torch.ones(1, 3, device=d), "prod")),
    ("take", "aten::take", lambda d: _x(d).take(_t([6], d))),
    ("put_", "aten::put_", lambda d: _x(d).put_(_t([-7], d), torch.ones(1, device=d))),
    ("one_hot", "aten::one_hot", lambda d: F.one_hot(_t([0, 5], d), 3)),
    ("one_hot -1", "aten::one_hot", lambda d: F.one_hot(_t([4, -1], d), 3)),
]
_IDS = [case[0] for case in _BAD]


def _cpu_error(fn):
    with pytest.raises(Exception) as error:  # noqa: PT011 - whatever CPU raises is the expected error
        fn("cpu")
    return error.value


pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")


@pytest.mark.parametrize("name, op, fn", _BAD, ids=_IDS)
def test_an_out_of_range_index_raises_cpus_error_at_the_next_read_without_a_sync(name, op, fn):
    expected = _cpu_error(fn)
    torch.tpu.synchronize()
    syncs = hf_tpu.metrics()["host_syncs"]
    fn("tpu")  # no sync, no error yet: the device finds it
    assert hf_tpu.metrics()["host_syncs"] == syncs
    with pytest.raises(type(expected)) as raised:
        torch.ones(1, device="tpu").item()
    message = str(raised.value)
    assert message.startswith(str(expected)), (message, str(expected))
    assert f"({op} called at " in message
    assert f"{THIS_FILE}:{fn.__code__.co_firstlineno} in <lambda>" in message
    # reported once; the device computes on
    assert torch.ones(2, device="tpu").sum().item() == 2.0


@pytest.mark.parametrize("name, op, fn", _BAD, ids=_IDS)
@pytest.mark.parametrize("how", ["HF_TPU_CHECK_INDICES=1", "launch-blocking"])
def test_checking_at_each_op_raises_cpus_exact_error_at_the_call(name, op, fn, how, monkeypatch):
    expected = _cpu_error(fn)
    if how == "launch-blocking":
        context = torch.tpu.use_eager_mode("DEFER_NEVER_AND_LAUNCH_BLOCKING")
    else:
        monkeypatch.setenv("HF_TPU_CHECK_INDICES", "1")
        context = torch.tpu.use_eager_mode(torch.tpu.eager_mode)
    with context, pytest.raises(type(expected)) as raised:
        fn("tpu")
    assert str(raised.value) == str(expected)


def test_an_op_that_reads_its_values_anyway_checks_them_at_the_call():
    """bincount's result size is its largest value: it syncs, so its check costs nothing more there."""
    expected = _cpu_error(lambda d: torch.bincount(_t([1, -2, 3], d)))
    with pytest.raises(RuntimeError) as raised:
        torch.bincount(_t([1, -2, 3], "tpu"))
    assert str(raised.value) == str(expected)
    with pytest.raises(RuntimeError, match="bincount only supports 1-d non-negative integral inputs"):
        torch.bincount(_t([[1]], "tpu"))  # a shape error, whatever the values
    torch.tpu.synchronize()


_VALID = {
    "negative getitem": lambda d: _x(d)[_t([-1, -2, 1], d)],
    "negative getitem int32": lambda d: _x(d)[:, _t([-3, 2], d, torch.int32)],
    "negative index_put_": lambda d: _x(d).index_put_((_t([-1], d), _t([-3], d)), torch.tensor(9.0, device=d)),
    "negative setitem": lambda d: _x(d).__setitem__((slice(None), _t([-1], d)), 7.0),
    "mask getitem": lambda d: _x(d)[_t([[True, False, True], [False, False, True]], d, torch.bool)],
    "mask and index": lambda d: _x(d)[_t([False, True], d, torch.bool), _t([2], d)],
    "negative index_fill": lambda d: _x(d).index_fill(1, _t([-1, -3], d), 5.0),
    "negative take": lambda d: _x(d).take(_t([-6, -1, 5], d)),
    "negative put_": lambda d: _x(d).put_(_t([-6, 5], d), torch.ones(2, device=d)),
    "ignore_index -100": lambda d: F.cross_entropy(_x(d), _t([-100, 2], d)),
    "ignore_index 7": lambda d: F.nll_loss(_x(d), _t([7, 2], d), ignore_index=7),
    "ignored with smoothing": lambda d: F.cross_entropy(_x(d), _t([1, -100], d), label_smoothing=0.1),
    "padding_idx -1": lambda d: F.embedding(_t([0, 1], d), _x(d), padding_idx=-1),
    "edges": lambda d: (_x(d).index_select(1, _t([0, 2], d)), _x(d).gather(0, _t([[1, 0, 1]], d)),
                        F.embedding(_t([1, 0], d), _x(d)), F.one_hot(_t([2, 0], d), 3), torch.bincount(_t([0, 4], d))),
    "empty indices": lambda d: (_x(d).index_select(0, _t([], d)), F.embedding(_t([], d), _x(d)), _x(d)[_t([], d)],
                                _x(d).gather(0, _t([], d).reshape(0, 3)), F.cross_entropy(_x(d)[:0], _t([], d))),
    "index into an empty result": lambda d: torch.zeros(0, 3, device=d)[:, _t([9], d)],
    "scatter_ in range": lambda d: torch.zeros(2, 3, device=d).scatter_(1, _t([[2, 0], [1, 1]], d), 1.0),
    "index_add in range": lambda d: torch.zeros(3, 2, device=d).index_add(0, _t([2, 0, 2], d), torch.ones(3, 2,
                                                                                                           device=d)),
}


@pytest.mark.parametrize("name", list(_VALID))
def test_valid_indices_never_raise(name):
    differential(_VALID[name])
    torch.tpu.synchronize()  # nothing found on the device


def test_the_error_surfaces_at_any_host_read_and_only_the_first_is_raised():
    x = _x("tpu")
    reads = [lambda t: t.item(), lambda t: t.cpu(), lambda t: print(t), lambda t: torch.tpu.synchronize(),
             lambda t: t.tolist(), lambda t: bool(t)]
    for read in reads:
        x.index_select(0, _t([2], "tpu"))
        x.gather(0, _t([[9, 0, 0]], "tpu"))  # a second error before the read: the first is the one raised
        with pytest.raises(IndexError, match=r"index out of range in self \(aten::index_select called at"):
            read(x.sum())
        read(x.sum())  # reported once, and the device computes on
    assert x.index_select(0, _t([1], "tpu")).tolist() == [[3.0, 4.0, 5.0]]


def test_checked_ops_add_no_host_sync_however_many_run():
    weight = torch.randn(10, 4, device="tpu")
    torch.tpu.synchronize()
    syncs = hf_tpu.metrics()["host_syncs"]
    total = torch.zeros(4, device="tpu")
    for step in range(20):
        ids = torch.tensor([step % 10, 9 - step % 10], device="tpu")
        total = total + F.embedding(ids, weight).sum(0) + weight.index_select(0, ids).sum(0)
    assert hf_tpu.metrics()["host_syncs"] == syncs
    expected = 8 * weight.cpu().sum(0)  # each row twice per lookup as i, twice as 9 - i
    torch.testing.assert_close(total.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_a_compiled_graph_checks_its_indices_without_running_eagerly_or_syncing():
    weight = torch.randn(5, 3, device="tpu")

    @torch.compile(backend="tpu")
    def lookup(ids):
        return F.embedding(ids, weight).sum() + weight[ids[:1]].sum()

    assert torch.isfinite(lookup(_t([1, 4], "tpu"))).item()  # compiles
    torch.tpu.synchronize()
    hf_tpu.reset_metrics()
    y = lookup(_t([1, 8], "tpu"))
    assert hf_tpu.metrics()["ops_dispatched"] == 0 and hf_tpu.metrics()["host_syncs"] == 0
    line = lookup.__wrapped__.__code__.co_firstlineno + 2  # the graph's node knows the line it was traced from
    with pytest.raises(IndexError, match=rf"index out of range in self \(aten::embedding called at .*{THIS_FILE}:"
                                         rf"{line} in lookup"):
        y.item()
    expected = (2 * weight[0].sum() + weight[4].sum()).item()
    assert lookup(_t([0, 4], "tpu")).item() == pytest.approx(expected, rel=1e-5)
    torch._dynamo.reset()


def test_a_compiled_graph_checking_at_each_call_stays_compiled(monkeypatch):
    """With HF_TPU_CHECK_INDICES=1 a compiled graph's indices are read after each call (its ops cannot sync
    inside the trace), and the graph still runs compiled."""
    monkeypatch.setenv("HF_TPU_CHECK_INDICES", "1")
    weight = torch.randn(5, 3, device="tpu")

    @torch.compile(backend="tpu")
    def lookup(ids):
        return F.embedding(ids, weight).sum()

    lookup(_t([1, 4], "tpu"))
    hf_tpu.reset_metrics()
    with pytest.raises(IndexError, match=r"index out of range in self \(aten::embedding called at"):
        lookup(_t([1, 8], "tpu"))
    assert hf_tpu.metrics()["ops_dispatched"] == 0
    torch._dynamo.reset()


def test_a_traced_function_checks_its_indices():
    weight = torch.randn(5, 3, device="tpu")

    def lookup(ids):
        return F.embedding(ids, weight).sum(0)

    traced = hf_tpu.jit(lookup)
    with torch.no_grad():
        assert traced(_t([1, 4], "tpu")).shape == (3,)
        torch.tpu.synchronize()
        hf_tpu.reset_metrics()
        y = traced(_t([5, 4], "tpu"))
        assert hf_tpu.metrics()["ops_dispatched"] == 0 and hf_tpu.metrics()["host_syncs"] == 0
        with pytest.raises(IndexError, match=rf"index out of range in self \(aten::embedding called at .*{THIS_FILE}:"):
            y.cpu()
        torch.testing.assert_close(traced(_t([0, 2], "tpu")).cpu(), weight.cpu()[[0, 2]].sum(0))


def test_a_trace_decides_the_checks_of_indices_computed_from_constants():
    """Indices a trace computes from constants alone (Transformers' mask functions index position ids made by
    `arange`) are checked on the host as the function is traced: the program checks only the others, and the ops
    that only the decided checks read leave the program. Known indices out of range still raise CPU's error."""
    weight = torch.randn(5, 3, device="tpu")

    def lookup(shift):
        def fn(ids):
            positions = torch.arange(8, device="tpu")
            picked = positions[torch.arange(4, device="tpu") + shift]  # never read below: only its check keeps it
            return F.embedding(ids, weight).sum(0) + 0 * picked.shape[0]
        return hf_tpu.jit(fn)

    def ops_of(text):
        return sum(line.strip().startswith("%") for line in text.splitlines())

    ids = _t([1, 4], "tpu")
    with torch.no_grad():
        in_range, out_of_range = lookup(4), lookup(5)
        assert ops_of(in_range.lower(ids).as_text()) < ops_of(out_of_range.lower(ids).as_text()) - 10
        torch.testing.assert_close(in_range(ids).cpu(), weight.cpu()[[1, 4]].sum(0))
        y = out_of_range(ids)
        with pytest.raises(IndexError, match=r"index 8 is out of bounds for dimension 0 with size 8"):
            y.cpu()


@pytest.mark.parametrize("traced", ["torch.compile", "hf_tpu.jit"])
def test_a_device_loop_carries_its_index_checks_through_its_iterations(traced):
    """A decoding loop looks up each new token: the loop stays on the device, and an id out of range in any
    iteration is raised after it."""
    embedding = torch.nn.Embedding(6, 2).to("tpu")

    def body(ids, total):
        return ids + 1, total + embedding(ids).sum()

    state = {"state": (embedding,)} if traced == "hf_tpu.jit" else {}
    with torch.no_grad():
        for limit in (5, 5, 8):  # a bound in a tensor: an input of the step, which compiles once
            carried = (_t([0], "tpu"), torch.zeros((), device="tpu"))
            bound = _t(limit, "tpu")
            torch.tpu.synchronize()
            hf_tpu.reset_metrics()
            ids, total = hf_tpu.while_loop(lambda ids, total: ids[0] < bound, body, carried, **state)
            assert hf_tpu.metrics()["host_syncs"] == 0 and hf_tpu.metrics()["compiles"] == 0 or limit == 5
            if limit == 5:
                torch.testing.assert_close(total.cpu(), embedding.weight.cpu()[:5].sum())
        assert hf_tpu.metrics()["ops_dispatched"] <= 2  # the loop ran on the device, not in Python
        line = body.__code__.co_firstlineno + 1
        with pytest.raises(IndexError, match=rf"index out of range in self \(aten::embedding called at .*{THIS_FILE}:"
                                             rf"{line} in body"):
            total.item()
    assert ids.item() == 8
    torch._dynamo.reset()
