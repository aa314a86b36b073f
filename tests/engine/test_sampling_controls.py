"""Per-request sampling controls, logprobs and n / best_of in the engine: equal to the
naive full-recompute decode (which applies the same controls) in mixed batches, under
forced preemption, and each control really changes what is generated."""

from __future__ import annotations

import numpy as np
import pytest

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.llm_engine import Engine
from paddle_step.engine.naive import generate_naive
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.sampling_params import SamplingParams
from paddle_step.testing.constraints import CyclingConstraint

MAX_MODEL_LEN = 48
# A 12-block decoder pool (one full sequence) shared by 8 slots: preemption is certain.
TIGHT = EngineConfig(
    max_batch=8, max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=72,
    decoder_pool_ratio=0.17,
)  # fmt: skip
GENEROUS = EngineConfig(max_batch=8, max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=200)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelConfig(dtype="float64", seed=5))


def mixes() -> list[dict]:
    """One request's worth of controls each, sampled and greedy."""
    return [
        {},
        dict(temperature=0.9, top_k=5, logprobs=3),
        dict(presence_penalty=1.5, frequency_penalty=0.5, prompt_logprobs=2),
        dict(repetition_penalty=1.8, temperature=1.0, min_p=0.1, seed=11),
        dict(logit_bias={7: 3.0, 9: -100.0}, min_tokens=4, temperature=0.7, top_p=0.8),
        dict(max_tokens=0, prompt_logprobs=1),
        dict(temperature=1.0, n=3, logprobs=0, seed=5),
        dict(temperature=1.0, n=2, best_of=3),
        dict(repetition_penalty=0.6, frequency_penalty=-1.0, top_k=3, temperature=1.2),
        dict(temperature=0.8, logprobs=5, prompt_logprobs=0, presence_penalty=-2.0),
    ]


def workload(count: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(count):
        prompt = rng.integers(0, 256, int(rng.integers(1, 20))).tolist()
        fields = {
            "max_tokens": int(rng.integers(1, MAX_MODEL_LEN - len(prompt))),
            **mixes()[i % 10],
        }
        prompts.append(prompt)
        params.append(SamplingParams(**fields))
    return prompts, params


def assert_same_results(got, expected, logprob_tolerance: float) -> None:
    for request, (a, b) in enumerate(zip(got, expected)):
        assert len(a.outputs) == len(b.outputs), request
        for x, y in zip(a.outputs, b.outputs):
            assert (x.index, x.token_ids, x.finish_reason) == (
                y.index,
                y.token_ids,
                y.finish_reason,
            ), request
            assert (x.logprobs is None) == (y.logprobs is None), request
            assert (x.cumulative_logprob is None) == (y.cumulative_logprob is None), request
            if x.cumulative_logprob is not None:
                assert x.cumulative_logprob == pytest.approx(
                    y.cumulative_logprob, abs=logprob_tolerance
                )
            for u, v in zip(x.logprobs or [], y.logprobs or []):
                assert u.token_id == v.token_id
                assert u.logprob == pytest.approx(v.logprob, abs=logprob_tolerance)
                assert [i for i, _ in u.top] == [i for i, _ in v.top]
                np.testing.assert_allclose(
                    [p for _, p in u.top], [p for _, p in v.top], atol=logprob_tolerance
                )
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None), request
        for u, v in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
            assert u.token_id == v.token_id
            assert u.logprob == pytest.approx(v.logprob, abs=logprob_tolerance)
            assert [i for i, _ in u.top] == [i for i, _ in v.top]


@pytest.mark.parametrize("config", [TIGHT, GENEROUS], ids=["tight", "generous"])
def test_mixed_controls_equal_the_naive_decode(model, config):
    prompts, params = workload(20, seed=3)
    engine = Engine(model, config, check_state=True, seed=9)
    got = engine.generate(prompts, params)
    expected, _ = generate_naive(model, prompts, params, seed=9)
    if config is TIGHT:
        assert engine.stats.preemptions > 0 and engine.stats.recoveries > 0
    assert_same_results(got, expected, 1e-9)
    assert engine.encoder_blocks.num_free == config.num_encoder_blocks


