"""The NumPy reference of step_paddle: hand-worked SPEC scenarios, bounds
corners, and long runs under FakeDecodeLoop with every invariant checked.

Needs no compiled op.
"""

from __future__ import annotations

import numpy as np
import pytest

from paddle_step.spec.check_state import StateError, check_state
from paddle_step.spec.tensor_table import STEP_PADDLE_TENSORS
from paddle_step.testing.fake_decode_loop import (
    FakeDecodeLoop,
    FakeLoopError,
    add_preempted,
    add_running,
    make_state,
    token_at,
)
from paddle_step.testing.ref_step_paddle import ref_step_paddle


def copy_state(state):
    return {name: array.copy() for name, array in state.items()}


def assert_states_equal(actual, expected):
    """Every tensor equal in shape, dtype and bytes; names the ones that differ."""
    differing = []
    for name in STEP_PADDLE_TENSORS:
        a, e = actual[name], expected[name]
        if a.shape != e.shape or a.dtype != e.dtype or not np.array_equal(a, e):
            differing.append(f"{name}: got {a.tolist()}, expected {e.tolist()}")
    assert not differing, "\n".join(differing)


def stop_like_update_inputs(state, slot):
    """What the host does when a sequence ends (FastDeploy's update_inputs)."""
    state["stop_flags"][slot] = True
    state["seq_lens_this_time"][slot] = 0
    state["seq_lens_decoder"][slot] = 0


def expected_start(state):
    """A copy of ``state`` with the scratch lists reset, as step_paddle always leaves them;
    a test writes the changes it expects on top."""
    expected = copy_state(state)
    expected["need_block_list"][:] = -1
    expected["need_block_len"][0] = 0
    expected["recover_lens"][0] = 0
    return expected


def expect_preempted(expected, victims):
    """``victims`` preempted in this order: pushed onto step_block_list and stopped; their
    used_list_len stays (recovery restores it). Table entries and the pool are the
    caller's to set."""
    for position, slot in enumerate(victims):
        expected["step_block_list"][position] = slot
        expected["stop_flags"][slot] = True
        expected["is_block_step"][slot] = True
        expected["seq_lens_this_time"][slot] = 0
        expected["seq_lens_decoder"][slot] = 0
    expected["step_lens"][0] = len(victims)


def expect_dispatched(expected, slot, column, block):
    """``slot`` takes ``block`` from the pool into table column ``column``, counted in its
    used_list_len. The pool's length is the caller's to set."""
    expected["block_tables"][slot, column] = block
    expected["used_list_len"][slot] += 1


# ---- Phase 1: Free. --------------------------------------------------------------


def test_free_returns_decoder_blocks_in_column_order():
    state = make_state(3, 6, 24, free_list=[20], free_list_size=4)
    add_running(
        state, 0, encoder_blocks=[0, 1], decoder_blocks=[21, 22], seq_lens_decoder=14, prompt_len=6
    )
    stop_like_update_inputs(state, 0)
    add_running(state, 1, encoder_blocks=[2], seq_lens_decoder=2, prompt_len=2)  # no decoder block
    stop_like_update_inputs(state, 1)
    add_running(state, 2, encoder_blocks=[3], decoder_blocks=[23], seq_lens_decoder=5, prompt_len=3)
    result = ref_step_paddle(state, 4)

    expected = expected_start(state)
    expected["free_list"][:] = [20, 21, 22, -1]  # column enc+0 first, so 22 ends on top
    expected["free_list_len"][0] = 3
    expected["block_tables"][0] = [0, 1, -1, -1, -1, -1]  # encoder blocks stay for the host
    expected["encoder_block_lens"][0] = 0
    expected["used_list_len"][0] = 0
    expected["first_token_ids"][[0, 1]] = -1
    # Slot 1 held no decoder block: its encoder_block_lens is kept.
    assert_states_equal(result, expected)


