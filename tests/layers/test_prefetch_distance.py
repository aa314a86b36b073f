"""The prefetch distance of the CPU op's products, chosen by timing (layers/prefetch_distance).

That the distance never changes a product is tested with the products
(tests/layers/test_cpu_linear.py); here, what is timed, what is kept and when it is chosen.
"""

from dataclasses import replace

import pytest

from paddle_step.config import ModelConfig
from paddle_step.layers import cpu_linear, prefetch_distance
from paddle_step.models.llama import LlamaForCausalLM

QWEN_LIKE = ModelConfig(
    vocab_size=300, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2,
    intermediate_size=80, tie_word_embeddings=True,
)  # fmt: skip


@pytest.fixture
def small_cache(monkeypatch):
    """A 64 KiB last-level cache: the timed weights are 128 KiB, quick to time; the
    process's distances and remembered choices are restored afterwards."""
    monkeypatch.setattr(prefetch_distance, "last_level_cache_bytes", lambda: 64 << 10)
    monkeypatch.setattr(prefetch_distance, "_chosen", {})
    kept = cpu_linear.prefetch_bytes()
    yield
    cpu_linear.set_prefetch_bytes(*kept)


def test_last_level_cache_is_the_largest_cache_reported():
    size = prefetch_distance.last_level_cache_bytes()
    assert size >= 1 << 20 and size % 1024 == 0


@pytest.mark.parametrize("tied", [True, False])
def test_streamed_weight_bytes_are_the_products_weights(tied):
    config = replace(QWEN_LIKE, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    weights = sum(getattr(layer, name).size for layer in model.layers for name in names)
    weights += (model.embed if tied else model.lm_head).size
    assert prefetch_distance.streamed_weight_bytes(config) == 4 * weights
    for weight_format, size in (("bfloat16", 2), ("int8", 1)):
        packed = replace(config, weight_format=weight_format)
        assert prefetch_distance.streamed_weight_bytes(packed) == size * weights


@pytest.mark.parametrize("weight_format", cpu_linear.FORMATS)
def test_choose_keeps_the_fastest_distance_for_each_row_count(small_cache, weight_format):
    cpu_linear.set_prefetch_bytes(64, 128)
    choice = prefetch_distance.choose(40, weight_format)
    for rows, kept in ((1, choice.one_row), (8, choice.several_rows)):
        timings = choice.timings[rows]
        assert list(timings) == list(prefetch_distance.CANDIDATES)
        assert all(ms > 0 for ms in timings.values())
        assert timings[kept] == min(timings.values())
    assert cpu_linear.prefetch_bytes() == (choice.one_row, choice.several_rows)
    # Remembered for the process: set again without timing.
    cpu_linear.set_prefetch_bytes(64, 128)
    assert prefetch_distance.choose(40, weight_format) is choice
    assert cpu_linear.prefetch_bytes() == (choice.one_row, choice.several_rows)


def test_choose_for_model_times_only_weights_past_the_cache(small_cache, monkeypatch):
    monkeypatch.setattr(prefetch_distance, "last_level_cache_bytes", lambda: 1 << 30)
    cpu_linear.set_prefetch_bytes(64, 128)
    assert prefetch_distance.choose_for_model(QWEN_LIKE) is None
    assert cpu_linear.prefetch_bytes() == (64, 128)
    monkeypatch.setattr(prefetch_distance, "last_level_cache_bytes", lambda: 64 << 10)
    choice = prefetch_distance.choose_for_model(QWEN_LIKE)
    assert choice is not None and cpu_linear.prefetch_bytes() == (
        choice.one_row, choice.several_rows,
    )  # fmt: skip
