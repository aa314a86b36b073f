"""End to end: the engine's outputs equal the naive full-recompute decode, token for token,
with and without preemption, through the API and through examples/generate.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.llm_engine import Engine
from paddle_step.engine.naive import generate_naive
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.sampling_params import SamplingParams
from paddle_step.testing.greedy import greedy_reference

REPO = Path(__file__).resolve().parents[2]
NUM_REQUESTS = 18
MAX_MODEL_LEN = 56
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelConfig(dtype="float64", seed=5))


@pytest.fixture(scope="module")
def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 1..30 tokens and output limits of 1..24 tokens (greedy)."""
    rng = np.random.default_rng(2024)
    prompts = [rng.integers(0, 256, int(rng.integers(1, 31))).tolist() for _ in range(NUM_REQUESTS)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 25))) for _ in range(NUM_REQUESTS)]
    return prompts, params


@pytest.fixture(scope="module")
def greedy_tokens(model, workload) -> list[list[int]]:
    prompts, params = workload
    return greedy_reference(model, prompts, [p.max_tokens for p in params])


def engine_config(num_kv_blocks: int, decoder_pool_ratio: float) -> EngineConfig:
    return EngineConfig(
        max_batch=8,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks,
        decoder_pool_ratio=decoder_pool_ratio,
    )


