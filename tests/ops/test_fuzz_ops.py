"""Property-based tests (hypothesis) for both ops.

Valid states keep SPEC's invariants and match the references byte for byte;
invalid inputs raise a ValueError naming the argument and never crash the
interpreter (those run in a subprocess, so a crash fails the test instead of
killing the run).
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paddle_step
from paddle_step.spec.check_state import check_state
from paddle_step.testing.fake_decode_loop import (
    FakeDecodeLoop,
    add_preempted,
    add_running,
    make_state,
)
from paddle_step.testing.paddle_ops import run_step_paddle
from paddle_step.testing.ref_advance_step import ref_advance_step
from paddle_step.testing.ref_step_paddle import ref_step_paddle
from paddle_step.testing.step_paddle_cases import assert_same_bytes, random_state

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(
    batch=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**32 - 1),
    tight=st.booleans(),
    stopped_shape=st.sampled_from(["[B]", "[B,1]"]),
)
def test_serving_states_keep_invariants(batch, block_size, seed, tight, stopped_shape):
    blocks_per_seq = 32 // block_size
    max_len = blocks_per_seq * block_size
    budget = blocks_per_seq  # the largest recovery budget always fits
    loop = FakeDecodeLoop(
        batch,
        max_len,
        block_size,
        blocks_per_seq,
        budget if tight else budget * batch,
        64 * batch,
        seed=seed,
        stop_prob=0.05,
        prompt_len_range=(1, block_size + 1),
        output_len_range=(1, max_len // 2),
        num_requests=2 * batch,
        stopped_shape=stopped_shape,
    )

    def step(state):
        got = run_step_paddle(state, block_size)
        assert_same_bytes(got, ref_step_paddle(state, block_size))
        check_state(got, block_size, decoder_blocks=loop.decoder_block_ids)
        return got

    loop.run(step, max_steps=2000)


def decoder_blocks_held(state, first_decoder_block):
    """Every decoder block id in the pool or in a table, sorted (duplicates kept)."""
    pool = state["free_list"][: int(state["free_list_len"][0])].tolist()
    tables = state["block_tables"]
    return sorted(pool + tables[tables >= first_decoder_block].tolist())


@FUZZ
@given(
    batch=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**32 - 1)
)
def test_stopped_preempted_slots_with_tokens_conserve_blocks(batch, block_size, seed):
    # Serving states plus preempted slots whose seq_lens_this_time was left
    # non-zero (as FastDeploy's own test state has): no decoder block may be lost
    # or doubled, whatever the pool size.
    rng = np.random.default_rng(seed)
    blocks_per_seq = 6
    max_len = blocks_per_seq * block_size
    first_decoder_block = 100
    decoder_ids = list(range(first_decoder_block, first_decoder_block + 4 * batch))
    state = make_state(batch, blocks_per_seq, max_len, free_list_size=len(decoder_ids))
    next_encoder_block = 0
    for slot in range(batch):
        kind = rng.integers(3)
        encoder_count = int(rng.integers(1, 3))
        encoder_blocks = list(range(next_encoder_block, next_encoder_block + encoder_count))
        next_encoder_block += encoder_count
        if kind == 1:
            held = min(
                int(rng.integers(0, 3)), len(decoder_ids), blocks_per_seq - 1 - encoder_count
            )
            decoder_blocks = [decoder_ids.pop() for _ in range(held)]
            written = (encoder_count + held) * block_size - int(rng.integers(0, block_size))
            add_running(
                state,
                slot,
                encoder_blocks=encoder_blocks,
                decoder_blocks=decoder_blocks,
                seq_lens_decoder=written,
            )
        elif kind == 2:
            prompt_len = int(rng.integers(1, block_size * encoder_count + 1))
            add_preempted(
                state,
                slot,
                encoder_blocks=encoder_blocks,
                used_list_len=int(rng.integers(0, 3)),
                prompt_len=prompt_len,
                step_idx=int(rng.integers(1, max_len - prompt_len + 1)),
            )
            state["seq_lens_this_time"][slot] = int(rng.integers(1, 3))
            state["seq_lens_decoder"][slot] = int(rng.integers(0, max_len))
    pool = decoder_ids[: int(rng.integers(0, len(decoder_ids) + 1))]
    state["free_list"][: len(pool)] = pool
    state["free_list_len"][0] = len(pool)
    before = decoder_blocks_held(state, first_decoder_block)

    got = run_step_paddle(state, block_size)
    assert_same_bytes(got, ref_step_paddle(state, block_size))
    after = decoder_blocks_held(got, first_decoder_block)
    assert after == before, f"decoder blocks before {before}, after {after}"


@FUZZ
@given(batch=st.integers(1, 40), block_size=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_any_state_matches_reference(batch, block_size, seed):
    # Includes states no loop produces: the bounds rules must agree and the
    # call must return.
    state = random_state(batch, np.random.default_rng(seed))
    assert_same_bytes(run_step_paddle(state, block_size), ref_step_paddle(state, block_size))


@FUZZ
@given(num_seqs=st.integers(1, 300), data=st.data())
def test_advance_step_matches_reference(num_seqs, data):
    num_queries = data.draw(st.integers(1, num_seqs))
    block_size = data.draw(st.integers(1, 64))
    blocks_per_seq = data.draw(st.integers(0, 6))
    seq_dtype = data.draw(st.sampled_from([np.int32, np.int64]))
    table_dtype = data.draw(st.sampled_from([np.int32, np.int64]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    case = {
        "input_tokens": rng.integers(-5, 5, num_seqs).astype(np.int64),
        "sampled_token_ids": rng.integers(0, 2**40, (num_queries, 1)).astype(np.int64),
        "input_positions": rng.integers(-5, 5, num_seqs).astype(np.int64),
        "seq_lens": rng.integers(-3, (blocks_per_seq + 1) * block_size + 3, num_seqs).astype(
            seq_dtype
        ),
        "slot_mapping": rng.integers(-5, 5, num_seqs).astype(np.int64),
        "block_tables": rng.integers(-2, 2**31 - 1, (num_seqs, blocks_per_seq)).astype(table_dtype),
    }
    active = rng.random(num_seqs) < 0.7 if data.draw(st.booleans()) else None
    tensors = {name: paddle.to_tensor(value) for name, value in case.items()}
    paddle_step.advance_step(
        *tensors.values(),
        num_seqs,
        num_queries,
        block_size,
        active=None if active is None else paddle.to_tensor(active),
    )
    expected = ref_advance_step(
        **case, num_seqs=num_seqs, num_queries=num_queries, block_size=block_size, active=active
    )
    for name, want in zip(
        ("input_tokens", "input_positions", "seq_lens", "slot_mapping"), expected
    ):
        np.testing.assert_array_equal(tensors[name].numpy(), want, err_msg=name)


def test_invalid_inputs_raise_and_never_crash(tmp_path):
    # Each call changes one argument of a valid call; a ValueError must name it.
    script = Path(__file__).with_name("fuzz_invalid_calls.py")
    for seed in range(3):
        result = subprocess.run(
            [sys.executable, str(script), str(seed)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, (
            f"child crashed ({result.returncode}): {result.stderr[-2000:]}"
        )
        outcomes = json.loads(result.stdout.strip().splitlines()[-1])
        for op, name, message in outcomes:
            assert message != "no error", f"{op}: an invalid '{name}' was accepted"
            assert message.startswith(f"paddle_step.{op}: argument '"), message
            assert "expected" in message and ", got " in message, message