def test_sequence_at_end_of_table_is_stopped_and_freed_in_the_same_call():
    # M = 4 columns of 4 tokens; seq_lens_decoder = 16 would write column 4.
    state = make_state(1, 4, 32, free_list_size=4)
    add_running(
        state, 0, encoder_blocks=[0], decoder_blocks=[10, 11, 12], seq_lens_decoder=16, prompt_len=3
    )
    result = ref_step_paddle(state, 4)

    expected = expected_start(state)
    expected["stop_flags"][0] = True  # only stop_flags: seq_lens_* are the host's to reset
    expected["free_list"][:3] = [10, 11, 12]
    expected["free_list_len"][0] = 3
    expected["block_tables"][0] = [0, -1, -1, -1]
    expected["encoder_block_lens"][0] = 0
    expected["used_list_len"][0] = 0
    expected["first_token_ids"][0] = -1
    assert_states_equal(result, expected)


def test_all_stopped_frees_everything_and_dispatches_nothing():
    state = make_state(3, 4, 16, free_list=[], free_list_size=5)
    for slot, decoder_blocks in enumerate([[10, 11], [], [12]]):
        add_running(
            state,
            slot,
            encoder_blocks=[slot],
            decoder_blocks=decoder_blocks,
            seq_lens_decoder=4 + 4 * len(decoder_blocks) - 1,
            prompt_len=1,
        )
        stop_like_update_inputs(state, slot)
    result = ref_step_paddle(state, 4)

    assert result["free_list"][:3].tolist() == [10, 11, 12]
    assert result["free_list_len"][0] == 3
    assert result["first_token_ids"].tolist() == [-1, -1, -1]
    assert result["used_list_len"].tolist() == [0, 0, 0]
    assert result["encoder_block_lens"].tolist() == [0, 1, 0]
    assert result["block_tables"][:, 1:].tolist() == [[-1] * 3] * 3
    assert result["step_lens"][0] == 0


# ---- Phase 3: Dispatch. ----------------------------------------------------------


def test_dispatch_pops_pool_top_in_ascending_slot_order():
    state = make_state(3, 6, 24, free_list=[30, 31, 32])
    add_running(state, 0, encoder_blocks=[0, 1], seq_lens_decoder=8, prompt_len=6)  # column 2 empty
    add_running(state, 1, encoder_blocks=[2, 3], seq_lens_decoder=7, prompt_len=6)  # column 1 held
    add_running(state, 2, encoder_blocks=[4], seq_lens_decoder=4, prompt_len=2)  # column 1 empty
    result = ref_step_paddle(state, 4)

    expected = expected_start(state)
    expect_dispatched(expected, 0, 2, 32)
    expect_dispatched(expected, 2, 1, 31)
    expected["free_list_len"][0] = 1  # popping leaves free_list's entries as they were
    assert_states_equal(result, expected)


def test_single_dispatch_with_batch_of_one():
    state = make_state(1, 6, 24, free_list=[7])
    add_running(state, 0, encoder_blocks=[0], seq_lens_decoder=4, prompt_len=4)
    result = ref_step_paddle(state, 4)
    assert result["block_tables"][0].tolist() == [0, 7, -1, -1, -1, -1]
    assert result["used_list_len"][0] == 1
    assert result["free_list_len"][0] == 0
    assert result["free_list"].tolist() == [7]
    assert result["need_block_list"].tolist() == [-1]
    assert result["need_block_len"][0] == 0


def test_nothing_needy_and_empty_pool_changes_only_scratch():
    state = make_state(2, 6, 24, free_list=[], free_list_size=3)
    add_running(state, 0, encoder_blocks=[0], decoder_blocks=[5], seq_lens_decoder=6, prompt_len=2)
    state["need_block_list"][:] = [1, 0]  # stale scratch from a caller
    state["need_block_len"][0] = 2
    state["recover_lens"][0] = 1
    result = ref_step_paddle(state, 4)
    expected = expected_start(state)
    assert_states_equal(result, expected)


# ---- Phase 2: Preempt. -----------------------------------------------------------


