"""SamplingParams shorthand for the engine tests."""

from __future__ import annotations

from ..sampling_params import SamplingParams

__all__ = ["limited"]


def limited(max_tokens: int | list[int], **fields) -> SamplingParams | list[SamplingParams]:
    """SamplingParams of ``max_tokens`` (one, or one per entry of a list) and ``fields``."""
    if isinstance(max_tokens, list):
        return [SamplingParams(max_tokens=limit, **fields) for limit in max_tokens]
    return SamplingParams(max_tokens=max_tokens, **fields)
