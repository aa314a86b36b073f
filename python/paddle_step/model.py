"""A tiny Llama-style decoder in Paddle ops, runnable with and without a paged KV cache.

The model has random weights drawn from a seeded generator (no checkpoint), which is enough
to check a serving engine end to end: ``TinyLlama.forward_naive`` recomputes every sequence
from scratch and is the reference; ``TinyLlama.forward_paged`` runs one flattened step that
mixes prefill and decode rows, keeps K/V in a ``PagedKVCache`` and reads them back through
the block tables. The two give the same logits up to float rounding, so greedy decoding with
either gives the same tokens.

Typical engine step, from FastDeploy-style slot-indexed state::

    batch = build_flat_batch(input_ids, seq_lens_this_time, seq_lens_decoder,
                             block_tables, cache.block_size)
    logits = model.forward_paged(**batch, kv_cache=cache)   # [B, vocab]
    next_tokens = paddle.argmax(logits, axis=-1)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np
import paddle
from paddle import nn

from .dense_blocks import AllReduceFn, ModelBlocks, model_blocks
from .tokenizer import ByteTokenizer

# attend(q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> attention output [T, H * D]
AttendFn = Callable[[paddle.Tensor, paddle.Tensor, paddle.Tensor], paddle.Tensor]


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x's frequency-dependent rotary scaling (``rope_type: llama3``).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    stretched by ``factor``, shorter than ``.. / high_freq_factor`` kept, and the band
    between interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.high_freq_factor > self.low_freq_factor > 0 or self.factor <= 0:
            raise ValueError(
                "Llama3RopeScaling: expected factor > 0 and high_freq_factor > low_freq_factor "
                f"> 0, got factor={self.factor}, low_freq_factor={self.low_freq_factor}, "
                f"high_freq_factor={self.high_freq_factor}"
            )

    def scale(self, inv_freq: np.ndarray) -> np.ndarray:
        """The scaled inverse frequencies (float64, same shape as ``inv_freq``)."""
        context = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        smooth = (context / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        interpolated = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        long_waves = np.where(
            wavelen > context / self.low_freq_factor, inv_freq / self.factor, interpolated
        )
        return np.where(wavelen < context / self.high_freq_factor, inv_freq, long_waves)


@dataclass(frozen=True)
class ModelConfig:
    """Shape, numerics and seed of a ``TinyLlama``.

    The defaults are the random test model; ``paddle_step.hf_config`` fills the rest from a
    Hugging Face checkpoint (``explicit_head_dim``, biases, tied embeddings, rope scaling,
    context length).
    """

    vocab_size: int = ByteTokenizer().vocab_size
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: str = "float32"
    seed: int = 0
    explicit_head_dim: int | None = None  # None: hidden_size // num_heads
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    o_proj_bias: bool = False  # a bias on the attention output projection
    tie_word_embeddings: bool = False  # the lm head is the embedding matrix, transposed
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int | None = None  # context length; None: unbounded

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        if self.explicit_head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                f"({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(
                f"head_dim ({self.head_dim}) must be positive and even for rotary embedding"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        if self.explicit_head_dim is not None:
            return self.explicit_head_dim
        return self.hidden_size // self.num_heads


# draw(rng) -> a parameter's seeded random values (drawn in a fixed order, parameter by
# parameter, so the random model does not change when parameters are added after them).
Draw = Callable[[np.random.Generator], np.ndarray]
# values(name, shape, draw) -> the array parameter ``name`` starts from: a checkpoint's, or
# with none, ``draw(rng)``.
ParameterValues = Callable[[str, list[int], Draw], np.ndarray]


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


class PagedKVCache:
    """K and V of every layer, stored by slot (``slot = block_id * block_size + offset``).

    ``key`` and ``value`` have shape [num_layers, num_blocks * block_size, num_kv_heads,
    head_dim]; a sequence's tokens live in whichever blocks its block-table row names.
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
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = [num_layers, num_blocks * block_size, num_kv_heads, head_dim]
        self.key = paddle.zeros(shape, dtype=dtype)
        self.value = paddle.zeros(shape, dtype=dtype)

    @classmethod
    def for_config(cls, config: ModelConfig, num_blocks: int, block_size: int) -> PagedKVCache:
        """A cache shaped for a model built from ``config``."""
        return cls(
            num_blocks,
            block_size,
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            config.dtype,
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
        return k.reshape([*rows.shape, head_dim]), v.reshape([*rows.shape, head_dim])


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
    """Keyword arguments of ``TinyLlama.forward_paged`` (T tokens, B rows)."""

    input_ids: paddle.Tensor  # [T] int64
    positions: paddle.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: paddle.Tensor  # [T] int64, cache slot each token's K/V goes to (-1: none)
    token_rows: paddle.Tensor  # [T] int64, block-table row (batch slot) of each token
    last_token_index: paddle.Tensor  # [B] int64, flat index of each row's last token, -1 if none
    block_tables: paddle.Tensor  # [B, M] int32
    max_context_len: int  # longest context (start + tokens) of any row this step


def build_flat_batch(
    input_ids: paddle.Tensor,
    seq_lens_this_time: paddle.Tensor,
    seq_lens_decoder: paddle.Tensor,
    block_tables: paddle.Tensor,
    block_size: int,
) -> FlatBatch:
    """Flatten one step of slot-indexed (FastDeploy-style) state for ``forward_paged``.

    Row ``b`` contributes ``seq_lens_this_time[b]`` tokens ``input_ids[b, :n]`` at positions
    ``seq_lens_decoder[b] ..``; rows with 0 tokens are skipped. Tokens are ordered by row,
    then by position. ``seq_lens_*`` may be [B] or [B, 1], any integer dtype.

    Reads the token count back to the host (the flat length is data-dependent) and raises
    ``ValueError`` if no row has a token.
    """
    batch, width = input_ids.shape
    lens = seq_lens_this_time.reshape([-1]).astype("int64")
    starts = seq_lens_decoder.reshape([-1]).astype("int64")
    if lens.shape[0] != batch or starts.shape[0] != batch or block_tables.shape[0] != batch:
        raise ValueError(
            "input_ids, seq_lens_this_time, seq_lens_decoder and block_tables must have the "
            f"same batch size, got {batch}, {lens.shape[0]}, {starts.shape[0]} and "
            f"{block_tables.shape[0]}"
        )
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
    return FlatBatch(
        input_ids=paddle.masked_select(input_ids.astype("int64"), is_token),
        positions=positions,
        slot_mapping=slot_mapping,
        token_rows=token_rows,
        last_token_index=last_token_index,
        block_tables=block_tables,
        max_context_len=int(paddle.max(paddle.where(lens > 0, starts + lens, lens))),
    )


class PrefillLayout:
    """Which tokens of a flat step are prefill tokens, and how they pad into a batch.

    A prefill row is a row whose first token this step is at position 0 (a new or
    recovered sequence): its tokens attend only to each other, so they can use their own
    fresh K/V, padded into [R, L] (R prefill rows, L the longest), instead of reading every
    key of the context back from the cache for every token ([T, K] slots). The other
    (decode) tokens read their keys through the block tables. Built on the host from
    ``positions`` and ``token_rows``, whose rows must be contiguous and in position order,
    as ``build_flat_batch`` lays them out.
    """

    def __init__(self, positions: np.ndarray, token_rows: np.ndarray) -> None:
        count = positions.shape[0]
        row_starts = np.flatnonzero(np.r_[True, token_rows[1:] != token_rows[:-1]])
        row_lengths = np.diff(np.r_[row_starts, count])
        is_prefill = positions[row_starts] == 0
        starts, lengths = row_starts[is_prefill], row_lengths[is_prefill]
        self.num_rows = starts.shape[0]
        self.width = int(lengths.max()) if self.num_rows else 0
        columns = np.arange(self.width)
        real = columns[None, :] < lengths[:, None]  # [R, L]
        padded = np.where(real, starts[:, None] + columns[None, :], 0)
        self.prefill_tokens = padded[real]  # flat indices, ascending
        is_prefill_token = np.zeros(count, dtype=bool)
        is_prefill_token[self.prefill_tokens] = True
        self.decode_tokens = np.flatnonzero(~is_prefill_token)
        # Tensors only for the parts this step has: a pure decode step adds no work.
        if self.num_rows:
            self.padded_index = paddle.to_tensor(padded.reshape(-1).astype(np.int64))  # [R*L]
            self.unpad_index = paddle.to_tensor(np.flatnonzero(real.reshape(-1)).astype(np.int64))
            # Key j is visible to query i if it is a real token and j <= i; padding queries
            # see real keys too, so no softmax row is empty (their outputs are dropped).
            causal = real[:, None, :] & (columns[None, :, None] >= columns[None, None, :])
            self.causal = paddle.to_tensor(causal[:, None, None])  # [R, 1, 1, L, L]
        self.is_mixed = bool(self.num_rows and self.decode_tokens.size)
        if self.is_mixed:
            # Token order of [prefill outputs, decode outputs].
            order = np.concatenate([self.prefill_tokens, self.decode_tokens])
            self.restore_order = paddle.to_tensor(np.argsort(order).astype(np.int64))


class RMSNormWeight(nn.Layer):
    """The learned scale of an RMSNorm, which ``dense_blocks.rms_norm`` applies inside the
    blocks; a layer of its own so that the parameter is named ``<norm>.weight``."""

    def __init__(self, weight: np.ndarray, dtype: str) -> None:
        super().__init__()
        self.weight = self.create_parameter(
            list(weight.shape),
            dtype=dtype,
            default_initializer=nn.initializer.Assign(weight.astype(dtype)),
        )


def _present(*tensors: paddle.Tensor | None) -> list[paddle.Tensor]:
    """The optional trailing arguments of a block (biases) that this model has."""
    return [tensor for tensor in tensors if tensor is not None]


def _ones(size: int) -> Draw:
    return lambda _rng: np.ones(size)


def _small_normal(size: int) -> Draw:
    return lambda rng: 0.1 * rng.standard_normal(size)


def _scaled_normal(fan_in: int, fan_out: int) -> Draw:
    # 1/sqrt(fan_in) keeps activations O(1) through the stack.
    return lambda rng: rng.standard_normal((fan_in, fan_out)) / math.sqrt(fan_in)


class DecoderLayer(nn.Layer):
    """Pre-norm block: RMSNorm -> GQA attention -> residual, RMSNorm -> SwiGLU -> residual.

    How attention finds its keys is left to the caller (``attend``), which is the only thing
    that differs between the naive and the paged forward. Matrices are [in, out] (x @ W).
    The dense parts around attention are ``blocks`` (``paddle_step.dense_blocks``), shared
    by the model's layers.

    For one tensor-parallel rank's shard (``blocks`` made with an ``all_reduce``), ``wo``
    and ``w_down`` are row slices: their products are partial sums, reduced before the
    residual add, and ``o_bias`` is added once, after the reduction.
    """

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        values: ParameterValues,
        blocks: ModelBlocks,
    ) -> None:
        super().__init__()
        self.config = config
        self.blocks = blocks
        hidden, head_dim = config.hidden_size, config.head_dim
        q_width, kv_width = config.num_heads * head_dim, config.num_kv_heads * head_dim

        def parameter(name: str, shape: list[int], draw: Draw) -> paddle.Tensor:
            array = values(f"{prefix}.{name}", shape, draw)
            return self.create_parameter(
                shape,
                dtype=config.dtype,
                default_initializer=nn.initializer.Assign(array.astype(config.dtype)),
            )

        def linear(name: str, fan_in: int, fan_out: int) -> paddle.Tensor:
            return parameter(name, [fan_in, fan_out], _scaled_normal(fan_in, fan_out))

        def bias(name: str, size: int, present: bool) -> paddle.Tensor | None:
            return parameter(name, [size], _small_normal(size)) if present else None

        def norm(name: str) -> RMSNormWeight:
            weight = values(f"{prefix}.{name}.weight", [hidden], _ones(hidden))
            return RMSNormWeight(weight, config.dtype)

        self.attn_norm = norm("attn_norm")
        self.wq = linear("wq", hidden, q_width)
        self.q_bias = bias("q_bias", q_width, config.qkv_bias)
        self.wk = linear("wk", hidden, kv_width)
        self.k_bias = bias("k_bias", kv_width, config.qkv_bias)
        self.wv = linear("wv", hidden, kv_width)
        self.v_bias = bias("v_bias", kv_width, config.qkv_bias)
        self.wo = linear("wo", q_width, hidden)
        self.o_bias = bias("o_bias", hidden, config.o_proj_bias)
        self.mlp_norm = norm("mlp_norm")
        self.w_gate = linear("w_gate", hidden, config.intermediate_size)
        self.w_up = linear("w_up", hidden, config.intermediate_size)
        self.w_down = linear("w_down", config.intermediate_size, hidden)
        self._fused = None

    def _fused_weights(self) -> tuple[paddle.Tensor, paddle.Tensor | None, paddle.Tensor]:
        """``[wq | wk | wv]`` (with their biases) and ``[w_gate | w_up]``, concatenated on
        first use: one matmul instead of three and one instead of two, fewer eager ops per
        layer. Copies, made after construction (so after any sharding), while the
        parameters keep their names for checkpoints."""
        if self._fused is None:
            biases = (self.q_bias, self.k_bias, self.v_bias)
            self._fused = (
                paddle.concat([self.wq, self.wk, self.wv], axis=1),
                None if self.q_bias is None else paddle.concat(biases),
                paddle.concat([self.w_gate, self.w_up], axis=1),
            )
        return self._fused

    def forward(
        self, x: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor], attend: AttendFn
    ) -> paddle.Tensor:
        """``x`` [T, hidden]; ``rope`` = (cos, sin) [T, 1, head_dim] for each token's
        position."""
        w_qkv, qkv_bias, w_gate_up = self._fused_weights()
        cos, sin = rope
        q, k, v = self.blocks.attention_inputs(
            x, self.attn_norm.weight, w_qkv, cos, sin, *_present(qkv_bias)
        )
        return self.blocks.output_and_mlp(
            x,
            attend(q, k, v),
            self.wo,
            self.mlp_norm.weight,
            w_gate_up,
            self.w_down,
            *_present(self.o_bias),
        )