def test_preempts_biggest_holder_lowest_slot_on_ties():
    state = make_state(4, 6, 24, free_list=[], free_list_size=8)
    add_running(state, 0, encoder_blocks=[0], decoder_blocks=[10], seq_lens_decoder=5, prompt_len=2)
    add_running(
        state, 1, encoder_blocks=[1], decoder_blocks=[11, 12], seq_lens_decoder=9, prompt_len=2
    )
    add_running(
        state, 2, encoder_blocks=[2], decoder_blocks=[13, 14], seq_lens_decoder=10, prompt_len=2
    )
    add_running(state, 3, encoder_blocks=[3], seq_lens_decoder=4, prompt_len=2)  # needy
    result = ref_step_paddle(state, 4)

    expected = expected_start(state)
    # Slot 1 (2 blocks, tied with slot 2) is the victim.
    expected["free_list"][:2] = [11, 12]
    expected["block_tables"][1] = [1, -1, -1, -1, -1, -1]
    expect_preempted(expected, [1])
    # used_list_len[1] stays 2. Dispatch: slot 3 takes the pool top.
    expect_dispatched(expected, 3, 1, 12)
    expected["free_list_len"][0] = 1
    # Recovery: slot 1's budget min(2+1, 6-1, 6-1) = 3 > 1 left in the pool.
    assert_states_equal(result, expected)


@pytest.mark.parametrize(
    ("decoder_blocks", "seq_lens_decoder", "prompt_len"),
    [([10], 8, 2), ([], 4, 4)],
    ids=["victim-holding-a-block", "shortfall-holding-none"],
)
def test_lone_needy_slot_is_preempted_and_leaves_the_needy_list(
    decoder_blocks, seq_lens_decoder, prompt_len
):
    """A batch of one that needs a block the empty pool lacks is preempted, as the biggest
    holder or, holding none, for the shortfall. It is needy no more, so the blocks it gave
    back stay in the pool; its used_list_len stays for recovery."""
    state = make_state(1, 6, 24, free_list=[], free_list_size=2)
    add_running(
        state,
        0,
        encoder_blocks=[0],
        decoder_blocks=decoder_blocks,
        seq_lens_decoder=seq_lens_decoder,
        prompt_len=prompt_len,
    )
    result = ref_step_paddle(state, 4)

    expected = expected_start(state)
    expect_preempted(expected, [0])
    expected["block_tables"][0, 1:] = -1
    expected["free_list"][: len(decoder_blocks)] = decoder_blocks
    expected["free_list_len"][0] = len(decoder_blocks)
    assert_states_equal(result, expected)


def full_holder_state(batch_size):
    """L = 16, block_size 4: max_dec_blocks = 4, and slot 0 holds exactly 4; empty pool."""
    state = make_state(batch_size, 6, 16, free_list=[], free_list_size=6)
    add_running(state, 0, encoder_blocks=[], decoder_blocks=[10, 11, 12, 13], seq_lens_decoder=14)
    return state


def test_holders_of_max_dec_blocks_are_spared_while_others_hold_blocks():
    state = full_holder_state(3)
    add_running(state, 1, encoder_blocks=[0], decoder_blocks=[14], seq_lens_decoder=6, prompt_len=2)
    add_running(state, 2, encoder_blocks=[1], seq_lens_decoder=4, prompt_len=2)  # needy
    result = ref_step_paddle(state, 4)
    assert not result["is_block_step"][0]
    assert result["block_tables"][0, :4].tolist() == [10, 11, 12, 13]
    assert result["is_block_step"][1]
    assert result["block_tables"][2, 1] == 14
    assert result["step_block_list"][0] == 1 and result["step_lens"][0] == 1


def test_holders_of_max_dec_blocks_are_preempted_when_nobody_else_holds_any():
    state = full_holder_state(2)
    add_running(state, 1, encoder_blocks=[1], seq_lens_decoder=4, prompt_len=2)  # needy
    result = ref_step_paddle(state, 4)

    expected = expected_start(state)
    expected["free_list"][:4] = [10, 11, 12, 13]
    expected["block_tables"][0, :4] = -1
    expect_preempted(expected, [0])
    expect_dispatched(expected, 1, 1, 13)
    # Recovery: slot 0's budget max(1, min(5, 4-0, 6-0)) = 4 > 3 left.
    expected["free_list_len"][0] = 3
    assert_states_equal(result, expected)