def greedy(model, prompt, **fields) -> list[int]:
    engine = Engine(model, GENEROUS)
    return engine.generate([prompt], SamplingParams(**fields))[0]


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_logit_bias_min_tokens_and_stop_token_ids_take_effect(model):
    plain = greedy(model, PROMPT, max_tokens=12).token_ids
    forced = greedy(model, PROMPT, max_tokens=6, logit_bias={42: 100.0})
    assert forced.token_ids == [42] * 6
    # The first greedy token as eos ends the request at once, unless min_tokens holds it.
    eos = plain[0]
    assert greedy(model, PROMPT, max_tokens=12, eos_token_id=eos).token_ids == [eos]
    held = greedy(model, PROMPT, max_tokens=12, eos_token_id=eos, min_tokens=5)
    assert len(held.token_ids) >= 5 and eos not in held.token_ids[:5]
    stop = plain[3]
    stopped = greedy(model, PROMPT, max_tokens=12, stop_token_ids=[stop])
    first = plain.index(stop)
    assert (stopped.token_ids, stopped.finish_reason) == (plain[: first + 1], "stop")
    held = greedy(model, PROMPT, max_tokens=12, stop_token_ids=[stop], min_tokens=first + 2)
    assert stop not in held.token_ids[: first + 2]


def test_penalties_and_cuts_take_effect(model):
    plain = greedy(model, PROMPT, max_tokens=30).token_ids
    counts = np.bincount(plain)
    assert counts.max() > 1  # the greedy decode repeats itself
    penalized = greedy(model, PROMPT, max_tokens=30, frequency_penalty=2.0, presence_penalty=2.0)
    assert np.bincount(penalized.token_ids).max() < counts.max()
    repeated = greedy(model, PROMPT, max_tokens=30, repetition_penalty=3.0).token_ids
    assert repeated != plain
    # top_k 1 and min_p 1 keep only the most likely token: greedy at any temperature.
    assert greedy(model, PROMPT, max_tokens=30, temperature=1.5, top_k=1).token_ids == plain
    assert greedy(model, PROMPT, max_tokens=30, temperature=1.5, min_p=1.0).token_ids == plain


def test_top_k_and_min_tokens_past_int64_run_as_their_bounds(model):
    """The engine's state is int64: a top_k or min_tokens past it (a Python int, as a JSON
    body brings it) once failed the step, and with it the server's engine. A top_k at or
    past the vocabulary keeps every token, as 0 does; a min_tokens past max_tokens holds
    eos to the end, as max_tokens does."""
    vocab = model.config.vocab_size
    sampled = dict(max_tokens=12, temperature=1.0, seed=3)
    every_token = greedy(model, PROMPT, top_k=0, **sampled).token_ids
    assert greedy(model, PROMPT, top_k=2, **sampled).token_ids != every_token  # a cut shows
    for top_k in (vocab, 2**63, 10**23):
        assert greedy(model, PROMPT, top_k=top_k, **sampled).token_ids == every_token
    plain = greedy(model, PROMPT, max_tokens=12).token_ids
    held = greedy(model, PROMPT, max_tokens=12, stop_token_ids=[plain[0]], min_tokens=12)
    assert held.finish_reason == "length" and plain[0] not in held.token_ids
    for min_tokens in (2**63, 10**23):
        assert greedy(model, PROMPT, max_tokens=12, stop_token_ids=[plain[0]],
                      min_tokens=min_tokens) == held  # fmt: skip


def test_a_constraint_masks_each_token_and_ends_the_request(model):
    allowed = [[10, 11, 12], [200, 201], [5]]

    def params():
        return SamplingParams(max_tokens=20, temperature=1.0, seed=4,
                              constraint=CyclingConstraint(allowed, length=7))  # fmt: skip

    engine_params = [params(), SamplingParams(max_tokens=20), params()]
    prompts = [PROMPT, [1, 2], [7] * 9]
    engine = Engine(model, TIGHT, check_state=True)
    got = engine.generate(prompts, engine_params)
    naive_params = [params(), SamplingParams(max_tokens=20), params()]
    expected, _ = generate_naive(model, prompts, naive_params)
    assert_same_results(got, expected, 1e-9)
    for result, each in zip(got[::2], engine_params[::2]):
        assert result.finish_reason == "stop" and len(result.token_ids) == 7
        assert each.constraint.accepted == result.token_ids
        assert all(t in allowed[i % 3] for i, t in enumerate(result.token_ids))


