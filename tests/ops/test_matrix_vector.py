"""Half-precision matrix-vector products: on the CPU platform the vector side is multiplied as two rows
(`hf_tpu.ops.products._vector_as_two_rows`), which XLA:CPU runs without a float32 copy of the matrix; elsewhere the
product is left as it is. The products match PyTorch's on the CPU in every form a vector takes (a row, a column,
a 1-D tensor, one row per batch), and on the CPU platform the compiled program converts no matrix to float32."""

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

from hf_tpu import platform
from hf_tpu.ops import products

_ON_CPU = platform.name() == "cpu"

# bfloat16 and float16 products accumulate in float32 and round once, as PyTorch's CPU kernels do
_TOLERANCE = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=1e-3, atol=1e-3)}

_PRODUCTS = {
    "linear of one row": lambda x, w: F.linear(x[:1], w),
    "linear of one token": lambda x, w: F.linear(x[None, :1], w),
    "matmul of a 1-D vector": lambda x, w: torch.matmul(x[0], w.T),
    "mv": lambda x, w: torch.mv(w, x[0]),
    "matrix times a column": lambda x, w: w @ x[:1].T,
    "bmm of one row per batch": lambda x, w: torch.bmm(x[:2, None], w.T.expand(2, -1, -1)),
    "addmv": lambda x, w: torch.addmv(w[:, 0], w, x[0]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("product", list(_PRODUCTS))
def test_a_half_precision_matrix_vector_product_matches_the_cpus(product, dtype):
    torch.manual_seed(0)
    x, w = torch.randn(3, 64, dtype=dtype), torch.randn(96, 64, dtype=dtype)
    expected = _PRODUCTS[product](x, w)
    actual = _PRODUCTS[product](x.to("tpu"), w.to("tpu"))
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.cpu(), expected, **_TOLERANCE[dtype])


@pytest.mark.parametrize("sides", [((1, 64), (96, 64), 0), ((96, 64), (1, 64), 1), ((64,), (96, 64), 0),
                                   ((96, 64), (64,), 1)])
def test_the_matrix_is_not_converted_to_float32_on_the_cpu(sides):
    """On the CPU platform the vector goes in as two rows: the optimized program holds no float32 matrix of the
    weight's shape (XLA:CPU's matrix-vector path made one at every call). Elsewhere nothing is padded."""
    vector_shape, matrix_shape, vector_side = sides
    a, b = jnp.ones(vector_shape, jnp.bfloat16), jnp.ones(matrix_shape, jnp.bfloat16)
    contracting = (a.ndim - 1, b.ndim - 1)
    dimension_numbers = (((contracting[0],), (contracting[1],)), ((), ()))
    padded = products._half_precision_vector_on_cpu(a, b, dimension_numbers)
    assert padded == (vector_side if _ON_CPU else None)
    product = jax.jit(lambda a, b: products.dot(a, b, dimension_numbers))
    assert product(a, b).shape == jax.eval_shape(
        lambda a, b: jax.lax.dot_general(a, b, dimension_numbers), a, b).shape
    if _ON_CPU:
        assert "f32[96,64]" not in product.lower(a, b).compile().as_text()


def test_float32_and_matrix_products_are_left_as_they_are():
    """A float32 vector takes XLA:CPU's vector path, which is the faster one there; two matrices are not padded."""
    dimension_numbers = (((1,), (1,)), ((), ()))
    assert products._half_precision_vector_on_cpu(jnp.ones((1, 64)), jnp.ones((96, 64)), dimension_numbers) is None
    assert products._half_precision_vector_on_cpu(
        jnp.ones((2, 64), jnp.bfloat16), jnp.ones((96, 64), jnp.bfloat16), dimension_numbers) is None