def test_shortfall_preempts_needy_from_highest_slot_down():
    state = make_state(4, 6, 24, free_list=[20], free_list_size=4)
    for slot in range(4):  # all need their first decoder block; nobody holds one
        add_running(state, slot, encoder_blocks=[slot], seq_lens_decoder=4, prompt_len=3)
    result = ref_step_paddle(state, 4)

    expected = expected_start(state)
    expect_preempted(expected, [3, 2, 1])
    expect_dispatched(expected, 0, 1, 20)
    expected["free_list_len"][0] = 0
    assert_states_equal(result, expected)


def test_shortfall_after_holders_are_gone():
    state = make_state(4, 6, 24, free_list=[], free_list_size=4)
    add_running(state, 0, encoder_blocks=[0], decoder_blocks=[10], seq_lens_decoder=5, prompt_len=3)
    for slot in (1, 2, 3):
        add_running(state, slot, encoder_blocks=[slot], seq_lens_decoder=4, prompt_len=3)
    result = ref_step_paddle(state, 4)
    # Slot 0 (the only holder) goes first, then 3 and 2 for want of blocks.
    assert result["step_block_list"].tolist() == [0, 3, 2, -1]
    assert result["step_lens"][0] == 3
    assert result["block_tables"][1, 1] == 10
    assert result["used_list_len"].tolist() == [1, 1, 0, 0]
    assert result["is_block_step"].tolist() == [True, False, True, True]
    assert result["free_list_len"][0] == 0


# ---- Phase 4: Recover. -----------------------------------------------------------


def test_recovery_budget_uses_each_sequences_own_encoder_length():
    # L = 32, block_size 4: max_dec_blocks = 8 = M.
    state = make_state(2, 8, 32, free_list=[10, 11, 12, 13, 14, 15])
    add_preempted(state, 0, encoder_blocks=[0, 1], used_list_len=3, prompt_len=6, step_idx=9)
    add_preempted(
        state, 1, encoder_blocks=[2, 3, 4, 5, 6, 7], used_list_len=3, prompt_len=22, step_idx=5
    )
    result = ref_step_paddle(state, 4)

    expected = expected_start(state)
    # Top first: slot 1, budget max(1, min(3+1, 8-6, 8-6)) = 2; then slot 0,
    # budget min(3+1, 8-2, 8-2) = 4: 6 blocks in all.
    expected["recover_block_list"][:] = [1, 0]
    expected["used_list_len"][:] = [4, 2]
    expected["step_block_list"][:] = -1
    expected["step_lens"][0] = 0
    expected["is_block_step"][:] = False
    expected["stop_flags"][:] = False
    expected["block_tables"][1, 6:] = [15, 14]
    expected["block_tables"][0, 2:6] = [13, 12, 11, 10]
    expected["free_list_len"][0] = 0
    expected["seq_lens_this_time"][:] = [6 + 9, 22 + 5]
    expected["seq_lens_encoder"][:] = [6 + 9, 22 + 5]
    expected["input_ids"][0, :15] = [token_at(0, p) for p in range(15)]
    expected["input_ids"][1, :27] = [token_at(1, p) for p in range(27)]
    assert_states_equal(result, expected)


def test_recovery_is_lifo_and_stops_at_the_first_that_does_not_fit():
    state = make_state(3, 8, 32, free_list=[10, 11, 12])
    add_preempted(
        state, 0, encoder_blocks=[0], used_list_len=0, prompt_len=3, step_idx=2
    )  # budget 1
    add_preempted(
        state, 1, encoder_blocks=[1], used_list_len=1, prompt_len=4, step_idx=2
    )  # budget 2
    add_preempted(
        state, 2, encoder_blocks=[2], used_list_len=1, prompt_len=2, step_idx=5
    )  # budget 2
    result = ref_step_paddle(state, 4)

    expected = expected_start(state)
    # Slot 2 fits (3 >= 2); slot 1 does not (1 < 2), so slot 0 waits behind it.
    expected["recover_block_list"][0] = 2
    expected["step_block_list"][:] = [0, 1, -1]
    expected["step_lens"][0] = 2
    expected["is_block_step"][2] = False
    expected["stop_flags"][2] = False
    expected["used_list_len"][2] = 2
    expected["block_tables"][2, 1:3] = [12, 11]
    expected["free_list_len"][0] = 1
    expected["seq_lens_this_time"][2] = 7
    expected["seq_lens_encoder"][2] = 7
    expected["input_ids"][2, :7] = [token_at(2, p) for p in range(7)]
    assert_states_equal(result, expected)


