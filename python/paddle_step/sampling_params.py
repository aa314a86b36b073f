"""SamplingParams: everything a request asks of decoding, carried as one object from the
API to the sampler (as vLLM's). No paddle: the HTTP front end builds these.

Logprobs are of the model's own distribution (log-softmax of the raw logits) before any
sampling control (penalties, bias, top-k/top-p/min-p, temperature, constraints) is
applied, as vLLM reports them by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

__all__ = [
    "MAX_LOGPROBS",
    "SamplingParams",
    "TokenConstraint",
    "pack_token_mask",
    "token_mask_words",
    "unpack_token_mask",
]

# The most top-logprob alternatives a request may ask for per position (OpenAI's
# completions API allows 5, chat's top_logprobs 20).
MAX_LOGPROBS = 20


def token_mask_words(vocab_size: int) -> int:
    """The int32 words of a packed token mask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def pack_token_mask(mask: np.ndarray) -> np.ndarray:
    """bool [..., V] to int32 [..., ceil(V / 32)]: bit j of word w allows token 32 w + j
    (llguidance's and xgrammar's bitmask layout); the bits past V are 0."""
    mask = np.asarray(mask, dtype=bool)
    padded = np.zeros((*mask.shape[:-1], 32 * token_mask_words(mask.shape[-1])), dtype=bool)
    padded[..., : mask.shape[-1]] = mask
    return np.packbits(padded, axis=-1, bitorder="little").view(np.int32)


def unpack_token_mask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """``pack_token_mask``'s inverse: int32 [..., ceil(V / 32)] to bool [..., V]."""
    words = np.ascontiguousarray(words, dtype=np.int32)
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


class TokenConstraint(Protocol):
    """A per-request restriction of the next token (structured output): the engine asks
    for the allowed set before each sampled token of the request and reports the token
    it sampled. One object per request; it keeps its own state.

    A constraint may also have ``allowed_bitmask(vocab_size)``: the same set packed as
    ``pack_token_mask`` packs it (int32 [ceil(vocab_size / 32)], None allows all), which
    the engine then asks for instead, saving the bool mask and its packing per step. And
    ``error``: a string, not empty once the constraint failed (a matcher past its own
    limits) rather than completed; the server then answers the request with that error."""

    def allowed_tokens(self, vocab_size: int) -> np.ndarray | None:
        """A bool [vocab_size] mask of the tokens allowed next; None allows all."""

    def accept_token(self, token_id: int) -> None:
        """Advances past the sampled token."""

    def is_finished(self) -> bool:
        """True when the constraint admits nothing more (the request then stops)."""


def _check(condition: bool, name: str, expected: str, value) -> None:
    if not condition:
        raise ValueError(f"SamplingParams: argument '{name}': expected {expected}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    """A real number, not NaN or infinite (a str or a bool is none)."""
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


@dataclass
class SamplingParams:
    """How one request decodes.

    ``temperature`` 0 is greedy. ``top_k`` 0 keeps every token; ``min_p`` drops tokens
    whose probability is under ``min_p`` times the most likely one's. ``presence_penalty``
    and ``frequency_penalty`` follow OpenAI's definitions over the generated tokens;
    ``repetition_penalty`` follows vLLM's (over prompt and generated tokens: positive
    logits divided, negative multiplied). ``logit_bias`` adds to the logits of token ids.
    ``min_tokens``: eos and ``stop_token_ids`` are masked until that many tokens exist.
    ``eos_token_id`` None means the engine's eos ids, ``[]`` none (ignore eos).
    ``seed`` keys the request's draws (same seed, same tokens, whatever the batch).
    ``logprobs`` k: the sampled token's logprob and the k most likely alternatives per
    generated position; ``prompt_logprobs`` k: the same for each prompt position after the
    first. ``n`` samples are returned of ``best_of`` (>= n) drawn, at most 4,096 a
    request (``Engine.add_request`` refuses more). ``constraint``
    restricts the next token (structured output).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    constraint: TokenConstraint | None = None

    def __post_init__(self) -> None:
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 0,
            "max_tokens",
            "an int >= 0",
            self.max_tokens,
        )
        # Every float is checked finite first: NaN passes no comparison but slips past a
        # negated one, and a str would raise TypeError on the comparison.
        _check(_is_finite(self.temperature) and self.temperature >= 0.0, "temperature",
               "a finite number >= 0", self.temperature)  # fmt: skip
        _check(_is_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               "a value in (0, 1]", self.top_p)  # fmt: skip
        _check(
            _is_int(self.top_k) and self.top_k >= -1,
            "top_k",
            "an int >= 0 (0 or -1: off)",
            self.top_k,
        )
        _check(_is_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               "a value in [0, 1]", self.min_p)  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_finite(value) and -2.0 <= value <= 2.0, name, "a value in [-2, 2]", value)
        _check(_is_finite(self.repetition_penalty) and self.repetition_penalty > 0.0,
               "repetition_penalty", "a finite number > 0", self.repetition_penalty)  # fmt: skip
        _check(
            isinstance(self.logit_bias, dict)
            and all(_is_int(token) and _is_finite(bias) for token, bias in self.logit_bias.items()),
            "logit_bias",
            "a map of token ids to finite biases",
            self.logit_bias,
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens,
            "min_tokens",
            "an int >= 0",
            self.min_tokens,
        )
        _check(
            all(_is_int(token) for token in self.stop_token_ids),
            "stop_token_ids",
            "a list of token ids",
            self.stop_token_ids,
        )
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
               "None or an int in [0, 2**63)", self.seed)  # fmt: skip
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"None or an int in [0, {MAX_LOGPROBS}]",
                value,
            )
        _check(_is_int(self.n) and self.n >= 1, "n", "an int >= 1", self.n)
        _check(
            self.best_of is None or (_is_int(self.best_of) and self.best_of >= self.n),
            "best_of",
            f"None or an int >= n ({self.n})",
            self.best_of,
        )

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0

    def top_k_cut(self, vocab_size: int) -> int:
        """``top_k`` as the samplers take it (int64, 0: every token): -1, 0 and any value at
        or past ``vocab_size`` keep every token, however large the int."""
        return self.top_k if 0 < self.top_k < vocab_size else 0
