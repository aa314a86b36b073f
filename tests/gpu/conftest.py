"""The `gpu` fixture: the op's CUDA launchers without Paddle.

tests/gpu/build/libpaddle_step_gpu_test.so (`make -C tests/gpu build`) wraps
paddle_step::LaunchAdvanceStep / LaunchStepPaddle in C functions taking raw
device pointers; device memory comes from CuPy or PyTorch, whichever imports.
Everything else (streams, CUDA graphs, events) goes through the library, so
the two backends differ only in how arrays are allocated and copied.

Without the library, without CuPy and PyTorch, or without a visible CUDA
device, every test that uses the fixture is skipped with the reason. Nothing
here imports CuPy or PyTorch at import time.
"""

from __future__ import annotations

import ctypes
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

# NumPy only: found through PYTHONPATH=python (tests/gpu/Makefile) or an install.
from paddle_step.spec.tensor_table import (
    STEP_PADDLE_DTYPES,
    STEP_PADDLE_TABLE,
    STEP_PADDLE_TENSORS,
)
from paddle_step.testing.advance_step_cases import ADVANCE_STEP_OUTPUTS

REPO = Path(__file__).resolve().parents[2]
# PADDLE_STEP_GPU_LIBRARY points the tests at another build (to time two builds
# of the kernels side by side, say).
LIBRARY = Path(
    os.environ.get(
        "PADDLE_STEP_GPU_LIBRARY", REPO / "tests" / "gpu" / "build" / "libpaddle_step_gpu_test.so"
    )
)

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_SIGNATURES = {
    # name: (argtypes); every function returns a cudaError_t as int
    "paddle_step_advance_step": [
        _P,
        _P,
        _P,
        _P,
        ctypes.c_int,
        _P,
        _P,
        ctypes.c_int,
        _P,
        _I64,
        _I64,
        _I64,
        _I64,
        _P,
    ],
    "paddle_step_step_paddle": [ctypes.POINTER(_P), _I64, _I64, _I64, _I64, _I64, _I64, _P],
    "paddle_step_step_paddle_tensor_count": [],
    "paddle_step_device_count": [ctypes.POINTER(ctypes.c_int)],
    "paddle_step_device_info": [
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int),
    ],
    "paddle_step_gpu_count": [],
    "paddle_step_device_synchronize": [],
    "paddle_step_stream_create": [ctypes.POINTER(_P)],
    "paddle_step_stream_synchronize": [_P],
    "paddle_step_stream_destroy": [_P],
    "paddle_step_capture_begin": [_P],
    "paddle_step_capture_end": [_P, ctypes.POINTER(_P), ctypes.POINTER(_I64)],
    "paddle_step_graph_launch": [_P, _P],
    "paddle_step_graph_destroy": [_P],
    "paddle_step_memcpy_device": [_P, _P, _I64, _P],
    "paddle_step_add_one": [_P, _I64, _P],
    "paddle_step_event_create": [ctypes.POINTER(_P)],
    "paddle_step_event_record": [_P, _P],
    "paddle_step_event_elapsed_ms": [_P, _P, ctypes.POINTER(ctypes.c_float)],
    "paddle_step_event_destroy": [_P],
}


def load_library(path: Path = LIBRARY) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int
    lib.paddle_step_error_string.argtypes = [ctypes.c_int]
    lib.paddle_step_error_string.restype = ctypes.c_char_p
    return lib


# ---- Array backends: allocation and host<->device copies only. -------------


class CupyBackend:
    name = "cupy"

    def __init__(self, cupy):
        self.cp = cupy

    def to_device(self, array):
        return self.cp.array(np.ascontiguousarray(array))

    def to_host(self, buffer):
        return self.cp.asnumpy(buffer)

    def pointer(self, buffer) -> int:
        return int(buffer.data.ptr)

    def copy_from_host(self, buffer, array):
        buffer.set(np.ascontiguousarray(array))


class TorchBackend:
    name = "torch"

    def __init__(self, torch):
        self.torch = torch

    def to_device(self, array):
        return self.torch.from_numpy(np.array(array, copy=True, order="C")).to("cuda")

    def to_host(self, buffer):
        return buffer.cpu().numpy()

    def pointer(self, buffer) -> int:
        return int(buffer.data_ptr())

    def copy_from_host(self, buffer, array):
        buffer.copy_(self.torch.from_numpy(np.array(array, copy=True, order="C")))


