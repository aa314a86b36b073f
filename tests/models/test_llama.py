"""LlamaForCausalLM's paged forward against its naive one (full recompute, no cache):
mixed prefill and decode rows, float32 and float64, a greedy decode, continuations."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from paddle_step.config import ModelConfig
from paddle_step.layers.paged_attention import PagedKVCache, build_flat_batch
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.testing.greedy import greedy_reference
from paddle_step.testing.paged_batches import scrambled_block_tables, slot_state
from paddle_step.tokenizer.byte import ByteTokenizer


@pytest.fixture(scope="module")
def model64() -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelConfig(dtype="float64", seed=1234))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_prefill_decode_step_matches_naive(
    model64: LlamaForCausalLM, block_size: int
) -> None:
    rng = np.random.default_rng(block_size)
    short_prompt = rng.integers(0, 256, 5).tolist()
    long_prompt = rng.integers(0, 256, 19).tolist()
    decoding = rng.integers(0, 256, 22).tolist()  # 21 tokens cached earlier + 1 new
    width = 24
    block_tables = paddle.to_tensor(scrambled_block_tables(4, math.ceil(width / block_size)))
    cache = PagedKVCache.for_config(
        model64.config, num_blocks=block_tables.size, block_size=block_size
    )

    # Step 1: only slot 2 runs, prefilling the decoding sequence's history.
    batch = build_flat_batch(
        *slot_state([[], [], decoding[:21], []], [0, 0, 0, 0], width),
        block_tables,
        block_size,
    )
    logits = model64.forward_paged(**batch, kv_cache=cache)
    expected = model64.forward_naive([decoding[:21]])
    np.testing.assert_allclose(logits.numpy()[2], expected.numpy()[0], rtol=1e-9, atol=1e-9)

    # Step 2: two prefills of different lengths, an empty slot and one decode, all at once.
    batch = build_flat_batch(
        *slot_state([short_prompt, [], decoding[21:], long_prompt], [0, 0, 21, 0], width),
        block_tables,
        block_size,
    )
    logits = model64.forward_paged(**batch, kv_cache=cache).numpy()
    expected = model64.forward_naive([short_prompt, decoding, long_prompt]).numpy()
    assert logits.shape == (4, model64.config.vocab_size)
    np.testing.assert_allclose(logits[[0, 2, 3]], expected, rtol=1e-9, atol=1e-9)
    assert not logits[1].any()


def test_float32_paged_matches_naive() -> None:
    model = LlamaForCausalLM(ModelConfig(dtype="float32", seed=7))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [200, 100]]
    block_size = 4
    block_tables = paddle.to_tensor(scrambled_block_tables(2, 2))
    cache = PagedKVCache.for_config(model.config, num_blocks=4, block_size=block_size)
    batch = build_flat_batch(*slot_state(prompts, [0, 0], 8), block_tables, block_size)
    logits = model.forward_paged(**batch, kv_cache=cache)
    assert logits.dtype == paddle.float32
    np.testing.assert_allclose(
        logits.numpy(), model.forward_naive(prompts).numpy(), rtol=1e-4, atol=1e-4
    )


def test_greedy_decode_paged_equals_naive(model64: LlamaForCausalLM) -> None:
    """Drive the paged path like an engine: prefill, then one token per step, with the third
    sequence arriving late so its prefill shares steps with the others' decodes."""
    tok = ByteTokenizer()
    prompts = [tok.encode("Hello"), tok.encode("The quick brown fox"), tok.encode("paged")]
    arrival_step = [0, 0, 3]
    num_new, block_size, width = 8, 4, 32
    num_slots = len(prompts)
    block_tables = paddle.to_tensor(scrambled_block_tables(num_slots, width // block_size))
    cache = PagedKVCache.for_config(
        model64.config, num_blocks=block_tables.size, block_size=block_size
    )

    generated: list[list[int]] = [[] for _ in prompts]
    cached_len = [0] * num_slots  # seq_lens_decoder
    step = 0
    while any(len(tokens) < num_new for tokens in generated):
        rows: list[list[int]] = []
        for b, prompt in enumerate(prompts):
            if step < arrival_step[b] or len(generated[b]) == num_new:
                rows.append([])  # not arrived yet, or finished: no tokens this step
            elif cached_len[b] == 0:
                rows.append(prompt)
            else:
                rows.append(generated[b][-1:])
        batch = build_flat_batch(*slot_state(rows, cached_len, width), block_tables, block_size)
        next_tokens = paddle.argmax(model64.forward_paged(**batch, kv_cache=cache), axis=-1)
        for b, tokens in enumerate(rows):
            if tokens:
                generated[b].append(int(next_tokens[b]))
                cached_len[b] += len(tokens)
        step += 1

    assert generated == greedy_reference(model64, prompts, num_new)
    # Guards against a degenerate model whose greedy output would match trivially.
    assert len({t for tokens in generated for t in tokens}) > 8


def test_continuation_reads_the_cache_and_prefill_its_own_kv(model64: LlamaForCausalLM) -> None:
    """A row resuming at position 5 with several tokens (a chunked continuation) reads its
    earlier keys from the cache; a prefill row in the same step needs no cache at all."""
    rng = np.random.default_rng(11)
    resumed, fresh = rng.integers(0, 256, 9).tolist(), rng.integers(0, 256, 6).tolist()
    block_size, width = 4, 12
    block_tables = paddle.to_tensor(scrambled_block_tables(2, 3))
    block_tables[1] = -1  # the prefill row has no blocks: its K/V are never stored
    cache = PagedKVCache.for_config(model64.config, num_blocks=6, block_size=block_size)

    def build_step(rows: list[list[int]], starts: list[int]):
        return build_flat_batch(*slot_state(rows, starts, width), block_tables, block_size)

    model64.forward_paged(**build_step([resumed[:5], []], [0, 0]), kv_cache=cache)
    logits = model64.forward_paged(**build_step([resumed[5:], fresh], [5, 0]), kv_cache=cache)
    expected = model64.forward_naive([resumed, fresh]).numpy()
    np.testing.assert_allclose(logits.numpy(), expected, rtol=1e-9, atol=1e-9)


def test_chunk_rows_beside_decode_and_prefill_rows_match_naive(model64: LlamaForCausalLM) -> None:
    """One step with all three kinds of rows: two chunks of different lengths and starts
    (each reading its row's keys once, padded), a decode row and a fresh prefill."""
    rng = np.random.default_rng(12)
    long_a, long_b, decoding = (rng.integers(0, 256, n).tolist() for n in (17, 11, 10))
    fresh = rng.integers(0, 256, 3).tolist()
    block_size, width = 4, 20
    block_tables = paddle.to_tensor(scrambled_block_tables(4, 5))
    cache = PagedKVCache.for_config(model64.config, num_blocks=20, block_size=block_size)

    def build_step(rows: list[list[int]], starts: list[int]):
        return build_flat_batch(*slot_state(rows, starts, width), block_tables, block_size)

    model64.forward_paged(
        **build_step([long_a[:6], decoding[:9], long_b[:3], []], [0, 0, 0, 0]), kv_cache=cache
    )
    step = build_step([long_a[6:], decoding[9:], long_b[3:], fresh], [6, 9, 3, 0])
    logits = model64.forward_paged(**step, kv_cache=cache).numpy()
    expected = model64.forward_naive([long_a, decoding, long_b, fresh]).numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("rope_theta", [10000.0, 1e6])
def test_rope_table_rows_equal_the_rope_computed_alone(rope_theta: float) -> None:
    """On the CPU, ``_rope`` reads rows of a table of every position (grown as positions
    grow): bit for bit the values computed for the positions themselves."""
    model = LlamaForCausalLM(
        ModelConfig(hidden_size=96, num_heads=3, num_kv_heads=1, rope_theta=rope_theta)
    )
    rng = np.random.default_rng(7)
    for largest in (5, 17, 600, 5000):  # the table grows three times
        positions = paddle.to_tensor(rng.integers(0, largest, rng.integers(1, 40)))
        for table, computed in zip(model._rope(positions), model._rope_of(positions)):
            assert table.shape == computed.shape == [positions.shape[0], 1, 32]
            np.testing.assert_array_equal(table.numpy(), computed.numpy())
    cos, sin = model._rope_table(positions, flat=True)  # as DecoderStack takes them
    assert cos.shape == sin.shape == [8192, 32]
    np.testing.assert_array_equal(
        cos.numpy()[:600], model._rope_of(paddle.arange(600))[0].numpy()[:, 0]
    )
