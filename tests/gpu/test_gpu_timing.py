"""Kernel times of both ops on the GPU, without the host in the measurement.

Method (README.md, "Kernel times"): CALLS_PER_GRAPH launches of one op on the
same buffers are captured into one CUDA graph; the graph is replayed (one
untimed warm-up, then REPLAYS timed replays, CUDA events around each); the
per-call time is the best replay's time / CALLS_PER_GRAPH. The host wall time
per call is measured apart: time.perf_counter around HOST_CALLS direct ctypes
launches followed by one stream synchronize, divided by HOST_CALLS.

The ops work in place, so each row says which state the repeated calls see:

- step_paddle "steady decode": every slot decoding inside a block it holds;
  a call changes nothing (no block crossed, nobody finished, preempted or
  recovered), so repeated calls are identical, no restore.
- step_paddle "N preemptions" / "N recoveries": a state on which one call
  preempts / recovers exactly N slots. Each captured call is preceded by a
  device-to-device copy of the op's written tensors from a pristine copy
  (captured too), so all calls do that work; the copies alone are timed in
  their own graph and subtracted (both figures printed).
- advance_step: restore-free; each call advances seq_lens by one, and the
  block tables are wide enough that every position stays mapped.
- floor: one trivial kernel (x += 1 on B int64, launch_wrappers.cu).

`pytest -s tests/gpu/test_gpu_timing.py` (or `make -C tests/gpu bench`) prints
a markdown table. test_timing_state_* check the states on the CPU (NumPy
reference) and run without a GPU.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import pytest

from paddle_step.spec.tensor_table import STEP_PADDLE_OUTPUTS, STEP_PADDLE_TENSORS
from paddle_step.testing.advance_step_cases import ADVANCE_STEP_OUTPUTS
from paddle_step.testing.fake_decode_loop import add_preempted, add_running, make_state
from paddle_step.testing.ref_advance_step import ref_advance_step
from paddle_step.testing.ref_step_paddle import ref_step_paddle
from paddle_step.testing.step_paddle_cases import assert_same_bytes

CALLS_PER_GRAPH = 200
WARMUP_REPLAYS = 1
REPLAYS = 5
HOST_WARMUP = 10
HOST_CALLS = 200
# Calls each buffer sees in one row (advance_step and the floor are never restored):
# one first launch outside any capture (it loads the kernel: CUDA lazy loading),
# the graph's replays, the host-wall loop.
CALLS_PER_ROW = 1 + CALLS_PER_GRAPH * (WARMUP_REPLAYS + REPLAYS) + HOST_WARMUP + HOST_CALLS


@dataclass(frozen=True)
class Geometry:
    """Shapes and sequence lengths of a step_paddle timing state."""

    block_size: int
    max_model_len: int  # L = input_ids.shape[1]; max_dec_blocks = L / block_size
    blocks_per_seq: int  # M
    prompt_len: int
    preempted_step_idx: int  # tokens a preempted slot had generated: re-prefill = prompt + these
    preempted_used: int  # used_list_len of a preempted slot

    @property
    def encoder_blocks(self) -> int:
        return -(-self.prompt_len // self.block_size)

    @property
    def recovery_budget(self) -> int:
        """SPEC's budget of a preempted slot of this geometry."""
        room = min(self.max_model_len // self.block_size, self.blocks_per_seq)
        return max(1, min(self.preempted_used + 1, room - self.encoder_blocks))


# benchmarks/bench_ops.py's geometry: L = 256 tokens, 8-token blocks, 32 table
# columns, one encoder block; a preempted slot re-prefills 4 + 16 tokens.
SHORT = Geometry(8, 256, 32, 4, 16, 2)
# A preempted slot that re-prefills 1024 + 3072 tokens into 48 fresh blocks:
# the copy of its generated tokens into input_ids is the bulk of the work.
LONG = Geometry(64, 4096, 64, 1024, 3072, 48)
STEADY_BLOCKS = 2  # decoder blocks of a steady slot
VICTIM_BLOCKS = 4  # decoder blocks of a slot the preemption rows preempt

# The batch sizes of the steady rows, of advance_step and of the floor.
BATCHES = (1, 64, 255, 1024, 4096, 16384)
# (state, B, preemptions, recoveries, geometry): steady decode at each of BATCHES, the
# event rows of issue 14, and two recovery rows with long sequences.
STEP_ROWS = (
    *(("steady decode", batch, 0, 0, SHORT) for batch in BATCHES),
    ("5 preemptions", 64, 5, 0, SHORT),
    ("32 preemptions", 255, 32, 0, SHORT),
    ("2 recoveries", 64, 0, 2, SHORT),
    ("1 recovery", 255, 0, 1, SHORT),
    ("2 recoveries, 4096-token re-prefills", 64, 0, 2, LONG),
    ("1 recovery, 4096-token re-prefill", 255, 0, 1, LONG),
)

# advance_step geometry: 16-token blocks, seq_lens starting below 64, tables wide
# enough for every position a row reaches.
ADVANCE_BLOCK_SIZE = 16
ADVANCE_START_MAX = 64
ADVANCE_COLUMNS = 128
assert ADVANCE_START_MAX + CALLS_PER_ROW < ADVANCE_COLUMNS * ADVANCE_BLOCK_SIZE


# ---- States. ------------------------------------------------------------------


def timing_state(
    batch: int, preemptions: int = 0, recoveries: int = 0, geometry: Geometry = SHORT
) -> dict:
    """A step_paddle input (NumPy) on which one call preempts exactly
    `preemptions` and recovers exactly `recoveries` slots; with neither, a
    steady decode state that the call leaves unchanged.

    Steady slot: its encoder blocks + STEADY_BLOCKS decoder blocks, writing
    inside its last block. Preemptions: slots 0..p-1 hold VICTIM_BLOCKS blocks
    each (the largest holders, so the victims) and p * VICTIM_BLOCKS other
    slots are needy (at a block boundary) with an empty pool: exactly p victims
    free enough blocks. Recoveries: slots 0..r were preempted earlier (r + 1 on
    step_block_list, used_list_len geometry.preempted_used) and the pool holds
    r budgets: the walk from the last entry recovers r and stops at slot 0.
    """
    g = geometry
    kinds = ["steady"] * batch
    pool = 0
    if preemptions:
        needy = preemptions * VICTIM_BLOCKS
        assert preemptions + needy <= batch, "not enough slots for that many preemptions"
        kinds[:preemptions] = ["victim"] * preemptions
        kinds[preemptions : preemptions + needy] = ["needy"] * needy
    if recoveries:
        assert recoveries + 1 <= batch, "not enough slots for that many recoveries"
        assert not preemptions, "one kind of event per row"
        kinds[: recoveries + 1] = ["preempted"] * (recoveries + 1)
        pool = recoveries * g.recovery_budget
    decoder_blocks = {"steady": STEADY_BLOCKS, "victim": VICTIM_BLOCKS, "needy": 1, "preempted": 0}
    held = sum(decoder_blocks[kind] for kind in kinds)
    capacity = held + pool  # decoder blocks 0..capacity-1; the pool holds the last `pool`
    state = make_state(
        batch,
        g.blocks_per_seq,
        g.max_model_len,
        free_list=range(held, capacity),
        free_list_size=max(capacity, 1),
    )
    next_block = 0
    for slot, kind in enumerate(kinds):
        # Encoder block ids follow the decoder ones.
        first_encoder = capacity + slot * g.encoder_blocks
        encoder = list(range(first_encoder, first_encoder + g.encoder_blocks))
        if kind == "preempted":
            add_preempted(
                state,
                slot,
                encoder_blocks=encoder,
                used_list_len=g.preempted_used,
                prompt_len=g.prompt_len,
                step_idx=g.preempted_step_idx,
            )
            continue
        count = decoder_blocks[kind]
        decoder = list(range(next_block, next_block + count))
        next_block += count
        # Columns up to encoder + count - 1 hold blocks; a needy slot writes the
        # next column (-1), the others write inside the last one they hold.
        held_columns = g.encoder_blocks + count
        if kind == "needy":
            position = held_columns * g.block_size
        else:
            position = (held_columns - 1) * g.block_size + 3
        add_running(
            state,
            slot,
            encoder_blocks=encoder,
            decoder_blocks=decoder,
            seq_lens_decoder=position,
            prompt_len=g.prompt_len,
        )
    assert next_block == held
    return {name: state[name] for name in STEP_PADDLE_TENSORS}


def events_of_call(before: dict, after: dict) -> tuple[int, int]:
    """(preemptions, recoveries) of the step_paddle call that took `before` to `after`."""
    recovered = int((np.asarray(after["recover_block_list"]).reshape(-1) >= 0).sum())
    preempted = int(after["step_lens"][0]) - int(before["step_lens"][0]) + recovered
    return preempted, recovered


def advance_state(batch: int) -> dict:
    """advance_step input: num_queries = num_seqs = B, every row mapped."""
    rng = np.random.default_rng(batch)
    return {
        "input_tokens": np.zeros(batch, np.int64),
        "sampled_token_ids": rng.integers(1, 50_000, size=(batch, 1)).astype(np.int64),
        "input_positions": np.zeros(batch, np.int64),
        "seq_lens": rng.integers(0, ADVANCE_START_MAX, size=batch).astype(np.int32),
        "slot_mapping": np.zeros(batch, np.int64),
        "block_tables": rng.integers(0, 50_000, size=(batch, ADVANCE_COLUMNS)).astype(np.int32),
    }


class PackedArrays:
    """Host arrays packed into one uint8 array at 256-byte aligned offsets, so
    that one device allocation holds them all and one copy restores them."""

    ALIGN = 256

    def __init__(self, arrays: dict):
        self.layout = {}  # name -> (offset, dtype, shape)
        offset = 0
        for name, array in arrays.items():
            array = np.ascontiguousarray(array)
            self.layout[name] = (offset, array.dtype, array.shape)
            offset += -(-max(array.nbytes, 1) // self.ALIGN) * self.ALIGN
        self.nbytes = offset
        self.host = np.zeros(offset, np.uint8)
        for name, array in arrays.items():
            start = self.layout[name][0]
            raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            self.host[start : start + raw.size] = raw

    def end_of(self, name: str) -> int:
        """Offset just past `name`'s bytes."""
        offset, dtype, shape = self.layout[name]
        return offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def unpack(self, raw: np.ndarray) -> dict:
        """The arrays, from a (downloaded) copy of the packed bytes."""
        raw = np.asarray(raw).reshape(-1)
        arrays = {}
        for name, (offset, dtype, shape) in self.layout.items():
            end = self.end_of(name)
            arrays[name] = raw[offset:end].view(dtype).reshape(shape).copy()
        return arrays


# ---- The states, checked on the CPU (no GPU needed). -------------------------------


@pytest.mark.parametrize(
    "label,batch,preemptions,recoveries,geometry",
    [row for row in STEP_ROWS if row[1] <= 1024],
    ids=[f"{row[0]}-B{row[1]}" for row in STEP_ROWS if row[1] <= 1024],
)
def test_timing_state_does_what_its_row_says(label, batch, preemptions, recoveries, geometry):
    state = timing_state(batch, preemptions, recoveries, geometry)
    after = ref_step_paddle(state, geometry.block_size)
    assert events_of_call(state, after) == (preemptions, recoveries), label
    if not preemptions and not recoveries:
        # Steady: the call changes nothing, so repeated calls are identical.
        assert_same_bytes(after, state, context=f"{label}, B={batch}:")
    for slot in np.asarray(after["recover_block_list"]).reshape(-1)[:recoveries]:
        # The re-prefill covers prompt + generated tokens of the geometry.
        expected_len = geometry.prompt_len + geometry.preempted_step_idx
        assert int(np.asarray(after["seq_lens_this_time"]).reshape(-1)[slot]) == expected_len
        assert int(np.asarray(after["used_list_len"]).reshape(-1)[slot]) == (
            geometry.recovery_budget
        )


def test_timing_state_packs_and_unpacks():
    state = timing_state(64, preemptions=5)
    packed = PackedArrays(state)
    assert_same_bytes(packed.unpack(packed.host.copy()), state)
    for name, (offset, _, _) in packed.layout.items():
        assert offset % PackedArrays.ALIGN == 0, name


# ---- Kernel times (GPU). ---------------------------------------------------------


def _upload_packed(gpu, packed: PackedArrays):
    buffer = gpu.backend.to_device(packed.host)
    gpu.synchronize()
    return buffer, gpu.pointer(buffer)


def _step_paddle_args(packed: PackedArrays, base: int, block_size: int, stream) -> tuple:
    """paddle_step_step_paddle's arguments for the packed tensors at `base`."""
    shape = {name: packed.layout[name][2] for name in STEP_PADDLE_TENSORS}
    pointers = (ctypes.c_void_p * len(STEP_PADDLE_TENSORS))(
        *(base + packed.layout[name][0] for name in STEP_PADDLE_TENSORS)
    )
    return (
        pointers,
        shape["stop_flags"][0],
        shape["block_tables"][1],
        shape["free_list"][0],
        shape["input_ids"][1],
        shape["pre_ids"][1],
        block_size,
        stream,
    )


def _graph_us_per_call(gpu, record) -> float:
    """Best replay of a graph of `record(stream)`, per call (record makes
    CALLS_PER_GRAPH calls)."""
    with gpu.captured_graph(record) as (exec_handle, _):
        replay_ms = gpu.time_graph_ms(exec_handle, replays=REPLAYS, warmup=WARMUP_REPLAYS)
    return replay_ms * 1e3 / CALLS_PER_GRAPH


def _time_step_paddle(
    gpu, label: str, batch: int, preemptions: int, recoveries: int, geometry: Geometry
) -> dict:
    state = timing_state(batch, preemptions, recoveries, geometry)
    restore = bool(preemptions or recoveries)
    # The tensors the op writes first, so that one copy of a prefix restores them.
    order = [name for name in STEP_PADDLE_TENSORS if name in STEP_PADDLE_OUTPUTS]
    order += [name for name in STEP_PADDLE_TENSORS if name not in STEP_PADDLE_OUTPUTS]
    packed = PackedArrays({name: state[name] for name in order})
    restore_bytes = max(packed.end_of(name) for name in STEP_PADDLE_OUTPUTS)
    work, base = _upload_packed(gpu, packed)
    pristine, pristine_base = _upload_packed(gpu, packed)
    args = _step_paddle_args(packed, base, geometry.block_size, gpu.stream)

    def launch():
        gpu.check(gpu.lib.paddle_step_step_paddle(*args), "paddle_step_step_paddle")

    def restore_copy(stream):
        gpu.memcpy_device(base, pristine_base, restore_bytes, stream)

    def record_op(stream):
        for _ in range(CALLS_PER_GRAPH):
            if restore:
                restore_copy(stream)
            launch()

    def record_copies(stream):
        for _ in range(CALLS_PER_GRAPH):
            restore_copy(stream)

    launch()  # outside the capture: loads the kernel (CUDA lazy loading)
    restore_copy(gpu.stream)
    gpu.synchronize()
    op_us = _graph_us_per_call(gpu, record_op)
    # Every call started from the pristine state (restored, or unchanged by a
    # steady call): the buffers hold one call's result.
    got = packed.unpack(gpu.backend.to_host(work))
    expected = ref_step_paddle(state, geometry.block_size)
    assert_same_bytes(got, expected, context=f"step_paddle {label}, B={batch}, after the graph:")
    assert events_of_call(state, got) == (preemptions, recoveries)
    copy_us = _graph_us_per_call(gpu, record_copies) if restore else None
    # Host wall: direct launches on the state as the previous call left it.
    host_us = gpu.host_us_per_call(launch, HOST_CALLS, warmup=HOST_WARMUP)
    del work, pristine
    return {
        "op": "step_paddle",
        "state": label + (" (restored before each call)" if restore else ""),
        "B": batch,
        "gpu_us": op_us - copy_us if restore else op_us,
        "with_copy_us": op_us if restore else None,
        "copy_us": copy_us,
        "host_us": host_us,
    }


def _time_advance_step(gpu, batch: int) -> dict:
    state = advance_state(batch)
    packed = PackedArrays(state)
    work, base = _upload_packed(gpu, packed)
    address = {name: base + packed.layout[name][0] for name in state}
    args = (
        address["input_tokens"],
        address["sampled_token_ids"],
        address["input_positions"],
        address["seq_lens"],
        32,
        address["slot_mapping"],
        address["block_tables"],
        32,
        None,
        batch,
        batch,
        ADVANCE_COLUMNS,
        ADVANCE_BLOCK_SIZE,
        gpu.stream,
    )

    def launch():
        gpu.check(gpu.lib.paddle_step_advance_step(*args), "paddle_step_advance_step")

    def record(stream):
        for _ in range(CALLS_PER_GRAPH):
            launch()

    launch()  # outside the capture: loads the kernel
    gpu.synchronize()
    gpu_us = _graph_us_per_call(gpu, record)
    host_us = gpu.host_us_per_call(launch, HOST_CALLS, warmup=HOST_WARMUP)
    # Restore-free: every call advanced seq_lens by one; the last call's outputs
    # are the reference's on seq_lens - 1.
    got = packed.unpack(gpu.backend.to_host(work))
    calls = got["seq_lens"].astype(np.int64) - state["seq_lens"]
    assert (calls == CALLS_PER_ROW).all(), np.unique(calls)
    previous = dict(state, seq_lens=(got["seq_lens"] - 1).astype(np.int32))
    expected = ref_advance_step(
        **previous, num_seqs=batch, num_queries=batch, block_size=ADVANCE_BLOCK_SIZE
    )
    for name, array in zip(ADVANCE_STEP_OUTPUTS, expected):
        assert got[name].tobytes() == array.tobytes(), f"advance_step B={batch}: {name}"
    assert (got["slot_mapping"] >= 0).all()
    del work
    return {
        "op": "advance_step",
        "state": "restore-free (seq_lens += 1 per call)",
        "B": batch,
        "gpu_us": gpu_us,
        "with_copy_us": None,
        "copy_us": None,
        "host_us": host_us,
    }


def _time_floor(gpu, batch: int) -> dict:
    buffer = gpu.backend.to_device(np.zeros(batch, np.int64))
    gpu.synchronize()
    address = gpu.pointer(buffer)

    def launch():
        gpu.add_one(address, batch)

    def record(stream):
        for _ in range(CALLS_PER_GRAPH):
            gpu.add_one(address, batch, stream)

    launch()  # outside the capture: loads the kernel
    gpu.synchronize()
    gpu_us = _graph_us_per_call(gpu, record)
    host_us = gpu.host_us_per_call(launch, HOST_CALLS, warmup=HOST_WARMUP)
    got = gpu.backend.to_host(buffer)
    assert (got == CALLS_PER_ROW).all(), np.unique(got)
    del buffer
    return {
        "op": "floor (x += 1)",
        "state": "B int64",
        "B": batch,
        "gpu_us": gpu_us,
        "with_copy_us": None,
        "copy_us": None,
        "host_us": host_us,
    }


def _markdown(rows: list[dict]) -> str:
    def us(value):
        return "–" if value is None else f"{value:.2f}"

    lines = [
        "| op | B | state | GPU us/call | copy + op us/call | restore copy us/call "
        "| host wall us/call |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['op']} | {row['B']} | {row['state']} | {us(row['gpu_us'])} "
            f"| {us(row['with_copy_us'])} | {us(row['copy_us'])} | {us(row['host_us'])} |"
        )
    return "\n".join(lines)


def test_report_kernel_times(gpu):
    """The table of README.md "Kernel times" (printed with pytest -s)."""
    rows = [_time_step_paddle(gpu, *row) for row in STEP_ROWS]
    rows += [_time_advance_step(gpu, batch) for batch in BATCHES]
    rows += [_time_floor(gpu, batch) for batch in BATCHES]
    for row in rows:
        assert row["gpu_us"] > 0 and row["host_us"] > 0, row
    print(
        f"\n[tests/gpu] kernel times on {gpu.device_info()} ({gpu.backend.name} arrays)\n"
        f"GPU us/call: {CALLS_PER_GRAPH} launches captured in one CUDA graph, CUDA events "
        f"around each replay, best of {REPLAYS} replays / {CALLS_PER_GRAPH} (restored rows: "
        f"copy + op minus the copies alone). Host wall: perf_counter around {HOST_CALLS} "
        f"direct ctypes launches + one sync, / {HOST_CALLS}.\n"
    )
    print(_markdown(rows))
