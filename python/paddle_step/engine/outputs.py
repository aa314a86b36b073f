"""What generating yields: finished results, run statistics, the reasons a request
finishes, and one step's per-slot outcome on the host. No paddle."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "FINISH_ABORT",
    "FINISH_EOS",
    "FINISH_LENGTH",
    "GenerationResult",
    "GenerationStats",
    "StepOutcome",
]

FINISH_EOS = "eos"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass
class GenerationResult:
    """One finished request: its prompt, the tokens generated (an eos token included) and
    why it stopped: ``"eos"``, ``"length"`` (``max_new_tokens`` or the model length) or
    ``"abort"`` (``Engine.abort``). ``cached_tokens``: the prompt tokens whose K/V came
    from the prefix cache instead of being computed."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    cached_tokens: int = 0

    def to_dict(self) -> dict:
        """The JSON form: prompt_ids, token_ids and finish_reason."""
        return {
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
        }


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
