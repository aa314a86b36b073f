"""The host's side of continuous batching: the waiting queue, admission into free slots
with their prompt blocks, retirement of finished requests, and host mirrors of the slot
flags that the device state holds (refreshed once a step by ``record``).

Decoder blocks, preemption and recovery are ``step_paddle``'s work on the device; this
class only follows them through the mirrors.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
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
    TokenLogprobs,
)
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
    some slot uses (the others are skipped), the widest ``logit_bias``, the allowed-token
    mask of constrained slots ([B, V], all True elsewhere), and the most logprob
    alternatives a slot asks for (None: no slot needs logprobs)."""

    penalties: bool = False
    repetition: bool = False
    bias_width: int = 0
    min_tokens: bool = False
    top_k: bool = False
    min_p: bool = False
    allowed: np.ndarray | None = None
    logprobs_top: int | None = None

    @property
    def is_plain(self) -> bool:
        """Nothing but temperature and top_p: the sampler's fast path."""
        return not (
            self.penalties or self.repetition or self.bias_width or self.min_tokens
            or self.top_k or self.min_p or self.allowed is not None
            or self.logprobs_top is not None
        )  # fmt: skip


class StepLogprobs(NamedTuple):
    """A step's logprobs on the host, per slot: of the sampled token [B], and the top
    alternatives' ids and logprobs [B, k] (None when no slot asked for any)."""

    chosen: np.ndarray
    top_ids: np.ndarray | None
    top_values: np.ndarray | None


class Scheduler:
    """Which request is in which slot, and which requests wait.

    Each slot holds one sample of a request (a request with ``n`` or ``best_of`` > 1
    takes that many slots, admitted together). Slot mirrors: ``live`` (holds a sample,
    running or preempted), ``running`` (not ``stop_flags``), ``preempted``
    (``is_block_step``), ``step_idx``, the slot's request id, its sampling key, whether it
    samples (temperature > 0), the sampling controls it uses and the logprobs it needs;
    ``generated[b, k]`` is the k-th token (1-based, like ``pre_ids``) of slot b's sample,
    ``token_logprobs[b]`` their logprobs when asked.
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
        # Samples admitted this step that copy their first sample's prefill: slot -> the
        # slot of that first sample (see docs/serving.md, "n and best_of").
        self.fork_sources: dict[int, int] = {}
        # Finished samples of requests with samples still running.
        self._finished_samples: dict[int, list[SampleOutput]] = {}
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
        """Moves waiting requests (FIFO) into free slots, each with all its samples, while
        their prompt blocks are available; returns the slots they took. Sets
        ``fork_sources`` for the samples after the first."""
        self.fork_sources = {}
        # Preempted sequences come back first: admitting more would compete with them
        # for the decoder pool and could keep them out indefinitely.
        if not self.waiting or self.preempted.any():
            return []
        free = np.flatnonzero(~self.live).tolist()
        slots: list[int] = []
        while self.waiting:
            request = self.waiting[0]
            samples = request.samples
            if len(samples) > len(free) - len(slots):
                break
            needed = self.config.encoder_blocks_for(len(request.prompt_ids))
            if self.encoder_blocks.num_free < needed * len(samples):
                # The head of the queue waits for prompt blocks; FIFO keeps order.
                self._note_prompt_region_full(request)
                break
            self.waiting.popleft()
            first = free[len(slots)]
            for sample in samples:
                slot = free[len(slots)]
                sample.encoder_blocks = self.encoder_blocks.allocate(needed)
                self.slot_requests[slot] = sample
                if sample is not request:
                    self.fork_sources[slot] = first
                slots.append(slot)
        if slots:
            requests = [self.slot_requests[slot] for slot in slots]
            self.live[slots] = True
            self.running[slots] = True
            self.step_idx[slots] = 0
            self.slot_request_ids[slots] = [r.request_id for r in requests]
            self.slot_sampling_keys[slots] = [r.sampling_key for r in requests]
            self.slot_samples[slots] = [not r.params.greedy for r in requests]
            self.slot_controls[slots] = [_controls_of(r) for r in requests]
            self.slot_bias_width[slots] = [len(r.params.logit_bias) for r in requests]
            self.slot_sample_index[slots] = [r.index for r in requests]
            self.slot_special[slots] = [
                r.params.logprobs is not None
                or r.params.constraint is not None
                or r.params.max_tokens == 0
                for r in requests
            ]
            self.slot_logprobs_top[slots] = [
                -1 if r.logprobs_top is None else r.logprobs_top for r in requests
            ]
            self.slot_uses_more[slots] = self.slot_controls[slots].any(axis=1) | (
                self.slot_logprobs_top[slots] >= 0
            )
            for slot in slots:
                self.token_logprobs[slot] = []
        return slots

    def sampling_plan(self, vocab_size: int) -> SamplingPlan:
        """What sampling needs this step, from the slots that run it."""
        running = self.running
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
            plan.allowed = np.ones((self.config.max_batch, vocab_size), dtype=bool)
            for slot in np.flatnonzero(running & self.slot_controls[:, CONSTRAINT]).tolist():
                mask = self.slot_requests[slot].params.constraint.allowed_tokens(vocab_size)
                if mask is not None:
                    plan.allowed[slot] = mask
        return plan

    def slot_of(self, request_id: int) -> int | None:
        """The slot holding ``request_id`` (its first live sample), or None."""
        slots = np.flatnonzero(self.live & (self.slot_request_ids == request_id))
        return int(slots[0]) if slots.size else None

    def abort(self, request_id: int) -> list[AbortedRequest]:
        """Takes ``request_id`` out of the schedule; empty if it is not unfinished here.

        A waiting request leaves the queue (``slot`` None). Each of its samples in a slot
        is marked aborted and stops running; it is retired after the next step, when
        ``step_paddle`` has freed its decoder blocks. ``was_preempted``: it sat in
        ``step_block_list``, which it has now left without being recovered.
        """
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return [AbortedRequest(slot=None, was_preempted=False)]
        aborted = []
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
        step_idx."""
        rows = np.flatnonzero(outcome.ran)
        self.generated[rows, outcome.step_idx[rows]] = outcome.tokens[rows]
        self.running = ~outcome.stopped
        self.preempted = outcome.preempted
        self.step_idx = outcome.step_idx
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
                if request.params.logprobs is not None:
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
                            request.prompt_logprobs)  # fmt: skip
