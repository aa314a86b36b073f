"""The two tables of step_paddle's 22 tensors agree: the C++ one (ops/include/
step_paddle_tensors.h, exported by the op library) and the Python one
(paddle_step.spec.tensor_table)."""

import numpy as np

import paddle_step_ops
from paddle_step.spec.tensor_table import SHAPE_KINDS, STEP_PADDLE_TABLE

# The C++ shape kinds name fewer cases: one kBatchRows for every [B, any] tensor.
CPP_SHAPE_KIND = {
    "[B]": "kBatchOnly",
    "[B or B,1]": "kBatchVector",
    "[B,M]": "kBatchRows",
    "[B,L]": "kBatchRows",
    "[B,P]": "kBatchRows",
    "[N]": "kList",
    "[1]": "kCounter",
}


def test_every_python_shape_kind_has_a_cpp_kind():
    assert set(CPP_SHAPE_KIND) == set(SHAPE_KINDS)


def test_cpp_table_equals_python_table():
    cpp_rows = [
        (name, np.dtype(dtype), shape, written)
        for name, dtype, shape, written in paddle_step_ops.step_paddle_tensor_table()
    ]
    python_rows = [
        (spec.name, spec.dtype, CPP_SHAPE_KIND[spec.shape], spec.written)
        for spec in STEP_PADDLE_TABLE
    ]
    assert cpp_rows == python_rows
    assert len(cpp_rows) == 22
