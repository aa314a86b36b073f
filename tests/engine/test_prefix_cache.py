"""Automatic prefix caching: the block keys, the allocator's reference counts and LRU
eviction, and the engine reusing cached prompt blocks with the naive decode's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.block_allocator import EncoderBlockAllocator
from paddle_step.engine.llm_engine import Engine
from paddle_step.engine.prefix_cache import cacheable_blocks, prompt_block_hashes
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.testing.greedy import greedy_reference
from paddle_step.testing.sampling import limited


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelConfig(dtype="float64", seed=5))


def test_block_keys_chain_the_whole_prefix() -> None:
    a = prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    c = prompt_block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a == b  # the partial last block has no key
    assert a[0] != c[0] and a[1] != c[1]  # block 1 equal, but its parent differs
    assert prompt_block_hashes([1, 2, 3], 4) == []
    assert [cacheable_blocks(n, 4) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]


def test_allocator_counts_references_and_evicts_least_recently_released() -> None:
    allocator = EncoderBlockAllocator(4)
    first = allocator.allocate(2)
    allocator.cache(first[0], b"a")
    allocator.cache(first[1], b"b")
    allocator.cache(first[1], b"again")  # a block keeps its first key
    assert allocator.cached_prefix([b"a", b"b", b"c"]) == first
    assert allocator.cached_prefix([b"b"]) == [first[1]]
    allocator.share(first)
    assert [allocator.ref_count(block) for block in first] == [2, 2]
    allocator.free(first)
    allocator.free([first[1]])  # released first: evicted first
    allocator.free([first[0]])
    assert allocator.num_allocated == 0 and allocator.num_free == 4 and allocator.num_cached == 2
    fresh = allocator.allocate(2)  # never-cached blocks go before cached ones
    assert set(fresh).isdisjoint(first) and allocator.num_cached == 2
    assert allocator.allocate(1) == [first[1]]
    assert allocator.cached_prefix([b"a", b"b"]) == [first[0]] and allocator.num_cached == 1
    allocator.share([first[0]])  # a hit takes the block out of the evictable ones
    assert allocator.allocate(1) is None and allocator.problems() == []
    with pytest.raises(ValueError, match="expected cached block ids"):
        allocator.share([fresh[0]])
    with pytest.raises(ValueError, match="expected a held block id"):
        EncoderBlockAllocator(2).cache(0, b"x")


def test_allocator_books_report_corruption() -> None:
    allocator = EncoderBlockAllocator(3)
    allocator.allocate(1)
    allocator._free.append(0)  # a held block also free
    assert any("both free and held" in problem for problem in allocator.problems())


def shared_prefix_prompts(rng, count: int, prefix_len: int) -> list[list[int]]:
    prefix = rng.integers(0, 256, prefix_len).tolist()
    return [
        prefix[: int(rng.integers(prefix_len // 2, prefix_len + 1))]
        + rng.integers(0, 256, int(rng.integers(1, 6))).tolist()
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    "kv", [dict(num_kv_blocks=96), dict(num_kv_blocks=40, decoder_pool_ratio=0.2)]
)
def test_engine_reuses_cached_prefixes_exactly(model, kv) -> None:
    rng = np.random.default_rng(7)
    prompts = shared_prefix_prompts(rng, 12, 9)
    limits = [int(rng.integers(10, 18)) for _ in prompts]
    expected = greedy_reference(model, prompts, limits)
    # Tight: a pool of 8 blocks (one whole sequence) for six decoding slots.
    config = EngineConfig(max_batch=6, max_model_len=32, block_size=4, **kv)
    engine = Engine(model, config, check_state=True)
    results = engine.generate(prompts, limited(limits))
    assert [result.token_ids for result in results] == expected
    stats = engine.stats
    assert stats.prompt_tokens_queried == sum(map(len, prompts))
    assert stats.prompt_tokens_hit == sum(result.cached_tokens for result in results) > 0
    for prompt, result in zip(prompts, results):
        assert result.cached_tokens % 4 == 0 and result.cached_tokens < len(prompt)
    if "decoder_pool_ratio" in kv:
        assert stats.preemptions > 0 and stats.recoveries == stats.preemptions
    # Everything finished: every block is free again, cached ones included.
    assert engine.encoder_blocks.num_allocated == 0
    assert engine.encoder_blocks.num_free == config.num_encoder_blocks


def test_prefix_caching_off_computes_every_prompt_token(model) -> None:
    prompts = [[9, 8, 7, 6, 5, 4, 3, 2, 1]] * 3
    config = EngineConfig(
        max_batch=2, max_model_len=16, block_size=4, num_kv_blocks=24, enable_prefix_caching=False
    )
    engine = Engine(model, config, check_state=True)
    results = engine.generate(prompts, limited(4))
    assert [r.token_ids for r in results] == greedy_reference(model, prompts, [4] * 3)
    assert engine.stats.prompt_tokens_hit == 0 and engine.encoder_blocks.num_cached == 0


def test_a_whole_cached_prompt_still_computes_its_last_token(model) -> None:
    prompt = list(range(30, 38))  # two full blocks
    config = EngineConfig(max_batch=1, max_model_len=16, block_size=4, num_kv_blocks=16)
    engine = Engine(model, config, check_state=True)
    first, second = (engine.generate([prompt], limited(5))[0] for _ in range(2))
    assert first.cached_tokens == 0 and second.cached_tokens == 4  # block 1 is recomputed
    assert first.token_ids == second.token_ids == greedy_reference(model, [prompt], [5])[0]


def test_same_step_admissions_share_the_blocks_computed_in_that_step(model) -> None:
    prompt = list(range(50, 63))
    config = EngineConfig(max_batch=3, max_model_len=24, block_size=4, num_kv_blocks=48)
    engine = Engine(model, config, check_state=True)
    ids = [engine.add_request(prompt + [tail], limited(3)) for tail in (1, 2, 3)]
    engine.step()
    requests = engine.scheduler.slot_requests
    held = [r.encoder_blocks for r in requests]
    assert held[1][:3] == held[2][:3] == held[0][:3]  # three full prompt blocks, one copy
    assert engine.encoder_blocks.ref_count(held[0][0]) == 3
    results = {}
    while engine.has_unfinished():
        results.update((r.request_id, r.token_ids) for r in engine.step())
    assert [results[i] for i in ids] == greedy_reference(
        model, [prompt + [tail] for tail in (1, 2, 3)], [3] * 3
    )


def test_cached_blocks_are_evicted_only_when_needed_and_never_while_read(model) -> None:
    rng = np.random.default_rng(11)
    # A prompt region of 10 blocks: prompts of up to 4 blocks each, three slots, so
    # admission keeps evicting the cached blocks of finished prompts.
    prompts = shared_prefix_prompts(rng, 6, 10) + [
        rng.integers(0, 256, 12).tolist() for _ in range(6)
    ]
    prompts = [prompts[i] for i in rng.permutation(len(prompts))]
    limits = [int(rng.integers(3, 8)) for _ in prompts]
    config = EngineConfig(max_batch=3, max_model_len=24, block_size=4, num_kv_blocks=20)
    assert config.num_encoder_blocks == 10
    engine = Engine(model, config, check_state=True)  # reference counts checked every step
    results = engine.generate(prompts, limited(limits))
    assert [r.token_ids for r in results] == greedy_reference(model, prompts, limits)
    assert engine.encoder_blocks.num_cached <= config.num_encoder_blocks


def test_abort_releases_shared_blocks_and_spares_the_other_readers(model) -> None:
    prompt = list(range(70, 83))
    config = EngineConfig(max_batch=3, max_model_len=24, block_size=4, num_kv_blocks=48)
    engine = Engine(model, config, check_state=True)
    keep = engine.add_request(prompt + [1], limited(6))
    drop = engine.add_request(prompt + [2], limited(6))
    engine.step()
    shared = engine.scheduler.slot_requests[0].encoder_blocks[:3]
    assert [engine.encoder_blocks.ref_count(b) for b in shared] == [2, 2, 2]
    engine.abort(drop)
    results = {}
    while engine.has_unfinished():
        results.update((r.request_id, r) for r in engine.step())
        if engine.has_unfinished():
            assert [engine.encoder_blocks.ref_count(b) for b in shared] == [1, 1, 1]
    assert results[drop].finish_reason == "abort"
    assert results[keep].token_ids == greedy_reference(model, [prompt + [1]], [6])[0]
    assert [engine.encoder_blocks.ref_count(b) for b in shared] == [0, 0, 0]
    assert engine.encoder_blocks.cached_prefix(prompt_block_hashes(prompt, 4)) == shared
