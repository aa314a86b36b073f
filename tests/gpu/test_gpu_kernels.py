"""The CUDA kernels of both ops, without Paddle, against the NumPy references.

The cases are the CPU op tests' own: tests/test_advance_step.py and
tests/test_step_paddle.py are imported and their test functions run with
their `run_op` pointed at the GPU launchers (`gpu` fixture, conftest.py), over
their own parametrizations. When the compiled paddle_step op imports, each
GPU step_paddle / advance_step result is also compared with the CPU kernel.
Then: CUDA-graph capture and replay of both ops, and kernel times
(`pytest -s` shows them).

Every test skips, with the reason, without the built library, without
CuPy/PyTorch or without a CUDA device (conftest.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

try:  # conftest.py made these importable, or its gpu fixture skips every test
    from fake_decode_loop import FakeDecodeLoop
    from ref_advance_step import ref_advance_step
    from ref_step_paddle import STEP_PADDLE_TENSORS, ref_step_paddle
except Exception:  # noqa: BLE001
    FakeDecodeLoop = ref_advance_step = ref_step_paddle = None
    STEP_PADDLE_TENSORS = ()

TESTS_DIR = Path(__file__).resolve().parents[1]


def _load_cpu_test_module(name: str):
    """tests/<name>.py as (module, real). real: it imported with paddle and
    the built paddle_step, so its run_op runs the CPU op. Otherwise (the GPU
    machine may have neither) it is loaded under a private name with
    stand-ins for paddle and paddle_step, for its NumPy case builders and its
    parametrizations only. (None, False) if even that fails."""
    try:
        return importlib.import_module(name), True
    except Exception:  # noqa: BLE001  paddle or the built op missing
        sys.modules.pop(name, None)
    stubbed = ("paddle", "paddle_step")
    saved = {key: sys.modules.get(key) for key in stubbed}
    try:
        sys.modules.update({key: mock.MagicMock(name=key) for key in stubbed})
        spec = importlib.util.spec_from_file_location(f"_paddle_free_{name}",
                                                      TESTS_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module, False
    except Exception:  # noqa: BLE001  reported by the tests' empty parameter sets
        return None, False
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value


CPU_STEP, CPU_STEP_REAL = _load_cpu_test_module("test_step_paddle")
CPU_ADVANCE, CPU_ADVANCE_REAL = _load_cpu_test_module("test_advance_step")


def same_parametrization(module, test_name: str, argnames: str):
    """The parametrize marks of `module.test_name` (the CPU test), so the GPU
    test runs exactly its cases; an empty parameter set (a skip) if the CPU
    test module could not be loaded."""
    source = getattr(module, test_name, None)
    marks = [mark for mark in getattr(source, "pytestmark", []) if mark.name == "parametrize"]

    def apply(test):
        if not marks:
            return pytest.mark.parametrize(argnames, [])(test)
        for mark in reversed(marks):
            test = pytest.mark.parametrize(*mark.args, **mark.kwargs)(test)
        return test
    return apply


def assert_bytes_equal(got: dict, expected: dict, names, context=""):
    for name in names:
        assert got[name].dtype == expected[name].dtype, f"{context} {name} dtype"
        assert got[name].shape == expected[name].shape, f"{context} {name} shape"
        if got[name].tobytes() != expected[name].tobytes():
            np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{context} {name}")


# ---- The CPU tests' cases, on the GPU kernels. ---------------------------

@pytest.fixture
def gpu_step_paddle(gpu, monkeypatch):
    """tests/test_step_paddle.py with run_op = the GPU kernel (and, when the
    compiled op imports, a byte comparison with the CPU kernel per call)."""
    if CPU_STEP is None:
        pytest.skip("tests/test_step_paddle.py could not be loaded")
    cpu_run_op = CPU_STEP.run_op if CPU_STEP_REAL else None
    if cpu_run_op is not None:
        import paddle
        paddle.set_device("cpu")

    def run_op(state, block_size, encoder_decoder_block_num=0):
        got = gpu.run_step_paddle(state, block_size)
        if cpu_run_op is not None:
            assert_bytes_equal(got, cpu_run_op(state, block_size, encoder_decoder_block_num),
                               STEP_PADDLE_TENSORS, "GPU vs CPU kernel:")
        return got

    monkeypatch.setattr(CPU_STEP, "run_op", run_op)
    return CPU_STEP


@pytest.fixture
def gpu_advance_step(gpu, monkeypatch):
    """tests/test_advance_step.py with run_op = the GPU kernel (and the CPU
    kernel compared, when the compiled op imports)."""
    if CPU_ADVANCE is None:
        pytest.skip("tests/test_advance_step.py could not be loaded")
    cpu_run_op = CPU_ADVANCE.run_op if CPU_ADVANCE_REAL else None
    if cpu_run_op is not None:
        import paddle
        paddle.set_device("cpu")

    def run_op(case, active, num_seqs, num_queries, block_size):
        got = gpu.run_advance_step(case, active, num_seqs, num_queries, block_size)
        if cpu_run_op is not None:
            for name, got_array, cpu_array in zip(
                    CPU_ADVANCE.OUTPUT_NAMES, got,
                    cpu_run_op(case, active, num_seqs, num_queries, block_size)):
                assert got_array.tobytes() == cpu_array.tobytes(), f"GPU vs CPU kernel: {name}"
        return got

    monkeypatch.setattr(CPU_ADVANCE, "run_op", run_op)
    return CPU_ADVANCE


@same_parametrization(CPU_ADVANCE, "test_matches_reference",
                      "num_seqs,block_size,seq_lens_dtype,tables_dtype,with_active")
def test_advance_step_matches_reference(gpu_advance_step, num_seqs, block_size, seq_lens_dtype,
                                        tables_dtype, with_active):
    gpu_advance_step.test_matches_reference("gpu", num_seqs, block_size, seq_lens_dtype,
                                            tables_dtype, with_active)


@pytest.mark.parametrize("name", ["test_hand_worked_rows", "test_slot_is_computed_in_64_bits",
                                  "test_inactive_rows_keep_their_seq_len"])
def test_advance_step_edge_cases(gpu_advance_step, name):
    getattr(gpu_advance_step, name)("gpu")


@same_parametrization(CPU_STEP, "test_decode_loop_matches_reference",
                      "batch,max_len,block_size,blocks_per_seq,decoder_blocks,encoder_blocks,"
                      "stopped_shape")
def test_step_paddle_decode_loop(gpu_step_paddle, batch, max_len, block_size, blocks_per_seq,
                                 decoder_blocks, encoder_blocks, stopped_shape):
    gpu_step_paddle.test_decode_loop_matches_reference(
        "gpu", batch, max_len, block_size, blocks_per_seq, decoder_blocks, encoder_blocks,
        stopped_shape)


@same_parametrization(CPU_STEP, "test_random_states_match_reference", "batch")
def test_step_paddle_random_states(gpu_step_paddle, batch):
    gpu_step_paddle.test_random_states_match_reference("gpu", batch)


@pytest.mark.parametrize("name", ["test_shortfall_happens_and_matches", "test_batch_4096",
                                  "test_empty_pool_all_stopped_and_full_table"])
def test_step_paddle_cases(gpu_step_paddle, name):
    getattr(gpu_step_paddle, name)("gpu")


# ---- CUDA graphs: capture one call, replay it on fresh inputs. ------------

ADVANCE_OUTPUTS = ("input_tokens", "input_positions", "seq_lens", "slot_mapping")


@pytest.mark.parametrize("seq_lens_dtype,tables_dtype",
                         [(np.int32, np.int32), (np.int64, np.int32), (np.int32, np.int64),
                          (np.int64, np.int64)])
@pytest.mark.parametrize("with_active", [False, True])
def test_advance_step_cuda_graph(gpu, seq_lens_dtype, tables_dtype, with_active):
    if CPU_ADVANCE is None:
        pytest.skip("tests/test_advance_step.py could not be loaded (its make_case is used)")
    num_seqs, num_queries, block_size = 1000, 700, 16
    rng = np.random.default_rng(5)

    def fresh_inputs():
        case, active = CPU_ADVANCE.make_case(num_seqs, num_queries, block_size, seq_lens_dtype,
                                             tables_dtype, with_active, rng)
        arrays = dict(case)
        if active is not None:
            arrays["active"] = active
        return case, active, arrays

    case, active, arrays = fresh_inputs()
    # A first launch outside the capture also loads the kernel (CUDA lazy loading).
    gpu.run_advance_step(case, active, num_seqs, num_queries, block_size)
    buffers = gpu.upload(arrays)
    with gpu.graph(lambda stream: gpu.launch_advance_step(buffers, num_seqs, num_queries,
                                                          block_size, stream)) as replay:
        # Capturing records the launch without running it.
        assert_bytes_equal(gpu.download(buffers), arrays, arrays, "after capture:")
        for trial in range(4):
            if trial:
                case, active, arrays = fresh_inputs()
                gpu.copy_into(buffers, arrays)
            replay()
            expected = dict(zip(ADVANCE_OUTPUTS, ref_advance_step(
                **case, num_seqs=num_seqs, num_queries=num_queries, block_size=block_size,
                active=active)))
            assert_bytes_equal(gpu.download(buffers), expected, ADVANCE_OUTPUTS,
                               f"replay {trial}:")
        # Replaying again reads the buffers as they are now: a second step.
        replay()
        twice = dict(case, **expected)
        expected = dict(zip(ADVANCE_OUTPUTS, ref_advance_step(
            **twice, num_seqs=num_seqs, num_queries=num_queries, block_size=block_size,
            active=active)))
        assert_bytes_equal(gpu.download(buffers), expected, ADVANCE_OUTPUTS, "second replay:")


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
        assert_bytes_equal(gpu.download(buffers), state, STEP_PADDLE_TENSORS, "after capture:")
        while calls < max_steps and not loop.done:
            if calls:
                gpu.copy_into(buffers, {name: state[name] for name in STEP_PADDLE_TENSORS})
            replay()
            got = gpu.download(buffers)
            assert_bytes_equal(got, ref_step_paddle(state, block_size), STEP_PADDLE_TENSORS,
                               f"replay {calls}:")
            calls += 1
            loop.load(got)
            loop.host_update()
            state = loop.state()
    return calls


@pytest.mark.parametrize("batch,max_len,block_size,blocks_per_seq,decoder_blocks,encoder_blocks",
                         getattr(CPU_STEP, "LOOP_CONFIGS", []))
def test_step_paddle_cuda_graph_decode_loop(gpu, batch, max_len, block_size, blocks_per_seq,
                                            decoder_blocks, encoder_blocks):
    # The loop of test_decode_loop_matches_reference, every step a graph replay.
    loop = FakeDecodeLoop(batch, max_len, block_size, blocks_per_seq, decoder_blocks,
                          encoder_blocks, seed=batch, stop_prob=0.01,
                          prompt_len_range=(1, 2 * block_size), output_len_range=(1, max_len // 2),
                          num_requests=max(12, 2 * batch))
    calls = _graph_decode_loop(gpu, loop, block_size, max_steps=3000)
    assert loop.done and calls > 10
    if batch > 1:
        assert loop.preemptions > 0 and loop.recoveries > 0


def test_step_paddle_cuda_graph_batch_4096(gpu):
    # test_batch_4096's loop, every step a graph replay.
    loop = FakeDecodeLoop(4096, 32, 8, 4, 1500, 9000, seed=7, arrival_prob=0.9, stop_prob=0.05,
                          prompt_len_range=(1, 8), output_len_range=(1, 24), num_requests=4096)
    assert _graph_decode_loop(gpu, loop, 8, max_steps=12) == 12
    used = np.asarray(loop.state()["used_list_len"]).reshape(-1)
    assert used[256:].sum() > 0 and loop.preemptions > 0


# ---- Kernel times. ------------------------------------------------------

TIMING_BATCHES = (1, 64, 256, 1024, 4096)


def _busy_state(gpu, batch: int, block_size: int = 8) -> dict:
    """A serving state: a tight fake loop run a few steps through the GPU kernel."""
    loop = FakeDecodeLoop(batch, 32, block_size, 4, max(4, 3 * batch // 8), max(8, 9 * batch // 4),
                          seed=batch, arrival_prob=0.9, stop_prob=0.05, prompt_len_range=(1, 8),
                          output_len_range=(1, 24), num_requests=4 * batch)
    for _ in range(8):
        loop.host_update()
        loop.load(gpu.run_step_paddle(loop.state(), block_size))
    loop.host_update()
    return {name: array for name, array in loop.state().items() if name in STEP_PADDLE_TENSORS}


def test_report_kernel_times(gpu):
    """Median CUDA-event time of one launch (inputs restored between calls)."""
    if CPU_ADVANCE is None:
        pytest.skip("tests/test_advance_step.py could not be loaded (its make_case is used)")
    rows = []
    for batch in TIMING_BATCHES:
        state = _busy_state(gpu, batch)
        step_buffers = gpu.upload(state)
        step_ms = gpu.time_ms(lambda stream: gpu.launch_step_paddle(step_buffers, 8, stream),
                              lambda: gpu.copy_into(step_buffers, state))
        case, _ = CPU_ADVANCE.make_case(batch, batch, 16, np.int32, np.int32, False,
                                        np.random.default_rng(batch))
        advance_buffers = gpu.upload(case)
        advance_ms = gpu.time_ms(
            lambda stream: gpu.launch_advance_step(advance_buffers, batch, batch, 16, stream),
            lambda: gpu.copy_into(advance_buffers, case))
        rows.append((batch, step_ms, advance_ms))
        assert step_ms > 0 and advance_ms > 0
    print(f"\n[tests/gpu] kernel times, CUDA events, median of 50 launches ({gpu.backend.name})")
    print(f"{'B':>6} {'step_paddle us':>15} {'advance_step us':>16}")
    for batch, step_ms, advance_ms in rows:
        print(f"{batch:>6} {step_ms * 1e3:>15.1f} {advance_ms * 1e3:>16.1f}")
