"""Perplexity of a model over a text: the accuracy yardstick of the weight formats."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


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
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        total -= log_probs[np.arange(len(chunk) - 1), chunk[1:]].sum()
        count += len(chunk) - 1
    return math.exp(total / count)
