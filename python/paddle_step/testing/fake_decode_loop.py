"""A FastDeploy-like serving loop around ``step_paddle``, on NumPy arrays.

``FakeDecodeLoop`` holds the 22 tensors of SPEC's ``step_paddle`` and plays
the host's part between op calls: run the model step (prefill or decode) of
every running slot, post-process it like FastDeploy's ``update_inputs``,
release the encoder blocks of finished requests and admit new ones. Whoever
drives it calls the op (the reference or a compiled build) on ``state()`` and
hands the result back with ``load()``.

The loop checks the op's work as a model would feel it: a simulated KV cache
records which token was written at each (block, offset), and every step
verifies that each running sequence reads back exactly its own tokens and
that a re-prefill feeds exactly the prompt plus the generated tokens.

``make_state``, ``add_running`` and ``add_preempted`` build small states by
hand for edge cases; tokens there follow ``token_at``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..spec.tensor_table import STEP_PADDLE_TABLE, STEP_PADDLE_TENSORS, names_of_kind

# Tensors SPEC allows as [B] or [B, 1]; stopped_shape="[B,1]" gives them that shape.
COLUMN_CAPABLE = names_of_kind("[B or B,1]")
STOPPED_SHAPES = ("[B]", "[B,1]")
VOCAB_SIZE = 50_000


class FakeLoopError(AssertionError):
    """The op left the loop in a state a serving loop cannot go on from."""


def _check_stopped_shape(stopped_shape: str) -> None:
    if stopped_shape not in STOPPED_SHAPES:
        raise ValueError(
            f"argument 'stopped_shape': expected one of {STOPPED_SHAPES}, got {stopped_shape!r}"
        )


def _shaped(flat: Mapping[str, np.ndarray], stopped_shape: str) -> dict[str, np.ndarray]:
    """Copies of flat per-slot arrays, reshaped to [B, 1] where asked."""
    state = {}
    for name in STEP_PADDLE_TENSORS:
        array = np.array(flat[name], copy=True)
        if stopped_shape == "[B,1]" and name in COLUMN_CAPABLE:
            array = array.reshape(-1, 1)
        state[name] = array
    return state


# ---- Hand-built states. ---------------------------------------------------------


def token_at(slot: int, position: int) -> int:
    """Token of hand-built sequence ``slot`` at absolute ``position``."""
    return 10_000 * slot + position + 1


def make_state(
    batch_size: int,
    blocks_per_seq: int,
    max_model_len: int,
    free_list: Sequence[int] = (),
    *,
    free_list_len: int | None = None,
    free_list_size: int | None = None,
    pre_ids_len: int | None = None,
    stopped_shape: str = "[B]",
) -> dict[str, np.ndarray]:
    """A state whose slots are all empty (stopped, no blocks).

    ``free_list`` fills the start of a free list of ``free_list_size`` entries
    (default: just those, or 1 when empty); the pool length defaults to its
    length. ``max_model_len`` is ``input_ids.shape[1]`` and ``pre_ids_len``
    defaults to it. Fill slots with ``add_running`` / ``add_preempted``.
    """
    _check_stopped_shape(stopped_shape)
    free_list = list(free_list)
    size = free_list_size if free_list_size is not None else max(len(free_list), 1)
    shapes = {
        "[B]": (batch_size,),
        "[B or B,1]": (batch_size,),
        "[B,M]": (batch_size, blocks_per_seq),
        "[N]": (size,),
        "[1]": (1,),
        "[B,L]": (batch_size, max_model_len),
        "[B,P]": (batch_size, pre_ids_len or max_model_len),
    }
    flat = {spec.name: np.zeros(shapes[spec.shape], spec.dtype) for spec in STEP_PADDLE_TABLE}
    # An empty slot is stopped and holds nothing: -1 marks "no block / no entry / no token".
    flat["stop_flags"][:] = True
    for name in (
        "block_tables",
        "step_block_list",
        "recover_block_list",
        "need_block_list",
        "free_list",
        "pre_ids",
        "next_tokens",
        "first_token_ids",
    ):
        flat[name][:] = -1
    flat["free_list"][: len(free_list)] = free_list
    flat["free_list_len"][0] = len(free_list) if free_list_len is None else free_list_len
    return _shaped(flat, stopped_shape)


def _fill_tokens(state, slot: int, prompt_len: int, step_idx: int) -> None:
    """Prompt in input_ids, generated tokens in pre_ids, as after a decode step."""
    input_ids = state["input_ids"]
    pre_ids = state["pre_ids"]
    last_token = token_at(slot, prompt_len + step_idx - 1)
    input_ids[slot, :] = 0
    input_ids[slot, :prompt_len] = [token_at(slot, p) for p in range(prompt_len)]
    input_ids[slot, 0] = last_token  # a decode step feeds the last sampled token
    pre_ids[slot, :] = -1
    for generated in range(1, min(step_idx, pre_ids.shape[1] - 1) + 1):
        pre_ids[slot, generated] = token_at(slot, prompt_len + generated - 1)
    state["step_idx"].reshape(-1)[slot] = step_idx
    state["next_tokens"].reshape(-1)[slot] = last_token
    state["first_token_ids"].reshape(-1)[slot] = token_at(slot, 0)
    state["ori_seq_lens_encoder"].reshape(-1)[slot] = prompt_len


def add_running(
    state,
    slot: int,
    *,
    encoder_blocks: Sequence[int],
    decoder_blocks: Sequence[int] = (),
    seq_lens_decoder: int,
    prompt_len: int = 1,
) -> None:
    """Makes ``slot`` a decoding sequence that has ``seq_lens_decoder`` tokens
    in its cache and writes position ``seq_lens_decoder`` next."""
    if seq_lens_decoder < prompt_len:
        raise ValueError(
            f"argument 'seq_lens_decoder': expected >= prompt_len ({prompt_len}), "
            f"got {seq_lens_decoder}"
        )
    flat = {name: state[name].reshape(-1) for name in COLUMN_CAPABLE + ("is_block_step",)}
    row = state["block_tables"][slot]
    row[:] = -1
    row[: len(encoder_blocks)] = encoder_blocks
    row[len(encoder_blocks) : len(encoder_blocks) + len(decoder_blocks)] = decoder_blocks
    flat["stop_flags"][slot] = False
    flat["is_block_step"][slot] = False
    flat["seq_lens_this_time"][slot] = 1
    flat["seq_lens_encoder"][slot] = 0
    flat["seq_lens_decoder"][slot] = seq_lens_decoder
    flat["encoder_block_lens"][slot] = len(encoder_blocks)
    flat["used_list_len"][slot] = len(decoder_blocks)
    _fill_tokens(state, slot, prompt_len, seq_lens_decoder - prompt_len + 1)


def add_preempted(
    state,
    slot: int,
    *,
    encoder_blocks: Sequence[int],
    used_list_len: int,
    prompt_len: int,
    step_idx: int,
) -> None:
    """Makes ``slot`` a sequence preempted earlier (pushed on step_block_list)
    after ``step_idx`` generated tokens while holding ``used_list_len`` blocks."""
    flat = {name: state[name].reshape(-1) for name in COLUMN_CAPABLE + ("is_block_step",)}
    row = state["block_tables"][slot]
    row[:] = -1
    row[: len(encoder_blocks)] = encoder_blocks
    flat["stop_flags"][slot] = True
    flat["is_block_step"][slot] = True
    flat["seq_lens_this_time"][slot] = 0
    flat["seq_lens_encoder"][slot] = 0
    flat["seq_lens_decoder"][slot] = 0
    flat["encoder_block_lens"][slot] = len(encoder_blocks)
    flat["used_list_len"][slot] = used_list_len
    _fill_tokens(state, slot, prompt_len, step_idx)
    step_lens = state["step_lens"]
    flat["step_block_list"][step_lens[0]] = slot
    step_lens[0] += 1


# ---- The serving loop. ----------------------------------------------------------


@dataclass
class _Request:
    prompt: np.ndarray  # int64 token ids
    max_new_tokens: int


class FakeDecodeLoop:
    """Serves random requests through ``step_paddle`` like FastDeploy's loop.

    Block ids: the decoder pool is the top ``num_decoder_blocks`` ids, with
    ``free_list`` initialised descending as FastDeploy does; the host hands
    out encoder blocks (``ceil(prompt / block_size) + enc_dec_block_num`` per
    request) from the ``num_encoder_blocks`` lowest ids, and a request waits
    until they are available. Each step up to ``batch_size`` requests may
    arrive, each with ``arrival_prob``, until ``num_requests`` have; a running
    sequence ends on a random eos (``stop_prob`` per token), at its
    ``max_new_tokens`` (drawn from ``output_len_range``), or when its tokens
    fill the sequence's room; the op itself ends one with no table column left.

    Drive it with ``run(step_fn, max_steps)``, or by hand: ``host_update()``,
    call the op on ``state()``, ``load(result)``, repeat.
    Counters: ``preemptions``, ``recoveries``, ``shortfalls`` (sequences
    preempted while holding no decoder block), ``table_end_stops``,
    ``finished``, ``steps``.
    """

    def __init__(
        self,
        batch_size: int,
        max_model_len: int,
        block_size: int,
        blocks_per_seq: int,
        num_decoder_blocks: int,
        num_encoder_blocks: int,
        *,
        seed: int = 0,
        enc_dec_block_num: int = 0,
        arrival_prob: float = 0.3,
        stop_prob: float = 0.02,
        prompt_len_range: tuple[int, int] = (1, 16),
        output_len_range: tuple[int, int] = (1, 32),
        num_requests: int | None = None,
        stopped_shape: str = "[B]",
    ):
        _check_stopped_shape(stopped_shape)
        for name, value in (
            ("batch_size", batch_size),
            ("max_model_len", max_model_len),
            ("block_size", block_size),
            ("blocks_per_seq", blocks_per_seq),
            ("num_decoder_blocks", num_decoder_blocks),
            ("num_encoder_blocks", num_encoder_blocks),
        ):
            if value <= 0:
                raise ValueError(f"argument '{name}': expected > 0, got {value}")
        self.batch_size = batch_size
        self.block_size = block_size
        self.blocks_per_seq = blocks_per_seq
        self.max_model_len = max_model_len
        self.enc_dec_block_num = enc_dec_block_num
        self.arrival_prob = arrival_prob
        self.stop_prob = stop_prob
        self.output_len_range = output_len_range
        self.stopped_shape = stopped_shape
        self.num_requests = 3 * batch_size if num_requests is None else num_requests
        self.rng = np.random.default_rng(seed)

        # The host stops a sequence once its tokens fill max_dec_blocks blocks
        # (input_ids can hold them, re-prefill budgets cover them).
        max_dec_blocks = max_model_len // block_size
        self.max_tokens = max_dec_blocks * block_size
        low, high = prompt_len_range
        if not 1 <= low <= high < self.max_tokens:
            raise ValueError(
                f"argument 'prompt_len_range': expected 1 <= low <= high < {self.max_tokens} "
                f"(max_model_len // block_size * block_size), got {prompt_len_range}"
            )
        self.prompt_len_range = prompt_len_range
        largest_encoder = self._encoder_need(high)
        if largest_encoder > min(blocks_per_seq, num_encoder_blocks, max_dec_blocks):
            raise ValueError(
                f"argument 'prompt_len_range': its longest prompt needs {largest_encoder} encoder "
                f"blocks, expected <= min(blocks_per_seq={blocks_per_seq}, num_encoder_blocks="
                f"{num_encoder_blocks}, max_model_len // block_size={max_dec_blocks})"
            )
        # A preempted sequence comes back only when the pool holds its whole
        # budget, so the pool must be able to hold the largest one.
        largest_budget = max(1, min(max_dec_blocks, blocks_per_seq) - self._encoder_need(low))
        if num_decoder_blocks < largest_budget:
            raise ValueError(
                f"argument 'num_decoder_blocks': expected >= {largest_budget} (largest recovery "
                f"budget), got {num_decoder_blocks}"
            )

        self.num_blocks = num_encoder_blocks + num_decoder_blocks
        self.decoder_block_ids = frozenset(range(num_encoder_blocks, self.num_blocks))
        self._host_free_blocks = list(
            range(num_encoder_blocks - 1, -1, -1)
        )  # pop() gives the lowest
        self._slot_encoder_blocks: list[list[int] | None] = [
            None
        ] * batch_size  # None: slot is free
        self._waiting: deque[_Request] = deque()
        self._requests_created = 0
        self._requests: list[_Request | None] = [None] * batch_size
        # Each slot's tokens so far (prompt + generated) and the simulated KV cache.
        self._tokens = np.zeros((batch_size, max_model_len), np.int64)
        self._token_count = np.zeros(batch_size, np.int64)
        self._kv_cache = np.full((self.num_blocks, block_size), -1, np.int64)

        flat = make_state(
            batch_size,
            blocks_per_seq,
            max_model_len,
            free_list=list(range(self.num_blocks - 1, num_encoder_blocks - 1, -1)),
        )
        self._flat = {
            name: array.reshape(-1) if name in COLUMN_CAPABLE else array
            for name, array in flat.items()
        }
        self._op_input: dict[str, np.ndarray] | None = None  # what the op was last given

        self.preemptions = 0
        self.recoveries = 0
        self.shortfalls = 0
        self.table_end_stops = 0
        self.finished = 0
        self.steps = 0

    # ---- Public interface. ------------------------------------------------

    def state(self) -> dict[str, np.ndarray]:
        """Copies of the 22 tensors, per-slot ones in ``stopped_shape``."""
        return _shaped(self._flat, self.stopped_shape)

    @property
    def done(self) -> bool:
        """Every request has arrived and finished."""
        return self.finished == self.num_requests

    def host_update(self) -> None:
        """The host's work between two op calls: release finished requests,
        admit waiting ones, run the model step and post-process it."""
        if self._op_input is not None:
            raise FakeLoopError("host_update() called twice without load() of the op's result")
        self._retire_finished()
        self._arrive()
        self._admit()
        for slot in range(self.batch_size):
            if not self._flat["stop_flags"][slot] and self._flat["seq_lens_this_time"][slot] > 0:
                self._model_step(slot)
                self._post_process(slot)
        self.steps += 1
        self._op_input = self.state()

    def load(self, new_state: Mapping[str, object]) -> None:
        """Takes the op's result (arrays or Paddle tensors) as the new state."""
        if self._op_input is None:
            raise FakeLoopError("load() called without host_update() before the op")
        missing = [name for name in STEP_PADDLE_TENSORS if name not in new_state]
        if missing:
            raise ValueError(f"argument 'new_state': missing tensors {missing}")
        before = {
            name: array.reshape(-1) if name in COLUMN_CAPABLE else array
            for name, array in self._op_input.items()
        }
        after = {}
        for name in STEP_PADDLE_TENSORS:
            value = new_state[name]
            array = np.array(value.numpy() if hasattr(value, "numpy") else value, copy=True)
            if (
                array.shape != self._op_input[name].shape
                or array.dtype != self._op_input[name].dtype
            ):
                raise ValueError(
                    f"argument 'new_state': {name} expected {self._op_input[name].dtype} "
                    f"{list(self._op_input[name].shape)}, got {array.dtype} {list(array.shape)}"
                )
            after[name] = array.reshape(-1) if name in COLUMN_CAPABLE else array
        self._count_events(before, after)
        self._flat = after
        self._op_input = None

    def run(
        self,
        step_fn: Callable[[dict[str, np.ndarray]], Mapping[str, object]],
        max_steps: int,
        check: Callable[[dict[str, np.ndarray], bool], None] | None = None,
    ) -> int:
        """Alternates ``host_update`` and ``step_fn`` (state -> new state) until
        every request finished; returns the number of steps.

        ``check(state, after_step)`` runs on each op input and output.
        """
        for _ in range(max_steps):
            self.host_update()
            if self.done:
                return self.steps
            if check is not None:
                check(self.state(), False)
            self.load(step_fn(self.state()))
            if check is not None:
                check(self.state(), True)
        raise FakeLoopError(
            f"not done after {max_steps} steps: {self.finished}/{self.num_requests} requests "
            f"finished, {len(self._waiting)} waiting, {int(self._flat['step_lens'][0])} preempted"
        )

    # ---- Host side. -------------------------------------------------------

    def _encoder_need(self, prompt_len: int) -> int:
        return -(-prompt_len // self.block_size) + self.enc_dec_block_num

    def _retire_finished(self) -> None:
        """Releases the encoder blocks of requests the op has seen stopped.

        Runs only on slots stopped (and not preempted) when the op last ran,
        so their decoder blocks are back in the pool by now.
        """
        flat = self._flat
        for slot in range(self.batch_size):
            encoder_blocks = self._slot_encoder_blocks[slot]
            if (
                encoder_blocks is None
                or not flat["stop_flags"][slot]
                or flat["is_block_step"][slot]
            ):
                continue
            row = flat["block_tables"][slot]
            expected_row = np.full(self.blocks_per_seq, -1, np.int32)
            expected_row[: len(encoder_blocks)] = encoder_blocks
            if flat["used_list_len"][slot] != 0 or not np.array_equal(row, expected_row):
                raise FakeLoopError(
                    f"slot {slot} finished but step_paddle did not free its decoder blocks: "
                    f"block_tables row {row.tolist()}, expected {expected_row.tolist()}; "
                    f"used_list_len {int(flat['used_list_len'][slot])}, expected 0"
                )
            row[:] = -1
            flat["encoder_block_lens"][slot] = 0
            self._host_free_blocks.extend(reversed(encoder_blocks))
            self._slot_encoder_blocks[slot] = None
            self._requests[slot] = None
            self.finished += 1

    def _arrive(self) -> None:
        arrivals = self.rng.binomial(self.batch_size, self.arrival_prob)
        for _ in range(min(arrivals, self.num_requests - self._requests_created)):
            prompt_len = int(
                self.rng.integers(self.prompt_len_range[0], self.prompt_len_range[1] + 1)
            )
            self._waiting.append(
                _Request(
                    prompt=self.rng.integers(1, VOCAB_SIZE, prompt_len, dtype=np.int64),
                    max_new_tokens=int(
                        self.rng.integers(self.output_len_range[0], self.output_len_range[1] + 1)
                    ),
                )
            )
            self._requests_created += 1

    def _admit(self) -> None:
        """First come, first served: the head request waits for a free slot and
        for its encoder blocks, and everyone behind it waits too."""
        flat = self._flat
        for slot in range(self.batch_size):
            if not self._waiting:
                return
            if self._slot_encoder_blocks[slot] is not None:
                continue
            request = self._waiting[0]
            prompt_len = len(request.prompt)
            need = self._encoder_need(prompt_len)
            if need > len(self._host_free_blocks):
                return
            self._waiting.popleft()
            encoder_blocks = [self._host_free_blocks.pop() for _ in range(need)]
            self._slot_encoder_blocks[slot] = encoder_blocks
            self._requests[slot] = request
            flat["block_tables"][slot, :need] = encoder_blocks
            flat["encoder_block_lens"][slot] = need
            flat["used_list_len"][slot] = 0
            flat["stop_flags"][slot] = False
            flat["is_block_step"][slot] = False
            flat["seq_lens_this_time"][slot] = prompt_len
            flat["seq_lens_encoder"][slot] = prompt_len
            flat["ori_seq_lens_encoder"][slot] = prompt_len
            flat["seq_lens_decoder"][slot] = 0
            flat["step_idx"][slot] = 0
            flat["input_ids"][slot, :] = 0
            flat["input_ids"][slot, :prompt_len] = request.prompt
            flat["pre_ids"][slot, :] = -1
            flat["next_tokens"][slot] = -1
            flat["first_token_ids"][slot] = request.prompt[0]
            self._tokens[slot, :prompt_len] = request.prompt
            self._token_count[slot] = prompt_len

    def _model_step(self, slot: int) -> None:
        """Writes the fed tokens into the KV cache, then reads the whole
        sequence back as attention would: it must be this sequence's tokens."""
        flat = self._flat
        fed_count = int(flat["seq_lens_this_time"][slot])
        start = int(flat["seq_lens_decoder"][slot])
        tokens_so_far = int(self._token_count[slot])
        history = self._tokens[slot, :tokens_so_far]
        if flat["seq_lens_encoder"][slot] > 0:  # (re-)prefill of everything so far
            fed = flat["input_ids"][slot, :fed_count]
            if start != 0 or fed_count != tokens_so_far or not np.array_equal(fed, history):
                raise FakeLoopError(
                    f"slot {slot}: prefill feeds input_ids[:{fed_count}] = {fed.tolist()} from "
                    f"position {start}, expected its {tokens_so_far} tokens {history.tolist()} "
                    "from 0"
                )
        else:  # decode: the last sampled token
            fed = flat["input_ids"][slot, :1]
            if fed_count != 1 or start != tokens_so_far - 1 or fed[0] != history[-1]:
                raise FakeLoopError(
                    f"slot {slot}: decode feeds token {int(fed[0])} x{fed_count} at position "
                    f"{start}, "
                    f"expected token {int(history[-1])} x1 at position {tokens_so_far - 1}"
                )
        positions = np.arange(start + fed_count)
        columns = positions // self.block_size
        if columns[-1] >= self.blocks_per_seq:
            raise FakeLoopError(f"slot {slot}: position {positions[-1]} is past its block table")
        blocks = flat["block_tables"][slot, columns]
        if (blocks < 0).any():
            missing = sorted(set(columns[blocks < 0].tolist()))
            raise FakeLoopError(f"slot {slot}: no block in column(s) {missing} it reads or writes")
        offsets = positions % self.block_size
        self._kv_cache[blocks[start:], offsets[start:]] = fed
        seen = self._kv_cache[blocks, offsets]
        if not np.array_equal(seen, history):
            wrong = int(np.flatnonzero(seen != history)[0])
            raise FakeLoopError(
                f"slot {slot}: KV cache at position {wrong} (block {int(blocks[wrong])}) holds "
                f"token {int(seen[wrong])}, expected {int(history[wrong])}: a block is shared "
                "or was lost"
            )

    def _post_process(self, slot: int) -> None:
        """FastDeploy's update_inputs for one slot: advance, sample, stop."""
        flat = self._flat
        if flat["seq_lens_encoder"][slot] > 0:  # prefill -> decode
            flat["seq_lens_decoder"][slot] += flat["seq_lens_encoder"][slot]
            flat["seq_lens_encoder"][slot] = 0
        else:
            flat["seq_lens_decoder"][slot] += 1
        token = int(self.rng.integers(1, VOCAB_SIZE))
        flat["step_idx"][slot] += 1
        step_idx = int(flat["step_idx"][slot])
        flat["pre_ids"][slot, step_idx] = token
        flat["input_ids"][slot, 0] = token
        flat["next_tokens"][slot] = token
        flat["seq_lens_this_time"][slot] = 1
        self._tokens[slot, self._token_count[slot]] = token
        self._token_count[slot] += 1

        request = self._requests[slot]
        if (
            self.rng.random() < self.stop_prob
            or step_idx >= request.max_new_tokens
            or self._token_count[slot] >= self.max_tokens
        ):
            flat["stop_flags"][slot] = True
            flat["seq_lens_this_time"][slot] = 0
            flat["seq_lens_decoder"][slot] = 0

    # ---- What the op did. -------------------------------------------------

    def _count_events(self, before, after) -> None:
        # The op's input has every running sequence in decode (host_update ran
        # their prefill), so seq_lens_encoder > 0 afterwards means recovered.
        recovered = (after["seq_lens_encoder"] > 0) & ~after["stop_flags"]
        newly_preempted = after["is_block_step"] & ~before["is_block_step"]
        # A sequence preempted and recovered in the same call shows only as recovered.
        preempted = newly_preempted | (recovered & ~before["is_block_step"])
        running_before = ~before["stop_flags"] & (before["seq_lens_this_time"] != 0)
        self.preemptions += int(preempted.sum())
        self.shortfalls += int((preempted & (before["used_list_len"] == 0)).sum())
        self.recoveries += int(recovered.sum())
        self.table_end_stops += int(
            (running_before & after["stop_flags"] & ~after["is_block_step"]).sum()
        )
