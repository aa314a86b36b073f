"""A request as the engine tracks it, and its stop ids. No paddle."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..config import EngineConfig

__all__ = ["MAX_EOS_IDS", "MAX_STOP_IDS", "MAX_STOP_TOKEN_IDS", "Request", "normalize_eos"]


# Room for each slot's stop ids on the device: eos ids (Llama 3 checkpoints list three)
# then the request's stop_token_ids.
MAX_EOS_IDS = 8
MAX_STOP_TOKEN_IDS = 8
MAX_STOP_IDS = MAX_EOS_IDS + MAX_STOP_TOKEN_IDS


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


def _check_token_ids(name: str, ids, vocab_size: int) -> None:
    outside = [token for token in ids if not 0 <= int(token) < vocab_size]
    if outside:
        raise ValueError(
            f"add_request: argument '{name}': expected token ids in [0, {vocab_size}), "
            f"got {outside[:5]}"
        )


@dataclass
class Request:
    """A validated request; ``encoder_blocks`` are its prompt blocks once admitted.

    ``params`` is what the request asked for; ``eos_token_ids`` are its resolved eos ids
    (the engine's when it named none). ``sampling_key`` keys its random draws (see
    ``sampler.sampling_uniforms``): from the request's own seed when it gave one, else
    from the engine's seed and its id.
    """

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]  # empty: no eos stop
    sampling_key: int
    encoder_blocks: list[int] = field(default_factory=list)
    aborted: bool = False

    @property
    def max_new_tokens(self) -> int:
        """Tokens the slot may generate: ``max_tokens``, but at least the one a prefill
        samples (``max_tokens`` 0 prefills for prompt logprobs and keeps no token)."""
        return max(self.params.max_tokens, 1)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(int(token) for token in self.params.stop_token_ids)

    @classmethod
    def validated(
        cls,
        request_id: int,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        sampling_key: int,
        default_eos_token_ids: tuple[int, ...],
        vocab_size: int,
        config: EngineConfig,
    ) -> Request:
        """The request ``Engine.add_request`` was asked for. Raises ``ValueError`` for one
        the engine could never run (empty prompt, ids outside the vocabulary, prompt +
        max_tokens past ``max_model_len``, more prompt blocks than the encoder region
        holds) or a parameter outside what the engine supports."""
        if not isinstance(params, SamplingParams):
            raise TypeError(
                "add_request: argument 'params': expected a SamplingParams, "
                f"got {type(params).__name__}"
            )
        prompt = [int(token) for token in prompt_ids]
        max_len = config.max_model_len
        if not prompt:
            raise ValueError(
                "add_request: argument 'prompt_ids': expected at least one token, got []"
            )
        _check_token_ids("prompt_ids", prompt, vocab_size)
        request = cls(
            request_id,
            prompt,
            params,
            normalize_eos(params.eos_token_id, default_eos_token_ids, vocab_size),
            sampling_key,
        )
        total = len(prompt) + request.max_new_tokens
        if total > max_len:
            raise ValueError(
                f"add_request: prompt length {len(prompt)} + max_tokens {params.max_tokens} "
                f"= {total}, expected <= max_model_len ({max_len})"
            )
        needed = config.encoder_blocks_for(len(prompt))
        if needed > config.num_encoder_blocks:
            raise ValueError(
                f"add_request: a prompt of {len(prompt)} tokens needs {needed} encoder blocks, "
                f"expected <= {config.num_encoder_blocks} (the encoder region)"
            )
        _check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"add_request: argument 'stop_token_ids': expected at most "
                f"{MAX_STOP_TOKEN_IDS} ids, got {len(params.stop_token_ids)}"
            )
        _check_token_ids("logit_bias", params.logit_bias, vocab_size)
        _refuse_unsupported(params)
        return request


def _refuse_unsupported(params: SamplingParams) -> None:
    """Raises ``ValueError`` naming a field the engine does not honour yet (never ignored)."""
    defaults = SamplingParams()
    for name in ("top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "min_tokens", "logprobs",
                 "prompt_logprobs", "n", "best_of", "constraint"):  # fmt: skip
        value = getattr(params, name)
        if value != getattr(defaults, name) and not (name == "top_k" and value == -1):
            raise ValueError(
                f"add_request: argument '{name}': expected {getattr(defaults, name)!r} "
                f"(not supported yet), got {value!r}"
            )
