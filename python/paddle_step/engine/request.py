"""A request as the engine tracks it, and its stop ids. No paddle."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from ..sampling_params import SamplingParams
from .outputs import TokenLogprobs

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..config import EngineConfig

__all__ = [
    "MAX_DRAWS",
    "MAX_EOS_IDS",
    "MAX_LOGIT_BIAS",
    "MAX_STOP_IDS",
    "MAX_STOP_TOKEN_IDS",
    "Request",
    "check_params_type",
    "normalize_eos",
]


# Room for each slot's stop ids on the device: eos ids (Llama 3 checkpoints list three)
# then the request's stop_token_ids.
MAX_EOS_IDS = 8
MAX_STOP_TOKEN_IDS = 8
MAX_STOP_IDS = MAX_EOS_IDS + MAX_STOP_TOKEN_IDS
# Room for each slot's logit_bias entries on the device (OpenAI's own API caps them at 300).
MAX_LOGIT_BIAS = 300
# Samples one request draws (best_of, else n): each is a sequence of its own, made when the
# request is added, so a mistyped n (2**31) would fill the memory before it failed.
MAX_DRAWS = 4096


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


def check_params_type(params) -> None:
    """Raises ``TypeError`` unless ``params`` is a ``SamplingParams``."""
    if not isinstance(params, SamplingParams):
        raise TypeError(
            "add_request: argument 'params': expected a SamplingParams, "
            f"got {type(params).__name__}"
        )


def _token_list(prompt_ids) -> list[int]:
    """``prompt_ids`` as a list of Python ints; only integers count (1.5, "5" and True
    are not token ids, and a str is text for the tokenizer)."""
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
        raise TypeError(
            "add_request: argument 'prompt_ids': expected a sequence of int token ids, got "
            f"{type(prompt_ids).__name__} {prompt_ids!r:.40}"
            + (" (encode text with the tokenizer first)" if isinstance(prompt_ids, str) else "")
        )
    tokens = list(prompt_ids)
    for index, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise TypeError(
                "add_request: argument 'prompt_ids': expected int token ids, got "
                f"{type(token).__name__} {token!r:.40} at index {index}"
            )
    return [int(token) for token in tokens]


def _check_token_ids(name: str, ids, vocab_size: int) -> None:
    outside = [token for token in ids if not 0 <= int(token) < vocab_size]
    if outside:
        raise ValueError(
            f"add_request: argument '{name}': expected token ids in [0, {vocab_size}), "
            f"got {outside[:5]}"
        )


@dataclass(eq=False)
class Request:
    """A validated request; ``encoder_blocks`` are its prompt blocks once admitted.

    ``params`` is what the request asked for; ``eos_token_ids`` are its resolved eos ids
    (the engine's when it named none). ``sampling_key`` keys its random draws (see
    ``sampler.sampling_uniforms``): from the request's own seed when it gave one, else
    from the engine's seed and its id (and its sample index, for ``n`` > 1).

    Prefix caching: ``block_hashes`` are the keys of its full prompt blocks (made at its
    first admission attempt), ``blocks_cached`` how many leading ones are cached (hits
    and those it computed), ``num_cached_tokens`` the prompt tokens the cache supplied.
    """

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]  # empty: no eos stop
    sampling_key: int
    encoder_blocks: list[int] = field(default_factory=list)
    aborted: bool = False
    block_hashes: list[bytes] = field(default_factory=list)
    blocks_cached: int = 0
    num_cached_tokens: int = 0
    constraint_finished: bool = False  # its constraint admits nothing more
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_sent: bool = False  # reported in a step's last_step_prompt_logprobs
    index: int = 0  # which sample of its request this is (n, best_of)
    # Every sample of the request, this one included (one list, shared by all of them).
    samples: list[Request] = field(default_factory=list, repr=False)

    def add_samples(self, sampling_keys: Sequence[int]) -> None:
        """Adds samples 1, 2, .. to this (first) sample, one per key: the same request
        with its own draws."""
        for key in sampling_keys:
            sample = replace(self, sampling_key=key, encoder_blocks=[], index=len(self.samples),
                             blocks_cached=0, num_cached_tokens=0)  # fmt: skip
            self.samples.append(sample)

    @property
    def logprobs_top(self) -> int | None:
        """How many top alternatives its tokens' logprobs need (0: only the token's own,
        for ``best_of``), or None when it needs none."""
        params = self.params
        if params.logprobs is not None:
            return params.logprobs
        return 0 if (params.best_of or params.n) > params.n else None

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
        holds) or a parameter outside what the engine supports; ``TypeError`` for prompt
        ids that are not ints (``params`` is a ``SamplingParams``: ``check_params_type``)."""
        prompt = _token_list(prompt_ids)
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
        request.samples.append(request)
        total = len(prompt) + request.max_new_tokens
        if total > max_len:
            # max_tokens 0 still samples one token after the prompt (then drops it).
            new = f"max_tokens {params.max_tokens}" + (
                " (1 sampled)" if total > len(prompt) + params.max_tokens else ""
            )
            raise ValueError(
                f"add_request: prompt length {len(prompt)} + {new} = {total}, expected <= "
                f"max_model_len ({max_len})"
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
        if len(params.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"add_request: argument 'logit_bias': expected at most {MAX_LOGIT_BIAS} "
                f"entries, got {len(params.logit_bias)}"
            )
        draws = params.best_of or params.n
        if draws > MAX_DRAWS:
            name = "best_of" if params.best_of else "n"
            raise ValueError(
                f"add_request: argument '{name}': expected at most {MAX_DRAWS} samples a "
                f"request, got {draws}"
            )
        if draws > 1 and params.constraint is not None:
            raise ValueError(
                f"add_request: argument 'n': expected 1 with a constraint (one constraint "
                f"object follows one sample), got n={params.n}, best_of={params.best_of}"
            )
        return request
