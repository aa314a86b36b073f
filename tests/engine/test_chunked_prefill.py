"""Chunked prefill: a step never runs more than max_num_batched_tokens tokens, decode rows
first; a prompt continues over several steps and samples only when it is complete; the
tokens equal the naive decode's at every budget, with and without prefix caching and
preemption; seeded sampling is the same under every setting."""

from __future__ import annotations

import numpy as np
import pytest

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.llm_engine import Engine
from paddle_step.engine.naive import generate_naive
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.testing.sampling import limited


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelConfig(dtype="float64", seed=9))


def workload(seed: int):
    """Prompts of 1..14 tokens, half of them sharing an 8-token prefix, and limits long
    enough that three decoding slots outgrow a pool of 8 blocks."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 256, 8).tolist()
    prompts = []
    for index in range(10):
        head = prefix if index % 2 else []
        prompts.append(head + rng.integers(0, 256, int(rng.integers(1, 7))).tolist())
    return prompts, [int(rng.integers(12, 19)) for _ in prompts]


class TokenCounter:
    """Wraps ``runner.forward`` to record, before each forward, the tokens each slot runs
    (what the device holds in ``seq_lens_this_time``) and which of them decode."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.steps: list[np.ndarray] = []
        forward = engine.runner.forward

        def counted(logit_rows):
            state = engine.state
            lens = state.seq_lens_this_time.numpy().reshape(-1).copy()
            lens[state.stop_flags.numpy().reshape(-1)] = 0
            self.steps.append(lens)
            return forward(logit_rows)

        engine.runner.forward = counted


@pytest.mark.parametrize(
    "caching, budget, tight",
    [
        (False, 3, False),
        (True, 3, True),
        (False, 5, True),
        (True, 5, False),
        (True, 9, True),
        (False, 64, True),
        (True, 64, True),
    ],
)
def test_chunked_prefill_is_exact_within_its_budget(model, caching, budget, tight) -> None:
    prompts, limits = workload(1)
    expected = [r.token_ids for r in generate_naive(model, prompts, limited(limits))[0]]
    # Tight: a pool of 8 blocks, one whole sequence, and no spare prompt block, so three
    # decoding slots soon need more.
    kv = dict(num_kv_blocks=40, decoder_pool_ratio=0.2, enc_dec_block_num=0)
    config = EngineConfig(
        max_batch=3,
        max_model_len=32,
        block_size=4,  # budgets 3 (smaller than a block), 5, 9 and one above every prompt
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
        **(kv if tight else dict(num_kv_blocks=96)),
    )
    engine = Engine(model, config, check_state=True)
    counter = TokenCounter(engine)
    results = engine.generate(prompts, limited(limits))
    assert [r.token_ids for r in results] == expected
    assert max(lens.sum() for lens in counter.steps) <= budget
    if budget < 14:
        assert any(lens.sum() == budget for lens in counter.steps)  # chunks fill the budget
    if tight:
        assert engine.stats.preemptions > 0


def test_a_prompt_mid_prefill_is_never_sampled_and_decodes_go_first(model) -> None:
    long_prompt = list(range(100, 127))  # 27 tokens: 4 chunks of at most 7
    config = EngineConfig(
        max_batch=3, max_model_len=40, block_size=4, num_kv_blocks=80, max_num_batched_tokens=9
    )
    engine = Engine(model, config, check_state=True)
    counter = TokenCounter(engine)
    short = [engine.add_request([5, 6], limited(12)), engine.add_request([7], limited(12))]
    engine.step()  # both prompts run: 3 tokens
    long_id = engine.add_request(long_prompt, limited(4))
    first_token_step = None
    results = {}
    while engine.has_unfinished():
        results.update((r.request_id, r.token_ids) for r in engine.step())
        tokens_by_id = {t.request_id: t.token_id for t in engine.last_step_outputs}
        if long_id in tokens_by_id and first_token_step is None:
            first_token_step = len(counter.steps)
        decoding = counter.steps[-1][:2]
        if engine.stats.steps < 8:
            assert decoding.tolist() == [1, 1]  # the two decodes run every step
    # The long prompt ran 7 tokens a step (9 - 2 decodes) and sampled only after its last.
    assert [lens[2] for lens in counter.steps[1:5]] == [7, 7, 7, 6]
    assert first_token_step == 5
    prompts = [[5, 6], [7], long_prompt]
    expected = [r.token_ids for r in generate_naive(model, prompts, limited([12, 12, 4]))[0]]
    assert [results[i] for i in [*short, long_id]] == expected


@pytest.mark.parametrize(
    "settings",
    [
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=3),
        dict(max_num_batched_tokens=5, num_kv_blocks=40, decoder_pool_ratio=0.2),
    ],
)
def test_seeded_sampling_is_the_same_under_every_setting(model, settings) -> None:
    prompts, limits = workload(2)
    base = dict(max_batch=3, max_model_len=32, block_size=4, num_kv_blocks=96)
    reference = Engine(model, EngineConfig(**base, enable_prefix_caching=False))
    engine = Engine(model, EngineConfig(**{**base, **settings}), check_state=True)

    def sampled(engine: Engine) -> list[list[int]]:
        ids = [
            engine.add_request(prompt, limited(limit, temperature=0.9, top_p=0.95, seed=100 + i))
            for i, (prompt, limit) in enumerate(zip(prompts, limits))
        ]
        results = {}
        while engine.has_unfinished():
            results.update((r.request_id, r.token_ids) for r in engine.step())
        return [results[i] for i in ids]

    assert sampled(engine) == sampled(reference)


def test_budget_below_the_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens: expected None or an int >= "):
        EngineConfig(
            max_batch=4, max_model_len=16, block_size=4, num_kv_blocks=16, max_num_batched_tokens=3
        )
