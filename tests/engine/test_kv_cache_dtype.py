"""A bfloat16 KV cache (``EngineConfig.kv_cache_dtype``, ``--kv-cache-dtype``): the cache
holds the float32 keys and values rounded, the engine stays exact under preemption, the
held-out perplexity stays within 1% of a float32 cache's, prompt log-probs stay close to
transformers', and what cannot run is refused."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import paddle
import pytest

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.arg_utils import (
    add_engine_arguments,
    check_engine_arguments,
    engine_config,
)
from paddle_step.engine.llm_engine import Engine
from paddle_step.layers.paged_attention import PagedKVCache
from paddle_step.model_loader.loader import load_checkpoint
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.sampling_params import SamplingParams
from paddle_step.testing.perplexity import log_softmax, perplexity_through_cache
from paddle_step.testing.weight_formats import bfloat16_values

TESTS = Path(__file__).resolve().parents[1]
SHIPPED = TESTS.parent / "python" / "paddle_step" / "assets" / "pydoc-tiny"
HELD_OUT = TESTS / "data" / "heldout" / "python_notes.txt"
GOLDEN_DIR = TESTS / "data" / "hf-tiny"
# How a float32 model's layers run (PADDLE_STEP_DENSE, read when a model is built): "op",
# whole layers as one CPU call that attends through the cache for every token; "eager",
# the dense blocks with a per-layer attention that gives prompts their own float32 K/V.
WAYS = ("op", "eager")


def small_model(way: str, monkeypatch) -> LlamaForCausalLM:
    monkeypatch.setenv("PADDLE_STEP_DENSE", way)
    return LlamaForCausalLM(ModelConfig(seed=3))


def config(num_kv_blocks: int = 64, kv_cache_dtype: str = "bfloat16") -> EngineConfig:
    return EngineConfig(max_batch=4, max_model_len=48, block_size=4, num_kv_blocks=num_kv_blocks,
                        enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)  # fmt: skip


PROMPTS = [[5, 9, 2, 77, 31, 8, 14], [3, 3, 60], [101, 7, 22, 9, 40, 1, 2, 3, 18, 6, 11], [4]]


def test_cache_stores_bfloat16_half_the_bytes(monkeypatch) -> None:
    engine = Engine(small_model("op", monkeypatch), config())
    cache = engine.runner.kv_cache
    assert cache.key.dtype == paddle.bfloat16 and cache.value.dtype == paddle.bfloat16
    float32 = Engine(small_model("op", monkeypatch), config(kv_cache_dtype="auto"))
    assert float32.runner.kv_cache.key.dtype == paddle.float32
    assert cache.key.shape == float32.runner.kv_cache.key.shape


def test_prompt_keys_are_the_float32_ones_rounded(monkeypatch) -> None:
    """After a prefill, a bfloat16 cache holds exactly the float32 cache's keys and values
    rounded to bfloat16: in every layer where prompts attend over their own float32 K/V
    (the dense blocks), in the first layer where they attend through the cache."""
    for way in WAYS:
        model = small_model(way, monkeypatch)
        caches = {}
        for dtype in ("auto", "bfloat16"):
            engine = Engine(model, config(kv_cache_dtype=dtype))
            engine.generate(PROMPTS, SamplingParams(max_tokens=1))
            cache = engine.runner.kv_cache
            caches[dtype] = [t.astype("float32").numpy() for t in (cache.key, cache.value)]
        layers = slice(None) if way == "eager" else slice(0, 1)
        for float32, bfloat16 in zip(caches["auto"], caches["bfloat16"]):
            assert np.count_nonzero(float32[layers]) > 0
            np.testing.assert_array_equal(bfloat16[layers], bfloat16_values(float32[layers]))


@pytest.mark.parametrize("way", WAYS)
def test_preemption_changes_no_token(way, monkeypatch) -> None:
    """Greedy tokens with a bfloat16 cache are the same whether the batch runs at once or
    is preempted and recomputed (a recovered sequence's keys are rounded again, the same)."""
    model = small_model(way, monkeypatch)
    params = SamplingParams(max_tokens=30, eos_token_id=[])
    generous = Engine(model, config(num_kv_blocks=64)).generate(PROMPTS, params)
    tight_engine = Engine(model, config(num_kv_blocks=24))
    tight = tight_engine.generate(PROMPTS, params)
    assert tight_engine.stats.preemptions > 0
    assert [r.outputs[0].token_ids for r in tight] == [r.outputs[0].token_ids for r in generous]


def test_prefix_caching_and_chunked_prefill_change_no_token(monkeypatch) -> None:
    """Where every token attends through the cache (layers fused), a prompt whose first
    blocks come from the prefix cache, or that runs in chunks of 5 tokens, sees the very
    rounded keys it would have written itself: the same greedy tokens."""
    model = small_model("op", monkeypatch)
    shared = [8, 1, 30, 44, 2, 9, 17, 3, 21, 5]  # 2 full blocks of 4, then more
    prompts = [shared + [12, 40], shared + [7], shared + [33, 2, 6]]
    params = SamplingParams(max_tokens=12, eos_token_id=[])
    plain = Engine(model, config()).generate(prompts, params)
    for fields in ({"enable_prefix_caching": True}, {"max_num_batched_tokens": 5}):
        engine = Engine(model, replace(config(), **fields))
        results = [engine.generate([prompt], params)[0] for prompt in prompts]
        assert [r.outputs[0].token_ids for r in results] == [r.outputs[0].token_ids for r in plain]
        if "enable_prefix_caching" in fields:
            assert sum(r.cached_tokens for r in results) > 0


def test_gathered_keys_are_widened_to_float32() -> None:
    """The dense blocks' prompt chunks read keys gathered from the cache: a bfloat16 cache
    gives them float32, the written values rounded."""
    cache = PagedKVCache(4, 2, 2, 3, 5, dtype="bfloat16")
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((3, 3, 5)).astype(np.float32) for _ in range(2))
    slots = paddle.to_tensor(np.array([6, 0, 3], np.int64))
    cache.write(1, slots, paddle.to_tensor(k), paddle.to_tensor(v))
    keys, values = cache.gather_head_major(1, cache.head_major_rows(slots.reshape([1, 3])))
    assert keys.dtype == paddle.float32 and values.dtype == paddle.float32
    np.testing.assert_array_equal(keys.numpy()[0], bfloat16_values(k).transpose(1, 0, 2))
    np.testing.assert_array_equal(values.numpy()[0], bfloat16_values(v).transpose(1, 0, 2))