class TinyLlama(nn.Layer):
    """Llama-style decoder (inference only), with seeded random weights or given ones.

    Head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention);
    rotary embedding uses each token's absolute position.

    ``weights`` maps every parameter name (as ``named_parameters`` lists them, e.g.
    ``layers.0.wq``; matrices [in, out]) to its array; without it the weights are drawn from
    ``config.seed``.

    ``all_reduce``: for one tensor-parallel rank's shard (``config`` with this rank's head
    counts and intermediate size, ``weights`` its slices, see ``paddle_step.tensor_parallel``):
    sums the row-parallel products over the ranks.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, np.ndarray] | None = None,
        *,
        all_reduce: AllReduceFn | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        if weights is None:
            rng = np.random.default_rng(config.seed)

            def values(name: str, shape: list[int], draw: Draw) -> np.ndarray:
                return draw(rng)
        else:

            def values(name: str, shape: list[int], draw: Draw) -> np.ndarray:
                if name not in weights:
                    raise ValueError(f"TinyLlama: argument 'weights': no array for {name!r}")
                array = np.asarray(weights[name])
                if list(array.shape) != shape:
                    raise ValueError(
                        f"TinyLlama: argument 'weights': {name!r}: expected shape {shape}, "
                        f"got {list(array.shape)}"
                    )
                return array

        hidden, vocab = config.hidden_size, config.vocab_size
        self.blocks = model_blocks(config, all_reduce)

        def parameter(name: str, shape: list[int], draw: Draw) -> paddle.Tensor:
            return self.create_parameter(
                shape,
                dtype=config.dtype,
                default_initializer=nn.initializer.Assign(
                    values(name, shape, draw).astype(config.dtype)
                ),
            )

        # Unit-variance embeddings and an lm_head scaled for O(1) logits keep the logits
        # spread out, so greedy decoding wanders over many tokens instead of tying.
        self.embed = parameter(
            "embed", [vocab, hidden], lambda rng: rng.standard_normal((vocab, hidden))
        )
        self.layers = nn.LayerList(
            [
                DecoderLayer(config, f"layers.{i}", values, self.blocks)
                for i in range(config.num_layers)
            ]
        )
        self.final_norm = RMSNormWeight(
            values("final_norm.weight", [hidden], _ones(hidden)), config.dtype
        )
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else parameter("lm_head", [hidden, vocab], _scaled_normal(hidden, vocab))
        )
        if weights is not None:
            unused = sorted(set(weights) - {name for name, _ in self.named_parameters()})
            if unused:
                raise ValueError(
                    f"TinyLlama: argument 'weights': arrays for no parameter: {unused}"
                )
        half = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
        inv_freq = 1.0 / config.rope_theta**half
        if config.rope_scaling is not None:
            inv_freq = config.rope_scaling.scale(inv_freq)
        self.inv_freq = paddle.to_tensor(inv_freq.astype(config.dtype))  # [head_dim / 2]
        for param in self.parameters():
            param.stop_gradient = True

    def _rope(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        angles = positions.astype(self.config.dtype).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        # [T, 1, head_dim], rotate-half layout, broadcast over heads.
        angles = paddle.concat([angles, angles], axis=-1).unsqueeze(1)
        return paddle.cos(angles), paddle.sin(angles)

    def _run_layers(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        attend_for_layer: Callable[[int], AttendFn],
    ) -> paddle.Tensor:
        """Hidden states [T, hidden] of the tokens ``input_ids`` [T], before the final norm
        (``_logits`` applies it, to the rows it needs)."""
        x = paddle.gather(self.embed, input_ids)
        rope = self._rope(positions)
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, attend_for_layer(index))
        return x

    def _attention(
        self, q: paddle.Tensor, keys: paddle.Tensor, values: paddle.Tensor, mask: paddle.Tensor
    ) -> paddle.Tensor:
        """Softmax attention of query batches over their own key sets, heads first.

        ``q`` [N, KVH, G, T, D] (G = H // KVH query heads per KV head); ``keys``/``values``
        [N, KVH, K, D]; ``mask`` (``_additive_mask``) broadcastable to [N, KVH, G, T, K].
        All contiguous: paddle's CPU matmul is very slow on strided (transposed) views.
        Returns [N, KVH, G, T, D].
        """
        scores = paddle.matmul(q, keys.unsqueeze(2), transpose_y=True) / math.sqrt(
            self.config.head_dim
        )
        scores = scores + mask
        return paddle.matmul(nn.functional.softmax(scores, axis=-1), values.unsqueeze(2))

    def _additive_mask(self, visible: paddle.Tensor) -> paddle.Tensor:
        """0 where ``visible`` (bool), -inf elsewhere: added to the scores, made once per
        step for every layer (an add instead of a where and a fill per layer)."""
        return paddle.where(
            visible,
            paddle.zeros(visible.shape, self.config.dtype),
            paddle.full(visible.shape, float("-inf"), self.config.dtype),
        )

    def _grouped_attention(
        self, q: paddle.Tensor, keys: paddle.Tensor, values: paddle.Tensor, mask: paddle.Tensor
    ) -> paddle.Tensor:
        """``_attention`` over token-major inputs: ``q`` [N, T, H, D]; ``keys``/``values``
        [N, K, KVH, D]; ``mask`` broadcastable to [N, KVH, G, T, K]. Returns
        [N, T, H * D]."""
        cfg = self.config
        batches, tokens = q.shape[0], q.shape[1]
        groups = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape([batches, tokens, cfg.num_kv_heads, groups, cfg.head_dim])
        q = q.transpose([0, 2, 3, 1, 4]).contiguous()  # [N, KVH, G, T, D]
        k = keys.transpose([0, 2, 1, 3]).contiguous()  # [N, KVH, K, D]
        v = values.transpose([0, 2, 1, 3]).contiguous()
        out = self._attention(q, k, v, mask).transpose([0, 3, 1, 2, 4])  # [N, T, KVH, G, D]
        return out.reshape([batches, tokens, cfg.num_heads * cfg.head_dim])

    def _logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Logits [N, vocab] of hidden states [N, hidden] from ``_run_layers``."""
        head = self.embed if self.lm_head is None else self.lm_head
        return self.blocks.logits(hidden, self.final_norm.weight, head)

    def _naive_hidden(self, sequence: Sequence[int]) -> paddle.Tensor:
        """Hidden states [len(sequence), hidden] of one whole sequence, no cache (before the
        final norm)."""
        ids = paddle.to_tensor(list(sequence), dtype="int64")
        length = ids.shape[0]
        causal = self._additive_mask(paddle.tril(paddle.ones([length, length], dtype="bool")))

        def self_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
            return self._grouped_attention(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal
            ).squeeze(0)

        return self._run_layers(
            ids, paddle.arange(length, dtype="int64"), lambda _layer: self_attention
        )

    @paddle.no_grad()
    def forward_naive(self, token_ids: list[list[int]]) -> paddle.Tensor:
        """Reference forward: recompute each whole sequence, no cache.

        Returns the logits of the last token of each sequence, [len(token_ids), vocab].
        """
        last_hidden = [self._naive_hidden(sequence)[-1] for sequence in token_ids]
        return self._logits(paddle.stack(last_hidden))

    @paddle.no_grad()
    def logits_all_positions(self, token_ids: Sequence[int]) -> paddle.Tensor:
        """Reference logits [len(token_ids), vocab] at every position of one sequence."""
        return self._logits(self._naive_hidden(token_ids))

    @paddle.no_grad()
    def forward_paged(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        slot_mapping: paddle.Tensor,
        token_rows: paddle.Tensor,
        last_token_index: paddle.Tensor,
        block_tables: paddle.Tensor,
        max_context_len: int,
        kv_cache: PagedKVCache,
    ) -> paddle.Tensor:
        """One serving step over a flattened batch of T tokens from B block-table rows.

        Args (see ``FlatBatch``; ``build_flat_batch`` makes them from slot-indexed state):
            input_ids: [T] int64 token ids; prefill rows contribute several, decode rows one.
            positions: [T] int64 absolute position of each token in its sequence.
            slot_mapping: [T] int64 cache slot for each token's K/V; -1 writes nothing.
            token_rows: [T] int64 block-table row each token belongs to.
            last_token_index: [B] int64 flat index of each row's last token, -1 for a row
                with no token this step.
            block_tables: [B, M] int32/int64 block ids of each row's sequence, -1 unused.
            max_context_len: at least the largest ``position + 1`` in the step; decode
                tokens look their keys up for positions ``0 .. max_context_len - 1``.
            kv_cache: written at ``slot_mapping``, then read through ``block_tables``.

        Each token attends to its sequence's keys at positions up to and including its own.
        Tokens of a row starting at position 0 (a prefill) use the step's own K/V; the others
        read theirs back from the cache (so earlier steps' K/V must be there). Returns
        logits [B, vocab] of each row's last token; rows without a token get zeros.
        """
        layout = PrefillLayout(positions.numpy(), token_rows.numpy())
        kept_slots = KeptSlots(slot_mapping)
        if layout.num_rows:
            prefill_mask = self._additive_mask(layout.causal)
        if layout.decode_tokens.size:
            decode_positions, decode_rows = positions, token_rows
            if layout.is_mixed:
                decode_tokens = paddle.to_tensor(layout.decode_tokens.astype(np.int64))
                decode_positions = paddle.gather(positions, decode_tokens)
                decode_rows = paddle.gather(token_rows, decode_tokens)
            key_positions = paddle.arange(max_context_len, dtype="int64").unsqueeze(0)
            key_slots = slots_through_table(
                paddle.gather(block_tables, decode_rows),
                key_positions.expand([decode_rows.shape[0], max_context_len]),
                kv_cache.block_size,
            )  # [Td, K]
            # Causal and in-table keys only; hidden keys read slot 0 and get zero weight.
            visible = (key_slots >= 0) & (key_positions <= decode_positions.unsqueeze(1))
            key_slots = paddle.where(visible, key_slots, paddle.zeros_like(key_slots))
            key_rows = kv_cache.head_major_rows(key_slots)  # [Td, KVH, K], shared by layers
            # [Td, 1, 1, 1, K]
            decode_mask = self._additive_mask(visible.unsqueeze(1).unsqueeze(1).unsqueeze(3))
            cfg = self.config
            groups = cfg.num_heads // cfg.num_kv_heads

        def padded(x: paddle.Tensor) -> paddle.Tensor:
            """[T, heads, D] -> the prefill rows' tokens, [R, L, heads, D]."""
            rows = paddle.gather(x, layout.padded_index)
            return rows.reshape([layout.num_rows, layout.width, *x.shape[1:]])

        def paged_attention_for(layer: int) -> AttendFn:
            def attend(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
                kv_cache.write_kept(layer, kept_slots, k, v)
                outputs = []
                if layout.num_rows:
                    out = self._grouped_attention(padded(q), padded(k), padded(v), prefill_mask)
                    out = out.reshape([layout.num_rows * layout.width, -1])
                    outputs.append(paddle.gather(out, layout.unpad_index))
                if layout.decode_tokens.size:
                    keys, values = kv_cache.gather_head_major(layer, key_rows)  # [Td, KVH, K, D]
                    # Each token is its own query batch of one, over its own key set; with
                    # one query per token, [Td, H, D] is [Td, KVH, G, 1, D] by a reshape.
                    decode_q = paddle.gather(q, decode_tokens) if layout.is_mixed else q
                    decode_q = decode_q.reshape([-1, cfg.num_kv_heads, groups, 1, cfg.head_dim])
                    out = self._attention(decode_q, keys, values, decode_mask)
                    outputs.append(out.reshape([out.shape[0], -1]))
                if layout.is_mixed:
                    return paddle.gather(paddle.concat(outputs), layout.restore_order)
                return outputs[0]

            return attend

        hidden = self._run_layers(input_ids, positions, paged_attention_for)
        has_token = (last_token_index >= 0).unsqueeze(1)
        last_hidden = paddle.gather(hidden, paddle.clip(last_token_index, min=0))
        logits = self._logits(last_hidden)
        return paddle.where(has_token, logits, paddle.zeros_like(logits))
