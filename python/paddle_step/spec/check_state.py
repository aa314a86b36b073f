"""Host-side validation of a ``step_paddle`` state (docs/SPEC.md's invariants).

Needs only NumPy: it works on Paddle tensors (through ``.numpy()``) or NumPy
arrays and never imports the compiled ops. ``check_state`` runs one check per
family of invariants (layout, lengths and lists, block ids, per-slot tables)
and reports every violation at once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

import numpy as np

from .tensor_table import STEP_PADDLE_TABLE, STEP_PADDLE_TENSORS

__all__ = ["StateError", "check_state"]


class StateError(ValueError):
    """A state breaks SPEC's invariants; ``violations`` lists each one."""

    def __init__(self, violations: Iterable[str]):
        self.violations = list(violations)
        lines = "\n".join(f"  - {violation}" for violation in self.violations)
        super().__init__(f"step_paddle state: {len(self.violations)} violation(s):\n{lines}")


def _to_numpy(value) -> np.ndarray:
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)


def _c_div(numerator: int, denominator: int) -> int:
    """Integer division truncating toward zero, as the kernels compute it."""
    quotient = abs(numerator) // abs(denominator)
    return quotient if (numerator >= 0) == (denominator > 0) else -quotient


def _batch_size(arrays: Mapping[str, np.ndarray]) -> int | None:
    """B from a usable block_tables, else from seq_lens_this_time, else None."""
    block_tables = arrays.get("block_tables")
    if block_tables is not None and block_tables.ndim == 2:
        return block_tables.shape[0]
    lens = arrays.get("seq_lens_this_time")
    if lens is not None:
        return lens.shape[0] if lens.ndim else 0
    return None


def _shape_problem(name: str, kind: str, shape: tuple, batch_size: int | None) -> str | None:
    """The violation of SPEC's shape ``kind`` by ``shape``, or None."""
    if kind in ("[B]", "[B or B,1]"):
        allowed = [(batch_size,)] + ([(batch_size, 1)] if kind == "[B or B,1]" else [])
        if batch_size is None or shape in allowed:
            return None
        wanted = " or ".join(str(list(s)) for s in allowed)
        return f"{name}: expected shape {wanted}, got {list(shape)}"
    if kind == "[1]":
        return None if shape == (1,) else f"{name}: expected shape [1], got {list(shape)}"
    if kind == "[N]":
        return None if len(shape) == 1 else f"{name}: expected shape [N], got {list(shape)}"
    if kind == "[B,M]":
        return None if len(shape) == 2 else f"{name}: expected shape [B, M], got {list(shape)}"
    # [B,L] and [B,P]: any width.
    if len(shape) != 2 or (batch_size is not None and shape[0] != batch_size):
        return f"{name}: expected shape [{batch_size}, *], got {list(shape)}"
    return None


def _distinct_ids(
    entries: list[int], list_name: str, kind: str, limit: int, problems: list[str]
) -> dict[int, int]:
    """The first position of each entry of ``list_name`` that is a ``kind`` id in
    [0, limit); a problem for every other entry (out of range, or a repeat)."""
    first_positions: dict[int, int] = {}
    for position, value in enumerate(entries):
        if not 0 <= value < limit:
            problems.append(
                f"{list_name}[{position}] is {value}, expected a {kind} id in [0, {limit})"
            )
        elif value in first_positions:
            problems.append(
                f"{kind} {value} is in {list_name} twice: {list_name}[{first_positions[value]}]"
                f" and {list_name}[{position}]"
            )
        else:
            first_positions[value] = position
    return first_positions


