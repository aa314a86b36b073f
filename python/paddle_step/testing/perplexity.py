"""Perplexity of a model over a text: the accuracy yardstick of the weight formats and of
the KV cache's storage."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..config import EngineConfig
from ..engine.llm_engine import Engine
from ..sampling_params import SamplingParams


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis of ``logits``, in their dtype."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def perplexity(model, token_ids: Sequence[int], window: int) -> float:
    """exp(mean next-token negative log-likelihood) of ``token_ids`` under ``model`` (a
    ``LlamaForCausalLM``), read in consecutive windows of at most ``window`` tokens, each
    from scratch (every token after a window's first is predicted)."""
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = list(token_ids[start : start + window])
        if len(chunk) < 2:
            break
        logits = model.logits_all_positions(chunk).numpy().astype(np.float64)[:-1]
        log_probs = log_softmax(logits)
        total -= log_probs[np.arange(len(chunk) - 1), chunk[1:]].sum()
        count += len(chunk) - 1
    return math.exp(total / count)


def perplexity_through_cache(
    model, token_ids: Sequence[int], window: int, kv_cache_dtype: str = "auto"
) -> float:
    """``perplexity`` as the engine computes it when every token after a window's first
    reads the keys and values before it back from the paged KV cache (stored in
    ``kv_cache_dtype``): each window is one request's prompt, run one token a step
    (``max_num_batched_tokens`` 1), and its prompt logprobs are the predictions."""
    block_size = 16
    blocks = -(-(window + 1) // block_size)  # room for the token after the prompt
    config = EngineConfig(max_batch=1, max_model_len=blocks * block_size, block_size=block_size,
                          num_kv_blocks=4 * blocks, max_num_batched_tokens=1,
                          enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    engine = Engine(model, config)
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = list(token_ids[start : start + window])
        if len(chunk) < 2:
            break
        [result] = engine.generate([chunk], SamplingParams(max_tokens=0, prompt_logprobs=0))
        total -= sum(entry.logprob for entry in result.prompt_logprobs)
        count += len(result.prompt_logprobs)
    return math.exp(total / count)
