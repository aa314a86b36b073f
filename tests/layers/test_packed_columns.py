"""``cpu_linear.columns``: columns of packed weights read straight from the panels (the
embedding lookup of a model whose embedding exists only as its packed LM head), against
NumPy's rounding and quantization of the same weights."""

import numpy as np
import paddle
import pytest

from paddle_step.layers import cpu_linear
from paddle_step.testing.weight_formats import bfloat16_values, int8_values

# K odd and even, N off the 32-column panel width.
SHAPES = ((1, 1), (13, 17), (64, 100), (33, 70), (128, 33))
FORMATS = (("float32", None), ("bfloat16", None), ("int8", None), ("int8", 32))


def expected_values(w, weight_format, group_size):
    if weight_format == "float32":
        return w
    if weight_format == "bfloat16":
        return bfloat16_values(w)
    return int8_values(w, group_size)


@pytest.mark.parametrize("weight_format, group_size", FORMATS)
@pytest.mark.parametrize("k, n", SHAPES)
def test_columns_are_the_values_the_products_use(weight_format, group_size, k, n):
    rng = np.random.default_rng(k * 1000 + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = cpu_linear.pack(w, weight_format, group_size)
    ids = np.array([n - 1, 0, n // 2, 0, *rng.integers(0, n, 5)], dtype=np.int64)
    got = cpu_linear.columns(packed, paddle.to_tensor(ids)).numpy()
    assert got.dtype == np.float32 and got.shape == (len(ids), k)
    np.testing.assert_array_equal(got, expected_values(w, weight_format, group_size).T[ids])
    # The product with the identity reads the same values (exact: one term per output).
    identity = cpu_linear.linear(paddle.eye(k, dtype="float32"), packed).numpy()
    np.testing.assert_array_equal(got, identity.T[ids])
