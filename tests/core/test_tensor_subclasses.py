"""Tensor subclasses that keep their data in inner tensors (PyTorch's `__tensor_flatten__` protocol, as torchao's
quantized weights do) inside `hf_tpu.jit`: their inner tensors are the program's inputs, their flattening's context
is keyed, and a write to an inner tensor is rebound; against the same function run eagerly."""

import logging

import pytest
import torch

import hf_tpu
from hf_tpu import direct


class QuantizedWeight(torch.Tensor):
    """An int8 weight with a scale per row, kept as torchao keeps one: a wrapper whose data is its inner tensors,
    with a list in its flattening's context."""

    @staticmethod
    def __new__(cls, qdata, scale, block_size):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=scale.dtype, device=qdata.device)

    def __init__(self, qdata, scale, block_size):
        self.qdata, self.scale, self.block_size = qdata, scale, block_size

    def __tensor_flatten__(self):
        return ["qdata", "scale"], {"block_size": self.block_size}

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        return QuantizedWeight(inner["qdata"], inner["scale"], context["block_size"])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, weight, bias = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias")
            rows = weight.block_size[0]  # rows sharing one scale
            scale = weight.scale.repeat_interleave(rows)
            y = torch.mm(x.reshape(-1, x.shape[-1]), weight.qdata.t().to(x.dtype)) * scale.to(x.dtype)
            y = y.reshape(*x.shape[:-1], -1)
            return y if bias is None else y + bias
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        weight = args[0]
        if func is torch.ops.aten.detach.default:
            return QuantizedWeight(weight.qdata, weight.scale, weight.block_size)
        if func is torch.ops.aten._to_copy.default:  # a move: the inner tensors move
            device = (kwargs or {}).get("device")
            return QuantizedWeight(weight.qdata.to(device), weight.scale.to(device), weight.block_size)
        if func is torch.ops.aten.slice.Tensor:  # rows take their scales along; a slice of inputs keeps them all
            _, dim, start, end = args[:4]
            scale = weight.scale[start:end] if dim == 0 else weight.scale
            return QuantizedWeight(weight.qdata[start:end] if dim == 0 else weight.qdata[:, start:end], scale,
                                   weight.block_size)
        raise NotImplementedError(f"QuantizedWeight does not implement {func}")


def _quantized_linear(rows_per_scale: int = 1) -> torch.nn.Linear:
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4)
    qdata = torch.randint(-128, 128, (4, 8), dtype=torch.int8)
    scale = torch.rand(4 // rows_per_scale) / 64
    linear.weight = torch.nn.Parameter(QuantizedWeight(qdata, scale, [rows_per_scale, 8]), requires_grad=False)
    return linear


def _on_tpu(linear: torch.nn.Linear) -> torch.nn.Linear:
    weight = linear.weight
    on_tpu = torch.nn.Linear(8, 4, device="tpu")
    on_tpu.weight = torch.nn.Parameter(
        QuantizedWeight(weight.qdata.to("tpu"), weight.scale.to("tpu"), weight.block_size), requires_grad=False)
    on_tpu.bias = torch.nn.Parameter(linear.bias.detach().to("tpu"), requires_grad=False)
    return on_tpu


@pytest.fixture(autouse=True)
def fresh_programs():
    direct.reset()
    yield


@pytest.fixture
def fallbacks(caplog):
    caplog.set_level(logging.WARNING, logger="hf_tpu.compile")
    return lambda: [r.getMessage() for r in caplog.records if "runs without hf_tpu.jit's trace" in r.getMessage()]


def _traced() -> int:
    return hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0)


def test_a_module_with_a_subclass_weight_runs_as_one_program(fallbacks):
    cpu = _quantized_linear()
    tpu = _on_tpu(cpu)
    traced = hf_tpu.jit(lambda x: torch.tanh(tpu(x)), state=(tpu,))
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = torch.tanh(cpu(x))
        hf_tpu.reset_metrics()
        for call in range(2):
            torch.testing.assert_close(traced(x.to("tpu")).cpu(), expected)
            assert _traced() == 1  # traced once, then replayed
    assert not fallbacks()


def test_the_flattening_context_is_keyed():
    tpu = _on_tpu(_quantized_linear())
    traced = hf_tpu.jit(lambda x: tpu(x), state=(tpu,))
    x = torch.randn(3, 8, device="tpu")
    with torch.no_grad():
        traced(x)
        grouped = _quantized_linear(rows_per_scale=2)
        tpu.weight = _on_tpu(grouped).weight  # another block size: another program
        hf_tpu.reset_metrics()
        torch.testing.assert_close(traced(x).cpu(), grouped(x.cpu()))
        assert _traced() == 1