def test_held_out_perplexity_within_1_percent_of_float32(monkeypatch) -> None:
    """The shipped model over a text it was not trained on, each token after the first
    reading the keys before it from the cache: bfloat16 within 1% of float32, each way."""
    results = {}
    for way in WAYS:
        monkeypatch.setenv("PADDLE_STEP_DENSE", way)
        loaded = load_checkpoint(SHIPPED, "float32")
        ids = loaded.tokenizer.encode(HELD_OUT.read_text())
        for dtype in ("auto", "bfloat16"):
            results[way, dtype] = perplexity_through_cache(
                loaded.model, ids, loaded.max_model_len, dtype
            )
    print("held-out perplexity through the cache:", {k: round(v, 3) for k, v in results.items()})
    for way in WAYS:
        assert abs(results[way, "bfloat16"] / results[way, "auto"] - 1) <= 0.01, results


@pytest.mark.parametrize("name", ("llama-tiny", "qwen2-tiny"))
def test_prompt_log_probs_against_transformers(name) -> None:
    """The log-prob of each golden prompt's next token, every token read through the cache
    (one a step), against transformers' float64 logits: at rounding level with a float32
    cache, within 0.05 with a bfloat16 one (printed: docs/models.md quotes them)."""
    golden = json.loads((GOLDEN_DIR / "golden.json").read_text())["models"][name]["prompts"]
    prompts = [(i, e["prompt_ids"]) for i, e in enumerate(golden) if e["dtype"] == "float64"]
    model = load_checkpoint(GOLDEN_DIR / name, "float32").model
    longest = max(len(ids) for _, ids in prompts)
    worst = {}
    for dtype, bound in (("auto", 1e-4), ("bfloat16", 0.05)):
        config = EngineConfig(max_batch=1, max_model_len=-(-(longest + 1) // 4) * 4,
                              block_size=4, num_kv_blocks=32, max_num_batched_tokens=1,
                              enable_prefix_caching=False, kv_cache_dtype=dtype)  # fmt: skip
        engine = Engine(model, config)
        worst[dtype] = 0.0
        for index, ids in prompts:
            if len(ids) < 2:
                continue
            logits = np.load(GOLDEN_DIR / name / f"golden_prefill_logits_{index}.npy")
            expected = log_softmax(logits.astype(np.float64))[np.arange(len(ids) - 1), ids[1:]]
            [result] = engine.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))
            got = np.array([entry.logprob for entry in result.prompt_logprobs])
            worst[dtype] = max(worst[dtype], float(np.abs(got - expected).max()))
        assert worst[dtype] <= bound, worst
    print(f"{name}: max |log-prob - transformers| through the cache:", worst)


def test_refusals(monkeypatch) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        config(kv_cache_dtype="float16")
    float64 = LlamaForCausalLM(ModelConfig(dtype="float64", seed=3))
    with pytest.raises(ValueError, match="kv_cache_dtype 'bfloat16': expected a model"):
        Engine(float64, config())
    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:0")  # refused before allocating
    with pytest.raises(ValueError, match=r"kv_cache_dtype\) 'bfloat16': expected the CPU"):
        PagedKVCache(4, 2, 1, 1, 8, dtype="bfloat16")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    check_engine_arguments(parser, args)
    return args


def test_flag_reaches_the_engine_config(capsys) -> None:
    assert engine_config(parse(["--kv-cache-dtype", "bfloat16"]), 64).kv_cache_dtype == "bfloat16"
    assert engine_config(parse([]), 64).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parse(["--kv-cache-dtype", "bfloat16", "--dtype", "float64"])
    assert "--kv-cache-dtype bfloat16: expected a float32 model" in capsys.readouterr().err
