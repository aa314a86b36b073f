"""Sequential NumPy reference of ``step_paddle`` as docs/SPEC.md states it.

Written for clarity, not speed: one slot at a time, in the order SPEC fixes, so
that every build of the op can be compared with it byte for byte.

Corners SPEC leaves open are decided as the C++ kernels decide them:

- ``/`` is C division (truncates toward zero).
- A ``block_tables`` column is used only when ``0 <= column < M``.
- A push onto a full list (``free_list``, ``step_block_list``) is dropped.
- The pool length is clamped to ``[0, free_list.size]`` and ``step_lens`` to
  ``[0, B]`` on entry.
- Recovery stops at a ``step_block_list`` entry that is not a preempted slot
  (not a slot id, or not ``is_block_step``: a slot listed twice is recovered once).
- ``input_ids`` / ``pre_ids`` positions outside their rows are skipped.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..spec.tensor_table import STEP_PADDLE_TENSORS


def c_div(numerator: int, denominator: int) -> int:
    """Integer division truncating toward zero, as C does."""
    quotient = abs(numerator) // abs(denominator)
    return quotient if (numerator >= 0) == (denominator > 0) else -quotient


def to_int32(value: int) -> int:
    """Wraps ``value`` to int32 the way a C cast does."""
    return (value + 2**31) % 2**32 - 2**31


def _host_copy(value) -> np.ndarray:
    """A fresh C-contiguous NumPy copy of an array or a Paddle tensor."""
    array = value.numpy() if hasattr(value, "numpy") else value
    return np.array(array, copy=True, order="C")


def ref_step_paddle(
    state: Mapping[str, np.ndarray],
    block_size: int,
    encoder_decoder_block_num: int = 0,
) -> dict[str, np.ndarray]:
    """Returns the state after one ``step_paddle`` call; ``state`` is not modified.

    ``state`` maps the 22 tensor names of SPEC to arrays of SPEC's dtypes and
    shapes; the result has the same names, shapes and dtypes.
    ``encoder_decoder_block_num`` is accepted for compatibility and unused.
    """
    del encoder_decoder_block_num  # SPEC: accepted for compatibility only
    if not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(
            f"ref_step_paddle: argument 'block_size': expected a positive int, got {block_size!r}"
        )
    missing = [name for name in STEP_PADDLE_TENSORS if name not in state]
    if missing:
        raise ValueError(f"ref_step_paddle: argument 'state': missing tensors {missing}")

    out = {name: _host_copy(state[name]) for name in STEP_PADDLE_TENSORS}
    # [B] and [B,1] tensors are handled through flat views of the copies.
    flat = {name: array.reshape(-1) for name, array in out.items()}
    stop_flags = flat["stop_flags"]
    seq_lens_this_time = flat["seq_lens_this_time"]
    ori_seq_lens_encoder = flat["ori_seq_lens_encoder"]
    seq_lens_encoder = flat["seq_lens_encoder"]
    seq_lens_decoder = flat["seq_lens_decoder"]
    encoder_block_lens = flat["encoder_block_lens"]
    is_block_step = flat["is_block_step"]
    step_block_list = flat["step_block_list"]
    recover_block_list = flat["recover_block_list"]
    need_block_list = flat["need_block_list"]
    used_list_len = flat["used_list_len"]
    free_list = flat["free_list"]
    step_idx = flat["step_idx"]
    next_tokens = flat["next_tokens"]
    first_token_ids = flat["first_token_ids"]
    block_tables = out["block_tables"]
    input_ids = out["input_ids"]
    pre_ids = out["pre_ids"]

    batch_size = seq_lens_this_time.size
    blocks_per_seq = block_tables.shape[1]
    input_len = input_ids.shape[1]
    pre_ids_len = pre_ids.shape[1]
    free_list_capacity = free_list.size
    max_dec_blocks = input_len // block_size

    # Lengths are clamped to their lists so no index leaves a tensor.
    pool_len = min(max(int(flat["free_list_len"][0]), 0), free_list_capacity)
    step_len = min(max(int(flat["step_lens"][0]), 0), batch_size)

    def next_column(slot: int) -> int:
        """Table column of the position ``slot`` writes next."""
        return c_div(int(seq_lens_decoder[slot]), block_size)

    def push_decoder_blocks(slot: int) -> None:
        """Moves the slot's decoder blocks (columns enc .. enc+used-1 inside
        the table) onto the pool top, clearing their table entries."""
        nonlocal pool_len
        encoder_blocks = int(encoder_block_lens[slot])
        used_blocks = int(used_list_len[slot])
        first = max(encoder_blocks, 0)
        end = min(encoder_blocks + used_blocks, blocks_per_seq)
        for column in range(first, end):
            if pool_len < free_list_capacity:  # a full pool drops the entry
                free_list[pool_len] = block_tables[slot, column]
                pool_len += 1
            block_tables[slot, column] = -1

    def pop_pool() -> int:
        """Takes the block at the pool top; the free_list entry stays as is."""
        nonlocal pool_len
        pool_len -= 1
        return int(free_list[pool_len])

    # ---- Phase 1: Free. ------------------------------------------------------
    needy: list[int] = []  # ascending slot ids
    for slot in range(batch_size):
        running = not stop_flags[slot] and seq_lens_this_time[slot] != 0
        if running and next_column(slot) >= blocks_per_seq:
            stop_flags[slot] = True  # no table column left for its next token
        if stop_flags[slot] and not is_block_step[slot]:
            first_token_ids[slot] = -1
            if used_list_len[slot] > 0:
                push_decoder_blocks(slot)
                encoder_block_lens[slot] = 0
                used_list_len[slot] = 0
        elif not stop_flags[slot] and seq_lens_this_time[slot] != 0:
            # A stopped (preempted) slot is never needy (SPEC, phase 1).
            column = next_column(slot)
            if 0 <= column < blocks_per_seq and block_tables[slot, column] == -1:
                needy.append(slot)

    # ---- Phase 2: Preempt (and Shortfall). ----------------------------------
    def pick_victim(include_full_holders: bool) -> int | None:
        """The running slot holding the most decoder blocks, lowest slot on ties."""
        victim, victim_blocks = None, 0
        for slot in range(batch_size):
            if stop_flags[slot] or is_block_step[slot]:
                continue
            used_blocks = int(used_list_len[slot])
            if not include_full_holders and used_blocks == max_dec_blocks:
                continue  # it is about to finish: spare it while others hold blocks
            if used_blocks > victim_blocks:
                victim, victim_blocks = slot, used_blocks
        return victim

    def preempt(slot: int) -> None:
        nonlocal step_len
        push_decoder_blocks(slot)
        if slot in needy:
            needy.remove(slot)
        if step_len < batch_size:  # a full step_block_list drops the entry
            step_block_list[step_len] = slot
            step_len += 1
        stop_flags[slot] = True
        is_block_step[slot] = True
        seq_lens_this_time[slot] = 0
        seq_lens_decoder[slot] = 0
        # used_list_len is kept: recovery sizes its budget from it.

    include_full_holders = False
    while len(needy) > pool_len:
        victim = pick_victim(include_full_holders)
        if victim is None and not include_full_holders:
            include_full_holders = True  # for the rest of this call
            victim = pick_victim(include_full_holders)
        if victim is None:
            victim = needy[-1]  # Shortfall: nobody holds a block, highest needy slot goes
        preempt(victim)

    # ---- Phase 3: Dispatch. --------------------------------------------------
    for slot in needy:
        block_tables[slot, next_column(slot)] = pop_pool()
        used_list_len[slot] = to_int32(int(used_list_len[slot]) + 1)
    need_block_list[:] = -1
    flat["need_block_len"][0] = 0

    # ---- Phase 4: Recover. ---------------------------------------------------
    # Selection first: walk step_block_list from the top (last preempted first)
    # while the pool left after the budgets granted so far holds the next one.
    recovered: list[tuple[int, int]] = []  # (slot, budget) in recovery order
    pool_left = pool_len
    while step_len > 0:
        slot = int(step_block_list[step_len - 1])
        if not 0 <= slot < batch_size or not is_block_step[slot]:
            break  # not a preempted sequence
        encoder_blocks = int(encoder_block_lens[slot])
        budget = max(
            1,
            min(
                int(used_list_len[slot]) + 1,
                max_dec_blocks - encoder_blocks,
                blocks_per_seq - encoder_blocks,
            ),
        )
        if pool_left < budget:
            break
        is_block_step[slot] = False
        used_list_len[slot] = budget
        step_block_list[step_len - 1] = -1
        step_len -= 1
        if len(recovered) < recover_block_list.size:
            recover_block_list[len(recovered)] = slot
        recovered.append((slot, budget))
        pool_left -= budget

    # Then, in recovery order: blocks off the pool top, inputs for a re-prefill.
    for slot, budget in recovered:
        encoder_blocks = int(encoder_block_lens[slot])
        for i in range(budget):
            block = pop_pool()  # popped even when its column is outside the table
            if 0 <= encoder_blocks + i < blocks_per_seq:
                block_tables[slot, encoder_blocks + i] = block

        prompt_len = int(ori_seq_lens_encoder[slot])
        steps = int(step_idx[slot])
        prefill_len = to_int32(prompt_len + steps)
        seq_lens_this_time[slot] = prefill_len
        seq_lens_encoder[slot] = prefill_len
        stop_flags[slot] = False

        if input_len > 0:
            input_ids[slot, 0] = first_token_ids[slot]
        # input_ids[slot, prompt_len + i] = pre_ids[slot, i + 1] for i < steps - 1;
        # the range keeps both positions inside their rows.
        for i in range(
            max(0, -prompt_len), min(steps - 1, pre_ids_len - 1, input_len - prompt_len)
        ):
            input_ids[slot, prompt_len + i] = pre_ids[slot, i + 1]
        last_position = prompt_len + steps - 1
        if 0 <= last_position < input_len:
            input_ids[slot, last_position] = next_tokens[slot]

    flat["recover_lens"][0] = 0
    flat["step_lens"][0] = step_len
    flat["free_list_len"][0] = pool_len
    return out
