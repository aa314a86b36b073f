"""Logprobs and prompt logprobs: those of the model's raw distribution, equal to a float64
log-softmax of the naive decoder's logits (within float32 rounding) whatever the sampling
controls do; streamed with each token; prompt logprobs with max_tokens 0 (lm-eval's echo)."""

from __future__ import annotations

import numpy as np
import pytest

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.llm_engine import Engine
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.sampling_params import SamplingParams

CONFIG = EngineConfig(max_batch=4, max_model_len=40, block_size=4, num_kv_blocks=80)
TOLERANCE = 2e-4  # float32 engine against a float64 reference


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelConfig(dtype="float32", seed=7))


def reference_logprobs(model: LlamaForCausalLM, tokens: list[int]) -> np.ndarray:
    """[len(tokens), V]: float64 log-softmax of the naive decoder's logits at each
    position (position i predicts token i + 1)."""
    logits = model.logits_all_positions(tokens).numpy().astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def assert_entry(
    entry, reference_row: np.ndarray, token: int, k: int, prompt: bool = False
) -> None:
    """``entry`` against the reference; at a prompt position its rank too: the count of
    tokens at least as likely, within the float32 tolerance (None at generated ones)."""
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(reference_row[token], abs=TOLERANCE)
    assert len(entry.top) == k
    expected = np.argsort(-reference_row, kind="stable")[:k]
    assert [i for i, _ in entry.top] == expected.tolist()
    np.testing.assert_allclose([v for _, v in entry.top], reference_row[expected], atol=TOLERANCE)
    if not prompt:
        assert entry.rank is None
        return
    own = reference_row[token]
    assert 1 + np.sum(reference_row > own + TOLERANCE) <= entry.rank
    assert entry.rank <= np.sum(reference_row >= own - TOLERANCE)


@pytest.mark.parametrize(
    "controls",
    [dict(), dict(temperature=1.0, top_k=4, repetition_penalty=1.5, logit_bias={3: 4.0})],
    ids=["greedy", "controlled"],
)
def test_logprobs_are_those_of_the_raw_distribution(model, controls):
    prompts = [[5, 9, 2, 6, 5, 3], [11] * 13, [200, 1]]
    params = SamplingParams(max_tokens=9, logprobs=4, prompt_logprobs=3, seed=2, **controls)
    results = Engine(model, CONFIG).generate(prompts, params)
    for prompt, result in zip(prompts, results):
        [sample] = result.outputs
        tokens = prompt + sample.token_ids
        reference = reference_logprobs(model, tokens)
        assert len(sample.logprobs) == len(sample.token_ids)
        for i, entry in enumerate(sample.logprobs):
            assert_entry(entry, reference[len(prompt) - 1 + i], sample.token_ids[i], 4)
        assert sample.cumulative_logprob == pytest.approx(
            sum(e.logprob for e in sample.logprobs), abs=1e-9
        )
        assert len(result.prompt_logprobs) == len(prompt) - 1
        for i, entry in enumerate(result.prompt_logprobs):
            assert_entry(entry, reference[i], prompt[i + 1], 3, prompt=True)


def test_max_tokens_zero_returns_prompt_logprobs_only(model):
    prompt = [7, 7, 1, 30, 2, 9, 4]
    engine = Engine(model, CONFIG)
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    streamed = []
    while engine.has_unfinished():
        [result] = engine.step()
        streamed += engine.last_step_outputs
        prompt_logprobs = engine.last_step_prompt_logprobs[request_id]
    assert streamed == []
    assert (result.token_ids, result.finish_reason) == ([], "length")
    assert result.prompt_logprobs is prompt_logprobs
    reference = reference_logprobs(model, prompt)
    for i, entry in enumerate(result.prompt_logprobs):
        assert_entry(entry, reference[i], prompt[i + 1], 0, prompt=True)
    # A one-token prompt has no position with context.
    [single] = engine.generate([[4]], SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert single.prompt_logprobs == [] and single.token_ids == []


def test_streamed_tokens_carry_their_logprobs(model):
    engine = Engine(model, CONFIG)
    ids = [
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, logprobs=2)),
        engine.add_request([4, 5], SamplingParams(max_tokens=5)),
        engine.add_request([6], SamplingParams(max_tokens=7, temperature=1.0, n=2, logprobs=1)),
    ]
    streamed: dict[tuple[int, int], list] = {}
    finished = {}
    while engine.has_unfinished():
        for result in engine.step():
            finished[result.request_id] = result
        for token in engine.last_step_outputs:
            streamed.setdefault((token.request_id, token.index), []).append(token)
    for request_id in ids:
        for sample in finished[request_id].outputs:
            tokens = streamed[(request_id, sample.index)]
            assert [t.token_id for t in tokens] == sample.token_ids
            assert [t.finish_reason for t in tokens] == [None] * (len(tokens) - 1) + [
                sample.finish_reason
            ]
            if sample.logprobs is None:
                assert all(t.logprobs is None for t in tokens)
            else:
                assert [t.logprobs for t in tokens] == sample.logprobs


def test_prompt_logprobs_of_a_chunked_prefill(model):
    """A prompt computed over several steps (a 5-token budget) gathers its prompt
    logprobs chunk by chunk, and a cached prefix is not used for them."""
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]
    config = EngineConfig(max_batch=4, max_model_len=40, block_size=4, num_kv_blocks=80,
                          max_num_batched_tokens=5)  # fmt: skip
    engine = Engine(model, config)
    engine.generate([prompt], SamplingParams(max_tokens=2))  # caches its prompt blocks
    [result] = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert result.cached_tokens == 0
    reference = reference_logprobs(model, prompt)
    assert len(result.prompt_logprobs) == len(prompt) - 1
    for i, entry in enumerate(result.prompt_logprobs):
        assert_entry(entry, reference[i], prompt[i + 1], 1, prompt=True)
