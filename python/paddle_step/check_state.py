"""Host-side validation of a ``step_paddle`` state (SPEC's invariants).

Needs only NumPy: it works on Paddle tensors (through ``.numpy()``) or NumPy
arrays and never imports the compiled ops.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

import numpy as np

__all__ = ["STEP_PADDLE_TENSORS", "StateError", "check_state"]

# SPEC's tensors, in FastDeploy's argument order.
STEP_PADDLE_TENSORS = (
    "stop_flags",
    "seq_lens_this_time",
    "ori_seq_lens_encoder",
    "seq_lens_encoder",
    "seq_lens_decoder",
    "block_tables",
    "encoder_block_lens",
    "is_block_step",
    "step_block_list",
    "step_lens",
    "recover_block_list",
    "recover_lens",
    "need_block_list",
    "need_block_len",
    "used_list_len",
    "free_list",
    "free_list_len",
    "input_ids",
    "pre_ids",
    "step_idx",
    "next_tokens",
    "first_token_ids",
)

# Per-slot tensors: dtype and whether SPEC also allows the shape [B, 1].
_PER_SLOT = {
    "stop_flags": (np.bool_, True),
    "is_block_step": (np.bool_, False),
    "seq_lens_this_time": (np.int32, True),
    "ori_seq_lens_encoder": (np.int32, True),
    "seq_lens_encoder": (np.int32, True),
    "seq_lens_decoder": (np.int32, True),
    "encoder_block_lens": (np.int32, True),
    "used_list_len": (np.int32, True),
    "step_block_list": (np.int32, True),
    "recover_block_list": (np.int32, True),
    "need_block_list": (np.int32, True),
    "step_idx": (np.int64, True),
    "next_tokens": (np.int64, True),
    "first_token_ids": (np.int64, True),
}
_LENGTHS = ("step_lens", "recover_lens", "need_block_len", "free_list_len")  # int32 [1]


class StateError(ValueError):
    """A state breaks SPEC's invariants; ``violations`` lists each one."""

    def __init__(self, violations: Iterable[str]):
        self.violations = list(violations)
        lines = "\n".join(f"  - {violation}" for violation in self.violations)
        super().__init__(
            f"step_paddle state: {len(self.violations)} violation(s):\n{lines}"
        )


def _to_numpy(value) -> np.ndarray:
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)


def _c_div(numerator: int, denominator: int) -> int:
    """Integer division truncating toward zero, as the kernels compute it."""
    quotient = abs(numerator) // abs(denominator)
    return quotient if (numerator >= 0) == (denominator > 0) else -quotient


