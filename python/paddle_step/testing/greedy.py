"""The greedy reference the engine tests compare with: the naive decoder (full recompute,
no cache), tokens only (needs paddle)."""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.naive import generate_naive
from ..models.llama import LlamaForCausalLM

__all__ = ["greedy_reference"]


def greedy_reference(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
) -> list[list[int]]:
    """Each prompt's greedy continuation (no eos stop), ``max_new_tokens`` long."""
    results, _ = generate_naive(model, prompts, max_new_tokens)
    return [result.token_ids for result in results]
