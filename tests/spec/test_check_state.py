"""check_state: a valid state passes; each planted corruption is reported by name."""

from __future__ import annotations

import numpy as np
import pytest

from paddle_step.spec.check_state import StateError, check_state
from paddle_step.spec.tensor_table import STEP_PADDLE_TENSORS
from paddle_step.testing.fake_decode_loop import (
    FakeDecodeLoop,
    add_preempted,
    add_running,
    make_state,
)
from paddle_step.testing.ref_step_paddle import ref_step_paddle

BLOCK_SIZE = 4
NUM_BLOCKS = 16
DECODER_BLOCKS = range(10, 16)


def valid_state(stopped_shape: str = "[B]"):
    """Four slots after a step: 0 and 3 decoding, 1 preempted, 2 empty.

    Encoder blocks 0..3; decoder blocks 10..15: 10 (slot 0) and 11, 12 (slot 3)
    owned, 13, 14, 15 in the pool.
    """
    state = make_state(
        4, 6, 24, free_list=[13, 14, 15], free_list_size=6, stopped_shape=stopped_shape
    )
    add_running(
        state, 0, encoder_blocks=[0, 1], decoder_blocks=[10], seq_lens_decoder=9, prompt_len=5
    )
    add_preempted(state, 1, encoder_blocks=[2], used_list_len=2, prompt_len=3, step_idx=4)
    add_running(
        state, 3, encoder_blocks=[3], decoder_blocks=[11, 12], seq_lens_decoder=11, prompt_len=2
    )
    return state


def violations(state, **kwargs) -> str:
    kwargs.setdefault("num_blocks", NUM_BLOCKS)
    kwargs.setdefault("decoder_blocks", DECODER_BLOCKS)
    with pytest.raises(StateError) as caught:
        check_state(state, BLOCK_SIZE, **kwargs)
    return str(caught.value)


# ---- Valid states pass. ------------------------------------------------------------


@pytest.mark.parametrize("stopped_shape", ["[B]", "[B,1]"])
def test_valid_state_passes(stopped_shape):
    state = valid_state(stopped_shape)
    assert (
        check_state(state, BLOCK_SIZE, num_blocks=NUM_BLOCKS, decoder_blocks=DECODER_BLOCKS) is None
    )
    assert check_state(state, BLOCK_SIZE, after_step=False) is None


def test_paddle_tensors_are_accepted():
    paddle = pytest.importorskip("paddle")
    state = {name: paddle.to_tensor(array) for name, array in valid_state().items()}
    assert check_state(state, BLOCK_SIZE) is None


def test_states_of_a_serving_loop_pass_before_and_after_each_step():
    loop = FakeDecodeLoop(
        7,
        16,
        2,
        8,
        3,
        40,
        seed=0,
        prompt_len_range=(10, 14),
        output_len_range=(1, 6),
        num_requests=20,
    )
    calls = []

    def check(state, after_step):
        check_state(
            state,
            2,
            after_step=after_step,
            num_blocks=loop.num_blocks,
            decoder_blocks=loop.decoder_block_ids,
        )
        calls.append(after_step)

    loop.run(lambda state: ref_step_paddle(state, 2), 500, check)
    assert True in calls and False in calls


def test_error_is_a_value_error_listing_violations():
    state = valid_state()
    state["free_list_len"][0] = 9
    state["block_tables"][3, 0] = 0  # slot 0's block
    with pytest.raises(ValueError) as caught:
        check_state(state, BLOCK_SIZE)
    error = caught.value
    assert isinstance(error, StateError)
    assert len(error.violations) >= 2
    assert "free_list_len is 9" in str(error) and "block 0 is owned twice" in str(error)


def test_rejects_a_non_positive_block_size():
    with pytest.raises(ValueError, match="block_size"):
        check_state(valid_state(), 0)


# ---- Block ownership. --------------------------------------------------------------


