"""A continuous-batching generation engine over ``step_paddle`` and ``advance_step``.

Requests run in fixed batch slots (FastDeploy's layout, see ``state.ShareInputs``). The
``Scheduler`` keeps the host's view (queue, slots, prompt blocks, prefix cache), the
``ModelRunner`` does the device work. Each ``Engine.step``:

1. plans the step (host): one token for every decoding slot, then prefill chunks for
   prompts under way and newly admitted ones, within ``max_num_batched_tokens``; an
   admitted prompt takes the cached blocks of its longest cached prefix and prefills
   only the rest;
2. runs one forward over every running slot: prefill chunks (new, continued or
   recovered requests) and decodes (inputs prepared by the previous step's
   ``advance_step``) in one flat batch;
3. samples one token per running slot that is not in the middle of its prompt;
4. updates the slot state on the device (lengths, ``step_idx``, ``pre_ids``, stop checks),
   as FastDeploy's ``update_inputs`` does;
5. ``step_paddle``: frees finished slots' decoder blocks, gives every decoding slot the
   block it writes next, preempts when the pool runs short, recovers preempted slots;
6. ``advance_step``: the next decode token, position and KV slot of every decoding slot;
7. copies the few per-slot values the host needs back in one transfer, then retires
   finished requests (their prompt blocks and slots become free).

A preempted request is recomputed by a re-prefill of its prompt and generated tokens when
the op recovers it, so its output is the same as if it had never been preempted. Its
prompt blocks stay with it while it is preempted, so the re-prefill starts after the
positions they hold (only the decoder blocks' K/V was lost).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence

import numpy as np
import paddle

from ..config import EngineConfig
from ..host_memory import keep_freed_memory
from ..layers import cpu_sampling, prefetch_distance
from ..layers.sampler import sample_key, sampling_key, token_logprobs_and_ranks
from ..models.llama import LlamaForCausalLM
from ..sampling_params import SamplingParams
from ..spec.check_state import StateError
from ..tokenizer.byte import ByteTokenizer
from .block_allocator import EncoderBlockAllocator
from .cpu_threads import default_threads, set_compute_threads
from .model_runner import ModelRunner
from .outputs import GenerationResult, GenerationStats, StepOutcome, StepToken, TokenLogprobs
from .request import MAX_EOS_IDS, Request, check_params_type
from .scheduler import AbortedRequest, Scheduler, StepLogprobs
from .slot_state import ShareInputs

__all__ = ["Engine", "GenerationResult", "GenerationStats", "SamplingParams"]


class Engine:
    """Generates from a ``LlamaForCausalLM`` with a paged KV cache and continuous batching.

    Args:
        model: the model; its parameters' place is where the state and cache live.
        config: batch slots, model length and KV-block budget.
        tokenizer: gives the default eos token (``tokenizer.eos_id``) when
            ``eos_token_ids`` is not given.
        eos_token_ids: the ids that end a request unless it says otherwise (a checkpoint's
            ``eos_token_id`` list); default: the tokenizer's eos, or none.
        seed: seeds temperature sampling of requests that bring no seed of their own
            (draws are keyed by request id and token index).
        check_state: debug mode: validate the slot state (SPEC's invariants via
            ``check_state``, and prompt-block conservation) after every step.
        after_step: called with the engine at the end of every step (e.g.
            ``tensor_parallel.RankChecker``, which compares the ranks' states).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: EngineConfig,
        *,
        tokenizer: ByteTokenizer | None = None,
        eos_token_ids: Sequence[int] | None = None,
        seed: int = 0,
        check_state: bool = False,
        after_step: Callable[[Engine], object] | None = None,
    ) -> None:
        if not isinstance(model, LlamaForCausalLM):
            raise TypeError(
                "Engine: argument 'model': expected a LlamaForCausalLM (load_checkpoint(...)"
                f".model), got {type(model).__name__}"
            )
        if not isinstance(config, EngineConfig):
            raise TypeError(
                f"Engine: argument 'config': expected an EngineConfig, got {type(config).__name__}"
            )
        self.model = model
        self.config = config
        # Every core by default (paddle's import leaves one), shared among TP ranks.
        self.threads = config.threads or default_threads(paddle.distributed.get_world_size())
        set_compute_threads(self.threads)
        prefetch_distance.choose_for_model(model)
        self.seed = seed
        self.check_state = check_state
        self.after_step = after_step
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_id] if tokenizer is not None else []
        if isinstance(eos_token_ids, numbers.Integral):  # one id, as config.json may say
            eos_token_ids = [eos_token_ids]
        vocab_size = model.config.vocab_size
        ids = list(eos_token_ids)
        if (
            any(isinstance(token, bool) or not isinstance(token, numbers.Integral) for token in ids)
            or any(not 0 <= token < vocab_size for token in ids)
            or len(ids) > MAX_EOS_IDS
        ):
            raise ValueError(  # one past the vocabulary would never end a request
                f"Engine: argument 'eos_token_ids': expected at most {MAX_EOS_IDS} ids in "
                f"[0, {vocab_size}), got {eos_token_ids!r}"
            )
        self.eos_token_ids = tuple(int(token) for token in ids)
        # The runner first: it refuses a cache or slot state past the memory, naming the
        # sizes, before the scheduler's block lists could fail without a word.
        self.runner = ModelRunner(model, config)
        self.scheduler = Scheduler(config)
        if self.runner.state.place.is_cpu_place():
            keep_freed_memory()  # a step's buffers reuse the last step's pages
        self.stats = GenerationStats()
        # Every token the last step generated, for streaming; and the prompt logprobs of
        # the requests whose prompt it finished, when they asked, by request id.
        self.last_step_outputs: list[StepToken] = []
        self.last_step_prompt_logprobs: dict[int, list[TokenLogprobs]] = {}
        # (request id, prompt tokens the prefix cache supplied) of each sample the last
        # step admitted.
        self.last_step_admitted: list[tuple[int, int]] = []
        self._next_request_id = 0
        self._step_lens = 0  # preempted slots after the previous step
        self._decoder_blocks_in_use = 0

    @property
    def state(self) -> ShareInputs:
        """The slot state the ops work on."""
        return self.runner.state

    @property
    def encoder_blocks(self) -> EncoderBlockAllocator:
        """The allocator of prompt blocks."""
        return self.scheduler.encoder_blocks

    # ------------------------------------------------------------------ public API

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queues a request and returns its id (0, 1, .. in submission order).

        ``params`` (default ``SamplingParams()``) says how it decodes; its
        ``eos_token_id`` None means the engine's ``eos_token_ids``. Sampled requests draw
        their random numbers keyed by ``params.seed`` when given (the same seed gives the
        same tokens whenever the request arrives and whatever shares its batch), else by
        the engine's seed and the request id. Raises ``ValueError`` for a request the
        engine could never run (empty prompt, ids outside the vocabulary, prompt +
        max_tokens past ``max_model_len``, more prompt blocks than the encoder region
        holds).
        """
        params = SamplingParams() if params is None else params
        check_params_type(params)
        request_id = self._next_request_id
        seed = params.seed
        key = sampling_key(seed) if seed is not None else sampling_key(self.seed, request_id)
        request = Request.validated(
            request_id,
            prompt_ids,
            params,
            sampling_key=key,
            default_eos_token_ids=self.eos_token_ids,
            vocab_size=self.model.config.vocab_size,
            config=self.config,
        )
        draws = params.best_of or params.n
        request.add_samples([sample_key(key, index) for index in range(1, draws)])
        self._next_request_id += 1
        self.scheduler.waiting.extend(request.samples)
        return request.request_id

    @property
    def num_waiting(self) -> int:
        """Requests queued and not admitted yet."""
        return len(self.scheduler.waiting)

    @property
    def num_active(self) -> int:
        """Requests holding a slot (running or preempted)."""
        return int(self.scheduler.live.sum())

    @property
    def num_running(self) -> int:
        """Requests holding a slot and not preempted."""
        scheduler = self.scheduler
        return int((scheduler.live & ~scheduler.preempted).sum())

    @property
    def num_preempted(self) -> int:
        """Requests preempted and waiting for recovery."""
        return int((self.scheduler.live & self.scheduler.preempted).sum())

    @property
    def free_decoder_blocks(self) -> int:
        """Blocks in the decoder pool after the last step (``free_list_len``)."""
        return self.config.num_decoder_blocks - self._decoder_blocks_in_use

    def abort(self, request_id: int) -> bool:
        """Cancels a request; returns whether it was still unfinished.

        A waiting request just leaves the queue. Each of its samples in a slot is stopped
        on the device and finishes through the same path as any finished one: the next
        ``step`` has ``step_paddle`` free its decoder blocks, then retires it (prompt
        blocks and slot freed) with ``finish_reason`` ``"abort"``. Call between steps.
        """
        aborted = self.scheduler.abort(request_id)
        for each in aborted:
            if each.slot is not None:
                self._stop_slot(each)
        return bool(aborted)

    def _stop_slot(self, stopped: AbortedRequest) -> None:
        """Stops a slot the scheduler took out of the running (abort, constraint)."""
        self.runner.abort_slot(stopped.slot, stopped.was_preempted)
        if stopped.was_preempted:
            self._step_lens -= 1  # it left step_block_list without being recovered

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or preempted."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[GenerationResult]:
        """Runs one iteration (see the module docstring); returns the requests it finished
        and leaves the tokens it generated in ``last_step_outputs`` (and the prompt
        logprobs of requests it prefilled, when asked, in ``last_step_prompt_logprobs``).

        Raises ``RuntimeError`` if unfinished requests exist but nothing can run, be
        admitted or be recovered (a state the config checks should rule out).
        """
        started = time.perf_counter()
        scheduler, runner = self.scheduler, self.runner
        for stopped in scheduler.take_constraint_stops():
            self._stop_slot(stopped)
        plan = scheduler.schedule()
        admitted = plan.admitted
        admitted_requests = [scheduler.slot_requests[slot] for slot in admitted]
        self.last_step_admitted = [
            (r.request_id, r.num_cached_tokens) for r in admitted_requests if r.index == 0
        ]
        if admitted:
            runner.write_admitted(admitted, admitted_requests)
        if plan.chunks:
            runner.write_prefill_chunks(plan.chunks)
        ran_any = plan.num_tokens > 0
        # Rows not stopped: running (prefill chunks, possibly empty, and decodes).
        running = paddle.logical_not(runner.state.stop_flags)
        ran = running  # the rows that sample: all but those mid-prefill
        if plan.unsampled_slots:
            unsampled = np.zeros(self.config.max_batch, dtype=bool)
            unsampled[plan.unsampled_slots] = True
            ran = paddle.logical_and(
                running, paddle.to_tensor(~unsampled, place=runner.state.place)
            )
        logprobs = None
        self.last_step_prompt_logprobs = {}
        if ran_any:
            logit_rows, targets = self._prompt_logprob_rows(plan.chunks)
            logits, prompt_logits = runner.forward(logit_rows)
            if logit_rows:
                self._record_prompt_logprobs(targets, prompt_logits)
            self._finish_prompt_logprobs(plan.chunks)
            sampling = scheduler.sampling_plan(self.model.config.vocab_size, plan.unsampled_slots)
            tokens, logprobs = runner.sample(logits, self._uniforms(), sampling, self.threads)
            runner.update_inputs(running, ran, tokens)
        else:
            tokens = paddle.zeros_like(runner.state.next_tokens)
        runner.schedule_blocks()
        runner.advance_decode_inputs()

        outcome = runner.sync_host(ran, tokens)
        rows = np.flatnonzero(outcome.ran)
        scheduler.record(outcome, _on_host(logprobs))
        scheduler.advance_constraints(rows, outcome)
        self.last_step_outputs = scheduler.step_tokens(rows, outcome)
        self._count(outcome)
        finished_slots = scheduler.finished_slots()
        finished = []
        if finished_slots.size:
            finished = scheduler.retire(finished_slots)
            runner.clear_slots(finished_slots)
        if self.check_state:
            self._check_invariants()
        self.stats.steps += 1
        self.stats.elapsed += time.perf_counter() - started
        if self.after_step is not None:
            self.after_step(self)

        progressed = admitted or ran_any or outcome.recovered or finished
        if not progressed and self.has_unfinished():
            raise RuntimeError(scheduler.stall_reason())
        return finished

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_finished: Callable[[int], object] | None = None,
    ) -> list[GenerationResult]:
        """Adds ``prompts`` and steps until every request is done.

        ``params`` is one ``SamplingParams`` for all prompts or one per prompt (default:
        ``SamplingParams()``). ``on_finished(n)`` is called after each step that finished
        ``n > 0`` requests (e.g. a progress bar's ``update``). Returns the results of
        ``prompts``, in their order.
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"generate: argument 'params': expected one SamplingParams or {len(prompts)} "
                f"(one per prompt), got {len(params)}"
            )
        request_ids = [self.add_request(prompt, each) for prompt, each in zip(prompts, params)]
        results: dict[int, GenerationResult] = {}
        while self.has_unfinished():
            finished = self.step()
            results.update((result.request_id, result) for result in finished)
            if finished and on_finished is not None:
                on_finished(len(finished))
        return [results[request_id] for request_id in request_ids]

    # ------------------------------------------------------------------ step parts

    def _prompt_logprob_rows(
        self, chunks: list
    ) -> tuple[list[tuple[int, int, int]], list[tuple[Request, int, int]]]:
        """For the prompt chunks of this step whose request asks for prompt logprobs (its
        first sample only): the runner's ``(slot, back, count)`` rows, and which positions
        ``(request, first, end)`` they cover. Position p's logits give the logprob of prompt
        token p + 1; positions already recorded (a recovery's re-prefill) are skipped."""
        rows, targets = [], []
        for chunk in chunks:
            request = self.scheduler.slot_requests[chunk.slot]
            if request.index != 0 or request.params.prompt_logprobs is None:
                continue
            if request.prompt_logprobs is None:
                request.prompt_logprobs = []
            count = len(chunk.token_ids)
            first = max(chunk.start, len(request.prompt_logprobs))
            end = min(chunk.start + count, len(request.prompt_ids) - 1)
            if first < end:
                rows.append((chunk.slot, count - 1 - (first - chunk.start), end - first))
                targets.append((request, first, end))
        return rows, targets

    def _record_prompt_logprobs(
        self, targets: list[tuple[Request, int, int]], logits: paddle.Tensor
    ) -> None:
        """Appends the logprobs of ``targets``' prompt positions (from their ``logits``)
        to their requests' ``prompt_logprobs``."""
        top = max(request.params.prompt_logprobs for request, _, _ in targets)
        ids = np.concatenate(
            [request.prompt_ids[first + 1 : end + 1] for request, first, end in targets]
        )
        on_cpu = cpu_sampling.supports(logits)  # one call of the op, else paddle ops
        logprobs_of = cpu_sampling.token_logprobs_and_ranks if on_cpu else token_logprobs_and_ranks
        chosen, top_ids, top_values, ranks = _arrays(
            logprobs_of(logits, paddle.to_tensor(ids.astype(np.int64)), top)
        )
        row = 0
        for request, first, end in targets:
            k = request.params.prompt_logprobs
            for i in range(row, row + end - first):
                pairs = list(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist())) if k else []
                request.prompt_logprobs.append(
                    TokenLogprobs(int(ids[i]), float(chosen[i]), pairs, int(ranks[i]))
                )
            row += end - first

    def _finish_prompt_logprobs(self, chunks: list) -> None:
        """Reports the prompt logprobs of requests whose prompt this step completes (once:
        not again after a recovery's re-prefill)."""
        for chunk in chunks:
            request = self.scheduler.slot_requests[chunk.slot]
            if (
                chunk.last
                and request.index == 0
                and request.params.prompt_logprobs is not None
                and not request.prompt_logprobs_sent
            ):
                request.prompt_logprobs_sent = True
                self.last_step_prompt_logprobs[request.request_id] = request.prompt_logprobs

    def _uniforms(self) -> paddle.Tensor | None:
        """This step's random draw per slot, or None when every running slot is greedy."""
        scheduler = self.scheduler
        if not scheduler.any_sampling():
            return None
        return self.runner.uniforms(scheduler.slot_sampling_keys, scheduler.step_idx + 1)

    def _count(self, outcome: StepOutcome) -> None:
        """Adds a step's tokens, preemptions, recoveries and block use to the stats."""
        stats = self.stats
        stats.generated_tokens += int(outcome.ran.sum())
        stats.prompt_tokens_queried = self.scheduler.prompt_tokens_queried
        stats.prompt_tokens_hit = self.scheduler.prompt_tokens_hit
        stats.recoveries += outcome.recovered
        # step_lens grows by the preempted and shrinks by the recovered.
        stats.preemptions += outcome.step_lens - self._step_lens + outcome.recovered
        self._step_lens = outcome.step_lens
        self._decoder_blocks_in_use = self.config.num_decoder_blocks - outcome.free_list_len
        stats.peak_blocks_in_use = max(
            stats.peak_blocks_in_use,
            self.encoder_blocks.num_allocated + self._decoder_blocks_in_use,
        )

    def _check_invariants(self) -> None:
        """SPEC's invariants (``check_state``) plus prompt-block conservation."""
        state = self.state
        state.check()
        problems = self.scheduler.prompt_block_problems(
            state.block_tables.numpy(), state.encoder_block_lens.numpy()
        )
        if problems:
            raise StateError(problems)


def _arrays(tensors: Sequence[paddle.Tensor | None]) -> list[np.ndarray | None]:
    """Each tensor as a NumPy array (None stays None)."""
    return [None if t is None else t.numpy() for t in tensors]


def _on_host(logprobs: tuple | None) -> StepLogprobs | None:
    """``token_logprobs``' tensors as NumPy arrays."""
    return None if logprobs is None else StepLogprobs(*_arrays(logprobs))
