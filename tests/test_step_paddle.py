"""step_paddle against the NumPy reference, byte for byte, on every place.

States come from a fake FastDeploy decode loop run under a tight decoder
pool (so preemption, recovery and shortfall all happen), from hand-built edge
cases, and from random states that no loop would produce (bounds rules).
"""

import numpy as np
import paddle
import pytest

import paddle_step
from fake_decode_loop import FakeDecodeLoop, add_preempted, make_state
from ref_step_paddle import STEP_PADDLE_TENSORS, ref_step_paddle


def run_op(state, block_size, encoder_decoder_block_num=0):
    tensors = {name: paddle.to_tensor(state[name]) for name in STEP_PADDLE_TENSORS}
    paddle_step.step_paddle(*(tensors[name] for name in STEP_PADDLE_TENSORS),
                            block_size, encoder_decoder_block_num)
    return {name: tensor.numpy() for name, tensor in tensors.items()}


def assert_same_bytes(got, expected, context=""):
    for name in STEP_PADDLE_TENSORS:
        assert got[name].dtype == expected[name].dtype, f"{context} {name} dtype"
        assert got[name].shape == expected[name].shape, f"{context} {name} shape"
        if got[name].tobytes() != expected[name].tobytes():
            np.testing.assert_array_equal(got[name], expected[name],
                                          err_msg=f"{context} {name}")


def checked_step(block_size, calls):
    """A step_fn for FakeDecodeLoop.run: the op, compared with the reference."""
    def step(state):
        expected = ref_step_paddle(state, block_size)
        got = run_op(state, block_size)
        assert_same_bytes(got, expected, f"call {len(calls)}")
        calls.append(1)
        return got
    return step


LOOP_CONFIGS = [
    # batch, max_model_len, block_size, blocks_per_seq, decoder pool, encoder pool
    pytest.param(1, 64, 4, 16, 16, 8, id="B1"),
    pytest.param(7, 64, 4, 16, 16, 40, id="B7-tight"),
    pytest.param(83, 96, 8, 12, 40, 300, id="B83-tight"),
    pytest.param(256, 64, 16, 4, 80, 600, id="B256"),
]


@pytest.mark.parametrize("batch,max_len,block_size,blocks_per_seq,decoder_blocks,encoder_blocks",
                         LOOP_CONFIGS)
