"""The slot state's NumPy views (``host_array``) share the CPU tensors' memory both ways,
and the runner's bookkeeping through them (``ShareInputs.on_host``) writes exactly what
its eager Paddle ops write, on random slot states."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.llm_engine import Engine
from paddle_step.engine.model_runner import ModelRunner
from paddle_step.engine.slot_state import host_array
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.sampling_params import SamplingParams

BATCH, WIDTH, BLOCK_SIZE = 7, 24, 4
EXPORTS_DLPACK = hasattr(paddle.zeros([1]), "__dlpack__")
WRITABLE_VIEWS = EXPORTS_DLPACK and np.from_dlpack(paddle.zeros([1])).flags.writeable
needs_dlpack = pytest.mark.skipif(
    not WRITABLE_VIEWS,
    reason=f"paddle {paddle.__version__} exports no DLPack from a tensor, or NumPy "
    f"{np.__version__} imports it read-only",
)
# What advance_decode_inputs writes.
ADVANCED = ("decode_active", "context_lens", "input_tokens", "input_positions", "slot_mapping")


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelConfig(dtype="float32", seed=1))


@needs_dlpack
@pytest.mark.parametrize("dtype", ["bool", "int32", "int64", "float32"])
def test_host_array_is_the_tensors_memory(dtype: str) -> None:
    tensor = paddle.zeros([5], dtype=dtype)
    array = host_array(tensor)
    assert array.shape == (5,) and array.dtype == np.dtype(dtype)
    array[3] = 1
    assert tensor.numpy().tolist() == np.array([0, 0, 0, 1, 0], dtype=dtype).tolist()
    tensor.fill_(1)  # an in-place Paddle op shows in the array
    assert array.tolist() == np.ones(5, dtype=dtype).tolist()


def test_on_host_only_where_the_views_work(model) -> None:
    runner = ModelRunner(model, small_config())
    assert runner.state.on_host == (runner.state.place.is_cpu_place() and WRITABLE_VIEWS)


def test_a_numpy_that_imports_dlpack_read_only_gets_the_eager_ops(model, monkeypatch) -> None:
    """NumPy 1.26 (PaddleFormers installs it) gives read-only DLPack arrays: the engine
    must not write through them (it did: ValueError in schedule_blocks)."""
    from_dlpack = np.from_dlpack

    def read_only(tensor):
        array = from_dlpack(tensor)
        array.flags.writeable = False
        return array

    monkeypatch.setattr(np, "from_dlpack", read_only)
    config = EngineConfig(max_batch=2, max_model_len=WIDTH, block_size=BLOCK_SIZE,
                          num_kv_blocks=64)  # fmt: skip
    engine = Engine(model, config)
    assert not engine.runner.state.on_host
    results = engine.generate([[3, 4, 5], [6, 7]], SamplingParams(max_tokens=4))
    assert [len(result.token_ids) for result in results] == [4, 4]


def small_config() -> EngineConfig:
    return EngineConfig(
        max_batch=BATCH, max_model_len=WIDTH, block_size=BLOCK_SIZE, num_kv_blocks=64
    )


def random_runner(model, seed: int, on_host: bool) -> ModelRunner:
    """A runner whose per-slot vectors and block tables are random (the same for a seed):
    stopped and running slots, prefills and decodes, positions past the table."""
    rng = np.random.default_rng(seed)
    runner = ModelRunner(model, small_config())
    state = runner.state
    state.on_host = on_host

    def put(name: str, values: np.ndarray) -> None:
        tensor = getattr(state, name)
        paddle.assign(paddle.to_tensor(values.astype(tensor.numpy().dtype)), output=tensor)

    put("stop_flags", rng.random(BATCH) < 0.3)
    put("seq_lens_encoder", np.where(rng.random(BATCH) < 0.3, rng.integers(1, 5, BATCH), 0))
    put("seq_lens_decoder", rng.integers(0, WIDTH, BATCH))
    put("next_tokens", rng.integers(0, 50, BATCH))
    put("block_tables", rng.integers(-1, 64, tuple(state.block_tables.shape)))
    put("recover_block_list", rng.integers(-1, BATCH, BATCH))
    put("decode_active", rng.random(BATCH) < 0.5)  # overwritten: any stale value
    return runner


@needs_dlpack
@pytest.mark.parametrize("seed", range(8))
def test_advance_decode_inputs_on_host_equals_the_eager_ops(model, seed: int) -> None:
    on_host, eager = random_runner(model, seed, True), random_runner(model, seed, False)
    on_host.advance_decode_inputs()
    eager.advance_decode_inputs()
    for name in ADVANCED:
        np.testing.assert_array_equal(
            getattr(on_host.state, name).numpy(), getattr(eager.state, name).numpy(), name
        )
    active = on_host.state.decode_active.numpy()
    if seed == 0:  # the case mix is real: some rows decode, some do not
        assert active.any() and not active.all()


@needs_dlpack
def test_schedule_blocks_on_host_clears_the_recover_list_first(model) -> None:
    on_host, eager = random_runner(model, 0, True), random_runner(model, 0, False)
    for runner in (on_host, eager):
        # A fresh state (every slot stopped) apart from the stale recover list.
        paddle.assign(paddle.ones([BATCH], "bool"), output=runner.state.stop_flags)
        runner.state.seq_lens_decoder.zero_()
        runner.state.block_tables.fill_(-1)
        runner.schedule_blocks()
    for name, tensor in on_host.state.step_tensors().items():
        np.testing.assert_array_equal(tensor.numpy(), getattr(eager.state, name).numpy(), name)
    assert (on_host.state.recover_block_list.numpy() == -1).all()
