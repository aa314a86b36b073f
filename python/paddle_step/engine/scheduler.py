"""The host's side of continuous batching: the waiting queue, admission into free slots
with their prompt blocks, retirement of finished requests, and host mirrors of the slot
flags that the device state holds (refreshed once a step by ``record``).

Decoder blocks, preemption and recovery are ``step_paddle``'s work on the device; this
class only follows them through the mirrors.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..config import EngineConfig
from .block_allocator import EncoderBlockAllocator
from .outputs import (
    FINISH_ABORT,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationResult,
    SampleOutput,
    StepToken,
)
from .request import Request

if TYPE_CHECKING:
    from .outputs import StepOutcome

__all__ = ["Scheduler"]

logger = logging.getLogger(__name__)


class AbortedRequest(NamedTuple):
    """What ``Scheduler.abort`` took out: the slot it ran in (None: it was waiting)."""

    slot: int | None
    was_preempted: bool


class Scheduler:
    """Which request is in which slot, and which requests wait.

    Slot mirrors: ``live`` (holds a request, running or preempted), ``running`` (not
    ``stop_flags``), ``preempted`` (``is_block_step``), ``step_idx``, the slot's request
    id, its sampling key and whether it samples (temperature > 0); ``generated[b, k]`` is
    the k-th token
    (1-based, like ``pre_ids``) of slot b's request.
    """

    def __init__(self, config: EngineConfig) -> None:
        batch = config.max_batch
        self.config = config
        self.encoder_blocks = EncoderBlockAllocator(config.num_encoder_blocks)
        self.waiting: deque[Request] = deque()
        self.slot_requests: list[Request | None] = [None] * batch
        self.live = np.zeros(batch, dtype=bool)
        self.running = np.zeros(batch, dtype=bool)
        self.preempted = np.zeros(batch, dtype=bool)
        self.step_idx = np.zeros(batch, dtype=np.int64)
        self.slot_request_ids = np.full(batch, -1, dtype=np.int64)
        self.slot_sampling_keys = np.zeros(batch, dtype=np.uint64)
        self.slot_samples = np.zeros(batch, dtype=bool)
        self.generated = np.full((batch, config.max_model_len), -1, dtype=np.int64)
        self._logged_prompt_region_full = False

    def _note_prompt_region_full(self, request: Request) -> None:
        """Logs, once per scheduler, that a request waits for prompt blocks while a slot is
        free: the batch then runs in waves, which a larger prompt region would avoid."""
        if self._logged_prompt_region_full:
            return
        self._logged_prompt_region_full = True
        config = self.config
        logger.warning(
            "a %d-token prompt waits for %d prompt blocks while batch slots are free: the "
            "prompt region holds %d of the %d KV blocks (decoder_pool_ratio=%s), %d free now; "
            "more KV blocks or a lower decoder_pool_ratio admit more prompts at once",
            len(request.prompt_ids),
            config.encoder_blocks_for(len(request.prompt_ids)),
            config.num_encoder_blocks,
            config.num_kv_blocks,
            config.decoder_pool_ratio,
            self.encoder_blocks.num_free,
        )

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.live.any())

    def any_sampling(self) -> bool:
        """Whether a running slot samples (so the step needs random draws)."""
        return bool((self.slot_samples & self.running).any())

    def admit(self) -> list[int]:
        """Moves waiting requests (FIFO) into free slots while their prompt blocks are
        available; returns the slots they took."""
        # Preempted sequences come back first: admitting more would compete with them
        # for the decoder pool and could keep them out indefinitely.
        if not self.waiting or self.preempted.any():
            return []
        slots: list[int] = []
        for slot in np.flatnonzero(~self.live).tolist():
            if not self.waiting:
                break
            request = self.waiting[0]
            blocks = self.encoder_blocks.allocate(
                self.config.encoder_blocks_for(len(request.prompt_ids))
            )
            if blocks is None:
                # The head of the queue waits for prompt blocks; FIFO keeps order.
                self._note_prompt_region_full(request)
                break
            self.waiting.popleft()
            request.encoder_blocks = blocks
            self.slot_requests[slot] = request
            slots.append(slot)
        if slots:
            requests = [self.slot_requests[slot] for slot in slots]
            self.live[slots] = True
            self.running[slots] = True
            self.step_idx[slots] = 0
            self.slot_request_ids[slots] = [r.request_id for r in requests]
            self.slot_sampling_keys[slots] = [r.sampling_key for r in requests]
            self.slot_samples[slots] = [not r.params.greedy for r in requests]
        return slots

    def slot_of(self, request_id: int) -> int | None:
        """The slot holding ``request_id``, or None."""
        slots = np.flatnonzero(self.live & (self.slot_request_ids == request_id))
        return int(slots[0]) if slots.size else None

    def abort(self, request_id: int) -> AbortedRequest | None:
        """Takes ``request_id`` out of the schedule; None if it is not unfinished here.

        A waiting request leaves the queue (``slot`` None). A request in a slot is marked
        aborted and stops running; it is retired after the next step, when ``step_paddle``
        has freed its decoder blocks. ``was_preempted``: it sat in ``step_block_list``,
        which it has now left without being recovered.
        """
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return AbortedRequest(slot=None, was_preempted=False)
        slot = self.slot_of(request_id)
        if slot is None or self.slot_requests[slot].aborted:
            return None
        self.slot_requests[slot].aborted = True
        was_preempted = bool(self.preempted[slot])
        self.running[slot] = False
        self.preempted[slot] = False
        return AbortedRequest(slot=slot, was_preempted=was_preempted)

    def record(self, outcome: StepOutcome) -> None:
        """Takes in a step's results: tokens generated, slot flags, step_idx."""
        rows = np.flatnonzero(outcome.ran)
        self.generated[rows, outcome.step_idx[rows]] = outcome.tokens[rows]
        self.running = ~outcome.stopped
        self.preempted = outcome.preempted
        self.step_idx = outcome.step_idx

    def finished_slots(self) -> np.ndarray:
        """Slots whose request stopped for good (stopped and not preempted)."""
        return np.flatnonzero(self.live & ~self.running & ~self.preempted)

    def _token_ids(self, slot: int) -> list[int]:
        """The tokens slot ``slot``'s request keeps (none for ``max_tokens`` 0, whose
        prefill samples one that is dropped)."""
        request = self.slot_requests[slot]
        kept = min(int(self.step_idx[slot]), request.params.max_tokens)
        return self.generated[slot, 1 : kept + 1].tolist()

    def _finish_reason(self, slot: int) -> str:
        """Why slot ``slot``'s request stopped (call once it has)."""
        request = self.slot_requests[slot]
        last = int(self.generated[slot, self.step_idx[slot]]) if self.step_idx[slot] else -1
        if request.aborted:
            return FINISH_ABORT
        if request.params.max_tokens and last in request.eos_token_ids:
            return FINISH_EOS
        if request.params.max_tokens and last in request.stop_token_ids:
            return FINISH_STOP
        return FINISH_LENGTH

    def step_tokens(self, rows: np.ndarray, outcome: StepOutcome) -> list[StepToken]:
        """The tokens a step generated in slots ``rows`` (after ``record``), each with its
        sample's finish reason when it ended it."""
        ended = outcome.stopped & ~outcome.preempted
        tokens = []
        for slot in rows.tolist():
            request = self.slot_requests[slot]
            if request.params.max_tokens == 0:
                continue
            reason = self._finish_reason(slot) if ended[slot] else None
            tokens.append(
                StepToken(request.request_id, 0, int(outcome.tokens[slot]), finish_reason=reason)
            )
        return tokens

    def retire(self, slots: np.ndarray) -> list[GenerationResult]:
        """The results of the requests in ``slots``; frees their prompt blocks and slots."""
        results = []
        for slot in slots.tolist():
            request = self.slot_requests[slot]
            sample = SampleOutput(0, self._token_ids(slot), self._finish_reason(slot))
            results.append(GenerationResult(request.request_id, request.prompt_ids, [sample]))
            self.encoder_blocks.free(request.encoder_blocks)
            self.slot_requests[slot] = None
        self.live[slots] = False
        self.slot_request_ids[slots] = -1
        self.slot_samples[slots] = False
        return results

    def stall_reason(self) -> str:
        """Why nothing can make progress, for the error ``Engine.step`` raises."""
        config = self.config
        parts = []
        if self.waiting:
            needed = config.encoder_blocks_for(len(self.waiting[0].prompt_ids))
            parts.append(
                f"{len(self.waiting)} request(s) waiting (the next needs {needed} encoder "
                f"blocks, {self.encoder_blocks.num_free} of {config.num_encoder_blocks} free; "
                f"{int((~self.live).sum())} of {config.max_batch} slots free)"
            )
        if self.preempted.any():
            parts.append(
                f"{int(self.preempted.sum())} preempted sequence(s) not recovered "
                f"(decoder pool of {config.num_decoder_blocks} blocks)"
            )
        return (
            "Engine.step: no progress: nothing is running, nothing can be admitted and "
            "nothing was recovered: " + "; ".join(parts)
        )

    def prompt_block_problems(self, tables: np.ndarray, encoder_lens: np.ndarray) -> list[str]:
        """How the device's block tables disagree with the prompt blocks handed out:
        each live slot's encoder columns hold its blocks, free slots hold none, and the
        allocator's blocks are exactly the live slots'."""
        problems = []
        held: set[int] = set()
        for slot in np.flatnonzero(self.live).tolist():
            expected = self.slot_requests[slot].encoder_blocks
            found = tables[slot, : encoder_lens[slot]].tolist()
            if found != expected:
                problems.append(
                    f"slot {slot}: encoder columns hold {found}, "
                    f"expected its prompt blocks {expected}"
                )
            held.update(expected)
        for slot in np.flatnonzero(~self.live).tolist():
            if (tables[slot] != -1).any():
                problems.append(f"free slot {slot} still holds blocks {tables[slot].tolist()}")
        if held != set(self.encoder_blocks.allocated):
            problems.append(
                f"allocated prompt blocks {sorted(self.encoder_blocks.allocated)} differ from "
                f"those the live slots hold {sorted(held)}"
            )
        return problems
