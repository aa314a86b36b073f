"""A CPU engine keeps the memory a step frees for the next step: buffers of up to 32 MiB
allocated and freed over and over reuse mapped pages instead of faulting in new ones."""

import subprocess
import sys
import textwrap

import pytest

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine import llm_engine
from paddle_step.engine.llm_engine import Engine
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
