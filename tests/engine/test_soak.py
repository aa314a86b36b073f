"""Soak: the engine under a tight block budget with random arrivals, prompt
lengths, output limits and eos stops, check_state after every step; every
request finishes with the tokens of the naive full-recompute decode.

`pytest tests/engine/test_soak.py --soak-steps 10000` runs the long version; CI runs
the default, bounded to about a minute.
"""

from __future__ import annotations

import numpy as np

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.llm_engine import Engine
from paddle_step.engine.naive import generate_naive
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.sampling_params import SamplingParams

MAX_MODEL_LEN = 48
BLOCK_SIZE = 4


def most_frequent_token(model: LlamaForCausalLM) -> int:
    """A token the model emits often enough that eos stops really happen."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 6).tolist() for _ in range(6)]
    results, _ = generate_naive(model, prompts, SamplingParams(max_tokens=16))
    tokens = np.concatenate([result.token_ids for result in results])
    return int(np.bincount(tokens).argmax())


def test_soak_tight_budget_matches_naive(soak_steps):
    model = LlamaForCausalLM(ModelConfig(dtype="float64", seed=11))
    eos_token_id = most_frequent_token(model)
    # A 12-block decoder pool (one full sequence) shared by 8 slots.
    config = EngineConfig(
        max_batch=8,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_kv_blocks=60,
        decoder_pool_ratio=0.2,
    )
    engine = Engine(model, config, check_state=True)
    rng = np.random.default_rng(2026)

    requests: dict[int, tuple[list[int], SamplingParams]] = {}
    finished = {}
    for _ in range(soak_steps):
        if engine.num_waiting < 4 and rng.random() < 0.3:
            prompt = rng.integers(0, 256, int(rng.integers(1, 25))).tolist()
            limit = int(rng.integers(1, MAX_MODEL_LEN - len(prompt) + 1))
            params = SamplingParams(max_tokens=limit, eos_token_id=eos_token_id)
            request_id = engine.add_request(prompt, params)
            requests[request_id] = (prompt, params)
        finished.update((result.request_id, result) for result in engine.step())
    while engine.has_unfinished():  # drain: arrivals stop, everything admitted finishes
        finished.update((result.request_id, result) for result in engine.step())

    assert sorted(finished) == sorted(requests)
    stats = engine.stats
    assert stats.preemptions > 0 and stats.recoveries > 0, stats
    reasons = {result.finish_reason for result in finished.values()}
    assert reasons == {"eos", "length"}, reasons

    order = sorted(requests)
    expected, _ = generate_naive(
        model,
        [requests[i][0] for i in order],
        [requests[i][1] for i in order],
        max_model_len=MAX_MODEL_LEN,
    )
    for request_id, reference in zip(order, expected):
        got = finished[request_id]
        assert got.token_ids == reference.token_ids, request_id
        assert got.finish_reason == reference.finish_reason, request_id
