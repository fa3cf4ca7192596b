"""Transfers, factories, host reads, serialization and dtypes, each compared with CPU."""

import copy
import io
import itertools
import math
import pickle

import pytest
import torch

from tests.util import assert_same, differential


def test_transfers_both_ways():
    x = torch.randn(3, 4)
    t = x.to("tpu")
    assert t.device == torch.device("tpu:0")
    assert torch.equal(t.cpu(), x) and torch.equal(t.to("cpu"), x)
    assert torch.equal(x.to("tpu", non_blocking=True).cpu(), x)
    dst = torch.empty(3, 4, device="tpu")
    dst.copy_(x)
    assert torch.equal(dst.cpu(), x)
    back = torch.empty(3, 4)
    back.copy_(dst, non_blocking=True)
    assert torch.equal(back, x)
    assert torch.equal(t.to(torch.float64).cpu(), x.double())


def test_numpy_on_tpu_raises_like_cuda():
    with pytest.raises(TypeError, match="can't convert tpu:0 device type tensor to numpy"):
        torch.ones(2, device="tpu").numpy()


def test_repr_item_tolist_bool():
    t = torch.tensor([1.5, 2.0, -3.0], device="tpu")
    assert "device='tpu:0'" in repr(t) and "1.5000" in repr(t)
    assert t[0].item() == 1.5
    assert t.tolist() == [1.5, 2.0, -3.0]
    assert bool(t[1]) is True and bool(torch.zeros((), device="tpu")) is False
    assert torch.tensor(7, device="tpu").item() == 7


@pytest.mark.parametrize(
    "factory",
    [
        lambda d: torch.zeros(2, 3, device=d),
        lambda d: torch.ones(2, 3, dtype=torch.int64, device=d),
        lambda d: torch.full((2, 2), 3.5, device=d),
        lambda d: torch.arange(10, device=d),
        lambda d: torch.arange(1.0, 4.0, 0.5, device=d),
        lambda d: torch.linspace(0, 1, 5, device=d),
        lambda d: torch.eye(3, device=d),
        lambda d: torch.eye(2, 4, dtype=torch.int32, device=d),
        lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
        lambda d: torch.zeros_like(torch.ones(2, 3, device=d)),
        lambda d: torch.ones_like(torch.ones(2, 3, device=d), dtype=torch.bool),
        lambda d: torch.full_like(torch.ones(2, device=d), 9),
        lambda d: torch.empty(2, 3, device=d).shape,
        lambda d: torch.empty_strided((2, 3), (1, 2), device=d).stride(),
    ],
)
def test_factories(factory):
    differential(factory)


def test_random_factories_have_the_right_shape_dtype_and_range():
    torch.manual_seed(0)
    r = torch.rand(100, device="tpu")
    assert r.shape == (100,) and r.dtype == torch.float32 and 0 <= r.min().item() and r.max().item() < 1
    n = torch.randn(2, 3, device="tpu", dtype=torch.bfloat16)
    assert n.dtype == torch.bfloat16 and n.shape == (2, 3)
    i = torch.randint(3, 9, (50,), device="tpu")
    assert i.dtype == torch.int64 and 3 <= i.min().item() and i.max().item() < 9
    p = torch.randperm(10, device="tpu")
    assert sorted(p.tolist()) == list(range(10))


def test_torch_save_and_load():
    x = torch.randn(3, 5).to("tpu")
    state = {"x": x, "view": x[1:, ::2], "i": torch.arange(4, device="tpu")}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    on_tpu = torch.load(buf, map_location="tpu")
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    buf.seek(0)
    as_saved = torch.load(buf)
    for loaded in (on_tpu, as_saved):
        assert loaded["x"].device.type == "tpu"
        assert_same(loaded, state)
    assert on_cpu["x"].device.type == "cpu"
    assert_same(on_cpu, state)
    # a view keeps sharing its storage after a round trip, as on CPU
    on_tpu["x"].zero_()
    assert on_tpu["view"].cpu().abs().sum().item() == 0


def test_cpu_checkpoint_loads_onto_tpu():
    buf = io.BytesIO()
    torch.save({"w": torch.arange(6.0).reshape(2, 3)}, buf)
    buf.seek(0)
    w = torch.load(buf, map_location="tpu")["w"]
    assert w.device.type == "tpu"
    assert (w * 2).cpu().tolist() == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]


