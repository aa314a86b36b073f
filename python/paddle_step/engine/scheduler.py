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
from ..sampling_params import pack_token_mask, token_mask_words
from .block_allocator import EncoderBlockAllocator
from .outputs import (
    FINISH_ABORT,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationResult,
    SampleOutput,
    StepToken,
    TokenLogprobs,
)
from .prefix_cache import cacheable_blocks, prompt_block_hashes
from .request import Request

if TYPE_CHECKING:
    from .outputs import StepOutcome

__all__ = ["SamplingPlan", "Scheduler", "StepLogprobs"]

logger = logging.getLogger(__name__)


class AbortedRequest(NamedTuple):
    """What ``Scheduler.abort`` took out: a slot one of its samples ran in (None: it was
    waiting)."""

    slot: int | None
    was_preempted: bool


# Columns of Scheduler.slot_controls: the sampling controls a slot's request uses.
PENALTIES, REPETITION, LOGIT_BIAS, MIN_TOKENS, TOP_K, MIN_P, CONSTRAINT = range(7)


def _controls_of(request: Request) -> list[bool]:
    params = request.params
    return [
        bool(params.presence_penalty or params.frequency_penalty),
        params.repetition_penalty != 1.0,
        bool(params.logit_bias),
        params.min_tokens > 0,
        params.top_k > 0,
        params.min_p > 0.0,
        params.constraint is not None,
    ]


@dataclass
class SamplingPlan:
    """What this step's sampling needs, from the running slots' requests: which controls
    some slot uses (the others are skipped), the widest ``logit_bias``, the allowed tokens
    of constrained slots packed as ``pack_token_mask`` packs them ([B, ceil(V / 32)]
    int32, all bits set elsewhere), and the most logprob alternatives a slot asks for
    (None: no slot needs logprobs)."""

    penalties: bool = False
    repetition: bool = False
    bias_width: int = 0
    min_tokens: bool = False
    top_k: bool = False
    min_p: bool = False
    allowed_bits: np.ndarray | None = None
    logprobs_top: int | None = None

    @property
    def is_plain(self) -> bool:
        """Nothing but temperature and top_p: the sampler's fast path."""
        return not (
            self.penalties or self.repetition or self.bias_width or self.min_tokens
            or self.top_k or self.min_p or self.allowed_bits is not None
            or self.logprobs_top is not None
        )  # fmt: skip