def test_blocks_freed_in_a_call_are_dispatched_in_it():
    state = make_state(2, 6, 24, free_list=[], free_list_size=4)
    add_running(
        state, 0, encoder_blocks=[0], decoder_blocks=[10, 11], seq_lens_decoder=9, prompt_len=3
    )
    stop_like_update_inputs(state, 0)  # finished: its 2 blocks go back in phase 1
    add_running(state, 1, encoder_blocks=[1], decoder_blocks=[12], seq_lens_decoder=8, prompt_len=3)
    result = ref_step_paddle(state, 4)
    # The pool (2) covers the one needy slot: no preemption, slot 1 takes the top.
    assert result["block_tables"][1].tolist() == [1, 12, 11, -1, -1, -1]
    assert result["free_list_len"][0] == 1
    assert result["step_lens"][0] == 0


def test_recovery_pops_blocks_even_for_columns_outside_the_table():
    # The table is full of encoder blocks: budget is max(1, ..) = 1, its column M.
    state = make_state(1, 2, 32, free_list=[10])
    add_preempted(state, 0, encoder_blocks=[0, 1], used_list_len=0, prompt_len=5, step_idx=1)
    result = ref_step_paddle(state, 4)
    assert result["block_tables"][0].tolist() == [0, 1]
    assert result["free_list_len"][0] == 0
    assert result["used_list_len"][0] == 1
    assert result["input_ids"][0, :6].tolist() == [token_at(0, p) for p in range(6)]


def test_rebuild_skips_positions_outside_input_ids_and_pre_ids():
    # input_ids holds 8 tokens, pre_ids 4; the sequence has 6 + 5 = 11 tokens.
    state = make_state(1, 4, 8, free_list=[10], pre_ids_len=4)
    add_preempted(state, 0, encoder_blocks=[0], used_list_len=0, prompt_len=6, step_idx=5)
    result = ref_step_paddle(state, 4)
    assert result["input_ids"][0].tolist() == [token_at(0, p) for p in range(8)]
    assert result["seq_lens_this_time"][0] == 11
    assert result["block_tables"][0].tolist() == [0, 10, -1, -1]


def test_rebuild_with_extreme_step_idx_copies_nothing():
    # step_idx - 1 must not wrap: with step_idx = INT64_MIN there is no i < step_idx - 1.
    state = make_state(1, 6, 24, free_list=[10])
    add_preempted(state, 0, encoder_blocks=[0], used_list_len=0, prompt_len=2, step_idx=3)
    state["step_idx"][0] = np.iinfo(np.int64).min
    before_row = state["input_ids"][0].copy()
    result = ref_step_paddle(state, 4)
    expected_row = before_row
    expected_row[0] = token_at(0, 0)  # first_token_ids only
    assert result["input_ids"][0].tolist() == expected_row.tolist()
    assert result["seq_lens_this_time"][0] == 2  # 2 + INT64_MIN, cast to int32


def test_recovery_stops_at_an_entry_that_is_not_a_slot():
    state = make_state(2, 6, 24, free_list=[10, 11])
    add_preempted(state, 0, encoder_blocks=[0], used_list_len=0, prompt_len=2, step_idx=1)
    state["step_block_list"][:] = [0, 7]
    state["step_lens"][0] = 2
    result = ref_step_paddle(state, 4)
    assert result["step_lens"][0] == 2
    assert result["is_block_step"][0]
    assert result["free_list_len"][0] == 2


# ---- Corners SPEC leaves open (decided as the kernels do). -----------------------


def test_next_column_uses_c_division():
    # -3 / 4 is 0 in C (floor division would give -1, outside the table).
    state = make_state(1, 4, 16, free_list=[10])
    add_running(state, 0, encoder_blocks=[], seq_lens_decoder=3, prompt_len=1)
    state["seq_lens_decoder"][0] = -3
    result = ref_step_paddle(state, 4)
    assert result["block_tables"][0, 0] == 10
    assert result["used_list_len"][0] == 1


