"""The prefetch distance of the CPU op's products, chosen by timing (layers/prefetch_distance).

That the distance never changes a product is tested with the products
(tests/layers/test_cpu_linear.py); here, what is timed, what is kept and when it is chosen.
"""

from dataclasses import replace

import numpy as np
import pytest

from paddle_step.config import ModelConfig
from paddle_step.layers import cpu_linear, prefetch_distance
from paddle_step.models.llama import LlamaForCausalLM

QWEN_LIKE = ModelConfig(
    vocab_size=300, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2,
    intermediate_size=80, tie_word_embeddings=True,
)  # fmt: skip


@pytest.fixture
def restored():
    """The process's distances and remembered choices, restored afterwards."""
    kept = cpu_linear.prefetch_bytes()
    chosen = dict(prefetch_distance._chosen)
    prefetch_distance._chosen.clear()
    yield
    cpu_linear.set_prefetch_bytes(*kept)
    prefetch_distance._chosen.clear()
    prefetch_distance._chosen.update(chosen)


def test_last_level_cache_is_the_largest_cache_reported():
    size = prefetch_distance.last_level_cache_bytes()
    assert size >= 1 << 20 and size % 1024 == 0


@pytest.mark.parametrize("weight_format", [None, "bfloat16", "int8"])
@pytest.mark.parametrize("tied", [True, False])
def test_decode_products_are_each_layers_four_then_the_lm_head(weight_format, tied):
    config = replace(QWEN_LIKE, tie_word_embeddings=tied, weight_format=weight_format)
    products = LlamaForCausalLM(config).decode_products()
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_width = config.num_heads * config.head_dim
    qkv_width = q_width + 2 * config.num_kv_heads * config.head_dim
    layer = [(hidden, qkv_width), (q_width, hidden), (hidden, 2 * inter), (inter, hidden)]
    assert [(p.k, p.n) for p in products] == layer * config.num_layers + [(hidden, vocab)]
    assert {p.format for p in products} == {weight_format or "float32"}
    size = {None: 4, "bfloat16": 2, "int8": 1}[weight_format]
    for packed in products:  # the panels, padded to 32 columns, and the int8 scales
        panels = size * packed.k * -(-packed.n // 32) * 32
        scales = 0 if packed.scales is None else 4 * packed.scales.size
        assert packed.nbytes == panels + scales


def test_a_model_off_the_cpu_op_has_no_products():
    assert LlamaForCausalLM(replace(QWEN_LIKE, dtype="float64")).decode_products() == []


@pytest.mark.parametrize("weight_format", cpu_linear.FORMATS)
def test_choose_keeps_the_shortest_near_fastest_distance_per_row_count(restored, weight_format):
    rng = np.random.default_rng(3)
    products = [cpu_linear.pack(rng.standard_normal(shape).astype(np.float32), weight_format)
                for shape in ((40, 70), (70, 33), (40, 200))]  # fmt: skip
    cpu_linear.set_prefetch_bytes(64, 128)
    choice = prefetch_distance.choose(products)
    for rows, kept in ((1, choice.one_row), (8, choice.several_rows)):
        timings = choice.timings[rows]
        assert list(timings) == list(prefetch_distance.CANDIDATES)
        assert all(ms > 0 for ms in timings.values())
        fastest = min(timings.values())
        near = [d for d, ms in timings.items() if ms <= fastest * (1 + prefetch_distance.NEAR_BEST)]
        assert kept == near[0]  # the first of the near-fastest
    assert cpu_linear.prefetch_bytes() == (choice.one_row, choice.several_rows)
    # Remembered for the process: set again without timing.
    cpu_linear.set_prefetch_bytes(64, 128)
    assert prefetch_distance.choose(products) is choice
    assert cpu_linear.prefetch_bytes() == (choice.one_row, choice.several_rows)


def test_the_first_distance_near_the_fastest_is_kept():
    near = prefetch_distance._first_near_best
    assert near({0: 1.2, 2048: 1.04, 8192: 1.0, 16384: 1.01}) == 2048
    assert near({0: 1.2, 2048: 1.06, 8192: 1.0, 16384: 1.01}) == 8192
    assert near({0: 1.0, 2048: 1.0}) == 0
    with_l2 = cpu_linear.Prefetch(2048, 8192)
    assert near({cpu_linear.Prefetch(2048): 1.1, with_l2: 1.0}) == with_l2
    assert near({cpu_linear.Prefetch(2048): 1.04, with_l2: 1.0}) == (2048, 0)


def test_candidates_ask_into_l1_alone_first_then_into_l2_too():
    candidates = prefetch_distance.CANDIDATES
    alone = [d for d in candidates if d.l2 == 0]
    assert candidates[: len(alone)] == tuple(alone) and alone == sorted(alone)
    assert all(d.l2 > d.l1 for d in candidates[len(alone) :])
    assert prefetch_distance.describe(cpu_linear.Prefetch(2048, 8192)) == "2048 B (L2 8192 B)"
    assert prefetch_distance.describe(cpu_linear.Prefetch(1024)) == "1024 B"


def test_choose_for_model_times_whole_layers_past_twice_the_cache(restored, monkeypatch):
    model = LlamaForCausalLM(QWEN_LIKE)
    products = model.decode_products()
    layer_bytes = sum(p.nbytes for p in products[:4])
    timed = []
    monkeypatch.setattr(prefetch_distance, "choose", lambda p: timed.append(p) or "chosen")
    monkeypatch.setattr(prefetch_distance, "last_level_cache_bytes", lambda: 1 << 30)
    assert prefetch_distance.choose_for_model(model) is None  # fits the cache: not timed
    monkeypatch.setattr(prefetch_distance, "last_level_cache_bytes", lambda: layer_bytes // 2)
    assert prefetch_distance.choose_for_model(model) == "chosen"
    assert timed == [products[:4]]  # one layer is twice the cache
    monkeypatch.setattr(prefetch_distance, "last_level_cache_bytes", lambda: layer_bytes)
    prefetch_distance.choose_for_model(model)
    assert timed[-1] == products[:8]
