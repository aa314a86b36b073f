"""The model shipped in the package: it loads through the Hugging Face loader and its
greedy continuation of one prompt is pinned (a change to the model code, the loader, the
tokenizer or the weights shows up here)."""

from __future__ import annotations

import json

import pytest

from paddle_step.config import EngineConfig
from paddle_step.engine.arg_utils import DEFAULT_MODEL
from paddle_step.engine.llm_engine import Engine
from paddle_step.engine.naive import generate_naive
from paddle_step.model_loader.loader import load_checkpoint
from paddle_step.sampling_params import SamplingParams

PROMPT = "The for statement"
PROMPT_IDS = [0, 339, 341, 462]  # <s> first: the tokenizer's post-processor adds it
GREEDY_24 = [200, 1785, 301, 343, 1874, 64, 951, 533, 270, 1404, 3, 324,
             270, 1404, 3, 324, 270, 1404, 3, 462, 294, 262, 200, 398]  # fmt: skip


def test_shipped_files_are_small_and_complete():
    names = {path.name for path in DEFAULT_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names  # fmt: skip
    assert sum(path.stat().st_size for path in DEFAULT_MODEL.iterdir()) <= 5 * 2**20
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_greedy_output_is_pinned(dtype):
    loaded = load_checkpoint(DEFAULT_MODEL, dtype=dtype)
    ids = loaded.tokenizer.encode(PROMPT)
    assert ids == PROMPT_IDS
    [naive], _ = generate_naive(
        loaded.model, [ids], SamplingParams(max_tokens=24), eos_token_ids=loaded.eos_token_ids
    )
    assert naive.token_ids == GREEDY_24
    config = EngineConfig(max_batch=2, max_model_len=64, block_size=8, num_kv_blocks=32)
    engine = Engine(loaded.model, config, eos_token_ids=loaded.eos_token_ids)
    [paged] = engine.generate([ids], SamplingParams(max_tokens=24))
    assert paged.token_ids == GREEDY_24
    text = loaded.tokenizer.decode(paged.token_ids, skip_special_tokens=True)
    assert text.startswith("\n*****") and "async_stmt" in text