def test_pushes_onto_a_full_free_list_are_dropped():
    state = make_state(1, 4, 16, free_list=[20, 21])
    add_running(
        state, 0, encoder_blocks=[0], decoder_blocks=[10, 11], seq_lens_decoder=9, prompt_len=1
    )
    stop_like_update_inputs(state, 0)
    result = ref_step_paddle(state, 4)
    assert result["free_list"].tolist() == [20, 21]
    assert result["free_list_len"][0] == 2
    assert result["block_tables"][0].tolist() == [0, -1, -1, -1]
    assert result["used_list_len"][0] == 0


@pytest.mark.parametrize(("given", "clamped"), [(5, 3), (-2, 0)])
def test_pool_length_is_clamped_to_free_list(given, clamped):
    state = make_state(1, 4, 16, free_list=[10, 11, 12], free_list_len=given)
    result = ref_step_paddle(state, 4)
    assert result["free_list_len"][0] == clamped


def test_pushes_onto_a_full_step_block_list_are_dropped():
    state = make_state(2, 6, 24, free_list=[], free_list_size=4)
    add_preempted(state, 0, encoder_blocks=[0], used_list_len=5, prompt_len=2, step_idx=20)
    add_preempted(state, 1, encoder_blocks=[1], used_list_len=5, prompt_len=2, step_idx=20)
    state["is_block_step"][1] = False  # left on the list by a caller, but running and needy
    state["stop_flags"][1] = False
    state["seq_lens_this_time"][1] = 1
    state["seq_lens_decoder"][1] = 4
    state["used_list_len"][1] = 0
    result = ref_step_paddle(state, 4)
    # Shortfall preempts slot 1; the list (capacity B = 2) is full.
    assert result["step_block_list"].tolist() == [0, 1]
    assert result["step_lens"][0] == 2
    assert result["is_block_step"][1]


def test_recovery_stops_at_a_slot_that_is_no_longer_preempted():
    # Not a state a serving loop makes: slot 0 listed twice. Its second entry
    # is no longer is_block_step once the first is recovered, so recovery ends
    # there and no pool block is handed out twice.
    state = make_state(2, 6, 24, free_list=[10, 11, 12])
    add_preempted(state, 0, encoder_blocks=[0], used_list_len=0, prompt_len=2, step_idx=1)
    state["step_block_list"][:] = [0, 0]
    state["step_lens"][0] = 2
    result = ref_step_paddle(state, 4)
    assert result["recover_block_list"].tolist() == [0, -1]
    assert result["used_list_len"][0] == 1
    assert result["block_tables"][0].tolist() == [0, 12, -1, -1, -1, -1]
    assert result["free_list_len"][0] == 2
    assert result["step_block_list"].tolist() == [0, -1]
    assert result["step_lens"][0] == 1


# ---- Calling convention. ---------------------------------------------------------


@pytest.mark.parametrize("stopped_shape", ["[B]", "[B,1]"])
def test_returns_copies_with_input_shapes_and_dtypes(stopped_shape):
    state = make_state(2, 6, 24, free_list=[10, 11], stopped_shape=stopped_shape)
    add_running(state, 0, encoder_blocks=[0], seq_lens_decoder=4, prompt_len=2)
    add_preempted(state, 1, encoder_blocks=[1], used_list_len=0, prompt_len=2, step_idx=1)
    before = copy_state(state)
    result = ref_step_paddle(state, 4)
    assert_states_equal(state, before)  # input untouched
    for name in STEP_PADDLE_TENSORS:
        assert result[name].shape == state[name].shape, name
        assert result[name].dtype == state[name].dtype, name
        assert not np.shares_memory(result[name], state[name]), name
    assert result["block_tables"][0, 1] == 11
    assert result["recover_block_list"].reshape(-1)[0] == 1


def test_rejects_a_non_positive_block_size():
    with pytest.raises(ValueError, match="block_size"):
        ref_step_paddle(make_state(1, 4, 16), 0)


# ---- Long runs under a FastDeploy-like loop. --------------------------------------

