"""A continuous-batching generation engine over ``step_paddle`` and ``advance_step``.

Requests run in fixed batch slots (FastDeploy's layout, see ``state.ShareInputs``). Each
``Engine.step``:

1. admits waiting requests into free slots (host: prompt blocks, slot state);
2. runs one forward over every running slot: prefills (new or recovered requests) and
   decodes (inputs prepared by the previous step's ``advance_step``) in one flat batch;
3. samples one token per running slot;
4. updates the slot state on the device (lengths, ``step_idx``, ``pre_ids``, stop checks),
   as FastDeploy's ``update_inputs`` does;
5. ``step_paddle``: frees finished slots' decoder blocks, gives every decoding slot the
   block it writes next, preempts when the pool runs short, recovers preempted slots;
6. ``advance_step``: the next decode token, position and KV slot of every decoding slot;
7. copies the few per-slot values the host needs back in one transfer, then retires
   finished requests (their prompt blocks and slots become free).

A preempted request is recomputed by a re-prefill of its prompt and generated tokens when
the op recovers it, so its output is the same as if it had never been preempted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import paddle

from .block_allocator import EncoderBlockAllocator
from .check_state import StateError
from .model import PagedKVCache, TinyLlama, build_flat_batch
from .ops import advance_step, step_paddle
from .sampling import sample_tokens, sampling_uniforms
from .state import EngineConfig, ShareInputs
from .tokenizer import ByteTokenizer

__all__ = ["Engine", "GenerationResult", "GenerationStats"]

FINISH_EOS = "eos"
FINISH_LENGTH = "length"


@dataclass
class GenerationResult:
    """One finished request: its prompt, the tokens generated (an eos token included) and
    why it stopped: ``"eos"`` or ``"length"`` (``max_new_tokens`` or the model length)."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str

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
    is the time spent in steps, in seconds.
    """

    steps: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    recoveries: int = 0
    peak_blocks_in_use: int = 0
    elapsed: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of step time."""
        return self.generated_tokens / self.elapsed if self.elapsed > 0 else 0.0

    def to_dict(self) -> dict:
        """All counters plus ``tokens_per_s``."""
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


@dataclass
class _Request:
    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_id: int  # -1: no eos stop
    temperature: float
    top_p: float
    encoder_blocks: list[int] = field(default_factory=list)


