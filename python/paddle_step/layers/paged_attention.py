"""The paged KV cache and the flat batch one engine step runs: slot mapping through the
block tables, the flattened prefill and decode rows, and the prefill layout."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, NamedTuple, TypedDict

import numpy as np
import paddle

import paddle_step_ops as _library

from ..host_memory import refuse_past_available_memory, untouched_zeros

if TYPE_CHECKING:
    from ..config import ModelConfig

__all__ = [
    "FlatBatch",
    "KeptSlots",
    "PagedKVCache",
    "PrefillLayout",
    "RowsRead",
    "DecodeInputs",
    "build_flat_batch",
    "slots_through_table",
]


class KeptSlots:
    """The entries of ``slots`` [N] (int64) that are >= 0, i.e. that write to the cache."""

    def __init__(self, slots: paddle.Tensor) -> None:
        kept = paddle.nonzero(slots >= 0).flatten()
        self.count = kept.shape[0]
        # The usual step writes every token: then nothing needs gathering.
        self._index = None if self.count == slots.shape[0] else kept
        self.slots = self.select(slots)

    def select(self, x: paddle.Tensor) -> paddle.Tensor:
        """The kept rows of ``x`` [N, ...]."""
        return x if self._index is None else paddle.gather(x, self._index)


class RowsRead:
    """The tokens of a step whose hidden states its logits read: those ``last_token_index``
    [R] (-1: none) and ``extra_index`` [N] (prompt logprobs) name, in token order
    (``output_rows``, int64; None where that is every token, as in a decode step), and both
    indexes into those rows (``last_rows``: ``last_token_index`` as a Python list, read
    once). The layers may then finish only those rows: a prompt's other tokens need their
    keys and values, not their last layer's output."""

    def __init__(
        self,
        tokens: int,
        last_token_index: paddle.Tensor,
        extra_index: paddle.Tensor | None = None,
    ) -> None:
        self.output_rows = None
        self.last_token_index, self.extra_index = last_token_index, extra_index
        last = last_token_index.numpy()
        self.last_rows = last.tolist()
        if extra_index is None and self.last_rows == list(range(tokens)):
            return  # a decode step (the usual one: tested first, in plain Python)
        extra = None if extra_index is None else extra_index.numpy()
        read = last[last >= 0] if extra is None else np.concatenate([last[last >= 0], extra])
        if np.any(read[1:] <= read[:-1]):  # rows' last tokens alone come in token order
            read = np.unique(read)
        if read.size == tokens:
            return
        # A step that reads no row (prompt chunks that sample nothing) still finishes
        # one, so that the logits of its rows (zeros) have a row to come from.
        read = read if read.size else np.zeros(1, np.int64)
        self.output_rows = paddle.to_tensor(read.astype(np.int64))
        rows = np.where(last >= 0, np.searchsorted(read, last), -1).astype(np.int64)
        self.last_rows = rows.tolist()
        self.last_token_index = paddle.to_tensor(rows)
        self.extra_index = (
            None
            if extra is None
            else paddle.to_tensor(np.searchsorted(read, extra).astype(np.int64))
        )


def _dense(x: paddle.Tensor) -> paddle.Tensor:
    """``x`` in plain row-major order (a split or slice may be a strided view)."""
    return x if x.is_contiguous() else x.contiguous()


def _check_fits_in_memory(shape: list[int], dtype: str) -> None:
    """Refuses keys and values of ``shape`` past the available memory, naming the sizes."""
    layers, slots, kv_heads, head_dim = shape
    refuse_past_available_memory(
        2 * math.prod(shape) * paddle.to_tensor([], dtype=dtype).element_size(),
        "the KV cache",
        f"{slots} token slots x {layers} layers x {kv_heads} KV heads x {head_dim}, keys and "
        f"values in {dtype}",
        "give it fewer blocks (--kv-blocks, or a smaller --max-batch or --max-model-len)",
    )


def _zeros(shape: list[int], dtype: str) -> paddle.Tensor:
    """A zero cache tensor. On the CPU in float32 or float64, NumPy's ``untouched_zeros``
    through DLPack, which Paddle 3 shares: a block's pages are mapped when a step first
    writes it, so a large cache costs neither start-up time nor resident memory for blocks
    not yet used (Paddle 2.6 copies them, which costs what ``paddle.zeros`` costs)."""
    if paddle.get_device() == "cpu" and dtype in ("float32", "float64"):
        return paddle.utils.dlpack.from_dlpack(untouched_zeros(shape, dtype).__dlpack__())
    return paddle.zeros(shape, dtype=dtype)


