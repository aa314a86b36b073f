"""step_paddle against the NumPy reference, byte for byte, on every place.

States come from a fake FastDeploy decode loop run under a tight decoder
pool (so preemption, recovery and shortfall all happen), from hand-built edge
cases, and from random states that no loop would produce (bounds rules).
"""

import numpy as np
import paddle
import pytest

import paddle_step
from paddle_step.spec.tensor_table import STEP_PADDLE_TENSORS
from paddle_step.testing import step_paddle_cases as cases
from paddle_step.testing.fake_decode_loop import FakeDecodeLoop, add_preempted, make_state
from paddle_step.testing.paddle_ops import run_step_paddle as run_op
from paddle_step.testing.ref_step_paddle import ref_step_paddle
from paddle_step.testing.step_paddle_cases import assert_same_bytes


@pytest.mark.parametrize("name", list(cases.CASES))
def test_matches_reference(place, name):
    cases.CASES[name](run_op)


@pytest.mark.parametrize("step_idx", [np.iinfo(np.int64).min, -5, 0, 1, 30, np.iinfo(np.int64).max])
def test_recovery_with_extreme_step_idx(place, step_idx):
    # Index arithmetic on step_idx must neither overflow nor leave the rows.
    state = make_state(2, 6, 24, free_list=[10, 11, 12])
    add_preempted(state, 1, encoder_blocks=[0], used_list_len=1, prompt_len=2, step_idx=3)
    state["step_idx"][1] = step_idx
    assert_same_bytes(run_op(state, 4), ref_step_paddle(state, 4))


def test_stopped_preempted_slot_is_never_needy(place):
    # FastDeploy's own test state: a preempted slot whose seq_lens_this_time was
    # left at 1. Counting it as needy gave it block 12, which recovery then lost
    # by rebuilding its table over the same columns.
    state = make_state(1, 4, 16, free_list=[10, 11, 12])
    state["stop_flags"][0] = True
    state["is_block_step"][0] = True
    state["seq_lens_this_time"][0] = 1
    state["seq_lens_decoder"][0] = 4
    state["block_tables"][0] = [0, -1, -1, -1]
    state["encoder_block_lens"][0] = 1
    state["used_list_len"][0] = 0
    state["step_block_list"][0] = 0
    state["step_lens"][0] = 1
    state["ori_seq_lens_encoder"][0] = 3
    state["step_idx"][0] = 2
    got = run_op(state, 4)
    assert_same_bytes(got, ref_step_paddle(state, 4))
    assert list(got["block_tables"][0]) == [0, 12, -1, -1]
    assert got["used_list_len"][0] == 1 and got["free_list_len"][0] == 2
    assert sorted(got["free_list"][:2]) == [10, 11]


@pytest.mark.needs_paddle3
def test_inside_to_static_matches_dynamic():
    loop = FakeDecodeLoop(7, 64, 4, 16, 16, 40, seed=11, num_requests=20)
    for _ in range(30):
        loop.host_update()
        loop.load(run_op(loop.state(), 4))
    state = loop.state()
    expected = ref_step_paddle(state, 4)
    tensors = [paddle.to_tensor(state[name]) for name in STEP_PADDLE_TENSORS]

    @paddle.jit.to_static(full_graph=True)
    def step(tensors):
        paddle_step.step_paddle(*tensors, 4, 0)
        return tensors[0]

    step(tensors)
    got = {name: tensor.numpy() for name, tensor in zip(STEP_PADDLE_TENSORS, tensors)}
    assert_same_bytes(got, expected)


def valid_state():
    return make_state(3, 4, 16, free_list=[7, 6, 5])


# (argument, bad value, what the error says was expected, what it says came)
BAD_INPUTS = [
    ("stop_flags", np.zeros(3, np.int32), "dtype bool", "dtype int32"),
    ("block_tables", np.zeros((3, 4), np.int64), "dtype int32", "dtype int64"),
    ("input_ids", np.zeros((3, 16), np.int32), "dtype int64", "dtype int32"),
    ("seq_lens_decoder", np.zeros(4, np.int32), "shape [3] or [3, 1]", "shape [4]"),
    ("is_block_step", np.zeros((3, 1), np.bool_), "shape [3]", "shape [3, 1]"),
    ("block_tables", np.zeros(3, np.int32), "shape [3, -1]", "shape [3]"),
    ("free_list_len", np.zeros(2, np.int32), "shape [1]", "shape [2]"),
    ("pre_ids", np.zeros((2, 16), np.int64), "shape [3, -1]", "shape [2, 16]"),
    ("free_list", np.zeros((3, 1), np.int32), "shape [-1]", "shape [3, 1]"),
]


@pytest.mark.parametrize(
    "name,value,expected,got",
    BAD_INPUTS,
    ids=[f"{case[0]}-{i}" for i, case in enumerate(BAD_INPUTS)],
)
def test_bad_input_raises_before_writing(name, value, expected, got):
    state = valid_state()
    state[name] = value
    tensors = {key: paddle.to_tensor(array) for key, array in state.items()}
    with pytest.raises(ValueError) as raised:
        paddle_step.step_paddle(*(tensors[key] for key in STEP_PADDLE_TENSORS), 4, 0)
    assert str(raised.value) == (
        f"paddle_step.step_paddle: argument '{name}': expected {expected}, got {got}"
    )
    for key, tensor in tensors.items():
        np.testing.assert_array_equal(tensor.numpy(), state[key], err_msg=key)


def test_bad_block_size_raises():
    state = valid_state()
    tensors = [paddle.to_tensor(state[name]) for name in STEP_PADDLE_TENSORS]
    with pytest.raises(
        ValueError, match="argument 'block_size': expected a positive integer, got 0"
    ):
        paddle_step.step_paddle(*tensors, 0, 0)


@pytest.mark.needs_paddle3
def test_bad_input_raises_in_static_mode():
    state = valid_state()
    state["used_list_len"] = state["used_list_len"].astype(np.int64)
    tensors = [paddle.to_tensor(state[name]) for name in STEP_PADDLE_TENSORS]

    @paddle.jit.to_static(full_graph=True)
    def step(tensors):
        paddle_step.step_paddle(*tensors, 4, 0)
        return tensors[0]

    with pytest.raises(ValueError, match="argument 'used_list_len': expected dtype int32"):
        step(tensors)


@pytest.mark.parametrize(
    "position,value,message",
    [(5, None, "'block_tables': expected a paddle.Tensor, got NoneType"),
     (22, "4", "'block_size': expected an int, got str")],
)  # fmt: skip
def test_an_argument_of_the_wrong_kind_is_named(position, value, message):
    """pybind11 alone answers with every signature it knows and the tensors' contents."""
    state = valid_state()
    arguments = [paddle.to_tensor(state[name]) for name in STEP_PADDLE_TENSORS] + [4, 0]
    arguments[position] = value
    with pytest.raises(TypeError) as raised:
        paddle_step.step_paddle(*arguments)
    assert str(raised.value) == f"paddle_step.step_paddle: argument {message}"