@pytest.mark.parametrize("stopped_shape", ["[B]", "[B,1]"])
def test_decode_loop_matches_reference(place, batch, max_len, block_size, blocks_per_seq,
                                       decoder_blocks, encoder_blocks, stopped_shape):
    loop = FakeDecodeLoop(batch, max_len, block_size, blocks_per_seq, decoder_blocks,
                          encoder_blocks, seed=batch, stopped_shape=stopped_shape,
                          stop_prob=0.01, prompt_len_range=(1, 2 * block_size),
                          output_len_range=(1, max_len // 2),
                          num_requests=max(12, 2 * batch))
    calls = []
    loop.run(checked_step(block_size, calls), max_steps=3000)
    assert loop.done and len(calls) > 10
    if batch > 1:  # a tight pool: the interesting paths really ran
        assert loop.preemptions > 0 and loop.recoveries > 0


def test_shortfall_happens_and_matches(place):
    # Many arrivals with one-block prompts and a pool of a few blocks: needy
    # sequences outnumber the pool while nobody holds a decoder block.
    loop = FakeDecodeLoop(16, 32, 4, 8, 7, 64, seed=3, arrival_prob=1.0, stop_prob=0.0,
                          prompt_len_range=(4, 4), output_len_range=(8, 20),
                          num_requests=48)
    loop.run(checked_step(4, []), max_steps=3000)
    assert loop.shortfalls > 0


def random_state(batch, rng):
    """Any values of the right dtypes and shapes, including ones outside
    every table and list, to exercise the bounds rules of both builds."""
    blocks_per_seq = int(rng.integers(1, 6))
    max_len = int(rng.integers(1, 40))
    capacity = int(rng.integers(1, 3 * batch + 2))
    state = make_state(batch, blocks_per_seq, max_len, free_list_size=capacity,
                       pre_ids_len=int(rng.integers(1, 40)))
    def ints(low, high, shape):
        return rng.integers(low, high, size=shape).astype(np.int32)
    for name in ("seq_lens_this_time", "ori_seq_lens_encoder", "seq_lens_encoder",
                 "seq_lens_decoder", "encoder_block_lens", "used_list_len"):
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


@pytest.mark.parametrize("batch", [1, 2, 7, 33])
def test_random_states_match_reference(place, batch):
    rng = np.random.default_rng(batch)
    for trial in range(150):
        state = random_state(batch, rng)
        block_size = int(rng.integers(1, 5))
        assert_same_bytes(run_op(state, block_size), ref_step_paddle(state, block_size),
                          f"trial {trial}")


@pytest.mark.parametrize("step_idx", [np.iinfo(np.int64).min, -5, 0, 1, 30,
                                      np.iinfo(np.int64).max])
def test_recovery_with_extreme_step_idx(place, step_idx):
    # Index arithmetic on step_idx must neither overflow nor leave the rows.
    state = make_state(2, 6, 24, free_list=[10, 11, 12])
    add_preempted(state, 1, encoder_blocks=[0], used_list_len=1, prompt_len=2, step_idx=3)
    state["step_idx"][1] = step_idx
    assert_same_bytes(run_op(state, 4), ref_step_paddle(state, 4))


def test_batch_4096(place):
    # Beyond FastDeploy's 256-thread limit: slots past 255 are served too.
    loop = FakeDecodeLoop(4096, 32, 8, 4, 1500, 9000, seed=7, arrival_prob=0.9,
                          stop_prob=0.05, prompt_len_range=(1, 8),
                          output_len_range=(1, 24), num_requests=4096)
    calls = []
    step = checked_step(8, calls)
    for _ in range(12):
        loop.host_update()
        loop.load(step(loop.state()))
    used = np.asarray(loop.state()["used_list_len"]).reshape(-1)
    assert used[256:].sum() > 0 and loop.preemptions > 0


def test_empty_pool_all_stopped_and_full_table(place):
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


BAD_INPUTS = [
    ("stop_flags", np.zeros(3, np.int32),
     "argument 'stop_flags': expected dtype bool, got dtype int32"),
    ("block_tables", np.zeros((3, 4), np.int64),
     "argument 'block_tables': expected dtype int32, got dtype int64"),
    ("input_ids", np.zeros((3, 16), np.int32),
     "argument 'input_ids': expected dtype int64, got dtype int32"),
    ("seq_lens_decoder", np.zeros(4, np.int32),
     "argument 'seq_lens_decoder': expected shape [3] or [3, 1], got shape [4]"),
    ("is_block_step", np.zeros((3, 1), np.bool_),
     "argument 'is_block_step': expected shape [3], got shape [3, 1]"),
    ("block_tables", np.zeros(3, np.int32),
     "argument 'block_tables': expected shape [3, -1], got shape [3]"),
    ("free_list_len", np.zeros(2, np.int32),
     "argument 'free_list_len': expected shape [1], got shape [2]"),
    ("pre_ids", np.zeros((2, 16), np.int64),
     "argument 'pre_ids': expected shape [3, -1], got shape [2, 16]"),
    ("free_list", np.zeros((3, 1), np.int32),
     "argument 'free_list': expected shape [-1], got shape [3, 1]"),
]


@pytest.mark.parametrize("name,value,message", BAD_INPUTS,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(BAD_INPUTS)])
def test_bad_input_raises_before_writing(name, value, message):
    state = valid_state()
    state[name] = value
    tensors = {key: paddle.to_tensor(array) for key, array in state.items()}
    with pytest.raises(ValueError) as raised:
        paddle_step.step_paddle(*(tensors[key] for key in STEP_PADDLE_TENSORS), 4, 0)
    assert str(raised.value) == "paddle_step.step_paddle: " + message
    for key, tensor in tensors.items():
        np.testing.assert_array_equal(tensor.numpy(), state[key], err_msg=key)


def test_bad_block_size_raises():
    state = valid_state()
    tensors = [paddle.to_tensor(state[name]) for name in STEP_PADDLE_TENSORS]
    with pytest.raises(ValueError, match="argument 'block_size': expected a positive "
                                         "integer, got 0"):
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
