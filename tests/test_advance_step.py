"""advance_step against the NumPy reference, on every place, plus bad input."""

import numpy as np
import paddle
import pytest

import paddle_step
from ref_advance_step import ref_advance_step

OUTPUT_NAMES = ("input_tokens", "input_positions", "seq_lens", "slot_mapping")


def make_case(num_seqs, num_queries, block_size, seq_lens_dtype, tables_dtype,
              with_active, rng):
    """A batch with mapped, unmapped (-1) and past-the-table positions."""
    blocks_per_seq = 5
    max_position = blocks_per_seq * block_size + 3  # some positions past the table
    seq_lens = rng.integers(0, max_position, size=num_seqs).astype(seq_lens_dtype)
    block_tables = rng.integers(0, 50_000, size=(num_seqs, blocks_per_seq))
    block_tables[rng.random(block_tables.shape) < 0.1] = -1
    case = {
        "input_tokens": rng.integers(1, 1000, size=num_seqs).astype(np.int64),
        "sampled_token_ids": rng.integers(1, 50_000, size=(num_queries, 1)).astype(np.int64),
        "input_positions": rng.integers(0, 1000, size=num_seqs).astype(np.int64),
        "seq_lens": seq_lens,
        "slot_mapping": rng.integers(0, 1000, size=num_seqs).astype(np.int64),
        "block_tables": block_tables.astype(tables_dtype),
    }
    active = rng.random(num_seqs) < 0.8 if with_active else None
    return case, active


def run_op(case, active, num_seqs, num_queries, block_size):
    tensors = {name: paddle.to_tensor(value) for name, value in case.items()}
    paddle_step.advance_step(
        tensors["input_tokens"], tensors["sampled_token_ids"],
        tensors["input_positions"], tensors["seq_lens"], tensors["slot_mapping"],
        tensors["block_tables"], num_seqs, num_queries, block_size,
        active=None if active is None else paddle.to_tensor(active))
    return [tensors[name].numpy() for name in OUTPUT_NAMES]


def assert_same(got, expected):
    for name, got_array, expected_array in zip(OUTPUT_NAMES, got, expected):
        assert got_array.dtype == expected_array.dtype, name
        np.testing.assert_array_equal(got_array, expected_array, err_msg=name)


@pytest.mark.parametrize("num_seqs", [1, 7, 256, 4097])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("seq_lens_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("tables_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("with_active", [False, True])
def test_matches_reference(place, num_seqs, block_size, seq_lens_dtype,
                           tables_dtype, with_active):
    rng = np.random.default_rng(num_seqs * 1000 + block_size)
    for num_queries in sorted({num_seqs, max(1, num_seqs // 2), 1}):
        case, active = make_case(num_seqs, num_queries, block_size, seq_lens_dtype,
                                 tables_dtype, with_active, rng)
        expected = ref_advance_step(**case, num_seqs=num_seqs, num_queries=num_queries,
                                    block_size=block_size, active=active)
        assert_same(run_op(case, active, num_seqs, num_queries, block_size), expected)


def test_hand_worked_rows(place):
    # Row 0: position 0 -> block 7, slot 7*4+0. Row 1: position 6 -> column 1,
    # block 9, slot 9*4+2. Row 2: position 8 is past a 2-column table -> -1.
    # Row 3: its column holds -1 -> -1. Row 4: padding (num_queries = 4).
    case = {
        "input_tokens": np.full(5, 11, np.int64),
        "sampled_token_ids": np.array([[101], [102], [103], [104]], np.int64),
        "input_positions": np.full(5, 11, np.int64),
        "seq_lens": np.array([0, 6, 8, 1, 3], np.int32),
        "slot_mapping": np.full(5, 11, np.int64),
        "block_tables": np.array([[7, 8], [3, 9], [1, 2], [-1, 5], [4, 4]], np.int32),
    }
    tokens, positions, seq_lens, slots = run_op(case, None, 5, 4, 4)
    np.testing.assert_array_equal(tokens, [101, 102, 103, 104, 0])
    np.testing.assert_array_equal(positions, [0, 6, 8, 1, 0])
    np.testing.assert_array_equal(seq_lens, [1, 7, 9, 2, 3])
    np.testing.assert_array_equal(slots, [28, 38, -1, -1, -1])


def test_slot_is_computed_in_64_bits(place):
    # block_id * block_size overflows int32 here.
    case = {
        "input_tokens": np.zeros(1, np.int64),
        "sampled_token_ids": np.ones((1, 1), np.int64),
        "input_positions": np.zeros(1, np.int64),
        "seq_lens": np.array([70], np.int64),
        "slot_mapping": np.zeros(1, np.int64),
        "block_tables": np.array([[2_000_000_000, 2_000_000_001]], np.int32),
    }
    slots = run_op(case, None, 1, 1, 64)[3]
    assert slots[0] == 2_000_000_001 * 64 + 6


def test_inactive_rows_keep_their_seq_len(place):
    case, _ = make_case(6, 6, 16, np.int32, np.int32, False, np.random.default_rng(0))
    active = np.array([True, False, True, False, False, True])
    got = run_op(case, active, 6, 6, 16)
    np.testing.assert_array_equal(got[2][~active], case["seq_lens"][~active])
    np.testing.assert_array_equal(got[0][~active], 0)
    np.testing.assert_array_equal(got[3][~active], -1)


@pytest.mark.needs_paddle3
def test_in_place_inside_to_static():
    case, _ = make_case(9, 5, 16, np.int64, np.int32, False, np.random.default_rng(1))
    expected = ref_advance_step(**case, num_seqs=9, num_queries=5, block_size=16)
    tensors = {name: paddle.to_tensor(value) for name, value in case.items()}

    @paddle.jit.to_static(full_graph=True)
    def advance(input_tokens, sampled, positions, seq_lens, slots, tables):
        paddle_step.advance_step(input_tokens, sampled, positions, seq_lens, slots,
                                 tables, 9, 5, 16)
        return seq_lens

    returned = advance(tensors["input_tokens"], tensors["sampled_token_ids"],
                       tensors["input_positions"], tensors["seq_lens"],
                       tensors["slot_mapping"], tensors["block_tables"])
    assert_same([tensors[name].numpy() for name in OUTPUT_NAMES], expected)
    np.testing.assert_array_equal(returned.numpy(), expected[2])


def test_library_exposes_every_op():
    import paddle_step_ops

    for name in ("advance_step", "step_paddle",
                 "static_op_advance_step", "static_op_step_paddle"):
        assert callable(getattr(paddle_step_ops, name)), name


def valid_tensors(num_seqs=4, num_queries=3):
    case, _ = make_case(num_seqs, num_queries, 16, np.int32, np.int32, False,
                        np.random.default_rng(2))
    return {name: paddle.to_tensor(value) for name, value in case.items()}


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


@pytest.mark.parametrize("label,overrides,message", BAD_INPUTS,
                         ids=[case[0] for case in BAD_INPUTS])
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
        paddle_step.advance_step(input_tokens, sampled, positions, seq_lens, slots,
                                 tables, 4, 3, 16)
        return seq_lens

    with pytest.raises(Exception, match="argument 'seq_lens': expected dtype int32 or int64"):
        advance(tensors["input_tokens"], tensors["sampled_token_ids"],
                tensors["input_positions"], paddle.zeros([4], "float32"),
                tensors["slot_mapping"], tensors["block_tables"])
