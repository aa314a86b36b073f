"""The host's side of continuous batching: the waiting queue, admission into free slots
with their prompt blocks (shared ones from the prefix cache included), each step's plan of
prefill chunks under the token budget, retirement of finished requests, and host mirrors
of the slot flags that the device state holds (refreshed once a step by ``record``).

Decoder blocks, preemption and recovery are ``step_paddle``'s work on the device; this
class follows them through the mirrors, and turns a recovered slot's re-prefill into
chunks that start after the K/V its prompt blocks still hold.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..config import EngineConfig
from .block_allocator import EncoderBlockAllocator
from .outputs import FINISH_ABORT, FINISH_EOS, FINISH_LENGTH, GenerationResult
from .prefix_cache import cacheable_blocks, prompt_block_hashes
from .request import Request

if TYPE_CHECKING:
    from .outputs import StepOutcome

__all__ = ["Scheduler"]

logger = logging.getLogger(__name__)


class AbortedRequest(NamedTuple):
    """What ``Scheduler.abort`` took out: the slot it ran in (None: it was waiting)."""

    slot: int | None
    was_preempted: bool


class PrefillChunk(NamedTuple):
    """The prompt (or re-prefill) tokens a slot computes this step, from position
    ``start``; empty when the token budget left none for it. ``last``: they end its
    prefill, so the slot samples its next token this step."""

    slot: int
    start: int
    token_ids: list[int]
    last: bool


@dataclass
class StepPlan:
    """What a step runs: the slots admitted before it and every prefill chunk (decode rows
    are the running slots that have none)."""

    admitted: list[int] = field(default_factory=list)
    chunks: list[PrefillChunk] = field(default_factory=list)
    num_decode_rows: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_decode_rows + sum(len(chunk.token_ids) for chunk in self.chunks)

    @property
    def unsampled_slots(self) -> list[int]:
        """Slots that run or wait mid-prefill this step: they sample nothing."""
        return [chunk.slot for chunk in self.chunks if not chunk.last]


class Scheduler:
    """Which request is in which slot, and which requests wait.

    Slot mirrors: ``live`` (holds a request, running or preempted), ``running`` (not
    ``stop_flags``), ``preempted`` (``is_block_step``), ``step_idx``, the slot's request
    id, its sampling key and whether it samples (temperature > 0); ``generated[b, k]`` is
    the k-th token (1-based, like ``pre_ids``) of slot b's request.

    Host-only per slot: ``computed`` (positions whose K/V the cache holds) and
    ``prefill_end`` (positions to compute before the slot samples again: its prompt, or
    prompt plus generated tokens after a recovery). A slot with ``computed <
    prefill_end`` is prefilling; otherwise it decodes one token a step.

    ``prompt_tokens_queried`` / ``prompt_tokens_hit`` count the prompt tokens admitted and
    those the prefix cache supplied.
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
        self.computed = np.zeros(batch, dtype=np.int64)
        self.prefill_end = np.zeros(batch, dtype=np.int64)
        self.prompt_tokens_queried = 0
        self.prompt_tokens_hit = 0
        self._logged_prompt_region_full = False

    def _note_prompt_region_full(self, request: Request, fresh: int, free: int) -> None:
        """Logs, once per scheduler, that a request waits for ``fresh`` prompt blocks
        (those the prefix cache does not supply; ``free`` are available) while a slot is
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
            fresh,
            config.num_encoder_blocks,
            config.num_kv_blocks,
            config.decoder_pool_ratio,
            free,
        )

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.live.any())

    def any_sampling(self) -> bool:
        """Whether a running slot samples (so the step needs random draws)."""
        return bool((self.slot_samples & self.running).any())

    def schedule(self) -> StepPlan:
        """Plans the next step: every decoding slot runs one token, then prefilling slots
        (oldest request first) and newly admitted ones share what is left of
        ``max_num_batched_tokens``. Advances ``computed`` by what the step will compute
        and caches the prompt blocks it completes."""
        config = self.config
        budget = config.max_num_batched_tokens or sys.maxsize
        active = self.live & self.running
        prefilling = active & (self.computed < self.prefill_end)
        decoding = active & ~prefilling
        plan = StepPlan(num_decode_rows=int(decoding.sum()))
        self.computed[decoding] += 1
        budget -= plan.num_decode_rows
        slots = np.flatnonzero(prefilling).tolist()
        for slot in sorted(slots, key=lambda b: self.slot_request_ids[b]):
            plan.chunks.append(self._plan_chunk(slot, budget))
            budget -= len(plan.chunks[-1].token_ids)
        self._admit(plan, budget)
        return plan

    def _plan_chunk(self, slot: int, budget: int) -> PrefillChunk:
        """The next ``budget`` tokens (at most) of ``slot``'s prefill."""
        start, end = int(self.computed[slot]), int(self.prefill_end[slot])
        stop = start + min(end - start, max(budget, 0))
        request = self.slot_requests[slot]
        prompt_len = len(request.prompt_ids)
        tokens = request.prompt_ids[start:stop]
        if stop > prompt_len:  # a re-prefill also runs the generated tokens but the last
            first = max(start, prompt_len) - prompt_len + 1
            tokens += self.generated[slot, first : stop - prompt_len + 1].tolist()
        self.computed[slot] = stop
        # The blocks this step fills become findable now: a prompt admitted later in this
        # step reads them after the forward writes them (each layer writes before it reads).
        block_size = self.config.block_size
        while (
            request.blocks_cached < len(request.block_hashes)
            and (request.blocks_cached + 1) * block_size <= stop
        ):
            index = request.blocks_cached
            self.encoder_blocks.cache(request.encoder_blocks[index], request.block_hashes[index])
            request.blocks_cached += 1
        return PrefillChunk(slot, start, tokens, stop == end)

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """Moves waiting requests (FIFO) into free slots while their prompt blocks are
        available and the budget lasts, each with the longest cached prefix of its prompt."""
        # Preempted sequences come back first: admitting more would compete with them
        # for the decoder pool and could keep them out indefinitely.
        if not self.waiting or self.preempted.any():
            return
        config, allocator = self.config, self.encoder_blocks
        for slot in np.flatnonzero(~self.live).tolist():
            if not self.waiting or budget <= 0:
                break
            request = self.waiting[0]
            prompt_len = len(request.prompt_ids)
            if config.enable_prefix_caching and not request.block_hashes:
                request.block_hashes = prompt_block_hashes(request.prompt_ids, config.block_size)
            hits = allocator.cached_prefix(
                request.block_hashes[: cacheable_blocks(prompt_len, config.block_size)]
            )
            fresh = config.encoder_blocks_for(prompt_len) - len(hits)
            reclaimed = sum(allocator.ref_count(block) == 0 for block in hits)
            if allocator.num_free - reclaimed < fresh:
                # The head of the queue waits for prompt blocks; FIFO keeps order.
                self._note_prompt_region_full(request, fresh, allocator.num_free - reclaimed)
                break
            allocator.share(hits)
            self.waiting.popleft()
            request.encoder_blocks = hits + allocator.allocate(fresh)
            request.blocks_cached = len(hits)
            request.num_cached_tokens = len(hits) * config.block_size
            self.prompt_tokens_queried += prompt_len
            self.prompt_tokens_hit += request.num_cached_tokens
            self.slot_requests[slot] = request
            self.live[slot] = self.running[slot] = True
            self.step_idx[slot] = 0
            self.slot_request_ids[slot] = request.request_id
            self.slot_sampling_keys[slot] = request.sampling_key
            self.slot_samples[slot] = request.temperature > 0
            self.computed[slot] = request.num_cached_tokens
            self.prefill_end[slot] = prompt_len
            plan.admitted.append(slot)
            plan.chunks.append(self._plan_chunk(slot, budget))
            budget -= len(plan.chunks[-1].token_ids)

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
        """Takes in a step's results: tokens generated, slot flags, step_idx, preemptions
        and recoveries.

        A preempted slot lost the K/V in its decoder blocks; its prompt blocks, which it
        keeps, still hold theirs. A recovered one (``step_paddle`` set it up to re-prefill
        everything) continues from there instead.
        """
        rows = np.flatnonzero(outcome.ran)
        self.generated[rows, outcome.step_idx[rows]] = outcome.tokens[rows]
        self.running = ~outcome.stopped
        self.step_idx = outcome.step_idx
        # A slot may be preempted and recovered by the same call, so both are looked at.
        lost = np.flatnonzero(outcome.preempted & ~self.preempted).tolist()
        self.preempted = outcome.preempted
        for slot in lost + outcome.recovered_slots.tolist():
            kept = len(self.slot_requests[slot].encoder_blocks) * self.config.block_size
            self.computed[slot] = min(self.computed[slot], kept)
        for slot in outcome.recovered_slots.tolist():
            prompt_len = len(self.slot_requests[slot].prompt_ids)
            self.prefill_end[slot] = prompt_len + self.step_idx[slot]

    def finished_slots(self) -> np.ndarray:
        """Slots whose request stopped for good (stopped and not preempted)."""
        return np.flatnonzero(self.live & ~self.running & ~self.preempted)

    def retire(self, slots: np.ndarray) -> list[GenerationResult]:
        """The results of the requests in ``slots``; frees their prompt blocks and slots."""
        results = []
        for slot in slots.tolist():
            request = self.slot_requests[slot]
            token_ids = self.generated[slot, 1 : self.step_idx[slot] + 1].tolist()
            if request.aborted:
                reason = FINISH_ABORT
            elif token_ids and token_ids[-1] in request.eos_token_ids:
                reason = FINISH_EOS
            else:
                reason = FINISH_LENGTH
            results.append(
                GenerationResult(
                    request.request_id,
                    request.prompt_ids,
                    token_ids,
                    reason,
                    cached_tokens=request.num_cached_tokens,
                )
            )
            self.encoder_blocks.free(request.encoder_blocks)
            self.slot_requests[slot] = None
        self.live[slots] = False
        self.computed[slots] = 0
        self.prefill_end[slots] = 0
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
        each live slot's encoder columns hold its blocks, free slots hold none, every
        held block's reference count is the number of live slots holding it, and the
        allocator's own books balance."""
        problems = []
        holders: dict[int, int] = {}
        for slot in np.flatnonzero(self.live).tolist():
            expected = self.slot_requests[slot].encoder_blocks
            found = tables[slot, : encoder_lens[slot]].tolist()
            if found != expected:
                problems.append(
                    f"slot {slot}: encoder columns hold {found}, "
                    f"expected its prompt blocks {expected}"
                )
            for block in expected:
                holders[block] = holders.get(block, 0) + 1
        for slot in np.flatnonzero(~self.live).tolist():
            if (tables[slot] != -1).any():
                problems.append(f"free slot {slot} still holds blocks {tables[slot].tolist()}")
        allocator = self.encoder_blocks
        if set(holders) != set(allocator.allocated):
            problems.append(
                f"allocated prompt blocks {sorted(allocator.allocated)} differ from "
                f"those the live slots hold {sorted(holders)}"
            )
        for block, count in sorted(holders.items()):
            if allocator.ref_count(block) != count:
                problems.append(
                    f"prompt block {block}: reference count {allocator.ref_count(block)}, "
                    f"expected {count} (the live slots holding it)"
                )
        problems.extend(allocator.problems())
        return problems
