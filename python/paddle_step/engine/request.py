"""A request as the engine tracks it, and its stop ids. No paddle."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..config import EngineConfig

__all__ = ["MAX_EOS_IDS", "Request", "normalize_eos"]


# Room for each slot's stop ids on the device (Llama 3 checkpoints list three).
MAX_EOS_IDS = 8


def normalize_eos(
    eos: int | Sequence[int] | None, default: tuple[int, ...], vocab_size: int
) -> tuple[int, ...]:
    """The stop ids of a request: ``None`` means ``default``; an int or a sequence of
    ints (empty: no eos stop) is checked against the vocabulary."""
    if eos is None:
        return tuple(default)
    ids = (int(eos),) if isinstance(eos, (int, np.integer)) else tuple(int(i) for i in eos)
    outside = [token for token in ids if not 0 <= token < vocab_size]
    if outside or len(ids) > MAX_EOS_IDS:
        raise ValueError(
            f"add_request: argument 'eos_token_id': expected None, an id or at most "
            f"{MAX_EOS_IDS} ids in [0, {vocab_size}), got {eos!r}"
        )
    return ids


@dataclass
class Request:
    """A validated request; ``encoder_blocks`` are its prompt blocks once admitted.

    Prefix caching: ``block_hashes`` are the keys of its full prompt blocks (made at its
    first admission attempt), ``blocks_cached`` how many leading ones are cached (hits
    and those it computed), ``num_cached_tokens`` the prompt tokens the cache supplied.

    ``sampling_key`` keys its random draws (see ``sampling.sampling_uniforms``): from the
    request's own seed when it gave one, else from the engine's seed and its id.
    """

    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]  # empty: no eos stop
    temperature: float
    top_p: float
    sampling_key: int
    encoder_blocks: list[int] = field(default_factory=list)
    aborted: bool = False
    block_hashes: list[bytes] = field(default_factory=list)
    blocks_cached: int = 0
    num_cached_tokens: int = 0

    @classmethod
    def validated(
        cls,
        request_id: int,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None,
        temperature: float,
        top_p: float,
        *,
        sampling_key: int,
        default_eos_token_ids: tuple[int, ...],
        vocab_size: int,
        config: EngineConfig,
    ) -> Request:
        """The request ``Engine.add_request`` was asked for (``eos_token_id`` None:
        ``default_eos_token_ids``). Raises ``ValueError`` for one the engine could never
        run (empty prompt, ids outside the vocabulary, prompt + max_new_tokens past
        ``max_model_len``, more prompt blocks than the encoder region holds) or a bad
        sampling parameter."""
        prompt = [int(token) for token in prompt_ids]
        max_len = config.max_model_len
        if not prompt:
            raise ValueError(
                "add_request: argument 'prompt_ids': expected at least one token, got []"
            )
        outside = [token for token in prompt if not 0 <= token < vocab_size]
        if outside:
            raise ValueError(
                f"add_request: argument 'prompt_ids': expected ids in [0, {vocab_size}), "
                f"got {outside[:5]}"
            )
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(
                "add_request: argument 'max_new_tokens': expected an int >= 1, "
                f"got {max_new_tokens!r}"
            )
        if len(prompt) + max_new_tokens > max_len:
            raise ValueError(
                f"add_request: prompt length {len(prompt)} + max_new_tokens {max_new_tokens} "
                f"= {len(prompt) + max_new_tokens}, expected <= max_model_len ({max_len})"
            )
        needed = config.encoder_blocks_for(len(prompt))
        if needed > config.num_encoder_blocks:
            raise ValueError(
                f"add_request: a prompt of {len(prompt)} tokens needs {needed} encoder blocks, "
                f"expected <= {config.num_encoder_blocks} (the encoder region)"
            )
        eos_token_ids = normalize_eos(eos_token_id, default_eos_token_ids, vocab_size)
        if not temperature >= 0.0:
            raise ValueError(
                f"add_request: argument 'temperature': expected >= 0, got {temperature!r}"
            )
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"add_request: argument 'top_p': expected in (0, 1], got {top_p!r}")
        return cls(
            request_id,
            prompt,
            int(max_new_tokens),
            eos_token_ids,
            float(temperature),
            float(top_p),
            sampling_key,
        )
