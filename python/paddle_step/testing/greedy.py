"""The greedy reference the engine tests compare with: the naive decoder (full recompute,
no cache), tokens only (needs paddle)."""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.naive import generate_naive
from ..models.llama import LlamaForCausalLM
from ..sampling_params import SamplingParams

__all__ = ["greedy_reference"]


def greedy_reference(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
) -> list[list[int]]:
    """Each prompt's greedy continuation (no eos stop), ``max_new_tokens`` long."""
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    params = [SamplingParams(max_tokens=int(limit)) for limit in max_new_tokens]
    results, _ = generate_naive(model, prompts, params)
    return [result.token_ids for result in results]
