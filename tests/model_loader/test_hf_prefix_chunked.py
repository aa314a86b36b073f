"""Prefix caching and chunked prefill on the golden checkpoints: float64 greedy ids equal
transformers' (tests/data/hf-tiny) with caching on and off, at several token budgets
(one below the block size), under forced preemption, and all combined."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paddle_step.config import EngineConfig
from paddle_step.engine.llm_engine import Engine
from paddle_step.model_loader.loader import load_checkpoint
from paddle_step.sampling_params import SamplingParams

DATA = Path(__file__).resolve().parents[1] / "data" / "hf-tiny"
GOLDEN = json.loads((DATA / "golden.json").read_text())
NEW_TOKENS = 40


@pytest.fixture(scope="module", params=("llama-tiny", "qwen2-tiny"))
def checkpoint(request):
    entries = [e for e in GOLDEN["models"][request.param]["prompts"] if e["dtype"] == "float64"]
    return load_checkpoint(DATA / request.param, dtype="float64"), entries


# max_model_len 56 fits the longest prompt (12) + 40 tokens in 4-token blocks. Tight: a
# decoder pool of 14 blocks, one whole sequence, for every decoding slot.
ROOMY = dict(num_kv_blocks=2 * 6 * 14)
TIGHT = dict(num_kv_blocks=70, decoder_pool_ratio=0.2)


@pytest.mark.parametrize(
    "caching, budget, max_batch, kv",
    [
        (True, None, 6, ROOMY),
        (True, None, 6, TIGHT),
        (False, 3, 3, ROOMY),
        (True, 3, 3, TIGHT),
        (False, 7, 6, TIGHT),
        (True, 7, 6, TIGHT),
    ],
    ids=["cache", "cache-preempt", "chunk3", "cache-chunk3-preempt", "chunk7-preempt", "all7"],
)
def test_float64_greedy_ids_match_transformers(checkpoint, caching, budget, max_batch, kv):
    loaded, entries = checkpoint
    config = EngineConfig(
        max_batch=max_batch,
        max_model_len=56,
        block_size=4,
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
        **kv,
    )
    engine = Engine(loaded.model, config, check_state=True)
    prompts = [e["prompt_ids"] for e in entries]
    # Each prompt twice: the second copy finds the first's full blocks cached.
    results = engine.generate(prompts + prompts, SamplingParams(max_tokens=NEW_TOKENS))
    expected = [e["greedy_ids"] for e in entries] * 2
    assert [r.token_ids for r in results] == expected
    hits = engine.stats.prompt_tokens_hit
    assert hits > 0 if caching else hits == 0
    assert (engine.stats.preemptions > 0) == (kv is TIGHT)
