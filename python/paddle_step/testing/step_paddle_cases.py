"""``step_paddle`` test cases that any build can run: each takes ``run_op(state,
block_size)`` (a NumPy state in, the state after the op out) and compares it with the
reference byte for byte. The CPU tests pass the Paddle op (``paddle_ops``); the Paddle-free
GPU harness (tests/gpu) passes its CUDA launcher. NumPy only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..spec.tensor_table import STEP_PADDLE_TENSORS
from .fake_decode_loop import FakeDecodeLoop, add_preempted, make_state
from .ref_step_paddle import ref_step_paddle

StepRunner = Callable[[Mapping[str, np.ndarray], int], dict]

# id: (batch, max_model_len, block_size, blocks_per_seq, decoder pool, encoder pool)
LOOP_CONFIGS = {
    "B1": (1, 64, 4, 16, 16, 8),
    "B7-tight": (7, 64, 4, 16, 16, 40),
    "B83-tight": (83, 96, 8, 12, 40, 300),
    "B256": (256, 64, 16, 4, 80, 600),
}
# 4097 and 9001 span several of the CUDA kernel's phase-1 tiles (4096 slots)
# with a ragged last one.
RANDOM_STATE_BATCHES = (1, 2, 7, 33, 4097, 9001)


def assert_same_bytes(got, expected, names: Sequence[str] = STEP_PADDLE_TENSORS, context=""):
    """Each of ``names`` has the same dtype, shape and bytes in ``got`` and ``expected``."""
    for name in names:
        assert got[name].dtype == expected[name].dtype, f"{context} {name} dtype"
        assert got[name].shape == expected[name].shape, f"{context} {name} shape"
        if got[name].tobytes() != expected[name].tobytes():
            np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{context} {name}")


def checked_step(run_op: StepRunner, block_size: int, calls: list):
    """A step_fn for FakeDecodeLoop.run: ``run_op``, compared with the reference."""

    def step(state):
        expected = ref_step_paddle(state, block_size)
        got = run_op(state, block_size)
        assert_same_bytes(got, expected, context=f"call {len(calls)}")
        calls.append(1)
        return got

    return step


def tight_loop(config: tuple, stopped_shape: str = "[B]") -> FakeDecodeLoop:
    """The fake FastDeploy loop of one of ``LOOP_CONFIGS`` (its decoder pool is tight)."""
    batch, max_len, block_size, blocks_per_seq, decoder_blocks, encoder_blocks = config
    return FakeDecodeLoop(
        batch, max_len, block_size, blocks_per_seq, decoder_blocks, encoder_blocks,
        seed=batch, stopped_shape=stopped_shape, stop_prob=0.01,
        prompt_len_range=(1, 2 * block_size), output_len_range=(1, max_len // 2),
        num_requests=max(12, 2 * batch),
    )  # fmt: skip


def decode_loop(run_op: StepRunner, config: tuple, stopped_shape: str = "[B]") -> None:
    """``tight_loop(config)`` run to the end, every call checked."""
    loop = tight_loop(config, stopped_shape)
    calls = []
    block_size = config[2]
    loop.run(checked_step(run_op, block_size, calls), max_steps=3000)
    assert loop.done and len(calls) > 10
    if config[0] > 1:  # a tight pool: the interesting paths really ran
        assert loop.preemptions > 0 and loop.recoveries > 0


def shortfall(run_op: StepRunner) -> None:
    # Many arrivals with one-block prompts and a pool of a few blocks: needy
    # sequences outnumber the pool while nobody holds a decoder block.
    loop = FakeDecodeLoop(
        16, 32, 4, 8, 7, 64, seed=3, arrival_prob=1.0, stop_prob=0.0,
        prompt_len_range=(4, 4), output_len_range=(8, 20), num_requests=48,
    )  # fmt: skip
    loop.run(checked_step(run_op, 4, []), max_steps=3000)
    assert loop.shortfalls > 0


def random_state(batch, rng):
    """Any values of the right dtypes and shapes, including ones outside
    every table and list, to exercise the bounds rules of both builds."""
    blocks_per_seq = int(rng.integers(1, 6))
    max_len = int(rng.integers(1, 40))
    capacity = int(rng.integers(1, 3 * batch + 2))
    state = make_state(
        batch,
        blocks_per_seq,
        max_len,
        free_list_size=capacity,
        pre_ids_len=int(rng.integers(1, 40)),
    )

    def ints(low, high, shape):
        return rng.integers(low, high, size=shape).astype(np.int32)

    for name in (
        "seq_lens_this_time",
        "ori_seq_lens_encoder",
        "seq_lens_encoder",
        "seq_lens_decoder",
        "encoder_block_lens",
        "used_list_len",
    ):
        state[name] = ints(-2, 3 * blocks_per_seq + 2, batch)
    state["seq_lens_decoder"] = ints(-3, 4 * blocks_per_seq * 4, batch)
    state["block_tables"] = ints(-1, 50, (batch, blocks_per_seq))
    state["stop_flags"] = rng.random(batch) < 0.4
    state["is_block_step"] = rng.random(batch) < 0.3
    state["step_block_list"] = ints(-1, batch + 1, batch)
    state["step_lens"] = ints(-1, batch + 2, 1)
    state["free_list"] = ints(0, 50, capacity)
    state["free_list_len"] = ints(-1, capacity + 2, 1)
    state["step_idx"] = rng.integers(0, 45, size=batch)
    state["next_tokens"] = rng.integers(0, 1000, size=batch)
    state["first_token_ids"] = rng.integers(0, 1000, size=batch)
    state["pre_ids"] = rng.integers(0, 1000, size=state["pre_ids"].shape)
    return state


def random_states(run_op: StepRunner, batch: int) -> None:
    rng = np.random.default_rng(batch)
    trials = 150 if batch < 1000 else 8  # each slot sees every kind of value either way
    for trial in range(trials):
        state = random_state(batch, rng)
        block_size = int(rng.integers(1, 5))
        assert_same_bytes(
            run_op(state, block_size), ref_step_paddle(state, block_size), context=f"trial {trial}"
        )


def batch_4096_loop() -> FakeDecodeLoop:
    """4096 slots with a busy arrival stream: slots past 255 hold blocks within steps."""
    return FakeDecodeLoop(
        4096, 32, 8, 4, 1500, 9000, seed=7, arrival_prob=0.9, stop_prob=0.05,
        prompt_len_range=(1, 8), output_len_range=(1, 24), num_requests=4096,
    )  # fmt: skip


def batch_4096(run_op: StepRunner) -> None:
    # Beyond FastDeploy's 256-thread limit: slots past 255 are served too.
    loop = batch_4096_loop()
    step = checked_step(run_op, 8, [])
    for _ in range(12):
        loop.host_update()
        loop.load(step(loop.state()))
    used = np.asarray(loop.state()["used_list_len"]).reshape(-1)
    assert used[256:].sum() > 0 and loop.preemptions > 0


def empty_pool_all_stopped_and_full_table(run_op: StepRunner) -> None:
    # All stopped with nothing held: nothing moves but first_token_ids.
    state = make_state(5, 4, 16)
    got = run_op(state, 4)
    assert_same_bytes(got, ref_step_paddle(state, 4))
    assert got["free_list_len"][0] == 0 and (got["first_token_ids"] == -1).all()

    # A running sequence whose next position is past its table stops here and
    # gives back its decoder blocks.
    state = make_state(1, 2, 8, free_list=[9], free_list_size=3)
    state["stop_flags"][0] = False
    state["seq_lens_this_time"][0] = 1
    state["seq_lens_decoder"][0] = 8  # column 2 of a 2-column table
    state["block_tables"][0] = [4, 5]
    state["encoder_block_lens"][0] = 1
    state["used_list_len"][0] = 1
    got = run_op(state, 4)
    assert_same_bytes(got, ref_step_paddle(state, 4))
    assert bool(got["stop_flags"][0]) and list(got["free_list"][:2]) == [9, 5]
    assert got["free_list_len"][0] == 2 and list(got["block_tables"][0]) == [4, -1]


def extreme_block_sizes(run_op: StepRunner) -> None:
    # The column of a position is a truncating division by block_size; the CUDA
    # kernel divides in 32 bits when block_size fits, in 64 bits otherwise. At
    # block_size 2^31 the position -2^31 is column -1 (not in the table: not needy),
    # -2^31 + 1 column 0 (needy: that column is empty).
    int32 = np.iinfo(np.int32)
    positions = [int32.min, int32.min + 1, -1, 0, 1, int32.max]
    for block_size in (int32.max, 2**31, 2**31 + 1, 2**40):
        state = make_state(len(positions), 3, 4, free_list=[20, 21, 22, 23, 24, 25, 26])
        for slot, position in enumerate(positions):
            state["stop_flags"][slot] = False
            state["seq_lens_this_time"][slot] = 1
            state["seq_lens_decoder"][slot] = position
        got = run_op(state, block_size)
        expected = ref_step_paddle(state, block_size)
        assert_same_bytes(got, expected, context=f"block_size={block_size}:")
        if block_size == 2**31:
            table = np.asarray(got["block_tables"])
            assert (table[0] == -1).all() and table[1, 0] >= 0, table


def many_recoveries(run_op: StepRunner) -> None:
    # Every slot preempted earlier and the pool holding all their budgets: one call
    # recovers them all, more than one 512-sequence chunk of the CUDA kernel's
    # rebuild (each sequence rebuilt by one thread there), at a batch under and
    # one over its two-launch threshold (1,024 slots).
    for batch in (700, 1100):
        budget = 2  # used_list_len 1, room for more: one block more than it held
        pool = budget * batch
        state = make_state(batch, 4, 16, free_list=range(pool))
        for slot in range(batch):
            add_preempted(
                state, slot, encoder_blocks=[pool + slot], used_list_len=1, prompt_len=3, step_idx=5
            )
        got = run_op(state, 4)
        assert_same_bytes(got, ref_step_paddle(state, 4), context=f"B={batch}:")
        recovered = np.asarray(got["recover_block_list"]).reshape(-1)
        assert sorted(recovered.tolist()) == list(range(batch)) and got["free_list_len"][0] == 0


# Every case a build runs, by id: each takes only the runner.
CASES: dict[str, Callable[[StepRunner], None]] = {
    **{
        f"decode_loop-{key}-stop_flags_{shape_id}": functools.partial(
            decode_loop, config=config, stopped_shape=stopped_shape
        )
        for key, config in LOOP_CONFIGS.items()
        for shape_id, stopped_shape in (("B", "[B]"), ("B1", "[B,1]"))
    },
    **{
        f"random_states-B{batch}": functools.partial(random_states, batch=batch)
        for batch in RANDOM_STATE_BATCHES
    },
    "shortfall": shortfall,
    "batch_4096": batch_4096,
    "empty_pool_all_stopped_and_full_table": empty_pool_all_stopped_and_full_table,
    "extreme_block_sizes": extreme_block_sizes,
    "many_recoveries": many_recoveries,
}