# Tight: a 14-block pool (one full sequence) shared by 8 slots. Generous: every slot can
# hold a full sequence in each region.
TIGHT = dict(num_kv_blocks=70, decoder_pool_ratio=0.2)
GENEROUS = dict(num_kv_blocks=2 * 8 * MAX_MODEL_LEN // BLOCK_SIZE, decoder_pool_ratio=0.5)


def test_tight_budget_preempts_recovers_and_matches_naive(model, workload, greedy_tokens):
    engine = Engine(model, engine_config(**TIGHT), check_state=True)
    results = engine.generate(*workload)
    stats = engine.stats
    assert stats.preemptions > 0 and stats.recoveries > 0, stats
    assert [result.token_ids for result in results] == greedy_tokens
    assert [result.prompt_ids for result in results] == workload[0]
    assert all(result.finish_reason == "length" for result in results)
    assert stats.generated_tokens == sum(p.max_tokens for p in workload[1])
    assert stats.peak_blocks_in_use <= TIGHT["num_kv_blocks"]


def test_generous_budget_never_preempts_and_matches_naive(model, workload, greedy_tokens):
    engine = Engine(model, engine_config(**GENEROUS))
    results = engine.generate(*workload)
    assert (engine.stats.preemptions, engine.stats.recoveries) == (0, 0)
    assert [result.token_ids for result in results] == greedy_tokens
    # Prefills and decodes share steps: far fewer steps than requests x tokens.
    assert engine.stats.steps < sum(p.max_tokens for p in workload[1]) / 2


def test_sampling_does_not_depend_on_batching_or_preemption(model, workload):
    prompts, greedy_params = workload[0][:10], workload[1][:10]
    params = [
        SamplingParams(max_tokens=p.max_tokens, temperature=0.8, top_p=0.9) for p in greedy_params
    ]
    tight = Engine(model, engine_config(**TIGHT), seed=7)
    generous = Engine(model, engine_config(**GENEROUS), seed=7)
    tight_tokens = [r.token_ids for r in tight.generate(prompts, params)]
    generous_tokens = [r.token_ids for r in generous.generate(prompts, params)]
    naive_results, _ = generate_naive(model, prompts, params, seed=7)
    assert tight.stats.preemptions > 0
    assert tight_tokens == generous_tokens == [r.token_ids for r in naive_results]
    greedy, _ = generate_naive(model, prompts, greedy_params)
    assert tight_tokens != [r.token_ids for r in greedy]  # it did sample


def run_example(*args: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "python"), *filter(None, [env.get("PYTHONPATH")])]
    )
    completed = subprocess.run(
        [sys.executable, str(REPO / "examples" / "generate.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout)  # the whole of stdout is one JSON object


def test_example_json_matches_naive_json():
    args = (
        "--num-requests",
        "12",
        "--max-batch",
        "6",
        "--max-new-tokens",
        "24",
        "--block-size",
        "4",
        "--kv-blocks",
        "80",
        "--decoder-pool-ratio",
        "0.25",
        "--dtype",
        "float64",
        "--json",
    )
    engine_run = run_example(*args)
    naive_run = run_example(*args, "--naive")
    assert engine_run["stats"]["preemptions"] > 0 and engine_run["stats"]["recoveries"] > 0
    for run in (engine_run, naive_run):
        assert len(run["requests"]) == 12
        assert {"steps", "preemptions", "recoveries", "tokens_per_s"} <= set(run["stats"])
    assert [r["prompt_ids"] for r in engine_run["requests"]] == [
        r["prompt_ids"] for r in naive_run["requests"]
    ]
    assert [r["token_ids"] for r in engine_run["requests"]] == [
        r["token_ids"] for r in naive_run["requests"]
    ]
    assert [r["finish_reason"] for r in engine_run["requests"]] == [
        r["finish_reason"] for r in naive_run["requests"]
    ]


# Neither importing paddle_step nor the example may need these (the progress bar, the
# benchmarks' plot, the serving stack, the test client; httpx is paddle 3's own dependency).
OPTIONAL_PACKAGES = (
    "tqdm", "matplotlib", "fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic",
    "openai", "hypothesis", "pytest",
)  # fmt: skip


def test_example_runs_without_optional_packages():
    # Without tqdm the example says so in one line and runs on.
    script = REPO / "examples" / "generate.py"
    code = (
        f"import runpy, sys; sys.modules.update(dict.fromkeys({OPTIONAL_PACKAGES!r})); "
        f"sys.argv = [{str(script)!r}, '--max-new-tokens', '4', '--json']; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "Traceback" not in completed.stderr
    assert "optional package 'tqdm' not installed" in completed.stderr
    assert len(json.loads(completed.stdout)["requests"]) == 6


def run_example_failing(*args: str) -> str:
    """stderr of a generate.py run expected to fail with one clear line."""
    completed = subprocess.run(
        [sys.executable, str(REPO / "examples" / "generate.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode != 0
    assert "Traceback" not in completed.stderr, completed.stderr[-3000:]
    return completed.stderr


GOLDEN_LLAMA = REPO / "tests" / "data" / "hf-tiny" / "llama-tiny"


def test_example_on_a_checkpoint_prints_text_and_stops_on_eos(tmp_path):
    run = run_example(
        "--model", str(GOLDEN_LLAMA), "--prompt", "Hello there", "--max-new-tokens", "8",
        "--json",
    )  # fmt: skip
    [request] = run["requests"]
    assert len(request["token_ids"]) <= 8 and isinstance(request["text"], str)
    # The default model's text is its tokens decoded, special tokens left out.
    default = run_example("--prompt", "A list is", "--max-new-tokens", "12", "--json")
    assert default["requests"][0]["text"].strip()
    ignored = run_example(
        "--model", str(GOLDEN_LLAMA), "--prompt", "Hello there", "--max-new-tokens", "40",
        "--ignore-eos", "--json",
    )  # fmt: skip
    assert len(ignored["requests"][0]["token_ids"]) == 40


def test_example_chat_on_the_shipped_model_uses_its_template():
    """--chat wraps the prompt in the shipped model's chat template: the prompt ids are
    longer than the bare prompt's and generation runs."""
    bare = run_example("--prompt", "What is a list?", "--max-new-tokens", "4", "--json")
    chat = run_example("--prompt", "What is a list?", "--max-new-tokens", "4", "--json", "--chat")
    bare_ids, chat_ids = bare["requests"][0]["prompt_ids"], chat["requests"][0]["prompt_ids"]
    assert len(chat_ids) > len(bare_ids) and chat_ids != bare_ids
    assert 1 <= len(chat["requests"][0]["token_ids"]) <= 4


def test_example_reduces_max_model_len_to_the_kv_budget():
    completed = subprocess.run(
        [sys.executable, str(REPO / "examples" / "generate.py"), "--prompt", "A list is",
         "--max-new-tokens", "4", "--block-size", "4", "--kv-blocks", "16", "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "max_model_len reduced from 256 to 32" in completed.stderr


def test_max_model_len_becomes_a_multiple_of_the_block_size_and_says_so(capsys):
    from paddle_step.engine.arg_utils import engine_config
    from paddle_step.entrypoints.openai.cli import parse_args

    config = engine_config(parse_args(["--block-size", "7", "--max-model-len", "20"]), 256)
    assert config.max_model_len == 14
    assert "max_model_len reduced from 20 to 14, a multiple of --block-size 7" in (
        capsys.readouterr().err
    )
    message = r"^--block-size: expected at most the model's context \(5\), got 7$"
    with pytest.raises(ValueError, match=message):
        engine_config(parse_args(["--block-size", "7"]), 5)


@pytest.mark.parametrize(
    "args,message",
    [
        (("--model", "/nonexistent/checkpoint"),
         "--model: expected a checkpoint directory or 'random', got '/nonexistent/checkpoint'"),
        (("--model", ""), "--model: expected a checkpoint directory or 'random', got ''"),
        # The golden checkpoint's tokenizer_config.json has no chat template.
        (("--model", str(GOLDEN_LLAMA), "--chat"), "chat template"),
        (("--max-model-len", "100000"), "expected at most the model's context (256)"),
        (("--prompt", "word " * 300), "expected <= max_model_len (256)"),
        (("--seed", "-1"), "--seed: expected an integer in [0, 2**63), got -1"),
        (("--temperature", "inf"), "'temperature': expected a finite number >= 0, got inf"),
        (("--naive", "--check-state"), "--naive: decodes without the engine, got --check-state"),
        # Bytes that are not UTF-8 reach Python as lone surrogates (and the child as bytes).
        (("--prompt", "a\udcffb"), "--prompt: expected UTF-8 text, got 'a\\udcffb'"),
    ],
    ids=["missing", "empty-model", "no-chat-template", "beyond-context", "prompt-too-long", "seed",
         "temperature", "naive-engine-flag", "not-utf8"],
)  # fmt: skip
def test_example_errors_are_one_clear_line(args, message):
    stderr = run_example_failing(*args, "--max-new-tokens", "4")
    assert message in stderr, stderr[-2000:]
