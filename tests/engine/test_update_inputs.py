"""ModelRunner.update_inputs: the CPU op (one call) makes exactly the updates of the
eager Paddle ops that other devices run, on random slot states; bad arguments are named
before anything is written."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import paddle_step_ops
from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.model_runner import ModelRunner
from paddle_step.models.llama import LlamaForCausalLM

BATCH, WIDTH = 7, 12
# The slot state update_inputs writes.
UPDATED = ("step_idx", "pre_ids", "next_tokens", "input_ids", "seq_lens_this_time",
           "seq_lens_encoder", "seq_lens_decoder", "stop_flags")  # fmt: skip


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelConfig(dtype="float32", seed=1))


def random_runner(model: LlamaForCausalLM, rng: np.random.Generator) -> ModelRunner:
    config = EngineConfig(max_batch=BATCH, max_model_len=WIDTH, block_size=4, num_kv_blocks=64)
    runner = ModelRunner(model, config)
    state = runner.state

    def put(name: str, values: np.ndarray) -> None:
        tensor = getattr(state, name)
        paddle.assign(paddle.to_tensor(values.astype(tensor.numpy().dtype)), output=tensor)

    # step_idx + 1 stays a column of pre_ids; max_new_tokens sometimes reached.
    step_idx = rng.integers(0, WIDTH - 1, BATCH)
    put("step_idx", step_idx)
    put("max_new_tokens", step_idx + rng.integers(1, 3, BATCH))
    put("pre_ids", rng.integers(-1, 50, (BATCH, WIDTH)))
    put("input_ids", rng.integers(0, 50, (BATCH, WIDTH)))
    put("next_tokens", rng.integers(-1, 50, BATCH))
    stops = np.full((BATCH, state.eos_token_ids.shape[1]), -1)
    stops[:, :2] = rng.integers(0, 6, (BATCH, 2))  # tokens below 6 often stop
    put("eos_token_ids", stops)
    put("seq_lens_this_time", rng.integers(0, 5, BATCH))
    put("seq_lens_encoder", rng.integers(0, 5, BATCH))
    put("seq_lens_decoder", rng.integers(0, 30, BATCH))
    put("stop_flags", rng.random(BATCH) < 0.3)
    return runner


def state_arrays(runner: ModelRunner) -> dict[str, np.ndarray]:
    return {name: getattr(runner.state, name).numpy() for name in UPDATED}


@pytest.mark.parametrize("seed", range(12))
def test_cpu_op_equals_eager_ops(model: LlamaForCausalLM, seed: int) -> None:
    rng = np.random.default_rng(seed)
    op_runner = random_runner(model, np.random.default_rng(seed))
    eager_runner = random_runner(model, np.random.default_rng(seed))
    stopped = op_runner.state.stop_flags.numpy()
    running = ~stopped
    ran = running & (rng.random(BATCH) < 0.8)  # some rows mid-prefill
    tokens = rng.integers(0, 12, BATCH)
    before = state_arrays(op_runner)
    args = [paddle.to_tensor(value) for value in (running, ran, tokens)]
    op_runner.update_inputs(*args)
    eager_runner.update_inputs_eager(*args)
    after, expected = state_arrays(op_runner), state_arrays(eager_runner)
    for name in UPDATED:
        np.testing.assert_array_equal(after[name], expected[name], err_msg=name)
    # The case mix is real: some rows finish, some keep running, some did not run.
    finished = ran & ~before["stop_flags"] & after["stop_flags"]
    assert (after["step_idx"] == before["step_idx"] + ran).all()
    if seed == 0:
        assert finished.any() and (ran & ~finished).any() and (~ran).any()


def call_args(runner: ModelRunner) -> dict[str, paddle.Tensor]:
    state = runner.state
    running = paddle.logical_not(state.stop_flags)
    return dict(
        running=running, ran=running, tokens=paddle.zeros([BATCH], "int64"),
        step_idx=state.step_idx, stop_ids=state.eos_token_ids,
        max_new_tokens=state.max_new_tokens, pre_ids=state.pre_ids,
        next_tokens=state.next_tokens, input_ids=state.input_ids,
        seq_lens_this_time=state.seq_lens_this_time, seq_lens_encoder=state.seq_lens_encoder,
        seq_lens_decoder=state.seq_lens_decoder, stop_flags=state.stop_flags,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argument", "bad", "message"),
    [
        ("tokens", paddle.zeros([BATCH], "int32"),
         "'tokens': expected dtype int64, got dtype int32"),
        ("ran", paddle.ones([BATCH + 1], "bool"),
         f"'ran': expected shape [{BATCH}] or [{BATCH}, 1]"),
        ("running", paddle.ones([BATCH, 2], "bool"), "'running': expected shape [-1], got shape"),
        ("pre_ids", paddle.zeros([BATCH, WIDTH], "int32"), "'pre_ids': expected dtype int64"),
        ("seq_lens_decoder", paddle.zeros([BATCH], "int64"),
         "'seq_lens_decoder': expected dtype int32, got dtype int64"),
        ("stop_ids", paddle.zeros([BATCH], "int64"), "'stop_ids': expected shape [7, -1]"),
    ],
)  # fmt: skip
def test_bad_argument_is_named(model, argument: str, bad: paddle.Tensor, message: str) -> None:
    runner = random_runner(model, np.random.default_rng(0))
    before = state_arrays(runner)
    args = call_args(runner) | {argument: bad}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        paddle_step_ops.cpu_update_inputs(**args)
    for name, values in state_arrays(runner).items():
        np.testing.assert_array_equal(values, before[name], err_msg=name)


def test_pre_ids_column_past_the_row_is_refused(model) -> None:
    runner = random_runner(model, np.random.default_rng(0))
    last = WIDTH - 1  # a slot whose next token would land past pre_ids' last column
    runner.state.step_idx[2] = last
    before = state_arrays(runner)
    args = call_args(runner)
    args["running"] = args["ran"] = paddle.ones([BATCH], "bool")
    with pytest.raises(ValueError, match=rf"'pre_ids': expected a column for slot 2's "
                                         rf"next token \(step_idx \+ 1\) in \[0, {WIDTH}\), "
                                         rf"got {WIDTH}"):  # fmt: skip
        paddle_step_ops.cpu_update_inputs(**args)
    for name, values in state_arrays(runner).items():
        np.testing.assert_array_equal(values, before[name], err_msg=name)
