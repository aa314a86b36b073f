"""The engine computes on every core it may run on unless told otherwise, and says when
the prompt region, not the batch slots, limits admission."""

import ctypes
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.arg_utils import add_engine_arguments, engine_config
from paddle_step.engine.cpu_threads import INTEL_OPENMP, available_cores, default_threads
from paddle_step.engine.llm_engine import Engine
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.sampling_params import SamplingParams

BASE = dict(max_batch=2, max_model_len=16, block_size=4, num_kv_blocks=16)


@pytest.mark.parametrize("threads", [0, -1, True, 1.5])
def test_config_rejects_bad_thread_counts(threads) -> None:
    with pytest.raises(ValueError, match=f"EngineConfig.threads: .* got {threads!r}"):
        EngineConfig(**BASE, threads=threads)


def test_default_threads_split_the_affinity_mask_among_ranks() -> None:
    cores = len(os.sched_getaffinity(0))
    assert available_cores() == cores
    assert default_threads() == cores
    assert default_threads(2) == max(1, cores // 2)
    assert default_threads(cores * 4) == 1
    with pytest.raises(ValueError, match="world_size': expected >= 1, got 0"):
        default_threads(0)


def test_engine_uses_every_core_unless_told() -> None:
    model = LlamaForCausalLM(ModelConfig())
    assert Engine(model, EngineConfig(**BASE)).threads == len(os.sched_getaffinity(0))
    assert Engine(model, EngineConfig(**BASE, threads=1)).threads == 1


def _intel_openmp():
    try:
        return ctypes.CDLL(INTEL_OPENMP, mode=os.RTLD_NOLOAD)
    except OSError:
        pytest.skip(f"{INTEL_OPENMP} is not loaded by this paddle build")


def test_engine_puts_idle_openmp_threads_to_sleep_at_once(monkeypatch) -> None:
    # Spinning for the default 200 ms after each of Paddle's parallel regions, they would
    # hold the cores the op's pool needs next.
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    runtime = _intel_openmp()
    runtime.kmp_set_blocktime(ctypes.c_int(200))
    Engine(LlamaForCausalLM(ModelConfig()), EngineConfig(**BASE))
    assert runtime.kmp_get_blocktime() == 0


def test_engine_leaves_a_blocktime_the_user_set() -> None:
    _intel_openmp()
    script = textwrap.dedent(f"""
        import ctypes, os
        import zlib
        from paddle_step.config import EngineConfig, ModelConfig
        from paddle_step.engine.llm_engine import Engine
        from paddle_step.models.llama import LlamaForCausalLM
        Engine(LlamaForCausalLM(ModelConfig()), EngineConfig(**{BASE!r}))
        runtime = ctypes.CDLL({INTEL_OPENMP!r}, mode=os.RTLD_NOLOAD)
        print("blocktime", runtime.kmp_get_blocktime())
    """)
    env = {**os.environ, "KMP_BLOCKTIME": "7"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "blocktime 7" in done.stdout


def test_threads_flag_reaches_the_engine_config() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flagged = parser.parse_args(["--model", "random", "--threads", "3"])
    assert engine_config(flagged, 64).threads == 3
    default = parser.parse_args(["--model", "random", "--tp", "2"])
    assert engine_config(default, 64).threads == default_threads(2)


def test_waiting_for_prompt_blocks_with_free_slots_is_logged_once(caplog) -> None:
    # 4 slots, a prompt region of 6 blocks: two 5-token prompts (3 blocks each with the
    # extra decode block; distinct, so the prefix cache shares none) fill it, the third
    # waits although two slots are free.
    config = EngineConfig(max_batch=4, max_model_len=16, block_size=4, num_kv_blocks=12)
    engine = Engine(LlamaForCausalLM(ModelConfig()), config)
    with caplog.at_level(logging.WARNING, logger="paddle_step.engine.scheduler"):
        engine.generate(
            [[token] * 5 for token in (1, 2, 3, 4)], SamplingParams(max_tokens=2, eos_token_id=[])
        )
    waits = [r for r in caplog.records if "waits for" in r.getMessage()]
    assert len(waits) == 1
    assert "5-token prompt waits for 3 prompt blocks" in waits[0].getMessage()
    assert "0 free now" in waits[0].getMessage()
    assert "prompt region holds 6 of the 12 KV blocks" in waits[0].getMessage()
