"""What generating yields: finished results, the tokens each step streams, run
statistics, the reasons a request finishes, and one step's per-slot outcome on the host.
No paddle.

The HTTP side reads these objects (through ``core_client``'s events):

- ``StepToken``: one generated token of one sample, as soon as its step ends, with its
  ``TokenLogprobs`` when the request asked for ``logprobs`` (with ``best_of`` > ``n``
  always, its own logprob at least) and the sample's
  ``finish_reason`` when this token ended it;
- ``GenerationResult``: the finished request: its prompt, ``prompt_logprobs`` when asked,
  and one ``SampleOutput`` per returned sample (``n`` of them, ``index`` 0 .. n-1).

Logprobs are of the model's own distribution at that position (a float32 log-softmax of
the raw logits), before any sampling control changes it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "FINISH_ABORT",
    "FINISH_EOS",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "GenerationResult",
    "GenerationStats",
    "SampleOutput",
    "StepOutcome",
    "StepToken",
    "TokenLogprobs",
]

FINISH_EOS = "eos"  # an eos token (the request's or the engine's)
FINISH_STOP = "stop"  # a stop_token_ids token, or the request's constraint finished
FINISH_LENGTH = "length"  # max_tokens, or the model length
FINISH_ABORT = "abort"  # Engine.abort


@dataclass(slots=True)
class TokenLogprobs:
    """The logprob of the token at one position and the ``top`` most likely tokens there,
    as (token id, logprob) pairs, most likely first (ties: lower id first); ``top`` has
    as many entries as the request asked for (``logprobs`` or ``prompt_logprobs``).
    ``rank``, at prompt positions: how many tokens have a logprob at least the token's
    (1 = most likely); None at generated positions."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass
class SampleOutput:
    """One sample of a request: the tokens generated (an eos or stop token included), why
    it stopped, and, when asked, the logprobs of each token. ``cumulative_logprob`` is the
    sum of its tokens' logprobs (set when ``logprobs`` or ``best_of`` > ``n`` asks for it).
    """

    index: int
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class GenerationResult:
    """One finished request: its prompt, its samples (``outputs``, ``n`` of them) and, when
    ``prompt_logprobs`` was asked, those of prompt positions 1 .. P-1 (position 0 has no
    context, as in vLLM, whose list starts with None there). ``cached_tokens``: the prompt
    tokens whose K/V came from the prefix cache instead of being computed.

    ``token_ids`` and ``finish_reason`` are those of sample 0 (the only one unless ``n`` >
    1): ``"eos"``, ``"stop"`` (a stop token or the constraint finished), ``"length"``
    (``max_tokens`` or the model length) or ``"abort"`` (``Engine.abort``).
    """

    request_id: int
    prompt_ids: list[int]
    outputs: list[SampleOutput]
    prompt_logprobs: list[TokenLogprobs] | None = None
    cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    def to_dict(self) -> dict:
        """The JSON form: prompt_ids, token_ids and finish_reason (of sample 0)."""
        return {
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
        }


@dataclass(slots=True)
class StepToken:
    """A token a step generated: of request ``request_id``'s sample ``index`` (with
    ``best_of`` > ``n``: the draw's index in 0 .. best_of-1, not streamable as a choice);
    ``logprobs`` when the request asked, or its own logprob alone with ``best_of`` > ``n``
    (what ranks the draws, also for a server that ends a draw early on a stop string);
    ``finish_reason`` when this token ended the sample."""

    request_id: int
    index: int
    token_id: int
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None


@dataclass
class GenerationStats:
    """Counters of a generation run.

    ``preemptions`` and ``recoveries`` count ``step_paddle``'s evictions of running
    sequences and their returns; ``peak_blocks_in_use`` is the most KV blocks held at once
    (prompt blocks plus decoder blocks, measured after each step's scheduling); ``elapsed``
    is the time spent in steps, in seconds. ``prompt_tokens_queried`` and
    ``prompt_tokens_hit`` are the prompt tokens admitted and those the prefix cache
    supplied.
    """

    steps: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    recoveries: int = 0
    peak_blocks_in_use: int = 0
    prompt_tokens_queried: int = 0
    prompt_tokens_hit: int = 0
    elapsed: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of step time."""
        return self.generated_tokens / self.elapsed if self.elapsed > 0 else 0.0

    def to_dict(self) -> dict:
        """All counters plus ``tokens_per_s``."""
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


@dataclass
class StepOutcome:
    """One step's per-slot results on the host ([B] arrays, then counts)."""

    ran: np.ndarray  # bool: the slot ran (had tokens) this step
    tokens: np.ndarray  # int64: the token it sampled
    stopped: np.ndarray  # bool: stop_flags after the step
    preempted: np.ndarray  # bool: is_block_step after the step
    step_idx: np.ndarray  # int64: tokens generated so far
    recovered_slots: np.ndarray  # int64: the slots step_paddle recovered this step
    step_lens: int  # preempted slots waiting for recovery
    free_list_len: int  # blocks left in the decoder pool

    @property
    def recovered(self) -> int:
        """How many slots step_paddle recovered this step."""
        return int(self.recovered_slots.size)
