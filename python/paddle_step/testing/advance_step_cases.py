"""``advance_step`` test cases that any build can run: each takes ``run_op(case, active,
num_seqs, num_queries, block_size)`` (NumPy inputs in, the four written arrays out, in
``ADVANCE_STEP_OUTPUTS`` order) and checks it against the reference. The CPU tests pass
the Paddle op (``paddle_ops``); tests/gpu passes its CUDA launcher. NumPy only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .ref_advance_step import ref_advance_step

AdvanceRunner = Callable[..., list]

# The tensors advance_step writes, in the order run_op and the reference return them.
ADVANCE_STEP_OUTPUTS = ("input_tokens", "input_positions", "seq_lens", "slot_mapping")
# The reference comparison's grid: argument name -> values.
MATRIX = {
    "num_seqs": (1, 7, 256, 4097),
    "block_size": (1, 16, 64),
    "seq_lens_dtype": (np.int32, np.int64),
    "tables_dtype": (np.int32, np.int64),
    "with_active": (False, True),
}


def make_case(num_seqs, num_queries, block_size, seq_lens_dtype, tables_dtype, with_active, rng):
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


def assert_same(got, expected):
    for name, got_array, expected_array in zip(ADVANCE_STEP_OUTPUTS, got, expected):
        assert got_array.dtype == expected_array.dtype, name
        np.testing.assert_array_equal(got_array, expected_array, err_msg=name)


def matches_reference(
    run_op: AdvanceRunner, num_seqs, block_size, seq_lens_dtype, tables_dtype, with_active
) -> None:
    rng = np.random.default_rng(num_seqs * 1000 + block_size)
    for num_queries in sorted({num_seqs, max(1, num_seqs // 2), 1}):
        case, active = make_case(
            num_seqs, num_queries, block_size, seq_lens_dtype, tables_dtype, with_active, rng
        )
        expected = ref_advance_step(
            **case, num_seqs=num_seqs, num_queries=num_queries, block_size=block_size, active=active
        )
        assert_same(run_op(case, active, num_seqs, num_queries, block_size), expected)


def hand_worked_rows(run_op: AdvanceRunner) -> None:
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


def slot_is_computed_in_64_bits(run_op: AdvanceRunner) -> None:
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


def inactive_rows_keep_their_seq_len(run_op: AdvanceRunner) -> None:
    case, _ = make_case(6, 6, 16, np.int32, np.int32, False, np.random.default_rng(0))
    active = np.array([True, False, True, False, False, True])
    got = run_op(case, active, 6, 6, 16)
    np.testing.assert_array_equal(got[2][~active], case["seq_lens"][~active])
    np.testing.assert_array_equal(got[0][~active], 0)
    np.testing.assert_array_equal(got[3][~active], -1)


# The cases every build runs with no arguments but the runner.
FIXED_CASES = {
    "hand_worked_rows": hand_worked_rows,
    "slot_is_computed_in_64_bits": slot_is_computed_in_64_bits,
    "inactive_rows_keep_their_seq_len": inactive_rows_keep_their_seq_len,
}
