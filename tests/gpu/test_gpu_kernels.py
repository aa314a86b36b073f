"""The CUDA kernels of both ops, without Paddle, against the NumPy references.

The cases are the CPU op tests' own (paddle_step.testing.step_paddle_cases and
advance_step_cases), run with the GPU launchers (`gpu` fixture, conftest.py) as
their `run_op`, over the same parametrizations. When paddle and the compiled
op import, each GPU step_paddle / advance_step result is also compared with the
CPU kernel. Then: CUDA-graph capture and replay of both ops. Kernel times are
test_gpu_timing.py's.

Every test skips, with the reason, without the built library, without
CuPy/PyTorch or without a CUDA device (conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from paddle_step.spec.tensor_table import STEP_PADDLE_TENSORS
from paddle_step.testing import advance_step_cases, step_paddle_cases
from paddle_step.testing.advance_step_cases import ADVANCE_STEP_OUTPUTS, make_case
from paddle_step.testing.fake_decode_loop import FakeDecodeLoop
from paddle_step.testing.ref_advance_step import ref_advance_step
from paddle_step.testing.ref_step_paddle import ref_step_paddle
from paddle_step.testing.step_paddle_cases import (
    LOOP_CONFIGS,
    assert_same_bytes,
    batch_4096_loop,
    tight_loop,
)


@pytest.fixture(scope="module")
def cpu_ops():
    """paddle_step.testing.paddle_ops when paddle and the built op import (the GPU
    machine may have neither), else None: the GPU results are then compared with
    the references only."""
    try:
        import paddle

        from paddle_step.testing import paddle_ops
    except ImportError:
        return None
    paddle.set_device("cpu")
    return paddle_ops


@pytest.fixture
def gpu_step_paddle(gpu, cpu_ops):
    """run_op for the step_paddle cases: the GPU kernel (and, when the compiled op
    imports, a byte comparison with the CPU kernel per call)."""

    def run_op(state, block_size):
        got = gpu.run_step_paddle(state, block_size)
        if cpu_ops is not None:
            assert_same_bytes(
                got, cpu_ops.run_step_paddle(state, block_size), context="GPU vs CPU kernel:"
            )
        return got

    return run_op


@pytest.fixture
def gpu_advance_step(gpu, cpu_ops):
    """run_op for the advance_step cases: the GPU kernel (and the CPU kernel
    compared, when the compiled op imports)."""

    def run_op(case, active, num_seqs, num_queries, block_size):
        got = gpu.run_advance_step(case, active, num_seqs, num_queries, block_size)
        if cpu_ops is not None:
            expected = cpu_ops.run_advance_step(case, active, num_seqs, num_queries, block_size)
            for name, got_array, cpu_array in zip(ADVANCE_STEP_OUTPUTS, got, expected):
                assert got_array.tobytes() == cpu_array.tobytes(), f"GPU vs CPU kernel: {name}"
        return got

    return run_op


# ---- The CPU tests' cases, on the GPU kernels. ---------------------------


@pytest.mark.parametrize("num_seqs", advance_step_cases.MATRIX["num_seqs"])
@pytest.mark.parametrize("block_size", advance_step_cases.MATRIX["block_size"])
@pytest.mark.parametrize("seq_lens_dtype", advance_step_cases.MATRIX["seq_lens_dtype"])
@pytest.mark.parametrize("tables_dtype", advance_step_cases.MATRIX["tables_dtype"])
@pytest.mark.parametrize("with_active", advance_step_cases.MATRIX["with_active"])
def test_advance_step_matches_reference(
    gpu_advance_step, num_seqs, block_size, seq_lens_dtype, tables_dtype, with_active
):
    advance_step_cases.matches_reference(
        gpu_advance_step, num_seqs, block_size, seq_lens_dtype, tables_dtype, with_active
    )


@pytest.mark.parametrize("name", list(advance_step_cases.FIXED_CASES))
def test_advance_step_edge_cases(gpu_advance_step, name):
    advance_step_cases.FIXED_CASES[name](gpu_advance_step)


@pytest.mark.parametrize("name", list(step_paddle_cases.CASES))
def test_step_paddle_cases(gpu_step_paddle, name):
    step_paddle_cases.CASES[name](gpu_step_paddle)


LOOP_PARAMS = [pytest.param(config, id=key) for key, config in LOOP_CONFIGS.items()]


# ---- CUDA graphs: capture one call, replay it on fresh inputs. ------------


@pytest.mark.parametrize(
    "seq_lens_dtype,tables_dtype",
    [(np.int32, np.int32), (np.int64, np.int32), (np.int32, np.int64), (np.int64, np.int64)],
)
@pytest.mark.parametrize("with_active", [False, True])
def test_advance_step_cuda_graph(gpu, seq_lens_dtype, tables_dtype, with_active):
    num_seqs, num_queries, block_size = 1000, 700, 16
    rng = np.random.default_rng(5)

    def fresh_inputs():
        case, active = make_case(
            num_seqs, num_queries, block_size, seq_lens_dtype, tables_dtype, with_active, rng
        )
        arrays = dict(case)
        if active is not None:
            arrays["active"] = active
        return case, active, arrays

    def reference(inputs, active):
        """The reference's outputs for ``inputs``, by name."""
        outputs = ref_advance_step(
            **inputs,
            num_seqs=num_seqs,
            num_queries=num_queries,
            block_size=block_size,
            active=active,
        )
        return dict(zip(ADVANCE_STEP_OUTPUTS, outputs))

    case, active, arrays = fresh_inputs()
    # A first launch outside the capture also loads the kernel (CUDA lazy loading).
    gpu.run_advance_step(case, active, num_seqs, num_queries, block_size)
    buffers = gpu.upload(arrays)
    with gpu.graph(
        lambda stream: gpu.launch_advance_step(buffers, num_seqs, num_queries, block_size, stream)
    ) as replay:
        # Capturing records the launch without running it.
        assert_same_bytes(gpu.download(buffers), arrays, arrays, "after capture:")
        for trial in range(4):
            if trial:
                case, active, arrays = fresh_inputs()
                gpu.copy_into(buffers, arrays)
            replay()
            expected = reference(case, active)
            assert_same_bytes(
                gpu.download(buffers), expected, ADVANCE_STEP_OUTPUTS, f"replay {trial}:"
            )
        # Replaying again reads the buffers as they are now: a second step.
        replay()
        twice = dict(case, **expected)
        expected = reference(twice, active)
        assert_same_bytes(gpu.download(buffers), expected, ADVANCE_STEP_OUTPUTS, "second replay:")