def import_backend():
    """CuPy, else PyTorch with CUDA; None when neither is usable.

    PADDLE_STEP_GPU_BACKEND=cupy or =torch picks one (`make -C tests/gpu sanitize`
    uses torch with its caching allocator off, so that each buffer is its own
    cudaMalloc and memcheck sees a write past its end).
    """
    wanted = os.environ.get("PADDLE_STEP_GPU_BACKEND", "")
    if wanted not in ("", "cupy", "torch"):
        raise ValueError(f"PADDLE_STEP_GPU_BACKEND: expected 'cupy' or 'torch', got {wanted!r}")
    if wanted in ("", "cupy"):
        try:
            import cupy

            return CupyBackend(cupy)
        except Exception:  # noqa: BLE001  not installed, or no CUDA runtime for it
            pass
    if wanted in ("", "torch"):
        try:
            import torch

            if torch.cuda.is_available():
                return TorchBackend(torch)
        except Exception:  # noqa: BLE001
            pass
    return None


# ---- The harness. ---------------------------------------------------------


class GpuHarness:
    """Device buffers for the ops' tensors and the library's launchers.

    Buffers are dicts name -> backend array. Host copies run on the
    backend's stream, launches on this harness's own non-blocking stream;
    upload, copy_into and download synchronize the device, so the two never
    overlap.
    """

    def __init__(self, lib: ctypes.CDLL, backend):
        self.lib = lib
        self.backend = backend
        handle = _P()
        self.check(lib.paddle_step_stream_create(ctypes.byref(handle)), "cudaStreamCreate")
        self.stream = handle.value

    def close(self):
        self.lib.paddle_step_stream_destroy(self.stream)

    def check(self, status: int, what: str):
        if status != 0:
            message = self.lib.paddle_step_error_string(status).decode()
            raise RuntimeError(f"{what} failed: CUDA error {status} ({message})")

    def synchronize(self):
        self.check(self.lib.paddle_step_device_synchronize(), "cudaDeviceSynchronize")

    # -- buffers

    def upload(self, arrays: dict) -> dict:
        buffers = {name: self.backend.to_device(array) for name, array in arrays.items()}
        self.synchronize()
        return buffers

    def copy_into(self, buffers: dict, arrays: dict):
        """Writes host arrays into existing buffers (same shapes and dtypes)."""
        for name, array in arrays.items():
            buffer = buffers[name]
            assert tuple(buffer.shape) == array.shape, (name, buffer.shape, array.shape)
            self.backend.copy_from_host(buffer, array)
        self.synchronize()

    def download(self, buffers: dict) -> dict:
        self.synchronize()
        return {name: self.backend.to_host(buffer) for name, buffer in buffers.items()}

    def pointer(self, buffer):
        return self.backend.pointer(buffer) or None  # an empty array may have no address

    # -- advance_step

    def launch_advance_step(
        self, buffers: dict, num_seqs: int, num_queries: int, block_size: int, stream=None
    ):
        """Launches on `stream` (default: the harness's); `buffers` holds the six
        tensors of advance_step, plus "active" when given."""
        seq_lens, tables = buffers["seq_lens"], buffers["block_tables"]
        seq_lens_bits = _bits(seq_lens)
        tables_bits = _bits(tables)
        assert seq_lens_bits in (32, 64) and tables_bits in (32, 64)
        for name in ("input_tokens", "input_positions", "slot_mapping"):
            assert _bits(buffers[name]) == 64 and tuple(buffers[name].shape) == (num_seqs,), name
        assert tuple(seq_lens.shape) == (num_seqs,)
        assert len(tables.shape) == 2 and tables.shape[0] == num_seqs
        sampled = buffers["sampled_token_ids"]
        assert _bits(sampled) == 64 and int(np.prod(sampled.shape)) == num_queries
        assert tuple(sampled.shape) in ((num_queries,), (num_queries, 1))
        active = buffers.get("active")
        if active is not None:
            assert tuple(active.shape) == (num_seqs,) and _dtype(active) == np.bool_
        status = self.lib.paddle_step_advance_step(
            self.pointer(buffers["input_tokens"]),
            self.pointer(sampled),
            self.pointer(buffers["input_positions"]),
            self.pointer(seq_lens),
            seq_lens_bits,
            self.pointer(buffers["slot_mapping"]),
            self.pointer(tables),
            tables_bits,
            None if active is None else self.pointer(active),
            num_seqs,
            num_queries,
            int(tables.shape[1]),
            block_size,
            self.stream if stream is None else stream,
        )
        self.check(status, "paddle_step_advance_step")

    def run_advance_step(self, case: dict, active, num_seqs, num_queries, block_size):
        """The op on copies of `case`; returns the four outputs, as the CPU test's run_op."""
        arrays = dict(case)
        if active is not None:
            arrays["active"] = np.asarray(active, dtype=np.bool_)
        buffers = self.upload(arrays)
        self.launch_advance_step(buffers, num_seqs, num_queries, block_size)
        got = self.download(buffers)
        return [got[name] for name in ADVANCE_STEP_OUTPUTS]

    # -- step_paddle

    def launch_step_paddle(self, buffers: dict, block_size: int, stream=None):
        for name in STEP_PADDLE_TENSORS:
            assert _dtype(buffers[name]) == STEP_PADDLE_DTYPES[name], name
        shape = {name: tuple(buffers[name].shape) for name in STEP_PADDLE_TENSORS}
        batch = shape["stop_flags"][0]
        allowed = {
            "[B]": lambda s: s == (batch,),
            "[B or B,1]": lambda s: s in ((batch,), (batch, 1)),
            "[N]": lambda s: len(s) == 1,
            "[1]": lambda s: s == (1,),
        }
        for spec in STEP_PADDLE_TABLE:
            # [B,M], [B,L], [B,P]: two dimensions, B rows.
            fits = allowed.get(spec.shape, lambda s: len(s) == 2 and s[0] == batch)
            assert fits(shape[spec.name]), (spec.name, spec.shape, shape[spec.name])
        count = self.lib.paddle_step_step_paddle_tensor_count()
        assert count == len(STEP_PADDLE_TENSORS)
        pointers = (_P * count)(*(self.pointer(buffers[name]) for name in STEP_PADDLE_TENSORS))
        status = self.lib.paddle_step_step_paddle(
            pointers,
            batch,
            shape["block_tables"][1],
            shape["free_list"][0],
            shape["input_ids"][1],
            shape["pre_ids"][1],
            block_size,
            self.stream if stream is None else stream,
        )
        self.check(status, "paddle_step_step_paddle")

    def run_step_paddle(self, state: dict, block_size: int) -> dict:
        """The op on copies of `state`; returns the 22 tensors afterwards."""
        buffers = self.upload({name: state[name] for name in STEP_PADDLE_TENSORS})
        self.launch_step_paddle(buffers, block_size)
        return self.download(buffers)

    # -- CUDA graphs

    @contextmanager
    def captured_graph(self, record):
        """Captures `record(stream)` (any number of launches and copies on the
        harness's stream) into one CUDA graph; yields (executable graph handle,
        number of nodes captured)."""
        self.synchronize()
        self.check(self.lib.paddle_step_capture_begin(self.stream), "cudaStreamBeginCapture")
        try:
            record(self.stream)
        finally:
            exec_handle, nodes = _P(), _I64()
            status = self.lib.paddle_step_capture_end(
                self.stream, ctypes.byref(exec_handle), ctypes.byref(nodes)
            )
        self.check(status, "cudaStreamEndCapture / cudaGraphInstantiate")
        assert nodes.value >= 1, "the capture recorded no kernel"
        try:
            yield exec_handle, nodes.value
        finally:
            self.lib.paddle_step_graph_destroy(exec_handle)

    @contextmanager
    def graph(self, launch):
        """Captures `launch(stream)` on the harness's stream; yields replay(),
        which launches the graph and waits for it."""
        with self.captured_graph(launch) as (exec_handle, _):

            def replay():
                self.check(
                    self.lib.paddle_step_graph_launch(exec_handle, self.stream), "cudaGraphLaunch"
                )
                self.check(
                    self.lib.paddle_step_stream_synchronize(self.stream),
                    "cudaStreamSynchronize after the graph",
                )

            yield replay

    # -- raw device work (timing)

    def memcpy_device(self, dst: int, src: int, nbytes: int, stream=None):
        """cudaMemcpyAsync device to device between raw addresses."""
        status = self.lib.paddle_step_memcpy_device(
            dst, src, nbytes, self.stream if stream is None else stream
        )
        self.check(status, "cudaMemcpyAsync")

    def add_one(self, address: int, count: int, stream=None):
        """The floor kernel: x[i] += 1 on `count` int64 at `address`."""
        status = self.lib.paddle_step_add_one(
            address, count, self.stream if stream is None else stream
        )
        self.check(status, "paddle_step_add_one")

    def device_info(self) -> str:
        """The device, as "NAME, CUDA runtime R, driver API D, sm_XY" (timing report)."""
        name = ctypes.create_string_buffer(256)
        runtime, driver, major, minor = (ctypes.c_int() for _ in range(4))
        status = self.lib.paddle_step_device_info(
            name,
            len(name),
            ctypes.byref(runtime),
            ctypes.byref(driver),
            ctypes.byref(major),
            ctypes.byref(minor),
        )
        self.check(status, "cudaGetDeviceProperties")

        def version(v):
            return f"{v.value // 1000}.{v.value % 1000 // 10}"

        return (
            f"{name.value.decode(errors='replace')}, CUDA runtime {version(runtime)}, "
            f"driver API {version(driver)}, sm_{major.value}{minor.value}"
        )

    # -- timing

    def time_graph_ms(self, exec_handle, replays: int = 5, warmup: int = 1) -> float:
        """Best (lowest) CUDA-event time of one replay of the executable graph
        `exec_handle`, over `replays` replays after `warmup` untimed ones."""
        start, end = _P(), _P()
        self.check(self.lib.paddle_step_event_create(ctypes.byref(start)), "cudaEventCreate")
        self.check(self.lib.paddle_step_event_create(ctypes.byref(end)), "cudaEventCreate")
        times = []
        try:
            for replay in range(warmup + replays):
                self.check(self.lib.paddle_step_event_record(start, self.stream), "cudaEventRecord")
                self.check(
                    self.lib.paddle_step_graph_launch(exec_handle, self.stream), "cudaGraphLaunch"
                )
                self.check(self.lib.paddle_step_event_record(end, self.stream), "cudaEventRecord")
                elapsed = ctypes.c_float()
                self.check(
                    self.lib.paddle_step_event_elapsed_ms(start, end, ctypes.byref(elapsed)),
                    "cudaEventElapsedTime",
                )
                if replay >= warmup:
                    times.append(elapsed.value)
        finally:
            self.lib.paddle_step_event_destroy(start)
            self.lib.paddle_step_event_destroy(end)
        return min(times)

    def host_us_per_call(self, launch, count: int, warmup: int = 10) -> float:
        """Host wall time per call: time.perf_counter around `count` calls of
        `launch()` (direct ctypes launches on the harness's stream) and one
        stream synchronize after them, divided by `count`."""
        for _ in range(warmup):
            launch()
        self.check(self.lib.paddle_step_stream_synchronize(self.stream), "cudaStreamSynchronize")
        begin = time.perf_counter()
        for _ in range(count):
            launch()
        status = self.lib.paddle_step_stream_synchronize(self.stream)
        elapsed = time.perf_counter() - begin
        self.check(status, "cudaStreamSynchronize")
        return elapsed / count * 1e6


