"""How a linear layer's product reaches XLA: its input contracted in the input's own shape
(`hf_tpu.memory.tensor_views.Flattened`), and on a TPU a bfloat16 product of many rows asked for in bfloat16
(`hf_tpu.ops.products._product_dtype`). Both decide the layouts XLA gives a model on a TPU; the values match
PyTorch's on the CPU either way."""

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

from hf_tpu import platform
from hf_tpu.memory import buffer, tensor_views
from hf_tpu.ops import products

_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}

# (input shape, the product of it): Transformers' linear layers and the views before them
_PRODUCTS = {
    "linear of (batch, tokens, features)": ((2, 5, 24), lambda x, w, b: F.linear(x, w)),
    "linear with a bias": ((2, 5, 24), lambda x, w, b: F.linear(x, w, b)),
    "linear of (batch, tokens, heads, dim) viewed whole": ((2, 5, 4, 6), lambda x, w, b: F.linear(x.view(2, 5, 24), w)),
    "mm of a flattened 4-d input": ((3, 2, 5, 24), lambda x, w, b: x.reshape(30, 24) @ w.t()),
    "linear of a transposed input (no flattened view)": ((5, 2, 24), lambda x, w, b: F.linear(x.transpose(0, 1), w)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("product", list(_PRODUCTS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_linear_layer_matches_the_cpus(product, dtype, compiled):
    torch.manual_seed(0)
    shape, fn = _PRODUCTS[product]
    x, w, b = torch.randn(shape, dtype=dtype), torch.randn(7, 24, dtype=dtype), torch.randn(7, dtype=dtype)
    expected = fn(x, w, b)
    run = torch.compile(fn, backend="tpu") if compiled else fn
    actual = run(x.to("tpu"), w.to("tpu"), b.to("tpu"))
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.cpu(), expected, **_TOLERANCE[dtype])


def test_a_linear_layers_input_is_contracted_in_its_own_shape(monkeypatch):
    """The product's left side is the input's buffer in its own shape, not a (tokens, features) copy of it."""
    seen = []
    dot = products.dot
    monkeypatch.setattr(products, "dot", lambda a, b, *rest: seen.append(a.shape) or dot(a, b, *rest))
    x, w = torch.randn(3, 11, 13).to("tpu"), torch.randn(17, 13).to("tpu")  # shapes no other test builds
    torch.testing.assert_close(F.linear(x, w).cpu(), F.linear(x.cpu(), w.cpu()), rtol=1e-5, atol=1e-5)
    assert seen == [(3, 11, 13)]


def test_which_views_are_flattened_inputs():
    def view(t):
        return tensor_views.view_of(t, buffer.buffer_of(t))

    x = torch.zeros(2, 5, 4, 6, device="tpu")
    assert tensor_views.flattened_shape(view(x.view(10, 24)), x.shape, x.dtype) == (2, 5, 24)
    assert tensor_views.flattened_shape(view(x.view(40, 6)), x.shape, x.dtype) == (2, 5, 4, 6)
    # one leading dim: a plain matrix
    assert tensor_views.flattened_shape(view(x.view(2, 120)), x.shape, x.dtype) is None
    assert tensor_views.flattened_shape(view(x.view(10, 24)[1:]), x.shape, x.dtype) is None  # not the whole buffer
    assert tensor_views.flattened_shape(view(x.view(10, 24).t()), x.shape, x.dtype) is None  # transposed


@pytest.mark.parametrize("name", ["tpu", "cpu", "gpu"])
def test_a_bfloat16_product_of_many_rows_is_asked_for_in_bfloat16_on_a_tpu_alone(monkeypatch, name):
    monkeypatch.setattr(platform, "name", lambda: name)
    many, few = products._BFLOAT16_PRODUCT_ROWS, products._BFLOAT16_PRODUCT_ROWS - 1
    assert products._product_dtype(jnp.bfloat16, many) == (jnp.bfloat16 if name == "tpu" else jnp.float32)
    assert products._product_dtype(jnp.bfloat16, few) == jnp.float32
    assert products._product_dtype(jnp.float16, many) == jnp.float32
    assert products._product_dtype(jnp.float32, many) == jnp.float32
    assert products._product_dtype(jnp.int8, many) == jnp.int32


def test_a_products_rows_are_its_left_sides_elements_per_contracted_element(monkeypatch):
    """A linear layer's input of (batch, tokens, features), contracted in its own shape (`tensor_views.Flattened`), has
    batch * tokens rows: 8x1024 asks for bfloat16 on a TPU, 1x1024 for float32."""
    monkeypatch.setattr(platform, "name", lambda: "tpu")
    weight = jnp.ones((4, 3), jnp.bfloat16)

    def asked_for(batch, tokens):
        x = jnp.ones((batch, tokens, 4), jnp.bfloat16)
        eqns = jax.make_jaxpr(lambda x, w: products.dot(x, w, (((2,), (0,)), ((), ()))))(x, weight).jaxpr.eqns
        return [e.params["preferred_element_type"] for e in eqns if e.primitive.name == "dot_general"]

    assert asked_for(8, 1024) == [jnp.bfloat16]
    assert asked_for(1, 1024) == [jnp.float32]


def test_a_product_with_an_epilogue_is_rounded_once_on_a_tpu_too(monkeypatch):
    """On a TPU `mm` of many rows asks for a bfloat16 product; `addmm` (a linear layer with a bias) and `mm` with an
    out_dtype ask for float32, so the bias is added, or the dtype given, before the one rounding."""
    monkeypatch.setattr(platform, "name", lambda: "tpu")
    a = jnp.ones((products._BFLOAT16_PRODUCT_ROWS, 8), jnp.bfloat16)
    b, bias = jnp.ones((8, 3), jnp.bfloat16), jnp.ones((3,), jnp.bfloat16)

    def asked_for(fn, *args):
        eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
        return [e.params["preferred_element_type"] for e in eqns if e.primitive.name == "dot_general"]

    assert asked_for(products.mm, a, b) == [jnp.bfloat16]
    assert asked_for(products.addmm, bias, a, b) == [jnp.float32]
    assert asked_for(lambda a, b: products.mm_out_dtype(a, b, torch.float32), a, b) == [jnp.float32]
    assert asked_for(products.addmv, bias, b.T, a[0]) == [jnp.float32]


def _equations(jaxpr):
    """Every equation of a jaxpr, those of the jaxprs nested in it (a jitted lowering's) included."""
    for equation in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield equation
        for value in equation.params.values():
            if hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns"):
                yield from _equations(value)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_out_dtype_int32_of_int8_matrices_is_an_int8_product(traced):
    """`out_dtype(mm, int32, a, b)` of int8 matrices (torchao's int8 layers) gives the exact int32 product, from a
    dot of the int8 operands asked for in int32 (the TPU's int8 matrix unit), not of int32 copies of them."""
    import hf_tpu
    from hf_tpu import direct
    from torch._higher_order_ops.out_dtype import out_dtype

    torch.manual_seed(0)
    a = torch.randint(-128, 128, (5, 64), dtype=torch.int8)
    b = torch.randint(-128, 128, (64, 8), dtype=torch.int8)
    product = lambda a, b: out_dtype(torch.ops.aten.mm.default, torch.int32, a, b)  # noqa: E731
    direct.reset()
    run = hf_tpu.jit(product) if traced else product
    actual = run(a.to("tpu"), b.to("tpu"))
    assert actual.dtype == torch.int32 and torch.equal(actual.cpu(), a.int() @ b.int())
    if traced:
        (program,) = direct._programs.values()
        dots = [e for e in _equations(program.jaxpr) if e.primitive.name == "dot_general"]
        assert [str(v.aval.dtype) for e in dots for v in e.invars] == ["int8", "int8"]
        assert [e.params["preferred_element_type"] for e in dots] == [jnp.int32]
        assert [e.params["precision"] for e in dots] == [None]  # a float product's setting, not an integer one's


@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, None), (torch.float16, "HIGHEST"),
                                              (torch.float32, "HIGHEST")])
def test_only_bfloat16_products_ask_for_no_precision(dtype, precision):
    """A bfloat16 product is exact in the float32 accumulator at any precision, and "highest" on bfloat16 operands
    made XLA's TPU program bigger for the same values (`products.product_precision`); float16 and float32
    products keep the float32 matmul precision ("highest" by default), linear layers and convolutions alike."""
    import hf_tpu

    x, w = torch.randn(4, 8, dtype=dtype, device="tpu"), torch.randn(16, 8, dtype=dtype, device="tpu")
    image, kernel = torch.randn(1, 2, 5, 5, dtype=dtype, device="tpu"), torch.randn(3, 2, 3, 3, dtype=dtype,
                                                                                     device="tpu")
    text = hf_tpu.jit(lambda x, w, image, kernel: (F.linear(x, w), F.conv2d(image, kernel))).lower(
        x, w, image, kernel).as_text()
    asked = [line for line in text.splitlines() if "dot_general" in line or "convolution" in line]
    assert len(asked) == 2
    assert all(("precision = [HIGHEST, HIGHEST]" in line or "precision_config = [#stablehlo<precision HIGHEST>"
                in line) == (precision == "HIGHEST") for line in asked), asked