class Engine:
    """Generates from a ``TinyLlama`` with a paged KV cache and continuous batching.

    Args:
        model: the model; its parameters' place is where the state and cache live.
        config: batch slots, model length and KV-block budget.
        tokenizer: gives the default eos token (``tokenizer.eos_id``); without one, requests
            stop on eos only when given ``eos_token_id``.
        seed: seeds temperature sampling (draws are keyed by request id and token index).
        check_state: debug mode: validate the slot state (SPEC's invariants via
            ``check_state``, and prompt-block conservation) after every step.
    """

    def __init__(
        self,
        model: TinyLlama,
        config: EngineConfig,
        *,
        tokenizer: ByteTokenizer | None = None,
        seed: int = 0,
        check_state: bool = False,
    ) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(
                f"Engine: argument 'config': expected an EngineConfig, got {type(config).__name__}"
            )
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.seed = seed
        self.check_state = check_state
        self.state = ShareInputs(config)
        self.kv_cache = PagedKVCache.for_config(
            model.config, config.num_kv_blocks, config.block_size
        )
        self.encoder_blocks = EncoderBlockAllocator(config.num_encoder_blocks)
        self.stats = GenerationStats()

        batch = config.max_batch
        self._waiting: deque[_Request] = deque()
        self._slot_requests: list[_Request | None] = [None] * batch
        self._next_request_id = 0
        # Host mirrors of the device state, refreshed by each step's single copy back.
        self._live = np.zeros(batch, dtype=bool)  # slot holds a request (running or preempted)
        self._running = np.zeros(batch, dtype=bool)  # not stop_flags
        self._preempted = np.zeros(batch, dtype=bool)  # is_block_step
        self._step_idx = np.zeros(batch, dtype=np.int64)
        self._slot_request_ids = np.full(batch, -1, dtype=np.int64)
        self._slot_samples = np.zeros(batch, dtype=bool)  # request has temperature > 0
        self._step_lens = 0
        # generated[b, k]: the k-th token (1-based, like pre_ids) of slot b's request.
        self._generated = np.full((batch, config.max_model_len), -1, dtype=np.int64)

    # ------------------------------------------------------------------ public API

    def add_request(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_token_id: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> int:
        """Queues a request and returns its id (0, 1, .. in submission order).

        ``eos_token_id`` None means the tokenizer's eos (no eos stop without a tokenizer).
        ``temperature`` 0 is greedy; otherwise tokens are sampled at that temperature from
        the ``top_p`` nucleus. Raises ``ValueError`` for a request the engine could never
        run (empty prompt, ids outside the vocabulary, prompt + max_new_tokens past
        ``max_model_len``, more prompt blocks than the encoder region holds).
        """
        prompt = [int(token) for token in prompt_ids]
        vocab_size = self.model.config.vocab_size
        max_len = self.config.max_model_len
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
        needed = self.config.encoder_blocks_for(len(prompt))
        if needed > self.config.num_encoder_blocks:
            raise ValueError(
                f"add_request: a prompt of {len(prompt)} tokens needs {needed} encoder blocks, "
                f"expected <= {self.config.num_encoder_blocks} (the encoder region)"
            )
        if eos_token_id is None:
            eos_token_id = self.tokenizer.eos_id if self.tokenizer is not None else -1
        elif not 0 <= eos_token_id < vocab_size:
            raise ValueError(
                f"add_request: argument 'eos_token_id': expected None or an id in "
                f"[0, {vocab_size}), got {eos_token_id!r}"
            )
        if not temperature >= 0.0:
            raise ValueError(
                f"add_request: argument 'temperature': expected >= 0, got {temperature!r}"
            )
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"add_request: argument 'top_p': expected in (0, 1], got {top_p!r}")

        request = _Request(
            self._next_request_id, prompt, int(max_new_tokens), int(eos_token_id),
            float(temperature), float(top_p),
        )
        self._next_request_id += 1
        self._waiting.append(request)
        return request.request_id

    @property
    def num_waiting(self) -> int:
        """Requests queued and not admitted yet."""
        return len(self._waiting)

    @property
    def num_active(self) -> int:
        """Requests holding a slot (running or preempted)."""
        return int(self._live.sum())

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or preempted."""
        return bool(self._waiting) or bool(self._live.any())

    def step(self) -> list[GenerationResult]:
        """Runs one iteration (see the module docstring); returns the requests it finished.

        Raises ``RuntimeError`` if unfinished requests exist but nothing can run, be
        admitted or be recovered (a state the config checks should rule out).
        """
        started = time.perf_counter()
        state = self.state
        admitted = self._admit()
        ran_any = bool(self._running.any())
        # Rows with tokens this step: running (new or recovered prefills, and decodes).
        ran = paddle.logical_not(state.stop_flags)
        if ran_any:
            logits = self._forward()
            tokens = sample_tokens(logits, state.temperature, state.top_p, self._uniforms())
            self._update_inputs(ran, tokens)
        else:
            tokens = paddle.zeros_like(state.next_tokens)

        state.recover_block_list.fill_(-1)  # so this call's recoveries can be counted
        step_paddle(*state.step_tensors().values(), self.config.block_size,
                    self.config.enc_dec_block_num)
        self._advance_decode_inputs()

        recovered = self._sync_host(ran, tokens)
        finished = self._retire(np.flatnonzero(self._live & ~self._running & ~self._preempted))
        if self.check_state:
            self._check_invariants()
        self.stats.steps += 1
        self.stats.elapsed += time.perf_counter() - started

        if not (admitted or ran_any or recovered) and self.has_unfinished():
            raise RuntimeError(self._stall_reason())
        return finished

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        eos_token_id: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        on_finished: Callable[[int], object] | None = None,
    ) -> list[GenerationResult]:
        """Adds ``prompts`` and steps until every request is done.

        ``max_new_tokens`` is one value for all prompts or one per prompt; the other
        arguments are ``add_request``'s. ``on_finished(n)`` is called after each step that
        finished ``n > 0`` requests (e.g. a progress bar's ``update``). Returns the results
        of ``prompts``, in their order.
        """
        if isinstance(max_new_tokens, (int, np.integer)):
            max_new_tokens = [int(max_new_tokens)] * len(prompts)
        if len(max_new_tokens) != len(prompts):
            raise ValueError(
                f"generate: argument 'max_new_tokens': expected one int or {len(prompts)} "
                f"(one per prompt), got {len(max_new_tokens)}"
            )
        request_ids = [
            self.add_request(prompt, limit, eos_token_id, temperature, top_p)
            for prompt, limit in zip(prompts, max_new_tokens)
        ]
        results: dict[int, GenerationResult] = {}
        while self.has_unfinished():
            finished = self.step()
            results.update((result.request_id, result) for result in finished)
            if finished and on_finished is not None:
                on_finished(len(finished))
        return [results[request_id] for request_id in request_ids]

    # ------------------------------------------------------------------ step phases

    def _admit(self) -> int:
        """Moves waiting requests (FIFO) into free slots while their prompt blocks are
        available; returns how many were admitted."""
        # Preempted sequences come back first: admitting more would compete with them
        # for the decoder pool and could keep them out indefinitely.
        if not self._waiting or self._preempted.any():
            return 0
        slots: list[int] = []
        for slot in np.flatnonzero(~self._live).tolist():
            if not self._waiting:
                break
            request = self._waiting[0]
            blocks = self.encoder_blocks.allocate(
                self.config.encoder_blocks_for(len(request.prompt_ids))
            )
            if blocks is None:
                break  # the head of the queue waits for prompt blocks; FIFO keeps order
            self._waiting.popleft()
            request.encoder_blocks = blocks
            self._slot_requests[slot] = request
            slots.append(slot)
        if slots:
            self._write_admitted(slots)
        return len(slots)

    def _write_admitted(self, slots: list[int]) -> None:
        """Sets the admitted slots' state as FastDeploy's runner does on insert."""
        state, config = self.state, self.config
        requests = [self._slot_requests[slot] for slot in slots]
        count = len(slots)
        prompt_lens = np.array([len(r.prompt_ids) for r in requests], dtype=np.int32)
        input_rows = np.zeros((count, config.max_model_len), dtype=np.int64)
        table_rows = np.full((count, config.blocks_per_seq), -1, dtype=np.int32)
        for row, request in enumerate(requests):
            input_rows[row, : len(request.prompt_ids)] = request.prompt_ids
            table_rows[row, : len(request.encoder_blocks)] = request.encoder_blocks

        index = paddle.to_tensor(np.array(slots, dtype=np.int64), place=state.place)

        def write(tensor: paddle.Tensor, values) -> None:
            """Rows ``slots`` of ``tensor`` = ``values`` (one per slot, or one for all)."""
            rows = np.broadcast_to(np.asarray(values), [count, *tensor.shape[1:]])
            paddle.scatter_(tensor, index, paddle.to_tensor(
                np.ascontiguousarray(rows), dtype=tensor.dtype, place=state.place))

        write(state.input_ids, input_rows)
        for lengths in (state.seq_lens_this_time, state.seq_lens_encoder,
                        state.ori_seq_lens_encoder):
            write(lengths, prompt_lens)
        write(state.seq_lens_decoder, 0)
        write(state.step_idx, 0)
        write(state.first_token_ids, [r.prompt_ids[0] for r in requests])
        write(state.encoder_block_lens, [len(r.encoder_blocks) for r in requests])
        write(state.block_tables, table_rows)
        write(state.used_list_len, 0)
        write(state.pre_ids, np.full((count, config.max_model_len), -1, dtype=np.int64))
        write(state.eos_token_id, [r.eos_token_id for r in requests])
        write(state.max_new_tokens, [r.max_new_tokens for r in requests])
        write(state.temperature, [r.temperature for r in requests])
        write(state.top_p, [r.top_p for r in requests])
        admitted_mask = np.zeros(config.max_batch, dtype=bool)
        admitted_mask[slots] = True
        keep_stopped = paddle.to_tensor(~admitted_mask, place=state.place)
        paddle.assign(paddle.logical_and(state.stop_flags, keep_stopped), output=state.stop_flags)

        self._live[slots] = True
        self._running[slots] = True
        self._step_idx[slots] = 0
        self._slot_request_ids[slots] = [r.request_id for r in requests]
        self._slot_samples[slots] = [r.temperature > 0 for r in requests]

    def _forward(self) -> paddle.Tensor:
        """Logits [B, vocab] of every running slot's last token this step."""
        state = self.state
        batch = build_flat_batch(state.input_ids, state.seq_lens_this_time,
                                 state.seq_lens_decoder, state.block_tables,
                                 self.config.block_size)
        # Decode rows take the token, position and KV slot advance_step prepared.
        rows = batch["token_rows"]
        # Gathered as int32: paddle 2.6 has no CPU gather kernel for bool.
        is_decode = paddle.gather(state.decode_active.astype("int32"), rows) != 0
        for key, prepared in (("input_ids", state.input_tokens),
                              ("positions", state.input_positions),
                              ("slot_mapping", state.slot_mapping)):
            batch[key] = paddle.where(is_decode, paddle.gather(prepared, rows), batch[key])
        return self.model.forward_paged(**batch, kv_cache=self.kv_cache)

    def _uniforms(self) -> paddle.Tensor | None:
        """This step's random draw per slot, or None when every running slot is greedy."""
        if not (self._slot_samples & self._running).any():
            return None
        draws = sampling_uniforms(self.seed, self._slot_request_ids, self._step_idx + 1)
        return paddle.to_tensor(draws, place=self.state.place)

    def _update_inputs(self, ran: paddle.Tensor, tokens: paddle.Tensor) -> None:
        """FastDeploy's update_inputs and stop checks, over the whole batch at once.

        The rows that did not run are the stopped ones (finished, preempted or free):
        their seq_lens_this_time is 0 and, of what is written here, later steps read only
        their next_tokens and pre_ids columns >= 1 (a recovery rebuilds its row from
        those), so only those two keep their values. That saves half the eager ops.
        """
        state = self.state
        ran_count = ran.astype(state.step_idx.dtype)
        state.step_idx.add_(ran_count)
        # add_request keeps prompt + max_new_tokens within max_model_len, so this stop
        # also keeps every pre_ids / input_ids write inside its row.
        finished = paddle.logical_and(
            ran, (tokens == state.eos_token_id) | (state.step_idx >= state.max_new_tokens))
        # pre_ids[b, step_idx[b]] = token; rows that did not run write column 0, unread.
        column = (state.step_idx * ran_count).unsqueeze(1)
        state.pre_ids.put_along_axis_(column, tokens.unsqueeze(1), 1)
        paddle.assign(paddle.where(ran, tokens, state.next_tokens), output=state.next_tokens)
        state.input_ids[:, 0] = tokens

        still_running = paddle.logical_and(ran, paddle.logical_not(finished)).astype(
            state.seq_lens_this_time.dtype)
        # A row that ran advances by the tokens it ran; a stopped one ends at 0.
        state.seq_lens_decoder.add_(state.seq_lens_this_time).multiply_(still_running)
        paddle.assign(still_running, output=state.seq_lens_this_time)
        state.seq_lens_encoder.zero_()  # prefills are done; recovery sets it after this
        paddle.assign(paddle.logical_or(state.stop_flags, finished), output=state.stop_flags)

    def _advance_decode_inputs(self) -> None:
        """Next step's decode token, position and slot for every running, non-prefill slot."""
        state = self.state
        paddle.assign(
            paddle.logical_and(paddle.logical_not(state.stop_flags), state.seq_lens_encoder == 0),
            output=state.decode_active,
        )
        # A copy, so positions start at the next write position; it ends as context length.
        paddle.assign(state.seq_lens_decoder, output=state.context_lens)
        batch = self.config.max_batch
        advance_step(state.input_tokens, state.next_tokens, state.input_positions,
                     state.context_lens, state.slot_mapping, state.block_tables,
                     batch, batch, self.config.block_size, active=state.decode_active)

    def _sync_host(self, ran: paddle.Tensor, tokens: paddle.Tensor) -> int:
        """Copies this step's per-slot results to the host in one transfer, updates the
        host mirrors and the stats; returns how many sequences step_paddle recovered."""
        state, batch = self.state, self.config.max_batch
        packed = paddle.concat([
            paddle.cast(vector, "int64").reshape([-1]) for vector in (
                ran, tokens, state.stop_flags, state.is_block_step, state.step_idx,
                state.recover_block_list, state.step_lens, state.free_list_len,
            )
        ]).numpy()
        ran_host, tokens_host, stopped, preempted, step_idx, recover_list = (
            packed[i * batch:(i + 1) * batch] for i in range(6)
        )
        step_lens, free_list_len = (int(value) for value in packed[6 * batch:])

        rows = np.flatnonzero(ran_host)
        self._generated[rows, step_idx[rows]] = tokens_host[rows]
        self._running = stopped == 0
        self._preempted = preempted != 0
        self._step_idx = step_idx

        # step_lens grows by the preempted and shrinks by the recovered.
        recovered = int((recover_list >= 0).sum())
        stats = self.stats
        stats.generated_tokens += len(rows)
        stats.recoveries += recovered
        stats.preemptions += step_lens - self._step_lens + recovered
        self._step_lens = step_lens
        decoder_in_use = self.config.num_decoder_blocks - free_list_len
        stats.peak_blocks_in_use = max(
            stats.peak_blocks_in_use, self.encoder_blocks.num_allocated + decoder_in_use
        )
        return recovered

    def _retire(self, slots: np.ndarray) -> list[GenerationResult]:
        """Finishes the requests of stopped, non-preempted slots; frees their prompt blocks
        and slots."""
        if slots.size == 0:
            return []
        results = []
        for slot in slots.tolist():
            request = self._slot_requests[slot]
            token_ids = self._generated[slot, 1: self._step_idx[slot] + 1].tolist()
            reason = FINISH_EOS if token_ids and token_ids[-1] == request.eos_token_id \
                else FINISH_LENGTH
            results.append(GenerationResult(
                request.request_id, request.prompt_ids, token_ids, reason))
            self.encoder_blocks.free(request.encoder_blocks)
            self._slot_requests[slot] = None
        self._live[slots] = False
        self._slot_request_ids[slots] = -1
        self._slot_samples[slots] = False

        # step_paddle already returned their decoder blocks; drop the prompt blocks too.
        state, count = self.state, slots.size
        index = paddle.to_tensor(slots.astype(np.int64), place=state.place)
        paddle.scatter_(state.block_tables, index, paddle.full(
            [count, self.config.blocks_per_seq], -1, dtype=state.block_tables.dtype))
        paddle.scatter_(state.encoder_block_lens, index,
                        paddle.zeros([count], dtype=state.encoder_block_lens.dtype))
        return results

    # ------------------------------------------------------------------ diagnostics

    def _stall_reason(self) -> str:
        config = self.config
        parts = []
        if self._waiting:
            needed = config.encoder_blocks_for(len(self._waiting[0].prompt_ids))
            parts.append(
                f"{len(self._waiting)} request(s) waiting (the next needs {needed} encoder "
                f"blocks, {self.encoder_blocks.num_free} of {config.num_encoder_blocks} free; "
                f"{int((~self._live).sum())} of {config.max_batch} slots free)"
            )
        if self._preempted.any():
            parts.append(
                f"{int(self._preempted.sum())} preempted sequence(s) not recovered "
                f"(decoder pool of {config.num_decoder_blocks} blocks)"
            )
        return ("Engine.step: no progress: nothing is running, nothing can be admitted and "
                "nothing was recovered: " + "; ".join(parts))

    def _check_invariants(self) -> None:
        """SPEC's invariants (``check_state``) plus prompt-block conservation."""
        state = self.state
        state.check()
        tables = state.block_tables.numpy()
        encoder_lens = state.encoder_block_lens.numpy()
        problems = []
        held: set[int] = set()
        for slot in np.flatnonzero(self._live).tolist():
            expected = self._slot_requests[slot].encoder_blocks
            found = tables[slot, : encoder_lens[slot]].tolist()
            if found != expected:
                problems.append(f"slot {slot}: encoder columns hold {found}, "
                                f"expected its prompt blocks {expected}")
            held.update(expected)
        for slot in np.flatnonzero(~self._live).tolist():
            if (tables[slot] != -1).any():
                problems.append(f"free slot {slot} still holds blocks {tables[slot].tolist()}")
        if held != set(self.encoder_blocks.allocated):
            problems.append(
                f"allocated prompt blocks {sorted(self.encoder_blocks.allocated)} differ from "
                f"those the live slots hold {sorted(held)}"
            )
        if problems:
            raise StateError(problems)
