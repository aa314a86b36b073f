"""Token sampling shared by the engine and the naive reference.

Random draws come from a counter-based generator keyed by (request key, token index)
rather than from a stream consumed step by step, so a request samples the same tokens
whatever else shares its batch and whether or not it was preempted and recomputed. A
request's key comes from its own seed when it has one (so its output does not depend on
its arrival order), else from the engine's seed and its request id.
"""

from __future__ import annotations

import inspect

import numpy as np
import paddle

__all__ = ["sample_tokens", "sampling_key", "sampling_uniforms"]

# paddle 2.6's argsort has no `stable`; its CPU sort is deterministic per row
# all the same, which is what keeps engine and naive draws equal.
_ARGSORT_OPTIONS = (
    {"stable": True} if "stable" in inspect.signature(paddle.argsort).parameters else {}
)

_MASK64 = (1 << 64) - 1


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a well-mixed uint64 for each uint64 input (wraps mod 2**64)."""
    z = values + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sampling_key(seed: int, request_id: int = 0) -> int:
    """The key of a request's draws: a mix of a seed and (for engine-seeded requests) the
    request id."""
    mixed = np.array([(seed & _MASK64) ^ (request_id & _MASK64)], dtype=np.uint64)
    return int(_splitmix64(mixed)[0])


def sampling_uniforms(keys: np.ndarray, token_index: np.ndarray) -> np.ndarray:
    """One float64 in [0, 1) per entry, a pure function of (key, token index)."""
    keys = np.asarray(keys).astype(np.uint64)
    token_index = np.asarray(token_index).astype(np.uint64)
    bits = _splitmix64(keys ^ _splitmix64(token_index))
    return (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def sample_tokens(
    logits: paddle.Tensor,
    temperature: paddle.Tensor,
    top_p: paddle.Tensor,
    uniforms: paddle.Tensor | None,
) -> paddle.Tensor:
    """Next token of each row of ``logits`` [R, V]: int64 [R].

    Rows with ``temperature`` 0 take the argmax (lowest id on ties). The others sample from
    ``softmax(logits / temperature)`` cut to the smallest set of most likely tokens whose
    mass reaches ``top_p`` (nucleus sampling), by inverting its CDF at ``uniforms`` [R].
    ``uniforms`` may be None when every row is greedy.
    """
    greedy = paddle.argmax(logits, axis=-1)
    if uniforms is None:
        return greedy
    scale = paddle.clip(temperature, min=1e-6).astype(logits.dtype).unsqueeze(1)
    probs = paddle.nn.functional.softmax(logits / scale, axis=-1)
    order = paddle.argsort(probs, axis=-1, descending=True, **_ARGSORT_OPTIONS)
    sorted_probs = paddle.take_along_axis(probs, order, axis=-1)
    mass_before = paddle.cumsum(sorted_probs, axis=-1) - sorted_probs
    # The most likely token is always kept, so top_p near 0 degrades to greedy.
    kept = paddle.where(
        mass_before < top_p.astype(logits.dtype).unsqueeze(1),
        sorted_probs,
        paddle.zeros_like(sorted_probs),
    )
    cdf = paddle.cumsum(kept, axis=-1)
    target = uniforms.astype(logits.dtype).unsqueeze(1) * cdf[:, -1:]
    # The first rank whose CDF reaches the target; cut tokens add no mass, so it is a
    # kept one even when rounding makes the target equal the total.
    rank = paddle.sum((cdf < target).astype("int64"), axis=-1)
    sampled = paddle.take_along_axis(order, rank.unsqueeze(1), axis=-1).squeeze(1)
    return paddle.where(temperature > 0, sampled, greedy)