def _check_layout(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Dtype and shape of every tensor, per SPEC's table."""
    problems = []
    missing = [name for name in STEP_PADDLE_TENSORS if name not in arrays]
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    batch_size = _batch_size(arrays)
    for spec in STEP_PADDLE_TABLE:
        array = arrays.get(spec.name)
        if array is None:
            continue
        problem = _shape_problem(spec.name, spec.shape, tuple(array.shape), batch_size)
        if problem:
            problems.append(problem)
        if array.dtype != spec.dtype:
            problems.append(
                f"{spec.name}: expected dtype {spec.dtype.name}, got {array.dtype.name}"
            )
    return problems


def _check_lengths_and_lists(
    flat: Mapping[str, np.ndarray], batch_size: int, after_step: bool
) -> list[str]:
    """Scalar lengths in range, scratch lists reset, step_block_list agreeing with
    is_block_step, preempted slots stopped with no decoded positions, no negative
    per-slot length."""
    problems = []
    free_list_capacity = flat["free_list"].size
    free_list_len = int(flat["free_list_len"][0])
    if not 0 <= free_list_len <= free_list_capacity:
        problems.append(
            f"free_list_len is {free_list_len}, expected 0 <= free_list_len <= "
            f"{free_list_capacity} (free_list size)"
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

    step_lens = int(flat["step_lens"][0])
    is_block_step = flat["is_block_step"]
    listed = flat["step_block_list"][: min(max(step_lens, 0), batch_size)].tolist()
    listed_slots = _distinct_ids(listed, "step_block_list", "slot", batch_size, problems)
    for slot, position in listed_slots.items():
        if not is_block_step[slot]:
            problems.append(
                f"slot {slot} is in step_block_list[{position}] but is_block_step is false"
            )
    for slot in np.flatnonzero(is_block_step).tolist():
        if slot not in listed_slots:
            problems.append(
                f"slot {slot} is preempted (is_block_step) but not in step_block_list[:{step_lens}]"
            )
        if not flat["stop_flags"][slot]:
            problems.append(f"slot {slot} is preempted (is_block_step) but stop_flags is false")
        # Preemption zeroes seq_lens_decoder and recovery re-prefills from position 0, so
        # a preempted slot never has cached positions to decode from.
        if flat["seq_lens_decoder"][slot] != 0:
            problems.append(
                f"slot {slot} is preempted (is_block_step) but seq_lens_decoder is "
                f"{int(flat['seq_lens_decoder'][slot])}, expected 0"
            )

    for name in (
        "seq_lens_this_time",
        "seq_lens_encoder",
        "seq_lens_decoder",
        "encoder_block_lens",
        "used_list_len",
    ):
        for slot in np.flatnonzero(flat[name] < 0).tolist():
            problems.append(f"slot {slot}: {name} is {int(flat[name][slot])}, expected >= 0")
    return problems


def _check_block_ids(
    block_tables: np.ndarray,
    encoder_lens: np.ndarray,
    pool: np.ndarray,
    num_blocks: int,
    decoder_blocks: Iterable[int] | None,
    shared_prompt_blocks: Iterable[int] | None,
) -> list[str]:
    """Block ids in ``[0, num_blocks)``, each owned or pooled once (a block of
    ``shared_prompt_blocks`` may sit in several slots' encoder columns), and (given
    ``decoder_blocks``) every decoder block accounted for and nothing else in the pool."""
    problems = []

    owners: dict[int, list[tuple[int, int]]] = defaultdict(list)  # block -> [(slot, column)]
    for slot, column in zip(*np.nonzero(block_tables != -1)):
        slot, column = int(slot), int(column)
        block = int(block_tables[slot, column])
        if not 0 <= block < num_blocks:
            problems.append(
                f"slot {slot}: block_tables[{slot}, {column}] is {block}, expected -1 or a "
                f"block id in [0, {num_blocks})"
            )
        else:
            owners[block].append((slot, column))
    shareable = {int(block) for block in shared_prompt_blocks or ()}

    def shared_prompt_block(block: int, places: list[tuple[int, int]]) -> bool:
        return block in shareable and all(column < encoder_lens[slot] for slot, column in places)

    for block, places in owners.items():
        if len(places) > 1 and not shared_prompt_block(block, places):
            where = ", ".join(f"slot {slot} column {column}" for slot, column in places)
            problems.append(f"block {block} is owned twice: {where}")

    pool_positions = _distinct_ids(pool.tolist(), "free_list", "block", num_blocks, problems)
    for block, position in pool_positions.items():
        if block in owners:
            slot, column = owners[block][0]
            problems.append(
                f"block {block} is both in the pool (free_list[{position}]) and owned by "
                f"slot {slot} (column {column})"
            )

    if decoder_blocks is not None:
        decoder_set = {int(block) for block in decoder_blocks}
        for block in sorted(decoder_set - pool_positions.keys() - owners.keys()):
            problems.append(
                f"decoder block {block} is lost: neither in the pool nor in any block table"
            )
        for block, position in pool_positions.items():
            if block not in decoder_set:
                problems.append(
                    f"free_list[{position}] is block {block}, which is not a decoder block"
                )
    return problems


def _check_slot_tables(
    flat: Mapping[str, np.ndarray], block_tables: np.ndarray, block_size: int, after_step: bool
) -> list[str]:
    """Each slot's table row: encoder then decoder columns filled, nothing past them, no
    decoder block on a finished or preempted slot, and (after a step) a block for every
    position a running slot writes next."""
    problems = []
    blocks_per_seq = block_tables.shape[1]
    for slot in range(block_tables.shape[0]):
        encoder_blocks = int(flat["encoder_block_lens"][slot])
        used_blocks = int(flat["used_list_len"][slot])
        stopped = bool(flat["stop_flags"][slot])
        preempted = bool(flat["is_block_step"][slot])
        if encoder_blocks + used_blocks > blocks_per_seq:
            problems.append(
                f"slot {slot}: encoder_block_lens + used_list_len is "
                f"{encoder_blocks}+{used_blocks}, expected <= {blocks_per_seq} "
                "(blocks per sequence)"
            )
        row = block_tables[slot]
        held = row != -1
        encoder_end = min(max(encoder_blocks, 0), blocks_per_seq)
        if stopped and not preempted and after_step:
            # step_paddle has freed it: no decoder block left. Its encoder blocks
            # stay until the host releases them (encoder_block_lens may be 0).
            if used_blocks > 0:
                problems.append(
                    f"slot {slot} is stopped and not preempted but still holds {used_blocks} "
                    "decoder block(s) (used_list_len), expected 0 after step_paddle"
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
                    f"slot {slot} is preempted but holds blocks {row[stray].tolist()} in "
                    f"decoder columns {stray}"
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
        if after_step and not stopped and flat["seq_lens_this_time"][slot] > 0:
            problems.extend(_missing_write_blocks(flat, row, slot, block_size))
    return problems


def _missing_write_blocks(
    flat: Mapping[str, np.ndarray], row: np.ndarray, slot: int, block_size: int
) -> list[str]:
    """A running slot must have blocks for every position it writes next: one decode
    token, or all its (re-)prefill tokens."""
    this_time = int(flat["seq_lens_this_time"][slot])
    first_position = int(flat["seq_lens_decoder"][slot])
    last_position = first_position + this_time - 1
    missing = [
        column
        for column in range(
            _c_div(first_position, block_size), _c_div(last_position, block_size) + 1
        )
        if not 0 <= column < row.size or row[column] == -1
    ]
    if not missing:
        return []
    what = (
        "its next write position"
        if first_position == last_position
        else (f"its tokens at positions {first_position}..{last_position}")
    )
    return [
        f"slot {slot} is running but has no block in column(s) {missing} for {what} "
        f"(seq_lens_decoder={first_position}, seq_lens_this_time={this_time}, "
        f"seq_lens_encoder={int(flat['seq_lens_encoder'][slot])})"
    ]


def check_state(
    tensors: Mapping[str, object],
    block_size: int,
    *,
    after_step: bool = True,
    num_blocks: int | None = None,
    decoder_blocks: Iterable[int] | None = None,
    shared_prompt_blocks: Iterable[int] | None = None,
) -> None:
    """Raises ``StateError`` listing every way ``tensors`` breaks SPEC's invariants.

    ``tensors`` maps SPEC's 22 names to Paddle tensors or NumPy arrays.
    ``after_step=True`` checks a state ``step_paddle`` has just returned (its
    scratch lists are reset, stopped slots hold no decoder block, running slots
    have the blocks they write next); ``False`` checks a state it is about to
    receive. Block ids must lie in ``[0, num_blocks)``; ``num_blocks`` defaults
    to ``max(free_list.size, largest id + 1)``. ``decoder_blocks``, when given,
    is the set of decoder block ids: each must be in the pool or in a table
    (none lost) and the pool must hold nothing else. ``shared_prompt_blocks``, when
    given, are ids that several slots may hold at once in their encoder columns (prompt
    blocks a host's prefix cache shares; SPEC leaves encoder blocks to the host).
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
    free_list = flat["free_list"]
    pool = free_list[: min(max(int(flat["free_list_len"][0]), 0), free_list.size)]
    if num_blocks is None:
        largest_id = max(int(block_tables.max(initial=-1)), int(pool.max(initial=-1)))
        num_blocks = max(free_list.size, largest_id + 1)
    problems = [
        *_check_lengths_and_lists(flat, block_tables.shape[0], after_step),
        *_check_block_ids(
            block_tables,
            flat["encoder_block_lens"],
            pool,
            num_blocks,
            decoder_blocks,
            shared_prompt_blocks,
        ),
        *_check_slot_tables(flat, block_tables, block_size, after_step),
    ]
    if problems:
        raise StateError(problems)
