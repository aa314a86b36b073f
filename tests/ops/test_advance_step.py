"""advance_step against the NumPy reference, on every place, plus bad input."""

import numpy as np
import paddle
import pytest

import paddle_step
from paddle_step.testing import advance_step_cases as cases
from paddle_step.testing.advance_step_cases import ADVANCE_STEP_OUTPUTS, assert_same, make_case
from paddle_step.testing.paddle_ops import run_advance_step as run_op
from paddle_step.testing.ref_advance_step import ref_advance_step


@pytest.mark.parametrize("num_seqs", cases.MATRIX["num_seqs"])
@pytest.mark.parametrize("block_size", cases.MATRIX["block_size"])
@pytest.mark.parametrize("seq_lens_dtype", cases.MATRIX["seq_lens_dtype"])
@pytest.mark.parametrize("tables_dtype", cases.MATRIX["tables_dtype"])
@pytest.mark.parametrize("with_active", cases.MATRIX["with_active"])
def test_matches_reference(place, num_seqs, block_size, seq_lens_dtype, tables_dtype, with_active):
    cases.matches_reference(run_op, num_seqs, block_size, seq_lens_dtype, tables_dtype, with_active)


@pytest.mark.parametrize("name", list(cases.FIXED_CASES))
def test_fixed_cases(place, name):
    cases.FIXED_CASES[name](run_op)


@pytest.mark.needs_paddle3
def test_in_place_inside_to_static():
    case, _ = make_case(9, 5, 16, np.int64, np.int32, False, np.random.default_rng(1))
    expected = ref_advance_step(**case, num_seqs=9, num_queries=5, block_size=16)
    tensors = {name: paddle.to_tensor(value) for name, value in case.items()}

    @paddle.jit.to_static(full_graph=True)
    def advance(input_tokens, sampled, positions, seq_lens, slots, tables):
        paddle_step.advance_step(
            input_tokens, sampled, positions, seq_lens, slots, tables, 9, 5, 16
        )
        return seq_lens

    returned = advance(*tensors.values())  # make_case's keys are in the op's order
    assert_same([tensors[name].numpy() for name in ADVANCE_STEP_OUTPUTS], expected)
    np.testing.assert_array_equal(returned.numpy(), expected[2])


def test_library_exposes_every_op():
    import paddle_step_ops

    for name in ("advance_step", "step_paddle", "static_op_advance_step", "static_op_step_paddle"):
        assert callable(getattr(paddle_step_ops, name)), name


def valid_tensors(num_seqs=4, num_queries=3):
    case, _ = make_case(
        num_seqs, num_queries, 16, np.int32, np.int32, False, np.random.default_rng(2)
    )
    return {name: paddle.to_tensor(value) for name, value in case.items()}


# A table: one entry a line or two, not reflowed.
# fmt: off
BAD_INPUTS = [
    # (what to change, keyword overrides, expected message fragment)
    ("input_tokens dtype", {"input_tokens": paddle.zeros([4], "int32")},
     "argument 'input_tokens': expected dtype int64, got dtype int32"),
    ("sampled dtype", {"sampled_token_ids": paddle.zeros([3, 1], "float32")},
     "argument 'sampled_token_ids': expected dtype int64, got dtype float32"),
    ("seq_lens dtype", {"seq_lens": paddle.zeros([4], "float32")},
     "argument 'seq_lens': expected dtype int32 or int64, got dtype float32"),
    ("block_tables dtype", {"block_tables": paddle.zeros([4, 5], "int16")},
     "argument 'block_tables': expected dtype int32 or int64, got dtype int16"),
    ("input_positions shape", {"input_positions": paddle.zeros([5], "int64")},
     "argument 'input_positions': expected shape [4], got shape [5]"),
    ("slot_mapping rank", {"slot_mapping": paddle.zeros([4, 1], "int64")},
     "argument 'slot_mapping': expected shape [4], got shape [4, 1]"),
    ("sampled rows", {"sampled_token_ids": paddle.zeros([2, 1], "int64")},
     "argument 'sampled_token_ids': expected shape [3] or [3, 1], got shape [2, 1]"),
    ("block_tables rank", {"block_tables": paddle.zeros([4], "int32")},
     "argument 'block_tables': expected shape [4, -1], got shape [4]"),
    ("block_size", {"block_size": 0},
     "argument 'block_size': expected a positive integer, got 0"),
    ("num_queries > num_seqs", {"num_queries": 5},
     "argument 'num_queries': expected at most num_seqs (4), got 5"),
    ("num_queries", {"num_queries": 0},
     "argument 'num_queries': expected a positive integer, got 0"),
    ("num_seqs vs tensors", {"num_seqs": 3},
     "argument 'input_tokens': expected shape [3], got shape [4]"),
    ("active dtype", {"active": paddle.zeros([4], "int32")},
     "argument 'active': expected dtype bool, got dtype int32"),
    ("active shape", {"active": paddle.zeros([3], "bool")},
     "argument 'active': expected shape [4], got shape [3]"),
]
# fmt: on


@pytest.mark.parametrize(
    "label,overrides,message", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS]
)
def test_bad_input_raises_before_writing(label, overrides, message):
    tensors = valid_tensors()
    before = {name: tensor.numpy().copy() for name, tensor in tensors.items()}
    arguments = dict(tensors, num_seqs=4, num_queries=3, block_size=16, active=None)
    arguments.update(overrides)
    with pytest.raises(ValueError) as raised:
        paddle_step.advance_step(**arguments)
    assert str(raised.value) == "paddle_step.advance_step: " + message
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(tensor.numpy(), before[name], err_msg=name)


@pytest.mark.needs_paddle3
def test_bad_input_raises_in_static_mode():
    tensors = valid_tensors()

    @paddle.jit.to_static(full_graph=True)
    def advance(input_tokens, sampled, positions, seq_lens, slots, tables):
        paddle_step.advance_step(
            input_tokens, sampled, positions, seq_lens, slots, tables, 4, 3, 16
        )
        return seq_lens

    with pytest.raises(Exception, match="argument 'seq_lens': expected dtype int32 or int64"):
        advance(
            tensors["input_tokens"],
            tensors["sampled_token_ids"],
            tensors["input_positions"],
            paddle.zeros([4], "float32"),
            tensors["slot_mapping"],
            tensors["block_tables"],
        )


@pytest.mark.parametrize(
    "overrides,message",
    [({"seq_lens": np.zeros(4, np.int32)}, "'seq_lens': expected a paddle.Tensor, got ndarray"),
     ({"active": [True] * 4}, "'active': expected a paddle.Tensor or None, got list"),
     ({"block_size": 16.0}, "'block_size': expected an int, got float")],
)  # fmt: skip
def test_an_argument_of_the_wrong_kind_is_named(overrides, message):
    """pybind11 alone answers with every signature it knows and the tensors' contents."""
    arguments = dict(valid_tensors(), num_seqs=4, num_queries=3, block_size=16, active=None)
    arguments.update(overrides)
    with pytest.raises(TypeError) as raised:
        paddle_step.advance_step(**arguments)
    assert str(raised.value) == f"paddle_step.advance_step: argument {message}"


def test_the_named_arguments_are_the_signatures():
    """The wrong-kind message looks the ops' arguments up by these names."""
    import inspect

    from paddle_step import ops

    for function, names in [(ops.advance_step, ops._ADVANCE_STEP_ARGUMENTS),
                            (ops.step_paddle, ops._STEP_PADDLE_ARGUMENTS)]:  # fmt: skip
        assert tuple(inspect.signature(function).parameters) == names
