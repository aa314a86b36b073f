"""ModelRunner: the LM head runs on the slots that run a token only, and each of them
samples with its own controls and draws."""

from __future__ import annotations

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.llm_engine import Engine
from paddle_step.engine.naive import generate_naive
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]
SAMPLED = SamplingParams(max_tokens=3, eos_token_id=[], temperature=0.8, seed=11)


def small_engine(model: LlamaForCausalLM, max_batch: int) -> Engine:
    config = EngineConfig(max_batch=max_batch, max_model_len=64, block_size=4, num_kv_blocks=64)
    return Engine(model, config)


def finish(engine: Engine) -> dict[int, list[int]]:
    results = {}
    while engine.has_unfinished():
        results.update((r.request_id, r.token_ids) for r in engine.step())
    return results


def test_logits_only_for_the_slots_that_sample() -> None:
    model = LlamaForCausalLM(ModelConfig(dtype="float64", seed=3))
    logits_rows = []
    run = model.blocks.logits.run

    def recording_run(method, hidden, *args):
        logits_rows.append(hidden.shape[0])
        return run(method, hidden, *args)

    model.blocks.logits.run = recording_run
    engine = small_engine(model, max_batch=5)
    greedy = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=6, eos_token_id=[]))
    sampled = engine.add_request(PROMPTS[1], SAMPLED)
    results = finish(engine)
    # 2 of the 5 slots run while both requests do, then 1: never a row per slot.
    assert logits_rows == [2, 2, 2, 1, 1, 1]
    naive, _ = generate_naive(model, [PROMPTS[0]], SamplingParams(max_tokens=6, eos_token_id=[]))
    assert results[greedy] == naive[0].token_ids
    # The sampled request, seeded, draws the same tokens in a batch of its own.
    alone = small_engine(model, max_batch=1)
    request = alone.add_request(PROMPTS[1], SAMPLED)
    assert finish(alone)[request] == results[sampled]