def test_an_inner_tensor_replaced_is_read_anew():
    cpu = _quantized_linear()
    tpu = _on_tpu(cpu)
    traced = hf_tpu.jit(lambda x: tpu(x), state=(tpu,))
    x = torch.randn(3, 8)
    with torch.no_grad():
        traced(x.to("tpu"))
        traced(x.to("tpu"))  # the module's walk is kept and replayed from now on
        cpu.weight.scale = cpu.weight.scale * 2
        tpu.weight.scale = cpu.weight.scale.to("tpu")
        torch.testing.assert_close(traced(x.to("tpu")).cpu(), cpu(x))


def test_an_inner_tensor_written_in_place_is_rebound(fallbacks):
    cpu = _quantized_linear()
    tpu = _on_tpu(cpu)

    def rescale(x):
        tpu.weight.scale.mul_(0.5)
        return tpu(x)

    traced = hf_tpu.jit(rescale, state=(tpu,))
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(2):
            cpu.weight.scale.mul_(0.5)
            torch.testing.assert_close(traced(x.to("tpu")).cpu(), cpu(x))
    torch.testing.assert_close(tpu.weight.scale.cpu(), cpu.weight.scale)
    assert not fallbacks()


def test_a_subclass_made_in_the_trace_is_returned_and_an_input_one_is_itself(fallbacks):
    """A weight quantized inside the trace comes back as a new object of its type over the program's new arrays
    (one program however many ops the quantization takes); one among the inputs comes back as that object."""
    tpu = _on_tpu(_quantized_linear())

    def quantize(weight, rows_per_scale):
        scale = weight.abs().amax(dim=1) / 127
        qdata = torch.round(weight / scale[:, None]).to(torch.int8)
        return QuantizedWeight(qdata, scale[::rows_per_scale], [rows_per_scale, weight.shape[1]])

    weight = torch.randn(4, 8)
    expected = quantize(weight, 2)
    traced = hf_tpu.jit(quantize)
    hf_tpu.reset_metrics()
    for _ in range(2):
        actual = traced(weight.to("tpu"), 2)
        assert type(actual) is QuantizedWeight and actual.block_size == [2, 8]
        assert torch.equal(actual.qdata.cpu(), expected.qdata)
        torch.testing.assert_close(actual.scale.cpu(), expected.scale)
    assert _traced() == 1
    assert hf_tpu.jit(lambda: tpu.weight, state=(tpu,))() is tpu.weight
    assert not fallbacks()


def test_module_to_moves_a_subclass_parameters_inner_tensors():
    """`Module.to("tpu")` swaps each parameter's contents for the moved one's, then puts back the attributes set on
    it: a subclass's data is among its attributes, and stays the moved one's."""
    linear = _quantized_linear()
    weight = linear.weight
    weight.note = "set by a library"
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = linear(x)
        linear.to("tpu")
        assert linear.weight is weight and weight.note == "set by a library"
        assert weight.qdata.device.type == weight.scale.device.type == "tpu"
        torch.testing.assert_close(linear(x.to("tpu")).cpu(), expected)


@pytest.mark.requires_chips(2)
@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_shard_model_splits_a_subclass_inner_tensors_as_its_slicing_does(style):
    import hf_tpu.distributed as dist

    linear = _quantized_linear()
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = linear(x)
        dist.shard_model(linear, {"": style}, dist.mesh(2, "tp"))
        weight = linear.weight
        assert type(weight) is QuantizedWeight
        rows_split = style == "colwise"
        assert dist.sharding(weight.qdata).spec == (("tp", None) if rows_split else (None, "tp"))
        assert dist.sharding(weight.scale).spec == (("tp",) if rows_split else (None,))
        torch.testing.assert_close(linear(x.to("tpu")).cpu(), expected)
        traced = hf_tpu.jit(lambda x: linear(x), state=(linear,))
        torch.testing.assert_close(traced(x.to("tpu")).cpu(), expected)


def test_an_unhashable_dataclass_argument_is_keyed_by_its_fields(fallbacks):
    """torchao passes its settings as dataclasses that are not hashable (`QuantizeTensorToInt8Kwargs`): keyed by
    value, equal settings share a program and other settings trace another."""
    import dataclasses

    @dataclasses.dataclass
    class Settings:
        scale: float
        rows: list

    traced = hf_tpu.jit(lambda x, settings: x * settings.scale + len(settings.rows))
    x = torch.ones(3, device="tpu")
    hf_tpu.reset_metrics()
    assert traced(x, Settings(2.0, [1])).tolist() == [3.0] * 3
    assert traced(x, Settings(2.0, [1])).tolist() == [3.0] * 3
    assert _traced() == 1
    assert traced(x, Settings(3.0, [1, 2])).tolist() == [5.0] * 3
    assert _traced() == 2 and not fallbacks()