def test_state_dict_safetensors_round_trip_is_bit_exact(tmp_path):
    from safetensors.torch import load_file, save_file

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8)).to(torch.bfloat16)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    model.to("tpu")
    path = tmp_path / "model.safetensors"
    save_file(model.state_dict(), str(path))
    loaded = load_file(str(path))
    for k, v in reference.items():
        assert torch.equal(loaded[k].view(torch.int16), v.view(torch.int16)), k
    moved = {k: v.to("tpu") for k, v in loaded.items()}
    assert all(torch.equal(moved[k].cpu(), reference[k]) for k in reference)


def test_deepcopy_and_pickle():
    x = torch.arange(6.0, device="tpu").reshape(2, 3)
    y = copy.deepcopy(x)
    y.add_(1)
    assert x.cpu().tolist() == [[0, 1, 2], [3, 4, 5]] and y.device.type == "tpu"
    z = pickle.loads(pickle.dumps(x))
    assert z.device.type == "tpu" and torch.equal(z.cpu(), x.cpu())
    model = copy.deepcopy(torch.nn.Linear(3, 2).to("tpu"))
    assert model.weight.device.type == "tpu"


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16, torch.int32,
     torch.int64, torch.uint8, torch.bool, torch.complex64],
)
def test_dtypes_round_trip_and_compute(dtype):
    if dtype == torch.bool:
        x = torch.tensor([True, False, True])
    elif dtype.is_complex:
        x = torch.tensor([1 + 2j, -3j, 0.5], dtype=dtype)
    else:
        x = torch.tensor([1, 0, 3, 100], dtype=dtype)
    t = x.to("tpu")
    assert t.dtype == dtype and torch.equal(t.cpu(), x)
    differential(lambda d: x.to(d) * 2 if dtype != torch.bool else x.to(d) & x.to(d))
    differential(lambda d: x.to(d).to(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_crosses_host_and_device_bit_exact(dtype):
    x = torch.tensor([1.5, -2.0, 0.0, 448.0, 1e-3]).to(dtype)
    t = x.to("tpu")
    assert t.dtype == dtype and torch.equal(t.cpu().view(torch.uint8), x.view(torch.uint8))
    assert t.tolist() == x.tolist()
    differential(lambda d: torch.tensor([0.5, 3.0], dtype=dtype, device=d).float())


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
@pytest.mark.parametrize("source", [torch.float32, torch.float16, torch.float64])
def test_out_of_range_floats_convert_as_on_cpu(dtype, source):
    """PyTorch's CPU casts wrap a float into a narrow integer (through int64) and saturate float8_e4m3fn
    at +-448; JAX's `astype` saturates the former and gives NaN for the latter."""
    values = [-1.0, -3.5, 300.0, 70000.0, -40000.0, 500.0, 1e6, float("inf"), float("-inf"), float("nan")]

    def convert(d):
        x = torch.tensor(values, device=d).to(source)
        dst = torch.zeros(len(values), dtype=dtype, device=d)
        dst.copy_(x)
        return x.to(dtype).float(), dst.float()

    differential(convert)


def test_a_real_view_with_the_negative_bit_reads_negated():
    def views(d):
        z = torch.tensor([1 + 2j, 3 - 4j], device=d)
        imag = z.conj().imag  # a float view with PyTorch's negative bit
        negated = torch._neg_view(torch.tensor([1.0, 2.0], device=d))
        assert imag.is_neg() and negated.is_neg()
        return imag * 1, imag.clone(), negated.sum(), negated + 0

    differential(views)


def test_view_as_another_dtype_reinterprets_bytes():
    differential(lambda d: torch.tensor([1.0, -2.0], device=d).view(torch.int32))
    differential(lambda d: torch.arange(4, dtype=torch.int16, device=d).view(torch.uint8))


def test_a_bool_view_of_bytes_leaves_their_other_bits():
    """Reading `x.view(torch.bool)` re-expressed the whole uint8 buffer as bool, so `x` read 0 or 1."""
    x = torch.tensor([2, 3, 0, 255], dtype=torch.uint8, device="tpu")
    assert x.view(torch.bool).cpu().tolist() == [True, True, False, True]
    assert x.cpu().tolist() == [2, 3, 0, 255]
    signed = torch.tensor([-5, 4], dtype=torch.int8, device="tpu")
    assert signed.view(torch.bool).sum().item() == 2 and signed.cpu().tolist() == [-5, 4]


def test_clamp_bounds_of_another_type_or_sign_compile_their_own_program():
    """Optional scalars were keyed by value, and 2 == 2.0 and 0.0 == -0.0 in Python: the first call's
    program (its result dtype, its zero) served the other."""
    ints = torch.tensor([1, 2, 3], device="tpu")
    assert ints.clamp(0.0, 1.0).dtype == torch.float32 and ints.clamp(0, 1).dtype == torch.int64
    assert ints.clamp(max=2).dtype == torch.int64 and ints.clamp(max=2.0).dtype == torch.float32
    x = torch.tensor([-1.0, 2.0], device="tpu")
    assert x.clamp(min=0.0).reciprocal().cpu().tolist() == [math.inf, 0.5]
    assert x.clamp(min=-0.0).reciprocal().cpu().tolist() == [-math.inf, 0.5]


_NEW_WIDTHS = itertools.count()


def test_nonzero_of_a_new_count_compiles_one_slice():
    """A MoE layer's per-expert `torch.where(mask)` meets a new count of routed tokens at each expert. Through
    `jnp.nonzero` each new count compiled five programs, two of them int64 divisions (5-7 s each on a TPU v5e);
    now only the first rows of the coordinates, already computed for the mask's shape, are taken anew."""
    from jax._src import monitoring

    compiled = []

    def on_duration(event, seconds, **kwargs):
        if event.endswith("backend_compile_duration"):
            compiled.append(kwargs.get("fun_name"))

    width = 41 + next(_NEW_WIDTHS)  # a shape no earlier run of this test compiled for (each mode runs it)
    mask = torch.zeros(3, width, dtype=torch.bool)
    mask[0, 0] = mask[2, -1] = True
    assert torch.equal(torch.nonzero(mask.to("tpu")).cpu(), torch.nonzero(mask))  # this shape's programs
    monitoring.register_event_duration_secs_listener(on_duration)
    try:
        for count in (5, 9):
            mask[1, :count] = True
            rows, columns = torch.where(mask.to("tpu"))
            expected_rows, expected_columns = torch.where(mask)
            assert torch.equal(rows.cpu(), expected_rows) and torch.equal(columns.cpu(), expected_columns)
    finally:
        monitoring.unregister_event_duration_listener(on_duration)
    slices = [name for name in compiled if "first_rows" in name]
    assert len(slices) == 2 and not {"floor_divide", "remainder", "cumsum"} & set(compiled), compiled


def test_rows_read_and_written_in_a_loop_share_one_program(monkeypatch):
    """`w[i]` in a loop (Transformers' eager Mixture-of-Experts layer takes each expert's weights so): the first
    two rows' offsets are compiled into their programs, every later row is read at a start its program is
    given. With every offset compiled in, each i compiled its own program for the row and for each op that
    read it. Writes through a row or a column take the same path. As in a process that never sharded an array:
    once one has been, every offset stays compiled in (a sharding test earlier in the same worker)."""
    import hf_tpu
    from hf_tpu.memory import buffer

    monkeypatch.setattr(buffer, "sharded_arrays_exist", False)

    weights = torch.randn(9, 3, 4)
    on_tpu = weights.to("tpu")
    ones = torch.ones(3, 4, device="tpu")
    ones.cpu()
    compiles = []
    for i in range(1, 9):
        before = hf_tpu.metrics()["compiles"]
        row = (on_tpu[i] * 2 + ones).cpu()
        compiles.append(hf_tpu.metrics()["compiles"] - before)
        assert torch.equal(row, weights[i] * 2 + 1)
    assert compiles[3:] == [0] * 5, compiles
    for i in range(1, 9):
        on_tpu[i].add_(ones)
    for i in range(1, 4):
        on_tpu[:, 1, i].mul_(3)
    before = hf_tpu.metrics()["compiles"]
    on_tpu[7].add_(ones)
    on_tpu[:, 2, 3].mul_(3)
    on_tpu.cpu()
    assert hf_tpu.metrics()["compiles"] - before <= 1  # deferred: the graph of these two writes
    weights[1:] += 1
    weights[:, 1, 1:4] *= 3
    weights[7] += 1
    weights[:, 2, 3] *= 3
    assert torch.equal(on_tpu.cpu(), weights)


def test_views_of_one_buffer_in_one_order_slice_one_transposed_array():
    """Rotary embeddings read q = x.view(b, s, h, d).transpose(1, 2) whole and as its two halves. Each half is a
    slice of the transposed array behind an optimization barrier, which XLA then computes once and keeps whole,
    not a slice transposed on its own; and no read keeps a trailing dim of size 1 for the contiguous innermost one
    (on a TPU, the minor dim of its tiles). A view of a small part of its buffer is sliced before its transpose,
    which XLA:CPU would otherwise make of the whole."""
    import jax
    from hf_tpu.memory import buffer, tensor_views

    x = torch.randn(2 * 16, 4 * 64)
    on_tpu = x.to("tpu")
    q, q_tpu = (t.view(2, 16, 4, 64).transpose(1, 2) for t in (x, on_tpu))
    halves, halves_tpu = ((t[..., 32:], t[..., :32]) for t in (q, q_tpu))
    buf = buffer.buffer_of(on_tpu)
    views = [tensor_views.view_of(t, buf) for t in (q_tpu, *halves_tpu)]
    jaxpr = jax.make_jaxpr(lambda a: [tensor_views.read(a, view) for view in views])(buf.value()).jaxpr
    transposed = [e.invars[0].aval.shape for e in jaxpr.eqns if e.primitive.name == "transpose"]
    assert transposed and all(shape == (2, 16, 4, 64) for shape in transposed), transposed
    # each transposed array is kept whole behind a barrier, which the slices read
    kept = {e.outvars[0] for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"
            and any(e.invars[0] is t.outvars[0] for t in jaxpr.eqns if t.primitive.name == "transpose")}
    assert all(e.invars[0] in kept for e in jaxpr.eqns if e.primitive.name == "slice") and len(kept) == 3, jaxpr
    assert all(v.aval.shape[-1:] != (1,) for e in jaxpr.eqns for v in e.outvars), jaxpr
    for expected, got in zip((q, *halves), (q_tpu, *halves_tpu)):
        assert torch.equal(got.cpu(), expected)
    # a view taking a small part of its buffer is sliced first: the transpose is of that part only
    y = torch.randn(8, 8, 8, 8)
    part, part_tpu = (t.permute(3, 2, 1, 0)[1] for t in (y, y.to("tpu")))
    buf = buffer.buffer_of(part_tpu)
    jaxpr = jax.make_jaxpr(lambda a: tensor_views.read(a, tensor_views.view_of(part_tpu, buf)))(buf.value()).jaxpr
    assert [e.invars[0].aval.shape for e in jaxpr.eqns if e.primitive.name == "transpose"] == [(8, 8, 8)]
    assert torch.equal(part_tpu.cpu(), part)


def test_an_uploaded_tensor_reads_back_without_waiting_for_the_device(monkeypatch):
    """A small tensor read back as it was uploaded (a prompt's ids, a tokenized batch) is copied from the values
    uploaded, not read from the device; the copy is the caller's, and once the tensor is written in place its
    values come from the device."""
    import jax

    source = torch.arange(12)
    t = source.to("tpu")
    reads = []
    device_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(1) or device_get(x))
    back = t.cpu()
    back.add_(100)
    assert torch.equal(t.cpu(), source) and t.sum().item() == 66
    assert reads == [1]  # the sum, a result of the device's; the two copies of `t` read nothing
    t.add_(1)
    assert torch.equal(t.cpu(), source + 1) and len(reads) == 2


def test_an_upload_of_values_just_read_back_is_the_array_they_were_read_from(monkeypatch):
    """The round trip `generate()` makes with a tpu prompt (its ids read to the host, then uploaded again by
    Transformers) uploads nothing the second way: equal values are the array they were read from, which no write
    to either tensor changes. Other values, and values whose array is gone or was donated, are uploaded."""
    import gc

    from hf_tpu.memory import buffer, host_transfers

    uploads = []
    upload = host_transfers._upload
    monkeypatch.setattr(host_transfers, "_upload", lambda *args: uploads.append(args[0].copy()) or upload(*args))
    torch.tpu.empty_cache()  # the uploads an earlier test kept (equal values recur: they would not be uploaded)
    computed = torch.arange(300).to("tpu") * 3 + 1
    torch.tpu.synchronize()  # deferred: its numbers are uploaded when it is computed
    uploads.clear()
    host = computed.cpu()
    again = host.clone().to("tpu")
    assert not uploads and buffer.buffer_of(again).array is buffer.buffer_of(computed).array
    again.add_(1)
    assert torch.equal(computed.cpu(), host) and torch.equal(again.cpu(), host + 1)
    assert torch.equal((host + 5).to("tpu").cpu(), host + 5) and len(uploads) == 1

    gone = (torch.arange(300).to("tpu") * 7).cpu()
    gc.collect()  # the array it was read from held by no tensor any more
    uploads.clear()
    assert torch.equal(gone.to("tpu").cpu(), gone) and len(uploads) == 1

    donated = torch.arange(300).to("tpu") * 11
    host = donated.cpu()
    buffer.buffer_of(donated).array.delete()  # as a program given it to overwrite leaves it
    uploads.clear()
    assert torch.equal(host.to("tpu").cpu(), host) and len(uploads) == 1