class PagedKVCache:
    """K and V of every layer, stored by slot (``slot = block_id * block_size + offset``).

    ``key`` and ``value`` have shape [num_layers, num_blocks * block_size, num_kv_heads,
    head_dim]; a sequence's tokens live in whichever blocks its block-table row names.

    A float32, float64 or bfloat16 cache on the CPU is written and read by our CPU ops
    (``ops/cpu_paged_attention.cc``): each decode token's attention reads its keys and
    values in place, through its block-table row. Elsewhere the writes are index puts
    and attention reads a gathered copy (``head_major_rows``, ``gather_head_major``).
    A bfloat16 cache serves a float32 model: the keys and values are rounded to bfloat16
    as they are written and widened back (exactly) as they are read; it runs on the CPU
    ops only.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "float32",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}"
            )
        if dtype == "bfloat16" and paddle.get_device() != "cpu":
            raise ValueError(
                "PagedKVCache: argument 'dtype' (EngineConfig.kv_cache_dtype) 'bfloat16': "
                f"expected the CPU, where our ops run, got device {paddle.get_device()!r}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = [num_layers, num_blocks * block_size, num_kv_heads, head_dim]
        if paddle.get_device() == "cpu":
            _check_fits_in_memory(shape, dtype)
        self.key = _zeros(shape, dtype)
        self.value = _zeros(shape, dtype)
        self.uses_cpu_ops = self.key.place.is_cpu_place() and self.key.dtype in (
            paddle.float32,
            paddle.float64,
            paddle.bfloat16,
        )

    @classmethod
    def for_config(
        cls, config: ModelConfig, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto"
    ) -> PagedKVCache:
        """A cache shaped for a model built from ``config``, storing keys and values in
        ``kv_cache_dtype`` (``EngineConfig.kv_cache_dtype``: "auto" is the model's dtype)."""
        dtype = config.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        if dtype == "bfloat16" and config.dtype != "float32":
            raise ValueError(
                "kv_cache_dtype 'bfloat16': expected a model computing in float32, got "
                f"{config.dtype!r}"
            )
        return cls(
            num_blocks,
            block_size,
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            dtype,
        )

    @property
    def num_slots(self) -> int:
        """Token capacity: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    def write(self, layer: int, slots: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> None:
        """Store ``k[i]``/``v[i]`` ([N, num_kv_heads, head_dim]) at ``slots[i]`` ([N] int64).

        Entries with slot -1 are skipped (a plain index would wrap to the last slot).
        """
        self.write_kept(layer, KeptSlots(slots), k, v)

    def write_kept(self, layer: int, kept: KeptSlots, k: paddle.Tensor, v: paddle.Tensor) -> None:
        """``write`` with the kept entries found beforehand (once per step, for every layer)."""
        if kept.count == 0:
            return
        if self.uses_cpu_ops:
            _library.cpu_write_kv(self.key, self.value, layer, kept.slots,
                                  _dense(kept.select(k)), _dense(kept.select(v)))  # fmt: skip
            return
        layer_index = paddle.full_like(kept.slots, layer)
        paddle.index_put_(self.key, (layer_index, kept.slots), kept.select(k))
        paddle.index_put_(self.value, (layer_index, kept.slots), kept.select(v))

    def head_major_rows(self, slots: paddle.Tensor) -> paddle.Tensor:
        """Row of each (slot, KV head) in one layer's ``[num_slots * num_kv_heads, head_dim]``
        view: [N, num_kv_heads, K] int64 for ``slots`` [N, K] (all >= 0). Computed once per
        step for ``gather_head_major``, which every layer calls with it."""
        heads = self.key.shape[2]
        head_index = paddle.arange(heads, dtype="int64").reshape([1, heads, 1])
        return slots.unsqueeze(1) * heads + head_index

    def gather_head_major(
        self, layer: int, rows: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """K and V at ``rows`` (from ``head_major_rows``), each [N, num_kv_heads, K, head_dim]:
        heads before keys, the layout attention multiplies in, so no transpose is needed
        (paddle's CPU matmul is very slow on transposed, strided views)."""
        flat = rows.flatten()
        head_dim = self.key.shape[3]
        k = paddle.gather(self.key[layer].reshape([-1, head_dim]), flat)
        v = paddle.gather(self.value[layer].reshape([-1, head_dim]), flat)
        if self.key.dtype == paddle.bfloat16:  # attention computes in float32
            k, v = k.astype("float32"), v.astype("float32")
        return k.reshape([*rows.shape, head_dim]), v.reshape([*rows.shape, head_dim])

    def view(
        self,
        layer: int,
        block_tables: paddle.Tensor,
        rows: paddle.Tensor,
        positions: paddle.Tensor,
    ) -> tuple:
        """Where tokens find their keys in ``layer``, as our CPU ops take it: token t reads
        row ``rows[t]`` of ``block_tables`` at positions ``0 .. positions[t]`` (columns past
        the table or holding -1 have no key). Only for a cache with ``uses_cpu_ops``."""
        return (self.key, self.value, layer, _dense(block_tables), rows, positions,
                self.block_size)  # fmt: skip

    def decode_attention(
        self,
        layer: int,
        q: paddle.Tensor,
        block_tables: paddle.Tensor,
        rows: paddle.Tensor,
        positions: paddle.Tensor,
        scale: float,
    ) -> paddle.Tensor:
        """Attention of tokens ``q`` [T, heads, head_dim] over their own sequences' keys
        (``view``). Returns [T, heads * head_dim]."""
        return _library.cpu_decode_attention(
            _dense(q), self.view(layer, block_tables, rows, positions), scale
        )


def slots_through_table(
    tables: paddle.Tensor, positions: paddle.Tensor, block_size: int
) -> paddle.Tensor:
    """Slot of each position, looked up in its block-table row.

    ``tables`` [N, M] holds one block-table row per entry of ``positions`` [N, K] (int64).
    Returns [N, K] int64 ``table[pos // block_size] * block_size + pos % block_size``, or -1
    where the column is past the table or holds a negative (unallocated) block.
    """
    num_cols = tables.shape[1]
    cols = positions // block_size
    in_table = cols < num_cols
    blocks = paddle.take_along_axis(
        tables, paddle.clip(cols, max=num_cols - 1), axis=1, broadcast=False
    ).astype("int64")
    slots = blocks * block_size + positions % block_size
    return paddle.where(in_table & (blocks >= 0), slots, paddle.full_like(slots, -1))


class FlatBatch(TypedDict):
    """Keyword arguments of ``LlamaForCausalLM.forward_paged`` (T tokens, B rows)."""

    input_ids: paddle.Tensor  # [T] int64
    positions: paddle.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: paddle.Tensor  # [T] int64, cache slot each token's K/V goes to (-1: none)
    token_rows: paddle.Tensor  # [T] int64, block-table row (batch slot) of each token
    last_token_index: paddle.Tensor  # [B] int64, flat index of each row's last token, -1 if none
    block_tables: paddle.Tensor  # [B, M] int32
    max_context_len: int  # longest context (start + tokens) of any row this step


class DecodeInputs(NamedTuple):
    """``advance_step``'s outputs for a step: the rows where ``active`` ([B] bool) decode
    run the token, position and KV slot prepared here ([B] int64 each)."""

    active: paddle.Tensor
    tokens: paddle.Tensor
    positions: paddle.Tensor
    slot_mapping: paddle.Tensor


def build_flat_batch(
    input_ids: paddle.Tensor,
    seq_lens_this_time: paddle.Tensor,
    seq_lens_decoder: paddle.Tensor,
    block_tables: paddle.Tensor,
    block_size: int,
    on_host: bool | None = None,
    decode_inputs: DecodeInputs | None = None,
) -> FlatBatch:
    """Flatten one step of slot-indexed (FastDeploy-style) state for ``forward_paged``.

    Row ``b`` contributes ``seq_lens_this_time[b]`` tokens ``input_ids[b, :n]`` at positions
    ``seq_lens_decoder[b] ..``; rows with 0 tokens are skipped. Tokens are ordered by row,
    then by position. ``seq_lens_*`` may be [B] or [B, 1], any integer dtype. With
    ``decode_inputs``, the tokens of its active rows take their id, position and slot from
    it instead (``max_context_len`` still counts from ``seq_lens_decoder``).

    Reads the token count back to the host (the flat length is data-dependent) and raises
    ``ValueError`` if no row has a token. On the CPU the index arithmetic runs in NumPy on
    the small per-row vectors (a few microseconds, against some twenty Paddle ops on
    [B, width]); ``on_host`` forces either way (the tests compare them).
    """
    batch = input_ids.shape[0]
    # From the shapes: a tensor's ``size`` runs an op (~50 us cold in a decode step).
    sizes = (math.prod(seq_lens_this_time.shape), math.prod(seq_lens_decoder.shape),
             block_tables.shape[0])  # fmt: skip
    if any(size != batch for size in sizes):
        raise ValueError(
            "input_ids, seq_lens_this_time, seq_lens_decoder and block_tables must have the "
            f"same batch size, got {batch}, {sizes[0]}, {sizes[1]} and {sizes[2]}"
        )
    if on_host is None:
        on_host = input_ids.place.is_cpu_place()
    if on_host:
        return _flat_batch_on_host(
            input_ids, seq_lens_this_time, seq_lens_decoder, block_tables, block_size,
            decode_inputs,
        )  # fmt: skip
    batch, width = input_ids.shape
    lens = seq_lens_this_time.reshape([-1]).astype("int64")
    starts = seq_lens_decoder.reshape([-1]).astype("int64")
    columns = paddle.arange(width, dtype="int64").unsqueeze(0).expand([batch, width])
    rows = paddle.arange(batch, dtype="int64").unsqueeze(1).expand([batch, width])
    is_token = columns < lens.unsqueeze(1)

    token_rows = paddle.masked_select(rows, is_token)
    if token_rows.shape[0] == 0:
        raise ValueError("build_flat_batch: no row has tokens this step")
    positions = paddle.gather(starts, token_rows) + paddle.masked_select(columns, is_token)
    slot_mapping = slots_through_table(
        paddle.gather(block_tables, token_rows), positions.unsqueeze(1), block_size
    ).squeeze(1)

    ends = paddle.cumsum(lens)
    last_token_index = paddle.where(lens > 0, ends - 1, paddle.full_like(ends, -1))
    max_context_len = int(paddle.max(paddle.where(lens > 0, starts + lens, lens)))
    flat_ids = paddle.masked_select(input_ids.astype("int64"), is_token)
    if decode_inputs is not None:
        # Gathered as int32: paddle 2.6 has no CPU gather kernel for bool.
        decodes = paddle.gather(decode_inputs.active.astype("int32"), token_rows) != 0

        def prepared(values: paddle.Tensor, flat: paddle.Tensor) -> paddle.Tensor:
            return paddle.where(decodes, paddle.gather(values, token_rows), flat)

        flat_ids = prepared(decode_inputs.tokens, flat_ids)
        positions = prepared(decode_inputs.positions, positions)
        slot_mapping = prepared(decode_inputs.slot_mapping, slot_mapping)
    return FlatBatch(
        input_ids=flat_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        token_rows=token_rows,
        last_token_index=last_token_index,
        block_tables=block_tables,
        max_context_len=max_context_len,
    )


def _slot_indices(batch: int) -> paddle.Tensor:
    """0 .. batch - 1 as an int64 tensor, made once per batch size (nothing writes it)."""
    if batch not in _SLOT_INDICES:
        _SLOT_INDICES[batch] = paddle.arange(batch, dtype="int64")
    return _SLOT_INDICES[batch]


_SLOT_INDICES: dict[int, paddle.Tensor] = {}


def _decode_rows_only(
    decode_inputs: DecodeInputs, lens: list[int], starts: list[int], block_tables: paddle.Tensor
) -> FlatBatch | None:
    """The flat batch of a step where every row with a token (``lens``, clipped to the
    row width) decodes it: the token, position and KV slot ``advance_step`` prepared, of
    those rows; None for any other step. At full batch, the decode inputs as they are (the
    forward pass only reads them) and the slot indices made once: no tensor made.

    Plain Python over the [B] values: after a step's weights have streamed through the
    caches, each NumPy call here ran cold (``build_flat_batch`` right after a 200 MB read:
    142-170 us with this check in NumPy, 69-76 us in Python with the batch-size check from
    the shapes; docs/performance-cpu.md)."""
    running = [count > 0 for count in lens]
    if not any(running) or any(count > 1 for count in lens):
        return None
    active = decode_inputs.active.numpy().reshape(-1).tolist()
    if not all(decodes for decodes, runs in zip(active, running) if runs):
        return None
    prepared = (decode_inputs.tokens, decode_inputs.positions, decode_inputs.slot_mapping)
    if all(running):
        rows = last_token_index = _slot_indices(len(lens))
    else:
        kept = [row for row, runs in enumerate(running) if runs]
        rows = paddle.to_tensor(np.array(kept, dtype=np.int64))
        prepared = tuple(paddle.gather(values, rows) for values in prepared)
        # A running row's token is the flat batch's next one.
        order = itertools.accumulate(running)
        last = [index - 1 if runs else -1 for index, runs in zip(order, running)]
        last_token_index = paddle.to_tensor(np.array(last, dtype=np.int64))
    return FlatBatch(
        input_ids=prepared[0],
        positions=prepared[1],
        slot_mapping=prepared[2],
        token_rows=rows,
        last_token_index=last_token_index,
        block_tables=block_tables,
        max_context_len=max(start + 1 if runs else 0 for start, runs in zip(starts, running)),
    )


def _flat_batch_on_host(
    input_ids: paddle.Tensor,
    seq_lens_this_time: paddle.Tensor,
    seq_lens_decoder: paddle.Tensor,
    block_tables: paddle.Tensor,
    block_size: int,
    decode_inputs: DecodeInputs | None,
) -> FlatBatch:
    """``build_flat_batch`` with its index arithmetic in NumPy (plain Python for the usual
    decode step)."""
    batch, width = input_ids.shape
    lens_read = seq_lens_this_time.numpy().reshape(-1)
    starts_read = seq_lens_decoder.numpy().reshape(-1)
    if decode_inputs is not None:
        clipped = [min(max(count, 0), width) for count in lens_read.tolist()]
        decoding = _decode_rows_only(decode_inputs, clipped, starts_read.tolist(), block_tables)
        if decoding is not None:
            return decoding
    # As the [B, width] mask of the Paddle path.
    lens = np.clip(lens_read.astype(np.int64), 0, width)
    starts = starts_read.astype(np.int64)
    token_rows = np.repeat(np.arange(batch, dtype=np.int64), lens)
    if token_rows.size == 0:
        raise ValueError("build_flat_batch: no row has tokens this step")
    ends = np.cumsum(lens)
    columns = np.arange(token_rows.size, dtype=np.int64) - np.repeat(ends - lens, lens)
    positions = starts[token_rows] + columns
    tables = block_tables.numpy()
    table_columns = positions // block_size
    in_table = table_columns < tables.shape[1]
    blocks = tables[token_rows, np.minimum(table_columns, tables.shape[1] - 1)].astype(np.int64)
    slot_mapping = np.where(
        in_table & (blocks >= 0), blocks * block_size + positions % block_size, -1
    )
    ids = paddle.gather(input_ids.flatten(), paddle.to_tensor(token_rows * width + columns))
    ids = ids.astype("int64")
    max_context_len = int(np.max(np.where(lens > 0, starts + lens, lens)))
    if decode_inputs is not None:
        decodes = decode_inputs.active.numpy().reshape(-1)[token_rows]
        if decodes.any():

            def prepared(values: paddle.Tensor, flat: np.ndarray) -> np.ndarray:
                return np.where(decodes, values.numpy().reshape(-1)[token_rows], flat)

            ids = paddle.to_tensor(prepared(decode_inputs.tokens, ids.numpy()))
            positions = prepared(decode_inputs.positions, positions)
            slot_mapping = prepared(decode_inputs.slot_mapping, slot_mapping)
    return FlatBatch(
        input_ids=ids,
        positions=paddle.to_tensor(positions),
        slot_mapping=paddle.to_tensor(slot_mapping),
        token_rows=paddle.to_tensor(token_rows),
        last_token_index=paddle.to_tensor(np.where(lens > 0, ends - 1, -1)),
        block_tables=block_tables,
        max_context_len=max_context_len,
    )


class PrefillLayout:
    """How the tokens of a flat step split into three kinds of rows, and how they pad.

    - A *prefill* row's first token this step is at position 0 (a new or recovered
      sequence): its tokens attend only to each other, so they use their own fresh K/V,
      padded into [R, L] (R such rows, L the longest), instead of reading every key back
      from the cache for every token.
    - A *chunk* row has several tokens from a position > 0 (a prompt continuing after
      cached blocks or an earlier chunk): its tokens, padded into [Rc, Lc], attend to the
      row's keys read back from the cache once per row ([Rc, Kc] slots, Kc its longest
      context), this step's own K/V included (the cache is written first).
    - The other tokens decode, one per row: each reads its keys through its block table.

    Built on the host from ``positions`` and ``token_rows``, whose rows must be
    contiguous and in position order, as ``build_flat_batch`` lays them out.
    """

    def __init__(self, positions: np.ndarray, token_rows: np.ndarray) -> None:
        count = positions.shape[0]
        row_starts = np.flatnonzero(np.r_[True, token_rows[1:] != token_rows[:-1]])
        row_lengths = np.diff(np.r_[row_starts, count])
        first_positions = positions[row_starts]
        is_prefill = first_positions == 0
        is_chunk = ~is_prefill & (row_lengths > 1)

        starts, lengths = row_starts[is_prefill], row_lengths[is_prefill]
        self.num_rows = starts.shape[0]
        self.width = int(lengths.max()) if self.num_rows else 0
        self.prefill_tokens, padded, real = self._pad(starts, lengths, self.width)
        chunk_starts, chunk_lengths = row_starts[is_chunk], row_lengths[is_chunk]
        self.num_chunk_rows = chunk_starts.shape[0]
        self.chunk_width = int(chunk_lengths.max()) if self.num_chunk_rows else 0
        self.chunk_tokens, chunk_padded, chunk_real = self._pad(
            chunk_starts, chunk_lengths, self.chunk_width
        )
        is_other = np.ones(count, dtype=bool)
        is_other[self.prefill_tokens] = False
        is_other[self.chunk_tokens] = False
        self.decode_tokens = np.flatnonzero(is_other)
        # Tensors only for the parts this step has: a pure decode step adds no work.
        if self.num_rows:
            self.padded_index = paddle.to_tensor(padded.reshape(-1).astype(np.int64))  # [R*L]
            self.unpad_index = paddle.to_tensor(np.flatnonzero(real.reshape(-1)).astype(np.int64))
            # Key j is visible to query i if it is a real token and j <= i; padding queries
            # see real keys too, so no softmax row is empty (their outputs are dropped).
            columns = np.arange(self.width)
            causal = real[:, None, :] & (columns[None, :, None] >= columns[None, None, :])
            self.causal = paddle.to_tensor(causal[:, None, None])  # [R, 1, 1, L, L]
        if self.num_chunk_rows:
            self.chunk_padded_index = paddle.to_tensor(chunk_padded.reshape(-1).astype(np.int64))
            self.chunk_unpad_index = paddle.to_tensor(
                np.flatnonzero(chunk_real.reshape(-1)).astype(np.int64)
            )
            self.chunk_table_rows = paddle.to_tensor(token_rows[chunk_starts].astype(np.int64))
            first = first_positions[is_chunk]
            # Padding queries sit past their row's last token; they see its real keys.
            query_positions = first[:, None] + np.arange(self.chunk_width)[None, :]
            self.chunk_query_positions = paddle.to_tensor(query_positions.astype(np.int64))
            self.chunk_context = int((first + chunk_lengths).max())
        groups = [self.prefill_tokens, self.chunk_tokens, self.decode_tokens]
        self.is_mixed = sum(group.size > 0 for group in groups) > 1
        if self.is_mixed:
            # Token order of [prefill outputs, chunk outputs, decode outputs].
            order = np.concatenate(groups)
            self.restore_order = paddle.to_tensor(np.argsort(order).astype(np.int64))

    @staticmethod
    def _pad(
        starts: np.ndarray, lengths: np.ndarray, width: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows of ``lengths`` tokens from flat index ``starts`` padded to ``width``: the
        flat indices of their tokens (ascending), the padded index grid [R, width] (0 in
        padding) and its real-token mask."""
        columns = np.arange(width)
        real = columns[None, :] < lengths[:, None]
        padded = np.where(real, starts[:, None] + columns[None, :], 0)
        return padded[real], padded, real