def _dtype(buffer) -> np.dtype:
    """NumPy dtype of a CuPy array (already one) or a torch tensor ("torch.int32")."""
    if isinstance(buffer.dtype, np.dtype):
        return buffer.dtype
    return np.dtype(str(buffer.dtype).replace("torch.", ""))


def _bits(buffer) -> int:
    dtype = _dtype(buffer)
    assert dtype.kind == "i", dtype
    return dtype.itemsize * 8


@pytest.fixture(scope="session")
def gpu():
    if not LIBRARY.exists():
        pytest.skip(f"{LIBRARY} is not built (make gpu-test, or make -C tests/gpu build)")
    try:
        lib = load_library(LIBRARY)
    except (OSError, AttributeError) as error:  # not loadable, or built from older sources
        pytest.skip(f"cannot load {LIBRARY.name} ({error}); rebuild: make -C tests/gpu build")
    count = ctypes.c_int()
    status = lib.paddle_step_device_count(ctypes.byref(count))
    if status != 0 or count.value == 0:
        reason = lib.paddle_step_error_string(status).decode() if status else "0 devices"
        pytest.skip(f"no CUDA device visible (cudaGetDeviceCount: {reason})")
    backend = import_backend()
    if backend is None:
        pytest.skip(
            "neither CuPy nor PyTorch with CUDA is importable (device arrays come from one of them)"
        )
    harness = GpuHarness(lib, backend)
    print(f"\n[tests/gpu] backend {backend.name}, {count.value} CUDA device(s)")
    yield harness
    harness.close()