def test_n_samples_share_one_prefill(model, monkeypatch):
    prompt = list(range(30, 47))
    assert GENEROUS.enable_prefix_caching
    engine = Engine(model, GENEROUS, check_state=True)
    computed = []
    forward = model.forward_paged

    def counting(**batch):
        computed.append(int(batch["input_ids"].shape[0]))
        return forward(**batch)

    monkeypatch.setattr(model, "forward_paged", counting)
    params = dict(max_tokens=8, temperature=1.0, seed=13)
    [result] = engine.generate([prompt], SamplingParams(n=4, **params))
    # One prefill: samples 1..3 find the first sample's 4 full prompt blocks (16 tokens)
    # in the prefix cache and compute only the 17th token.
    assert computed[0] == len(prompt) + 3 * (len(prompt) - 16)
    assert engine.scheduler.prompt_tokens_hit == 3 * 16
    assert computed[1:] == [4] * 7  # then 4 decodes a step
    monkeypatch.undo()
    assert [o.index for o in result.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in result.outputs}) == 4  # each draws its own
    # Sample 0 draws what the request draws alone; the others are the naive's samples.
    [alone] = engine.generate([prompt], SamplingParams(**params))
    assert result.outputs[0].token_ids == alone.token_ids
    [naive], _ = generate_naive(model, [prompt], SamplingParams(n=4, **params))
    assert [o.token_ids for o in result.outputs] == [o.token_ids for o in naive.outputs]


def test_best_of_returns_the_most_likely_samples(model):
    prompt = [8, 6, 7, 5, 3, 0, 9]
    params = SamplingParams(max_tokens=10, temperature=1.3, n=2, best_of=5, seed=21)
    [result] = Engine(model, GENEROUS).generate([prompt], params)
    drawn = Engine(model, GENEROUS).generate(
        [prompt], SamplingParams(max_tokens=10, temperature=1.3, n=5, logprobs=0, seed=21)
    )[0]
    ranked = sorted(drawn.outputs, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in result.outputs] == [o.token_ids for o in ranked]
    assert [o.index for o in result.outputs] == [0, 1]
    assert result.outputs[0].cumulative_logprob >= result.outputs[1].cumulative_logprob


def test_abort_stops_every_sample(model):
    engine = Engine(model, GENEROUS, check_state=True)
    request_id = engine.add_request(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, n=3))
    engine.step()
    engine.step()
    assert engine.abort(request_id)
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    [result] = finished
    assert [o.finish_reason for o in result.outputs] == ["abort"] * 3
    assert engine.encoder_blocks.num_free == GENEROUS.num_encoder_blocks


def test_more_samples_than_slots_queue_up(model):
    engine = Engine(model, EngineConfig(max_batch=2, max_model_len=16, block_size=4,
                                        num_kv_blocks=16), check_state=True)  # fmt: skip
    [result] = engine.generate([[1, 2]], SamplingParams(max_tokens=3, temperature=1.0, n=3))
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 3 for o in result.outputs)


def test_refusals(model):
    engine = Engine(model, EngineConfig(max_batch=2, max_model_len=16, block_size=4,
                                        num_kv_blocks=16))  # fmt: skip
    with pytest.raises(ValueError, match="'logit_bias': expected token ids in \\[0, 259\\)"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2, logit_bias={300: 1.0}))
    constraint = CyclingConstraint([[1]], 2)
    with pytest.raises(ValueError, match="'n': expected 1 with a constraint"):
        engine.add_request([1], SamplingParams(max_tokens=2, n=2, constraint=constraint))
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "fields, name, draws", [(dict(n=2**31), "n", 2**31), (dict(n=2, best_of=4097), "best_of", 4097)]
)
def test_more_draws_than_a_request_may_make_are_refused_at_once(model, fields, name, draws):
    """Each draw is a sequence made when the request is added: n = 2**31 filled the memory
    before; now it is refused by name, and a request at the cap is taken."""
    engine = Engine(model, GENEROUS)
    expected = f"'{name}': expected at most 4096 samples a request, got {draws}"
    with pytest.raises(ValueError, match=expected):
        engine.add_request(PROMPT, SamplingParams(temperature=1.0, **fields))
    assert not engine.has_unfinished()
    engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=1.0, n=4096))
    assert engine.num_waiting == 4096
