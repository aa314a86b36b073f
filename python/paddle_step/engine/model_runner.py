"""The device side of an engine step, over the slot state (``ShareInputs``) and the paged
KV cache: writing admitted requests into their slots and each step's prefill chunks, the
forward pass of every running slot, sampling, FastDeploy's ``update_inputs``, the two
ops, the one copy back to the host, and clearing retired slots. Nothing here decides
which request runs where; the ``Scheduler`` does.
"""

from __future__ import annotations

import numpy as np
import paddle

import paddle_step_ops as _library

from ..config import EngineConfig
from ..layers import cpu_sampling
from ..layers.paged_attention import DecodeInputs, PagedKVCache, build_flat_batch
from ..layers.sampler import (
    SamplingControls,
    apply_controls,
    sample_tokens,
    sampling_uniforms,
    token_logprobs,
)
from ..models.llama import LlamaForCausalLM
from ..ops import advance_step, step_paddle
from ..sampling_params import unpack_token_mask
from .cpu_threads import one_math_thread
from .outputs import StepOutcome
from .request import MAX_LOGIT_BIAS, MAX_STOP_IDS, Request
from .scheduler import PrefillChunk, SamplingPlan
from .slot_state import ShareInputs, host_array

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs ``model`` over the slot state of ``config``'s batch; the state and the KV cache
    live on Paddle's current device."""

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        # The cache first: past the memory, its refusal names the flag that sized it.
        self.kv_cache = PagedKVCache.for_config(
            model.config, config.num_kv_blocks, config.block_size, config.kv_cache_dtype
        )
        self.state = ShareInputs(config)

    def _row_writer(self, slots: list[int]):
        """``write(tensor, values)``: rows ``slots`` of ``tensor`` = ``values`` (one per
        slot, or one for all)."""
        state, count = self.state, len(slots)
        index = paddle.to_tensor(np.array(slots, dtype=np.int64), place=state.place)

        def write(tensor: paddle.Tensor, values) -> None:
            rows = np.broadcast_to(np.asarray(values), [count, *tensor.shape[1:]])
            paddle.scatter_(
                tensor,
                index,
                paddle.to_tensor(np.ascontiguousarray(rows), dtype=tensor.dtype, place=state.place),
            )

        return write

    def write_admitted(self, slots: list[int], requests: list[Request]) -> None:
        """Sets the admitted slots' state as FastDeploy's runner does on insert (their
        first tokens come with ``write_prefill_chunks``)."""
        state, config = self.state, self.config
        count = len(slots)
        table_rows = np.full((count, config.blocks_per_seq), -1, dtype=np.int32)
        for row, request in enumerate(requests):
            table_rows[row, : len(request.encoder_blocks)] = request.encoder_blocks
        write = self._row_writer(slots)
        write(state.ori_seq_lens_encoder, [len(r.prompt_ids) for r in requests])
        write(state.step_idx, 0)
        write(state.first_token_ids, [r.prompt_ids[0] for r in requests])
        write(state.encoder_block_lens, [len(r.encoder_blocks) for r in requests])
        write(state.block_tables, table_rows)
        write(state.used_list_len, 0)
        write(state.pre_ids, np.full((count, config.max_model_len), -1, dtype=np.int64))
        stop_rows = np.full((count, MAX_STOP_IDS), -1, dtype=np.int64)
        for row, request in enumerate(requests):
            stop_ids = request.eos_token_ids + request.stop_token_ids
            stop_rows[row, : len(stop_ids)] = stop_ids
        write(state.eos_token_ids, stop_rows)
        write(state.max_new_tokens, [r.max_new_tokens for r in requests])
        params = [r.params for r in requests]
        write(state.temperature, [p.temperature for p in params])
        write(state.top_p, [p.top_p for p in params])
        write(state.top_k, [p.top_k_cut(self.model.config.vocab_size) for p in params])
        write(state.min_p, [p.min_p for p in params])
        write(state.presence_penalty, [p.presence_penalty for p in params])
        write(state.frequency_penalty, [p.frequency_penalty for p in params])
        write(state.repetition_penalty, [p.repetition_penalty for p in params])
        # A min_tokens past the tokens the slot may generate (a Python int of any size, into
        # int64 state) holds eos to the end, as that bound does.
        write(state.min_tokens, [min(r.params.min_tokens, r.max_new_tokens) for r in requests])
        bias_ids = np.full((count, MAX_LOGIT_BIAS), -1, dtype=np.int64)
        bias_values = np.zeros((count, MAX_LOGIT_BIAS), dtype=np.float32)
        for row, p in enumerate(params):
            bias_ids[row, : len(p.logit_bias)] = list(p.logit_bias)
            bias_values[row, : len(p.logit_bias)] = list(p.logit_bias.values())
        write(state.logit_bias_ids, bias_ids)
        write(state.logit_bias_values, bias_values)
        prompt_rows = np.full((count, config.max_model_len), -1, dtype=np.int64)
        for row, request in enumerate(requests):
            prompt_rows[row, : len(request.prompt_ids)] = request.prompt_ids
        write(state.prompt_ids, prompt_rows)
        admitted_mask = np.zeros(config.max_batch, dtype=bool)
        admitted_mask[slots] = True
        keep_stopped = paddle.to_tensor(~admitted_mask, place=state.place)
        paddle.assign(paddle.logical_and(state.stop_flags, keep_stopped), output=state.stop_flags)

    def write_prefill_chunks(self, chunks: list[PrefillChunk]) -> None:
        """Each chunk's slot runs its tokens this step from position ``start`` (none when
        the budget left it nothing), as a prefill: FastDeploy's ``seq_lens_encoder`` is
        its token count, and it takes no decode input from ``advance_step``."""
        state, config = self.state, self.config
        lens = np.array([len(chunk.token_ids) for chunk in chunks], dtype=np.int32)
        input_rows = np.zeros((len(chunks), config.max_model_len), dtype=np.int64)
        for row, chunk in enumerate(chunks):
            input_rows[row, : lens[row]] = chunk.token_ids
        write = self._row_writer([chunk.slot for chunk in chunks])
        write(state.input_ids, input_rows)
        write(state.seq_lens_this_time, lens)
        write(state.seq_lens_encoder, lens)
        write(state.seq_lens_decoder, [chunk.start for chunk in chunks])
        prefilling = np.zeros(config.max_batch, dtype=bool)
        prefilling[[chunk.slot for chunk in chunks]] = True
        not_prefilling = paddle.to_tensor(~prefilling, place=state.place)
        paddle.assign(
            paddle.logical_and(state.decode_active, not_prefilling), output=state.decode_active
        )

    def forward(
        self, logit_rows: list[tuple[int, int, int]]
    ) -> tuple[paddle.Tensor, paddle.Tensor | None]:
        """Logits [B, vocab] of every running slot's last token this step (zeros for the
        slots that run no token: only the slots with one go through the LM head, so at
        B = 8 with one request running it multiplies one row, not eight); and, for each
        ``(slot, back, count)`` of ``logit_rows``, those of ``count`` tokens of that row
        starting ``back`` tokens before its last one (prompt logprobs), concatenated in
        that order ([sum(count), vocab]; None without any).
        """
        state = self.state
        # Decode rows take the token, position and KV slot advance_step prepared.
        decode_inputs = DecodeInputs(
            state.decode_active, state.input_tokens, state.input_positions, state.slot_mapping
        )
        batch = build_flat_batch(
            state.input_ids,
            state.seq_lens_this_time,
            state.seq_lens_decoder,
            state.block_tables,
            self.config.block_size,
            decode_inputs=decode_inputs,
        )
        last = batch["last_token_index"].numpy()
        # The common decode step: no gather, no scatter (tested in plain Python: a NumPy
        # test after the previous step's weights runs cold).
        every_slot = min(last.tolist(), default=0) >= 0
        if not every_slot:
            slots = paddle.to_tensor(np.flatnonzero(last >= 0))
            batch["last_token_index"] = paddle.to_tensor(last[last >= 0])
        extra = None
        if logit_rows:
            index = np.concatenate(
                [np.arange(count) + last[slot] - back for slot, back, count in logit_rows]
            )
            batch["extra_index"] = paddle.to_tensor(index)
        outputs = self.model.forward_paged(**batch, kv_cache=self.kv_cache)
        if logit_rows:
            outputs, extra = outputs
        if every_slot:
            return outputs, extra
        logits = paddle.zeros([self.config.max_batch, outputs.shape[1]], dtype=outputs.dtype)
        return paddle.scatter(logits, slots, outputs), extra

    def uniforms(self, sampling_keys: np.ndarray, token_index: np.ndarray) -> paddle.Tensor:
        """This step's random draw per slot, keyed by its request's key and token index."""
        draws = sampling_uniforms(sampling_keys, token_index)
        return paddle.to_tensor(draws, place=self.state.place)

    def sample(
        self,
        logits: paddle.Tensor,
        uniforms: paddle.Tensor | None,
        plan: SamplingPlan,
        math_threads: int,
    ) -> tuple[paddle.Tensor, tuple | None]:
        """One token per slot, with each slot's sampling controls; and, when ``plan``
        asks, ``token_logprobs`` of the raw logits (before any control). Float32 logits
        on the CPU take the fused CPU op (on the products' pool); others the paddle ops,
        on one of Paddle's math threads (``math_threads`` after)."""
        if cpu_sampling.supports(logits):
            return self._sample_on_cpu(logits, uniforms, plan)
        # The ops are [batch, vocab]: too small for the compute threads.
        with one_math_thread(math_threads):
            return self._sample_eager(logits, uniforms, plan)

    def _sample_eager(
        self, logits: paddle.Tensor, uniforms: paddle.Tensor | None, plan: SamplingPlan
    ) -> tuple[paddle.Tensor, tuple | None]:
        """``sample`` as paddle ops."""
        state = self.state
        if plan.is_plain:  # the greedy / temperature-only batch: nothing else to do
            return sample_tokens(logits, state.temperature, state.top_p, uniforms), None
        controls = self._controls(plan)
        processed = apply_controls(logits, controls) if controls.changes_logits() else logits
        tokens = sample_tokens(processed, state.temperature, state.top_p, uniforms,
                               top_k=controls.top_k, min_p=controls.min_p)  # fmt: skip
        logprobs = None
        if plan.logprobs_top is not None:
            logprobs = token_logprobs(logits, tokens, plan.logprobs_top)
        return tokens, logprobs

    def _sample_on_cpu(
        self, logits: paddle.Tensor, uniforms: paddle.Tensor | None, plan: SamplingPlan
    ) -> tuple[paddle.Tensor, tuple | None]:
        """``sample`` in one call of the CPU op, which reads the slot state's tables as
        they are (pre_ids up to step_idx, the prompt up to its first pad)."""
        state = self.state
        controls = {}
        if plan.allowed_bits is not None:
            controls["allowed_bits"] = paddle.to_tensor(plan.allowed_bits, place=state.place)
        if plan.min_tokens:
            controls.update(stop_ids=state.eos_token_ids, min_tokens=state.min_tokens)
        if plan.bias_width:
            controls.update(bias_ids=state.logit_bias_ids[:, : plan.bias_width],
                            bias_values=state.logit_bias_values[:, : plan.bias_width])  # fmt: skip
        if plan.penalties or plan.repetition:
            controls["output_ids"] = state.pre_ids
        if plan.min_tokens or plan.penalties or plan.repetition:
            controls["step_idx"] = state.step_idx
        if plan.penalties:
            controls.update(presence_penalty=state.presence_penalty,
                            frequency_penalty=state.frequency_penalty)  # fmt: skip
        if plan.repetition:
            controls.update(repetition_penalty=state.repetition_penalty,
                            prompt_ids=state.prompt_ids)  # fmt: skip
        if plan.top_k:
            controls["top_k"] = state.top_k
        if plan.min_p:
            controls["min_p"] = state.min_p
        return cpu_sampling.sample(logits, state.temperature, state.top_p, uniforms,
                                   logprobs_top=plan.logprobs_top, **controls)  # fmt: skip

    def _controls(self, plan: SamplingPlan) -> SamplingControls:
        """The controls ``plan`` needs, from the slot state (FastDeploy computes its
        penalties from ``pre_ids`` too)."""
        state = self.state
        controls = SamplingControls()
        if plan.allowed_bits is not None:
            vocab = self.model.config.vocab_size
            allowed = unpack_token_mask(plan.allowed_bits, vocab)
            controls.allowed = paddle.to_tensor(allowed, place=state.place)
        if plan.min_tokens:
            under = (
                (state.step_idx < state.min_tokens).unsqueeze(1).expand(state.eos_token_ids.shape)
            )
            controls.banned = paddle.where(
                under, state.eos_token_ids, paddle.full_like(state.eos_token_ids, -1)
            )
        if plan.bias_width:
            controls.bias_ids = state.logit_bias_ids[:, : plan.bias_width]
            controls.bias_values = state.logit_bias_values[:, : plan.bias_width]
        if plan.penalties or plan.repetition:
            columns = paddle.arange(state.pre_ids.shape[1], dtype="int64").unsqueeze(0)
            # pre_ids column k is the k-th generated token; column 0 is scratch.
            generated = (columns >= 1) & (columns <= state.step_idx.unsqueeze(1))
            controls.output_tokens = paddle.where(
                generated, state.pre_ids, paddle.full_like(state.pre_ids, -1)
            )
        if plan.penalties:
            controls.presence_penalty = state.presence_penalty
            controls.frequency_penalty = state.frequency_penalty
        if plan.repetition:
            controls.repetition_penalty = state.repetition_penalty
            controls.prompt_tokens = state.prompt_ids
        if plan.top_k:
            controls.top_k = state.top_k
        if plan.min_p:
            controls.min_p = state.min_p
        return controls

    def update_inputs(
        self, running: paddle.Tensor, ran: paddle.Tensor, tokens: paddle.Tensor
    ) -> None:
        """FastDeploy's update_inputs and stop checks, over the whole batch at once.

        ``running``: the slots not stopped before the step; ``ran``: those of them that
        sample a token (all but the ones mid-prefill). The rows that did not run are the
        stopped ones (finished, preempted or free): their seq_lens_this_time is 0 and, of
        what is written here, later steps read only their next_tokens and pre_ids columns
        >= 1 (a recovery rebuilds its row from those), so only those two keep their
        values. A row mid-prefill advances by its chunk and takes its next one from the
        host (its input_ids column 0 is rewritten then). On the CPU this is one call of
        our op; elsewhere ``update_inputs_eager``.
        """
        state = self.state
        if state.place.is_cpu_place():  # one call of our CPU op, the same updates
            _library.cpu_update_inputs(
                running, ran, tokens, state.step_idx, state.eos_token_ids,
                state.max_new_tokens, state.pre_ids, state.next_tokens, state.input_ids,
                state.seq_lens_this_time, state.seq_lens_encoder, state.seq_lens_decoder,
                state.stop_flags,
            )  # fmt: skip
            return
        self.update_inputs_eager(running, ran, tokens)

    def update_inputs_eager(
        self, running: paddle.Tensor, ran: paddle.Tensor, tokens: paddle.Tensor
    ) -> None:
        """``update_inputs`` as Paddle ops, for any device (rows that did not run write
        only what later steps ignore, which saves half the ops)."""
        state = self.state
        ran_count = ran.astype(state.step_idx.dtype)
        state.step_idx.add_(ran_count)
        # add_request keeps prompt + max_new_tokens within max_model_len, so this stop
        # also keeps every pre_ids / input_ids write inside its row.
        is_eos = paddle.any(tokens.unsqueeze(1) == state.eos_token_ids, axis=1)
        finished = paddle.logical_and(ran, is_eos | (state.step_idx >= state.max_new_tokens))
        # pre_ids[b, step_idx[b]] = token; rows that did not run write column 0, unread.
        column = (state.step_idx * ran_count).unsqueeze(1)
        state.pre_ids.put_along_axis_(column, tokens.unsqueeze(1), 1)
        paddle.assign(paddle.where(ran, tokens, state.next_tokens), output=state.next_tokens)
        state.input_ids[:, 0] = tokens

        still_running = paddle.logical_and(running, paddle.logical_not(finished)).astype(
            state.seq_lens_this_time.dtype
        )
        # A row that ran advances by the tokens it ran; a stopped one ends at 0.
        state.seq_lens_decoder.add_(state.seq_lens_this_time).multiply_(still_running)
        paddle.assign(still_running, output=state.seq_lens_this_time)
        state.seq_lens_encoder.zero_()  # prefills are done; recovery sets it after this
        paddle.assign(paddle.logical_or(state.stop_flags, finished), output=state.stop_flags)

    def schedule_blocks(self) -> None:
        """``step_paddle``: frees finished slots' decoder blocks, gives every decoding slot
        the block it writes next, preempts when the pool runs short, recovers."""
        state = self.state
        # So this call's recoveries can be counted.
        if state.on_host:
            host_array(state.recover_block_list).fill(-1)
        else:
            state.recover_block_list.fill_(-1)
        step_paddle(
            *state.step_tensors().values(), self.config.block_size, self.config.enc_dec_block_num
        )

    def advance_decode_inputs(self) -> None:
        """Next step's decode token, position and slot for every running, non-prefill slot."""
        state = self.state
        # context_lens: a copy, so positions start at the next write position; it ends as
        # the context length.
        if state.on_host:
            np.logical_and(
                ~host_array(state.stop_flags),
                host_array(state.seq_lens_encoder) == 0,
                out=host_array(state.decode_active),
            )
            host_array(state.context_lens)[:] = host_array(state.seq_lens_decoder)
        else:
            paddle.assign(
                paddle.logical_and(
                    paddle.logical_not(state.stop_flags), state.seq_lens_encoder == 0
                ),
                output=state.decode_active,
            )
            paddle.assign(state.seq_lens_decoder, output=state.context_lens)
        batch = self.config.max_batch
        advance_step(
            state.input_tokens,
            state.next_tokens,
            state.input_positions,
            state.context_lens,
            state.slot_mapping,
            state.block_tables,
            batch,
            batch,
            self.config.block_size,
            active=state.decode_active,
        )

    def sync_host(self, ran: paddle.Tensor, tokens: paddle.Tensor) -> StepOutcome:
        """This step's per-slot results, copied to the host in one transfer (on the CPU,
        read where they lie: a cast and a concat cost more than the copies)."""
        state, batch = self.state, self.config.max_batch
        vectors = (ran, tokens, state.stop_flags, state.is_block_step, state.step_idx,
                   state.recover_block_list, state.step_lens, state.free_list_len)  # fmt: skip
        if state.place.is_cpu_place():
            packed = np.concatenate(
                [vector.numpy().reshape(-1).astype(np.int64) for vector in vectors]
            )
        else:
            packed = paddle.concat(
                [paddle.cast(vector, "int64").reshape([-1]) for vector in vectors]
            ).numpy()
        ran, tokens, stopped, preempted, step_idx, recover_list = (
            packed[i * batch : (i + 1) * batch] for i in range(6)
        )
        step_lens, free_list_len = (int(value) for value in packed[6 * batch :])
        return StepOutcome(
            ran != 0,
            tokens,
            stopped != 0,
            preempted != 0,
            step_idx,
            recover_list[recover_list >= 0],
            step_lens,
            free_list_len,
        )

    def abort_slot(self, slot: int, preempted: bool) -> None:
        """Stops ``slot``'s sequence so the next ``step_paddle`` frees it as a finished one.

        A running slot is just stopped (its decoder blocks go back in the free phase). A
        preempted one already gave its decoder blocks back: it leaves ``step_block_list``
        and keeps no ``used_list_len``, so the free phase pushes nothing for it.
        """
        state = self.state
        state.stop_flags.reshape([-1])[slot] = True
        state.seq_lens_this_time.reshape([-1])[slot] = 0
        if preempted:
            state.is_block_step[slot] = False
            state.used_list_len.reshape([-1])[slot] = 0
            waiting = state.step_block_list.numpy().reshape(-1)
            count = int(state.step_lens.numpy()[0])
            kept = [entry for entry in waiting[:count].tolist() if entry != slot]
            waiting[: len(kept)] = kept
            waiting[len(kept) :] = -1
            paddle.assign(
                paddle.to_tensor(waiting.reshape(state.step_block_list.shape), place=state.place),
                output=state.step_block_list,
            )
            state.step_lens[0] = len(kept)

    def clear_slots(self, slots: np.ndarray) -> None:
        """Drops retired slots' prompt blocks from their tables (step_paddle already
        took back their decoder blocks)."""
        state, count = self.state, slots.size
        index = paddle.to_tensor(slots.astype(np.int64), place=state.place)
        paddle.scatter_(
            state.block_tables,
            index,
            paddle.full([count, self.config.blocks_per_seq], -1, dtype=state.block_tables.dtype),
        )
        paddle.scatter_(
            state.encoder_block_lens,
            index,
            paddle.zeros([count], dtype=state.encoder_block_lens.dtype),
        )