def _graph_decode_loop(gpu, loop: FakeDecodeLoop, block_size: int, max_steps: int) -> int:
    """Drives `loop` with one captured step_paddle call replayed on each
    step's state, copied into the captured buffers; each result is compared
    with the reference. Returns the number of op calls."""
    loop.host_update()
    state = loop.state()
    # A first launch outside the capture also loads the kernel (CUDA lazy loading).
    gpu.run_step_paddle(state, block_size)
    buffers = gpu.upload({name: state[name] for name in STEP_PADDLE_TENSORS})
    calls = 0
    with gpu.graph(lambda stream: gpu.launch_step_paddle(buffers, block_size, stream)) as replay:
        assert_same_bytes(gpu.download(buffers), state, STEP_PADDLE_TENSORS, "after capture:")
        while calls < max_steps and not loop.done:
            if calls:
                gpu.copy_into(buffers, {name: state[name] for name in STEP_PADDLE_TENSORS})
            replay()
            got = gpu.download(buffers)
            assert_same_bytes(
                got, ref_step_paddle(state, block_size), STEP_PADDLE_TENSORS, f"replay {calls}:"
            )
            calls += 1
            loop.load(got)
            loop.host_update()
            state = loop.state()
    return calls


@pytest.mark.parametrize("config", LOOP_PARAMS)
def test_step_paddle_cuda_graph_decode_loop(gpu, config):
    # The loop of the decode_loop cases, every step a graph replay.
    loop = tight_loop(config)
    calls = _graph_decode_loop(gpu, loop, block_size=config[2], max_steps=3000)
    assert loop.done and calls > 10
    if config[0] > 1:
        assert loop.preemptions > 0 and loop.recoveries > 0


def test_step_paddle_cuda_graph_batch_4096(gpu):
    # The batch_4096 case's loop, every step a graph replay.
    loop = batch_4096_loop()
    assert _graph_decode_loop(gpu, loop, 8, max_steps=12) == 12
    used = np.asarray(loop.state()["used_list_len"]).reshape(-1)
    assert used[256:].sum() > 0 and loop.preemptions > 0