# FakeDecodeLoop arguments. "tight" pools hold little more than the largest
# recovery budget, so preemption (and, with B above the pool, shortfall) is routine.
# A table: one entry a line or two, not reflowed.
# fmt: off
LOOP_CONFIGS = {
    "B1": dict(batch_size=1, max_model_len=32, block_size=4, blocks_per_seq=8,
               num_decoder_blocks=7, num_encoder_blocks=8, prompt_len_range=(1, 16),
               output_len_range=(1, 40), num_requests=20),
    "B7-tight": dict(batch_size=7, max_model_len=16, block_size=2, blocks_per_seq=8,
                     num_decoder_blocks=3, num_encoder_blocks=40, prompt_len_range=(10, 14),
                     output_len_range=(1, 6), num_requests=300),
    # blocks_per_seq * block_size < max_model_len: the op ends sequences at the table's end.
    "B7-short-table": dict(batch_size=7, max_model_len=32, block_size=2, blocks_per_seq=12,
                           num_decoder_blocks=9, num_encoder_blocks=60, enc_dec_block_num=1,
                           prompt_len_range=(3, 16), output_len_range=(4, 28), stop_prob=0.01,
                           num_requests=60, stopped_shape="[B,1]"),
    "B83-tight": dict(batch_size=83, max_model_len=32, block_size=2, blocks_per_seq=16,
                      num_decoder_blocks=12, num_encoder_blocks=600, prompt_len_range=(9, 24),
                      output_len_range=(2, 16)),
    "B83-column": dict(batch_size=83, max_model_len=64, block_size=4, blocks_per_seq=16,
                       num_decoder_blocks=20, num_encoder_blocks=600, enc_dec_block_num=1,
                       prompt_len_range=(1, 30), output_len_range=(2, 40), stopped_shape="[B,1]"),
}
# fmt: on
TIGHT = {"B7-tight", "B83-tight", "B7-short-table", "B83-column"}
WITH_SHORTFALL = {"B7-tight", "B83-tight"}


def run_reference_loop(loop: FakeDecodeLoop, max_steps: int = 3000) -> int:
    def check(state, after_step):
        check_state(
            state,
            loop.block_size,
            after_step=after_step,
            num_blocks=loop.num_blocks,
            decoder_blocks=loop.decoder_block_ids,
        )

    return loop.run(
        lambda state: ref_step_paddle(state, loop.block_size, loop.enc_dec_block_num),
        max_steps,
        check,
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config", sorted(LOOP_CONFIGS))
def test_reference_keeps_invariants_in_a_serving_loop(config, seed):
    loop = FakeDecodeLoop(**LOOP_CONFIGS[config], seed=seed)
    steps = run_reference_loop(loop)
    assert loop.done and loop.finished == loop.num_requests
    assert steps >= 200, f"only {steps} steps: the run is too short to mean much"
    assert loop.recoveries == loop.preemptions  # every preempted request came back
    if config in TIGHT:
        assert loop.preemptions > 0 and loop.recoveries > 0
    if config in WITH_SHORTFALL:
        assert loop.shortfalls > 0
    if config == "B7-short-table":
        assert loop.table_end_stops > 0


def test_serving_loop_catches_a_block_handed_out_twice():
    def reuses_a_block(state):
        result = ref_step_paddle(state, 2)
        # Put the block just dispatched back on the pool: it will be handed out
        # again while its first owner still uses it.
        if result["free_list_len"][0] < result["free_list"].size:
            result["free_list_len"][0] += 1
        return result

    loop = FakeDecodeLoop(**LOOP_CONFIGS["B7-tight"], seed=0)
    with pytest.raises(FakeLoopError, match="KV cache|owned|free"):
        loop.run(reuses_a_block, 3000)


def test_invariant_check_catches_a_lost_block():
    def loses_a_block(state):
        result = ref_step_paddle(state, 2)
        if result["free_list_len"][0] > 0:
            result["free_list_len"][0] -= 1
        return result

    loop = FakeDecodeLoop(**LOOP_CONFIGS["B7-tight"], seed=0)
    with pytest.raises(StateError, match="is lost"):
        loop.run(
            loses_a_block,
            50,
            lambda state, after_step: check_state(
                state,
                2,
                after_step=after_step,
                num_blocks=loop.num_blocks,
                decoder_blocks=loop.decoder_block_ids,
            ),
        )