# One planted corruption a row: the entries it writes (tensor, index, value) and what
# check_state reports.
# fmt: off
PLANTED = {
    # Block ownership.
    "block-owned-twice": ([("block_tables", (3, 2), 10)],  # slot 0 holds 10 in column 2
                          ["block 10 is owned twice: slot 0 column 2, slot 3 column 2"]),
    "in-pool-and-owned": ([("free_list", 0, 11)],  # slot 3 owns it
                          ["block 11 is both in the pool (free_list[0]) and owned by slot 3 "
                           "(column 1)"]),
    "twice-in-pool": ([("free_list", 2, 13)],
                      ["block 13 is in free_list twice: free_list[0] and free_list[2]",
                       "decoder block 15 is lost"]),
    "lost": ([("free_list_len", 0, 2)],
             ["decoder block 15 is lost: neither in the pool nor in any block table"]),
    "pooled-encoder-block": ([("free_list", 3, 4), ("free_list_len", 0, 4)],
                             ["free_list[3] is block 4, which is not a decoder block"]),
    "pool-id-out-of-range": ([("free_list", 1, 99)],
                             ["free_list[1] is 99, expected a block id in [0, 16)"]),
    # Lengths and lists.
    "preempted-not-listed": ([("step_lens", 0, 0)],
                             ["slot 1 is preempted (is_block_step) but not in "
                              "step_block_list[:0]"]),
    "preempted-not-stopped": ([("stop_flags", 1, False)],
                              ["slot 1 is preempted (is_block_step) but stop_flags is false"]),
    "negative-length": ([("used_list_len", 2, -1)],
                        ["slot 2: used_list_len is -1, expected >= 0"]),
    # Table layout per slot.
    "running-past-the-table": ([("seq_lens_decoder", 0, 24)],  # column 6 of 6
                               ["slot 0 is running but has no block in column(s) [6]"]),
    "preempted-holds-decoder-block": ([("block_tables", (1, 1), 15), ("free_list_len", 0, 2)],
                                      ["slot 1 is preempted but holds blocks [15] in decoder "
                                       "columns [1]"]),
    "hole-in-decoder-columns": ([("block_tables", (3, 1), -1), ("free_list", 3, 11),
                                 ("free_list_len", 0, 4)],
                                ["slot 3: decoder columns [1] are -1, expected block ids "
                                 "(used_list_len is 2)"]),
    "block-past-used-columns": ([("block_tables", (0, 3), 15), ("free_list_len", 0, 2)],
                                ["slot 0: columns [3] hold blocks [15] past its 2 encoder + 1 "
                                 "decoder blocks, expected -1"]),
    "missing-encoder-block": ([("block_tables", (0, 1), -1)],
                              ["slot 0: encoder columns [1] are -1, expected block ids "
                               "(encoder_block_lens is 2)"]),
    "encoder-plus-decoder-past-the-table": ([("used_list_len", 1, 6)],
                                            ["slot 1: encoder_block_lens + used_list_len is "
                                             "1+6, expected <= 6 (blocks per sequence)"]),
}
# fmt: on


@pytest.mark.parametrize(("edits", "messages"), list(PLANTED.values()), ids=list(PLANTED))
def test_planted_corruption_is_reported(edits, messages):
    state = valid_state()
    for name, index, value in edits:
        state[name][index] = value
    message = violations(state)
    for expected in messages:
        assert expected in message


def test_entries_past_the_pool_are_not_checked():
    state = valid_state()
    state["free_list"][3:] = [10, 10, 0]  # stale entries past free_list_len
    assert (
        check_state(state, BLOCK_SIZE, num_blocks=NUM_BLOCKS, decoder_blocks=DECODER_BLOCKS) is None
    )


@pytest.mark.parametrize("bad_id", [16, -7])
def test_block_id_out_of_range_in_table(bad_id):
    state = valid_state()
    state["block_tables"][0, 1] = bad_id
    message = violations(state)
    assert (
        f"slot 0: block_tables[0, 1] is {bad_id}, expected -1 or a block id in [0, 16)" in message
    )


def test_negative_id_is_caught_without_num_blocks():
    state = valid_state()
    state["block_tables"][0, 0] = -3
    message = violations(state, num_blocks=None, decoder_blocks=None)
    assert "block_tables[0, 0] is -3" in message


# ---- Lengths and lists. ------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        (
            "free_list_len",
            7,
            "free_list_len is 7, expected 0 <= free_list_len <= 6 (free_list size)",
        ),
        ("free_list_len", -1, "free_list_len is -1, expected 0 <= free_list_len <= 6"),
        ("step_lens", 5, "step_lens is 5, expected 0 <= step_lens <= 4 (B)"),
        ("need_block_len", 2, "need_block_len is 2, expected 0 after step_paddle"),
        ("recover_lens", 1, "recover_lens is 1, expected 0 after step_paddle"),
    ],
)
def test_bad_length(name, value, expected):
    state = valid_state()
    state[name][0] = value
    assert expected in violations(state, decoder_blocks=None)


def test_stale_need_block_list_after_step():
    state = valid_state()
    state["need_block_list"][2] = 0
    assert "need_block_list entries [2] are not -1 after step_paddle" in violations(state)
    assert check_state(state, BLOCK_SIZE, after_step=False) is None


@pytest.mark.parametrize(
    "entry,message",
    [
        (0, "slot 0 is in step_block_list[1] but is_block_step is false"),
        (9, "step_block_list[1] is 9, expected a slot id in [0, 4)"),
        (1, "slot 1 is in step_block_list twice: step_block_list[0] and step_block_list[1]"),
    ],
    ids=["not-preempted", "not-a-slot", "twice"],
)
def test_bad_second_step_block_list_entry(entry, message):
    state = valid_state()
    state["step_block_list"][1] = entry
    state["step_lens"][0] = 2
    assert message in violations(state)