def _check_layout(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Dtype and shape of every tensor, per SPEC."""
    problems = []
    missing = [name for name in STEP_PADDLE_TENSORS if name not in arrays]
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")

    def expect_dtype(name, dtype):
        if name in arrays and arrays[name].dtype != dtype:
            problems.append(
                f"{name}: expected dtype {np.dtype(dtype).name}, got {arrays[name].dtype.name}"
            )

    block_tables = arrays.get("block_tables")
    if block_tables is not None and block_tables.ndim != 2:
        problems.append(f"block_tables: expected shape [B, M], got {list(block_tables.shape)}")
        block_tables = None
    expect_dtype("block_tables", np.int32)
    # B comes from block_tables when it is usable, else from seq_lens_this_time.
    if block_tables is not None:
        batch_size = block_tables.shape[0]
    elif "seq_lens_this_time" in arrays:
        batch_size = arrays["seq_lens_this_time"].shape[0] if arrays["seq_lens_this_time"].ndim else 0
    else:
        batch_size = None

    for name, (dtype, allows_column) in _PER_SLOT.items():
        if name not in arrays:
            continue
        expect_dtype(name, dtype)
        shape = tuple(arrays[name].shape)
        allowed = [(batch_size,)] + ([(batch_size, 1)] if allows_column else [])
        if batch_size is not None and shape not in allowed:
            wanted = " or ".join(str(list(s)) for s in allowed)
            problems.append(f"{name}: expected shape {wanted}, got {list(shape)}")

    for name in _LENGTHS:
        if name in arrays:
            expect_dtype(name, np.int32)
            if tuple(arrays[name].shape) != (1,):
                problems.append(f"{name}: expected shape [1], got {list(arrays[name].shape)}")

    if "free_list" in arrays:
        expect_dtype("free_list", np.int32)
        if arrays["free_list"].ndim != 1:
            problems.append(f"free_list: expected shape [N], got {list(arrays['free_list'].shape)}")

    for name in ("input_ids", "pre_ids"):
        if name in arrays:
            expect_dtype(name, np.int64)
            shape = list(arrays[name].shape)
            if len(shape) != 2 or (batch_size is not None and shape[0] != batch_size):
                problems.append(f"{name}: expected shape [{batch_size}, *], got {shape}")
    return problems


def check_state(
    tensors: Mapping[str, object],
    block_size: int,
    *,
    after_step: bool = True,
    num_blocks: int | None = None,
    decoder_blocks: Iterable[int] | None = None,
) -> None:
    """Raises ``StateError`` listing every way ``tensors`` breaks SPEC's invariants.

    ``tensors`` maps SPEC's 22 names to Paddle tensors or NumPy arrays.
    ``after_step=True`` checks a state ``step_paddle`` has just returned (its
    scratch lists are reset, stopped slots hold no decoder block, running slots
    have the blocks they write next); ``False`` checks a state it is about to
    receive. Block ids must lie in ``[0, num_blocks)``; ``num_blocks`` defaults
    to ``max(free_list.size, largest id + 1)``. ``decoder_blocks``, when given,
    is the set of decoder block ids: each must be in the pool or in a table
    (none lost) and the pool must hold nothing else.
    Returns None when the state is fine.
    """
    if not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(
            f"check_state: argument 'block_size': expected a positive int, got {block_size!r}"
        )
    arrays = {name: _to_numpy(tensors[name]) for name in STEP_PADDLE_TENSORS if name in tensors}
    layout_problems = _check_layout(arrays)
    if layout_problems:  # the checks below index by the layout
        raise StateError(layout_problems)

    flat = {name: array.reshape(-1) for name, array in arrays.items()}
    block_tables = arrays["block_tables"]
    batch_size, blocks_per_seq = block_tables.shape
    stop_flags = flat["stop_flags"]
    is_block_step = flat["is_block_step"]
    seq_lens_this_time = flat["seq_lens_this_time"]
    seq_lens_encoder = flat["seq_lens_encoder"]
    seq_lens_decoder = flat["seq_lens_decoder"]
    encoder_block_lens = flat["encoder_block_lens"]
    used_list_len = flat["used_list_len"]
    free_list = flat["free_list"]
    free_list_capacity = free_list.size
    free_list_len = int(flat["free_list_len"][0])
    step_lens = int(flat["step_lens"][0])
    problems: list[str] = []

    # ---- Lengths and lists. -----------------------------------------------
    if not 0 <= free_list_len <= free_list_capacity:
        problems.append(
            f"free_list_len is {free_list_len}, expected 0 <= free_list_len <= {free_list_capacity} (free_list size)"
        )
    for name in ("step_lens", "need_block_len", "recover_lens"):
        value = int(flat[name][0])
        if not 0 <= value <= batch_size:
            problems.append(f"{name} is {value}, expected 0 <= {name} <= {batch_size} (B)")
    if after_step:
        for name in ("need_block_len", "recover_lens"):
            if flat[name][0] != 0:
                problems.append(f"{name} is {int(flat[name][0])}, expected 0 after step_paddle")
        stale = np.flatnonzero(flat["need_block_list"] != -1)
        if stale.size:
            problems.append(
                f"need_block_list entries {stale.tolist()} are not -1 after step_paddle"
            )

    listed_slots: set[int] = set()
    for position in range(min(max(step_lens, 0), batch_size)):
        slot = int(flat["step_block_list"][position])
        if not 0 <= slot < batch_size:
            problems.append(
                f"step_block_list[{position}] is {slot}, expected a slot id in [0, {batch_size})"
            )
        elif slot in listed_slots:
            problems.append(f"slot {slot} is in step_block_list twice (again at position {position})")
        else:
            listed_slots.add(slot)
            if not is_block_step[slot]:
                problems.append(
                    f"slot {slot} is in step_block_list[{position}] but is_block_step is false"
                )
    for slot in np.flatnonzero(is_block_step).tolist():
        if slot not in listed_slots:
            problems.append(
                f"slot {slot} is preempted (is_block_step) but not in step_block_list[:{step_lens}]"
            )
        if not stop_flags[slot]:
            problems.append(f"slot {slot} is preempted (is_block_step) but stop_flags is false")

    for name in ("seq_lens_this_time", "seq_lens_encoder", "seq_lens_decoder",
                 "encoder_block_lens", "used_list_len"):
        for slot in np.flatnonzero(flat[name] < 0).tolist():
            problems.append(f"slot {slot}: {name} is {int(flat[name][slot])}, expected >= 0")

    # ---- Block ids: range, ownership, pool. -------------------------------
    pool = free_list[: min(max(free_list_len, 0), free_list_capacity)]
    if num_blocks is None:
        largest_id = max(int(block_tables.max(initial=-1)), int(pool.max(initial=-1)))
        num_blocks = max(free_list_capacity, largest_id + 1)

    owners: dict[int, list[tuple[int, int]]] = defaultdict(list)  # block -> [(slot, column)]
    for slot, column in zip(*np.nonzero(block_tables != -1)):
        slot, column = int(slot), int(column)
        block = int(block_tables[slot, column])
        if not 0 <= block < num_blocks:
            problems.append(
                f"slot {slot}: block_tables[{slot}, {column}] is {block}, expected -1 or a block id in [0, {num_blocks})"
            )
        else:
            owners[block].append((slot, column))
    for block, places in owners.items():
        if len(places) > 1:
            where = ", ".join(f"slot {slot} column {column}" for slot, column in places)
            problems.append(f"block {block} is owned twice: {where}")

    pool_positions: dict[int, int] = {}
    for position, block in enumerate(pool.tolist()):
        if not 0 <= block < num_blocks:
            problems.append(
                f"free_list[{position}] is {block}, expected a block id in [0, {num_blocks})"
            )
        elif block in pool_positions:
            problems.append(
                f"block {block} is in the pool twice: free_list[{pool_positions[block]}] and free_list[{position}]"
            )
        else:
            pool_positions[block] = position
            if block in owners:
                slot, column = owners[block][0]
                problems.append(
                    f"block {block} is both in the pool (free_list[{position}]) and owned by slot {slot} (column {column})"
                )

    if decoder_blocks is not None:
        decoder_set = {int(block) for block in decoder_blocks}
        for block in sorted(decoder_set - pool_positions.keys() - owners.keys()):
            problems.append(f"decoder block {block} is lost: neither in the pool nor in any block table")
        for block, position in pool_positions.items():
            if block not in decoder_set:
                problems.append(f"free_list[{position}] is block {block}, which is not a decoder block")

    # ---- Per-slot table layout. -------------------------------------------
    for slot in range(batch_size):
        encoder_blocks = int(encoder_block_lens[slot])
        used_blocks = int(used_list_len[slot])
        stopped = bool(stop_flags[slot])
        preempted = bool(is_block_step[slot])
        if encoder_blocks + used_blocks > blocks_per_seq:
            problems.append(
                f"slot {slot}: encoder_block_lens + used_list_len is {encoder_blocks}+{used_blocks}, "
                f"expected <= {blocks_per_seq} (blocks per sequence)"
            )
        row = block_tables[slot]
        held = row != -1
        encoder_end = min(max(encoder_blocks, 0), blocks_per_seq)
        if stopped and not preempted and after_step:
            # step_paddle has freed it: no decoder block left. Its encoder blocks
            # stay until the host releases them (encoder_block_lens may be 0).
            if used_blocks > 0:
                problems.append(
                    f"slot {slot} is stopped and not preempted but still holds {used_blocks} decoder "
                    f"block(s) (used_list_len), expected 0 after step_paddle"
                )
            continue
        empty_encoder = np.flatnonzero(~held[:encoder_end]).tolist()
        if empty_encoder:
            problems.append(
                f"slot {slot}: encoder columns {empty_encoder} are -1, expected block ids "
                f"(encoder_block_lens is {encoder_blocks})"
            )
        if preempted:
            stray = (np.flatnonzero(held[encoder_end:]) + encoder_end).tolist()
            if stray:
                problems.append(
                    f"slot {slot} is preempted but holds blocks {row[stray].tolist()} in decoder columns {stray}"
                )
            continue
        decoder_end = min(max(encoder_end + used_blocks, encoder_end), blocks_per_seq)
        empty_decoder = (np.flatnonzero(~held[encoder_end:decoder_end]) + encoder_end).tolist()
        if empty_decoder:
            problems.append(
                f"slot {slot}: decoder columns {empty_decoder} are -1, expected block ids "
                f"(used_list_len is {used_blocks})"
            )
        beyond = (np.flatnonzero(held[decoder_end:]) + decoder_end).tolist()
        if beyond:
            problems.append(
                f"slot {slot}: columns {beyond} hold blocks {row[beyond].tolist()} past its "
                f"{encoder_blocks} encoder + {used_blocks} decoder blocks, expected -1"
            )

        # A running slot must have blocks for every position it writes next:
        # one decode token, or all its (re-)prefill tokens.
        if after_step and not stopped and seq_lens_this_time[slot] > 0:
            first_position = int(seq_lens_decoder[slot])
            last_position = first_position + int(seq_lens_this_time[slot]) - 1
            first_column = _c_div(first_position, block_size)
            last_column = _c_div(last_position, block_size)
            missing = [
                column for column in range(first_column, last_column + 1)
                if not 0 <= column < blocks_per_seq or row[column] == -1
            ]
            if missing:
                what = "its next write position" if first_position == last_position else (
                    f"its tokens at positions {first_position}..{last_position}"
                )
                problems.append(
                    f"slot {slot} is running but has no block in column(s) {missing} for {what} "
                    f"(seq_lens_decoder={first_position}, seq_lens_this_time={int(seq_lens_this_time[slot])}, "
                    f"seq_lens_encoder={int(seq_lens_encoder[slot])})"
                )

    if problems:
        raise StateError(problems)
