"""A CPU engine keeps the memory a step frees for the next step: buffers of up to 32 MiB
allocated and freed over and over reuse mapped pages instead of faulting in new ones. Its
KV cache is resident only where written."""

import resource
import subprocess
import sys
import textwrap

import numpy as np
import paddle
import pytest

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine import llm_engine
from paddle_step.engine.llm_engine import Engine
from paddle_step.host_memory import untouched_zeros
from paddle_step.layers.paged_attention import PagedKVCache
from paddle_step.models.llama import LlamaForCausalLM

# Buffers of 30, 24 and 12 MiB, each page written, then freed; page faults over 5 rounds
# after a first. glibc's own rules unmap (30 MiB above its threshold at first) or trim
# them (66 MiB freed at the top of its heap is past twice the largest block freed).
FAULTS_OF_ROUNDS = textwrap.dedent(
    """
    import resource, sys
    if sys.argv[1] == "keep":
        from paddle_step.host_memory import keep_freed_memory
        assert keep_freed_memory()
    MIB = 1 << 20

    def one_round():
        buffers = [bytearray(30 * MIB), bytearray(24 * MIB), bytearray(12 * MIB)]
        for buffer in buffers:
            buffer[::4096] = b"\\x01" * len(buffer[::4096])

    one_round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        one_round()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", FAULTS_OF_ROUNDS, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_buffers_are_reused_without_page_faults() -> None:
    pages = 5 * (30 + 24 + 12) * 256  # 4 KiB pages written over the 5 rounds
    assert faults("default") > pages // 2  # what the setting changes
    assert faults("keep") < pages // 20


def test_cpu_engine_keeps_freed_memory(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(llm_engine, "keep_freed_memory", lambda: calls.append(1) or True)
    Engine(
        LlamaForCausalLM(ModelConfig()),
        EngineConfig(max_batch=2, max_model_len=16, block_size=4, num_kv_blocks=16),
    )
    assert calls == [1]


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_untouched_zeros_cost_no_resident_memory_until_written(dtype) -> None:
    before = resident_bytes()
    zeros = untouched_zeros([3, 1000, 7, 4096 + 5], dtype)  # odd sizes: 690 or 1380 MB
    assert zeros.dtype == np.dtype(dtype) and zeros.shape == (3, 1000, 7, 4101)
    assert zeros.flags.c_contiguous and zeros.flags.writeable
    assert zeros.ctypes.data % 64 == 0
    assert resident_bytes() - before < 32 << 20
    zeros[1, 500] = 2.0  # one row: its pages only
    assert resident_bytes() - before < 32 << 20
    assert zeros[1, 500].sum() == 2.0 * 7 * 4101 and zeros.sum() == zeros[1, 500].sum()


def dlpack_shares_numpy_memory() -> bool:
    array = np.zeros(16, np.float32)
    return paddle.utils.dlpack.from_dlpack(array.__dlpack__()).data_ptr() == array.ctypes.data


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm")
@pytest.mark.skipif(not dlpack_shares_numpy_memory(), reason="this Paddle copies through DLPack")
def test_a_cpu_kv_cache_is_resident_only_where_written() -> None:
    before = resident_bytes()
    cache = PagedKVCache(num_blocks=4096, block_size=16, num_layers=8, num_kv_heads=2, head_dim=64)
    assert cache.uses_cpu_ops and cache.key.dtype == paddle.float32  # 2 x 256 MB
    assert cache.key.shape == [8, 65536, 2, 64] and cache.value.shape == [8, 65536, 2, 64]
    assert cache.key.data_ptr() % 64 == 0 and cache.value.data_ptr() % 64 == 0
    assert resident_bytes() - before < 32 << 20
    cache.key[2, 7] = paddle.ones([2, 64])
    assert float(cache.key.sum()) == 128.0 and float(cache.value.abs().sum()) == 0.0
    assert resident_bytes() - before < 32 << 20