@pytest.mark.parametrize("after_step", [True, False])
def test_preempted_slot_with_decoded_positions(after_step):
    """SPEC's preemption zeroes seq_lens_decoder; a preempted slot with cached positions
    is a state it never leaves, before or after a call."""
    state = valid_state()
    state["seq_lens_decoder"][1] = 7
    with pytest.raises(StateError) as caught:
        check_state(state, BLOCK_SIZE, after_step=after_step)
    assert caught.value.violations == [
        "slot 1 is preempted (is_block_step) but seq_lens_decoder is 7, expected 0"
    ]


# ---- Table layout per slot. ---------------------------------------------------------


def test_running_slot_without_its_next_block():
    state = valid_state()
    state["seq_lens_decoder"][0] = 12  # column 3: past its blocks
    message = violations(state)
    assert (
        "slot 0 is running but has no block in column(s) [3] for its next write position" in message
    )
    assert check_state(state, BLOCK_SIZE, after_step=False) is None  # step_paddle's job to fix


def test_recovered_slot_without_blocks_for_its_prefill():
    state = valid_state()
    # Slot 1 back for a re-prefill of 14 tokens (columns 0..3) holding only column 0.
    state["is_block_step"][1] = False
    state["stop_flags"][1] = False
    state["used_list_len"][1] = 0
    state["seq_lens_this_time"][1] = 14
    state["seq_lens_encoder"][1] = 14
    state["step_lens"][0] = 0
    state["step_block_list"][0] = -1
    message = violations(state)
    assert (
        "slot 1 is running but has no block in column(s) [1, 2, 3] for its tokens at "
        "positions 0..13" in message
    )


def test_stopped_slot_holding_decoder_blocks_after_step():
    state = valid_state()
    state["stop_flags"][3] = True  # finished, but its decoder blocks were not freed
    state["seq_lens_this_time"][3] = 0
    message = violations(state)
    assert "slot 3 is stopped and not preempted but still holds 2 decoder block(s)" in message
    assert check_state(state, BLOCK_SIZE, after_step=False) is None  # step_paddle frees it next


def test_stopped_slot_keeps_encoder_blocks_until_the_host_releases_them():
    state = valid_state()
    # As step_paddle leaves a freed slot: encoder_block_lens reset, encoder blocks still there.
    state["stop_flags"][3] = True
    state["seq_lens_this_time"][3] = 0
    state["block_tables"][3, 1:3] = -1
    state["used_list_len"][3] = 0
    state["encoder_block_lens"][3] = 0
    state["free_list"][3:5] = [11, 12]
    state["free_list_len"][0] = 5
    assert (
        check_state(state, BLOCK_SIZE, num_blocks=NUM_BLOCKS, decoder_blocks=DECODER_BLOCKS) is None
    )


# ---- Dtypes and shapes. ------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("seq_lens_decoder", np.int64, "seq_lens_decoder: expected dtype int32, got int64"),
        ("stop_flags", np.int32, "stop_flags: expected dtype bool, got int32"),
        ("input_ids", np.int32, "input_ids: expected dtype int64, got int32"),
        ("free_list_len", np.int64, "free_list_len: expected dtype int32, got int64"),
        ("block_tables", np.int64, "block_tables: expected dtype int32, got int64"),
    ],
)
def test_wrong_dtype(name, dtype, expected):
    state = valid_state()
    state[name] = state[name].astype(dtype)
    assert expected in violations(state)


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("stop_flags", (4, 2), "stop_flags: expected shape [4] or [4, 1], got [4, 2]"),
        ("is_block_step", (4, 1), "is_block_step: expected shape [4], got [4, 1]"),
        ("seq_lens_this_time", (3,), "seq_lens_this_time: expected shape [4] or [4, 1], got [3]"),
        ("step_lens", (2,), "step_lens: expected shape [1], got [2]"),
        ("free_list", (2, 3), "free_list: expected shape [N], got [2, 3]"),
        ("block_tables", (24,), "block_tables: expected shape [B, M], got [24]"),
        ("pre_ids", (3, 24), "pre_ids: expected shape [4, *], got [3, 24]"),
    ],
)
def test_wrong_shape(name, shape, expected):
    state = valid_state()
    state[name] = np.resize(state[name], shape)
    assert expected in violations(state)


def test_missing_tensor():
    state = valid_state()
    del state["next_tokens"]
    assert "missing tensors: next_tokens" in violations(state)


def test_every_tensor_name_is_checked():
    # Each of the 22 tensors is read: a wrong dtype on any of them is reported.
    for name in STEP_PADDLE_TENSORS:
        state = valid_state()
        state[name] = state[name].astype(np.float32)
        assert f"{name}: expected dtype" in violations(state), name