class StepLogprobs(NamedTuple):
    """A step's logprobs on the host, per slot: of the sampled token [B], and the top
    alternatives' ids and logprobs [B, k] (None when no slot asked for any)."""

    chosen: np.ndarray
    top_ids: np.ndarray | None
    top_values: np.ndarray | None


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

    Each slot holds one sample of a request (a request with ``n`` or ``best_of`` > 1 has
    that many samples, queued one after the other). Slot mirrors: ``live`` (holds a
    sample, running or preempted), ``running`` (not ``stop_flags``), ``preempted``
    (``is_block_step``), ``step_idx``, the slot's request id, its sampling key, whether it
    samples (temperature > 0), the sampling controls it uses and the logprobs it needs;
    ``generated[b, k]`` is the k-th token (1-based, like ``pre_ids``) of slot b's sample,
    ``token_logprobs[b]`` their logprobs when asked.

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
        self.slot_controls = np.zeros((batch, CONSTRAINT + 1), dtype=bool)
        self.slot_bias_width = np.zeros(batch, dtype=np.int64)
        self.slot_logprobs_top = np.full(batch, -1, dtype=np.int64)  # -1: none
        self.slot_sample_index = np.zeros(batch, dtype=np.int64)
        # It uses a sampling control or needs logprobs (sampling_plan looks closer).
        self.slot_uses_more = np.zeros(batch, dtype=bool)
        # Its streamed tokens need more than (request id, index, token): logprobs, a
        # constraint that may end it, or max_tokens 0 (nothing streamed).
        self.slot_special = np.zeros(batch, dtype=bool)
        self.generated = np.full((batch, config.max_model_len), -1, dtype=np.int64)
        self.token_logprobs: list[list[TokenLogprobs]] = [[] for _ in range(batch)]
        # Finished samples of requests with samples still running.
        self._finished_samples: dict[int, list[SampleOutput]] = {}
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
            if request.params.prompt_logprobs is not None and request.index == 0:
                hits = []  # its prompt logprobs need the logits of every position
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
            self._set_slot_params(slot, request)
            self.computed[slot] = request.num_cached_tokens
            self.prefill_end[slot] = prompt_len
            plan.admitted.append(slot)
            plan.chunks.append(self._plan_chunk(slot, budget))
            budget -= len(plan.chunks[-1].token_ids)

    def _set_slot_params(self, slot: int, request: Request) -> None:
        """The slot mirrors of ``request``'s sampling parameters."""
        params = request.params
        self.slot_samples[slot] = not params.greedy
        self.slot_controls[slot] = _controls_of(request)
        self.slot_bias_width[slot] = len(params.logit_bias)
        self.slot_sample_index[slot] = request.index
        top = request.logprobs_top
        self.slot_special[slot] = (
            top is not None or params.constraint is not None or params.max_tokens == 0
        )
        self.slot_logprobs_top[slot] = -1 if top is None else top
        self.slot_uses_more[slot] = self.slot_controls[slot].any() or top is not None
        self.token_logprobs[slot] = []

    def sampling_plan(self, vocab_size: int, unsampled: list[int]) -> SamplingPlan:
        """What sampling needs this step, from the slots that sample in it (running and
        not in the middle of their prompt: ``unsampled``)."""
        running = self.running
        if unsampled:
            running = running.copy()
            running[unsampled] = False
        if not (self.slot_uses_more & running).any():  # the usual batch: cheap to tell
            return SamplingPlan()
        used = self.slot_controls[running].any(axis=0)
        plan = SamplingPlan(
            penalties=bool(used[PENALTIES]),
            repetition=bool(used[REPETITION]),
            bias_width=int(self.slot_bias_width[running].max(initial=0)),
            min_tokens=bool(used[MIN_TOKENS]),
            top_k=bool(used[TOP_K]),
            min_p=bool(used[MIN_P]),
        )
        tops = self.slot_logprobs_top[running]
        if (tops >= 0).any():
            plan.logprobs_top = int(tops.max())
        if used[CONSTRAINT]:
            plan.allowed_bits = self._allowed_bits(running, vocab_size)
        return plan

    def _allowed_bits(self, running: np.ndarray, vocab_size: int) -> np.ndarray:
        """The running constrained slots' next allowed tokens, packed ([B, words], all
        bits set in the other rows): a constraint's own bitmask when it has one; the bool
        masks of the others, packed together."""
        bits = np.full((self.config.max_batch, token_mask_words(vocab_size)), -1, np.int32)
        masked, masks = [], []
        for slot in np.flatnonzero(running & self.slot_controls[:, CONSTRAINT]).tolist():
            constraint = self.slot_requests[slot].params.constraint
            bitmask = getattr(constraint, "allowed_bitmask", None)
            if bitmask is not None:
                words = bitmask(vocab_size)
                if words is not None:
                    bits[slot] = words
            elif (mask := constraint.allowed_tokens(vocab_size)) is not None:
                masked.append(slot)
                masks.append(mask)
        if masked:
            bits[masked] = pack_token_mask(np.stack(masks))
        return bits

    def slot_of(self, request_id: int) -> int | None:
        """The slot holding ``request_id``, or None."""
        slots = np.flatnonzero(self.live & (self.slot_request_ids == request_id))
        return int(slots[0]) if slots.size else None

    def abort(self, request_id: int) -> list[AbortedRequest]:
        """Takes ``request_id`` out of the schedule; empty if it is not unfinished here.

        A waiting request leaves the queue (``slot`` None). Each of its samples in a slot
        is marked aborted and stops running; it is retired after the next step, when
        ``step_paddle`` has freed its decoder blocks. ``was_preempted``: it sat in
        ``step_block_list``, which it has now left without being recovered.
        """
        aborted = []
        waiting = [r for r in self.waiting if r.request_id == request_id]
        for request in waiting:
            self.waiting.remove(request)
            aborted.append(AbortedRequest(slot=None, was_preempted=False))
        if waiting and self.slot_of(request_id) is not None:
            # Samples already in slots finish as aborted; those never admitted too.
            self._finished_samples.setdefault(request_id, []).extend(
                SampleOutput(r.index, [], FINISH_ABORT) for r in waiting
            )
        for slot in np.flatnonzero(self.live & (self.slot_request_ids == request_id)).tolist():
            if self.slot_requests[slot].aborted or not (self.running[slot] or self.preempted[slot]):
                continue  # already stopping
            self.slot_requests[slot].aborted = True
            aborted.append(AbortedRequest(slot=slot, was_preempted=bool(self.preempted[slot])))
            self.running[slot] = False
            self.preempted[slot] = False
        return aborted

    def record(self, outcome: StepOutcome, logprobs: StepLogprobs | None = None) -> None:
        """Takes in a step's results: tokens generated (and their logprobs), slot flags,
        step_idx, preemptions and recoveries.

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
        if logprobs is None:
            return
        for slot in rows[self.slot_logprobs_top[rows] >= 0].tolist():
            top = int(self.slot_logprobs_top[slot])
            pairs = []
            if top:
                pairs = list(
                    zip(
                        logprobs.top_ids[slot, :top].tolist(),
                        logprobs.top_values[slot, :top].tolist(),
                    )
                )
            self.token_logprobs[slot].append(
                TokenLogprobs(int(outcome.tokens[slot]), float(logprobs.chosen[slot]), pairs)
            )

    def advance_constraints(self, rows: np.ndarray, outcome: StepOutcome) -> None:
        """Reports each constrained slot's sampled token to its constraint, and notes the
        constraints now finished (``take_constraint_stops`` stops their slots)."""
        if not self.slot_controls[:, CONSTRAINT].any():
            return
        for slot in rows[self.slot_controls[rows, CONSTRAINT]].tolist():
            request = self.slot_requests[slot]
            constraint = request.params.constraint
            constraint.accept_token(int(outcome.tokens[slot]))
            if constraint.is_finished():
                request.constraint_finished = True

    def take_constraint_stops(self) -> list[AbortedRequest]:
        """The slots still going whose constraint finished in the last step, now taken out
        of the running like an abort (between steps, so ``step_paddle`` frees their decoder
        blocks before they retire); they finish with reason ``"stop"``."""
        stops = []
        if not self.slot_controls[:, CONSTRAINT].any():
            return stops
        going = (self.running | self.preempted) & self.slot_controls[:, CONSTRAINT]
        for slot in np.flatnonzero(going).tolist():
            if self.slot_requests[slot].constraint_finished:
                stops.append(AbortedRequest(slot=slot, was_preempted=bool(self.preempted[slot])))
                self.running[slot] = False
                self.preempted[slot] = False
        return stops

    def finished_slots(self) -> np.ndarray:
        """Slots whose sample stopped for good (stopped and not preempted)."""
        return np.flatnonzero(self.live & ~self.running & ~self.preempted)

    def _token_ids(self, slot: int) -> list[int]:
        """The tokens slot ``slot``'s sample keeps (none for ``max_tokens`` 0, whose
        prefill samples one that is dropped)."""
        request = self.slot_requests[slot]
        kept = min(int(self.step_idx[slot]), request.params.max_tokens)
        return self.generated[slot, 1 : kept + 1].tolist()

    def _finish_reason(self, slot: int) -> str:
        """Why slot ``slot``'s sample stopped (call once it has)."""
        request = self.slot_requests[slot]
        last = int(self.generated[slot, self.step_idx[slot]]) if self.step_idx[slot] else -1
        if request.aborted:
            return FINISH_ABORT
        if not request.params.max_tokens:
            return FINISH_LENGTH
        if last in request.eos_token_ids:
            return FINISH_EOS
        if last in request.stop_token_ids or request.constraint_finished:
            return FINISH_STOP
        return FINISH_LENGTH

    def step_tokens(self, rows: np.ndarray, outcome: StepOutcome) -> list[StepToken]:
        """The tokens a step generated in slots ``rows`` (after ``record`` and
        ``advance_constraints``), each with its sample's finish reason when it ended it."""
        ended = ~self.running & ~self.preempted
        tokens = [
            StepToken(request_id, index, token)
            for request_id, index, token in zip(
                self.slot_request_ids[rows].tolist(),
                self.slot_sample_index[rows].tolist(),
                outcome.tokens[rows].tolist(),
            )
        ]
        special = ended | self.slot_special
        if not special[rows].any():  # the usual decode step: nothing more to say
            return tokens
        kept = []
        for token, slot in zip(tokens, rows.tolist()):
            if special[slot]:
                request = self.slot_requests[slot]
                if request.params.max_tokens == 0:
                    continue  # the token a prompt-logprobs prefill samples is dropped
                if request.logprobs_top is not None:
                    token.logprobs = self.token_logprobs[slot][-1]
                if ended[slot] or request.constraint_finished:
                    token.finish_reason = self._finish_reason(slot)
            kept.append(token)
        return kept

    def _sample_output(self, slot: int) -> SampleOutput:
        request = self.slot_requests[slot]
        params = request.params
        tokens = self._token_ids(slot)
        entries = self.token_logprobs[slot][: len(tokens)]
        logprobs = entries if params.logprobs is not None else None
        cumulative = None
        if request.logprobs_top is not None:
            cumulative = float(sum(entry.logprob for entry in entries))
        return SampleOutput(request.index, tokens, self._finish_reason(slot), logprobs, cumulative)

    def retire(self, slots: np.ndarray) -> list[GenerationResult]:
        """Frees the slots in ``slots`` and their prompt blocks; returns the results of the
        requests whose last sample this was."""
        results = []
        for slot in slots.tolist():
            request = self.slot_requests[slot]
            samples = self._finished_samples.setdefault(request.request_id, [])
            samples.append(self._sample_output(slot))
            self.encoder_blocks.free(request.encoder_blocks)
            self.slot_requests[slot] = None
            self.token_logprobs[slot] = []
            first = request.samples[0]
            if len(samples) == len(first.samples):
                del self._finished_samples[request.request_id]
                results.append(_result(first, samples))
        self.live[slots] = False
        self.computed[slots] = 0
        self.prefill_end[slots] = 0
        self.slot_request_ids[slots] = -1
        self.slot_samples[slots] = False
        self.slot_controls[slots] = False
        self.slot_logprobs_top[slots] = -1
        self.slot_special[slots] = False
        self.slot_uses_more[slots] = False
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


def _result(request: Request, samples: list[SampleOutput]) -> GenerationResult:
    """A request's result from all its samples: with ``best_of`` > ``n``, the ``n`` with
    the highest cumulative logprob (re-indexed 0 .. n-1), else all in index order."""
    params = request.params
    if len(samples) > params.n:
        samples = sorted(samples, key=lambda sample: -sample.cumulative_logprob)[: params.n]
        for index, sample in enumerate(samples):
            sample.index = index
    else:
        samples = sorted(samples, key=lambda sample: sample.index)
    return GenerationResult(request.request_id, request.prompt_ids, samples,
                            request.prompt_logprobs,
                            cached_tokens=request.num_cached_tokens)  # fmt: skip
