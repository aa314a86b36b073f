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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

import numpy as np
import paddle
from paddle import nn

from .tokenizer import ByteTokenizer

# attend(q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> attention output [T, H * D]
AttendFn = Callable[[paddle.Tensor, paddle.Tensor, paddle.Tensor], paddle.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    """Shape, numerics and seed of a ``TinyLlama``."""

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

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                f"({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embedding")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads


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
        kept = paddle.nonzero(slots >= 0).flatten()
        if kept.shape[0] == 0:
            return
        kept_slots = paddle.gather(slots, kept)
        layer_index = paddle.full_like(kept_slots, layer)
        paddle.index_put_(self.key, (layer_index, kept_slots), paddle.gather(k, kept))
        paddle.index_put_(self.value, (layer_index, kept_slots), paddle.gather(v, kept))

    def gather(self, layer: int, slots: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """K and V at ``slots`` (any shape, all >= 0): each
        ``slots.shape + [kv_heads, head_dim]``."""
        flat = slots.flatten()
        tail = list(self.key.shape[2:])
        k = paddle.gather(self.key[layer], flat).reshape([*slots.shape, *tail])
        v = paddle.gather(self.value[layer], flat).reshape([*slots.shape, *tail])
        return k, v


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


class RMSNorm(nn.Layer):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, size: int, eps: float, dtype: str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter(
            [size], dtype=dtype, default_initializer=nn.initializer.Constant(1.0)
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        scale = paddle.rsqrt(paddle.mean(x * x, axis=-1, keepdim=True) + self.eps)
        return x * scale * self.weight


def _rotate_half(x: paddle.Tensor) -> paddle.Tensor:
    first, second = paddle.chunk(x, 2, axis=-1)
    return paddle.concat([-second, first], axis=-1)


class DecoderLayer(nn.Layer):
    """Pre-norm block: RMSNorm -> GQA attention -> residual, RMSNorm -> SwiGLU -> residual.

    How attention finds its keys is left to the caller (``attend``), which is the only thing
    that differs between the naive and the paged forward.
    """

    def __init__(self, config: ModelConfig, rng: np.random.Generator) -> None:
        super().__init__()
        self.config = config
        hidden, head_dim = config.hidden_size, config.head_dim

        def linear(fan_in: int, fan_out: int) -> paddle.Tensor:
            # 1/sqrt(fan_in) keeps activations O(1) through the stack.
            values = rng.standard_normal((fan_in, fan_out)) / math.sqrt(fan_in)
            return self.create_parameter(
                [fan_in, fan_out],
                dtype=config.dtype,
                default_initializer=nn.initializer.Assign(values.astype(config.dtype)),
            )

        self.attn_norm = RMSNorm(hidden, config.rms_eps, config.dtype)
        self.wq = linear(hidden, config.num_heads * head_dim)
        self.wk = linear(hidden, config.num_kv_heads * head_dim)
        self.wv = linear(hidden, config.num_kv_heads * head_dim)
        self.wo = linear(config.num_heads * head_dim, hidden)
        self.mlp_norm = RMSNorm(hidden, config.rms_eps, config.dtype)
        self.w_gate = linear(hidden, config.intermediate_size)
        self.w_up = linear(hidden, config.intermediate_size)
        self.w_down = linear(config.intermediate_size, hidden)

    def forward(
        self, x: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor], attend: AttendFn
    ) -> paddle.Tensor:
        """``x`` [T, hidden]; ``rope`` = (cos, sin) [T, head_dim] for each token's position."""
        cfg = self.config
        tokens = x.shape[0]
        h = self.attn_norm(x)
        q = paddle.matmul(h, self.wq).reshape([tokens, cfg.num_heads, cfg.head_dim])
        k = paddle.matmul(h, self.wk).reshape([tokens, cfg.num_kv_heads, cfg.head_dim])
        v = paddle.matmul(h, self.wv).reshape([tokens, cfg.num_kv_heads, cfg.head_dim])
        cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        x = x + paddle.matmul(attend(q, k, v), self.wo)

        h = self.mlp_norm(x)
        gated = nn.functional.silu(paddle.matmul(h, self.w_gate)) * paddle.matmul(h, self.w_up)
        return x + paddle.matmul(gated, self.w_down)


class TinyLlama(nn.Layer):
    """Llama-style decoder with seeded random weights (inference only).

    Head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention);
    rotary embedding uses each token's absolute position.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        rng = np.random.default_rng(config.seed)
        hidden = config.hidden_size
        # Unit-variance embeddings and an lm_head scaled for O(1) logits keep the logits
        # spread out, so greedy decoding wanders over many tokens instead of tying.
        self.embed = self.create_parameter(
            [config.vocab_size, hidden],
            dtype=config.dtype,
            default_initializer=nn.initializer.Assign(
                rng.standard_normal((config.vocab_size, hidden)).astype(config.dtype)
            ),
        )
        self.layers = nn.LayerList([DecoderLayer(config, rng) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(hidden, config.rms_eps, config.dtype)
        self.lm_head = self.create_parameter(
            [hidden, config.vocab_size],
            dtype=config.dtype,
            default_initializer=nn.initializer.Assign(
                (rng.standard_normal((hidden, config.vocab_size)) / math.sqrt(hidden)).astype(
                    config.dtype
                )
            ),
        )
        half = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
        self.inv_freq = paddle.to_tensor(
            (1.0 / config.rope_theta**half).astype(config.dtype)
        )  # [head_dim / 2]
        for param in self.parameters():
            param.stop_gradient = True

    def _rope(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        angles = positions.astype(self.config.dtype).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        angles = paddle.concat([angles, angles], axis=-1)  # [T, head_dim], rotate-half layout
        return paddle.cos(angles), paddle.sin(angles)

    def _run_layers(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        attend_for_layer: Callable[[int], AttendFn],
    ) -> paddle.Tensor:
        """Final-normed hidden states [T, hidden] of the tokens ``input_ids`` [T]."""
        x = paddle.gather(self.embed, input_ids)
        rope = self._rope(positions)
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, attend_for_layer(index))
        return self.final_norm(x)

    def _grouped_attention(
        self, q: paddle.Tensor, keys: paddle.Tensor, values: paddle.Tensor, visible: paddle.Tensor
    ) -> paddle.Tensor:
        """Softmax attention of query batches over their own key sets.

        ``q`` [N, T, H, D]; ``keys``/``values`` [N, K, KVH, D]; ``visible`` bool broadcastable
        to [N, KVH, G, T, K] (G = H // KVH). Returns [N, T, H * D].
        """
        cfg = self.config
        batches, tokens = q.shape[0], q.shape[1]
        groups = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape([batches, tokens, cfg.num_kv_heads, groups, cfg.head_dim])
        q = q.transpose([0, 2, 3, 1, 4])  # [N, KVH, G, T, D]
        k = keys.transpose([0, 2, 3, 1]).unsqueeze(2)  # [N, KVH, 1, D, K]
        v = values.transpose([0, 2, 1, 3]).unsqueeze(2)  # [N, KVH, 1, K, D]
        scores = paddle.matmul(q, k) / math.sqrt(cfg.head_dim)
        scores = paddle.where(visible, scores, paddle.full_like(scores, float("-inf")))
        out = paddle.matmul(nn.functional.softmax(scores, axis=-1), v)  # [N, KVH, G, T, D]
        return out.transpose([0, 3, 1, 2, 4]).reshape([batches, tokens, cfg.hidden_size])

    @paddle.no_grad()
    def forward_naive(self, token_ids: list[list[int]]) -> paddle.Tensor:
        """Reference forward: recompute each whole sequence, no cache.

        Returns the logits of the last token of each sequence, [len(token_ids), vocab].
        """
        last_hidden = []
        for sequence in token_ids:
            ids = paddle.to_tensor(sequence, dtype="int64")
            length = ids.shape[0]
            causal = paddle.tril(paddle.ones([length, length], dtype="bool"))

            def self_attention(
                q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor
            ) -> paddle.Tensor:
                return self._grouped_attention(
                    q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal
                ).squeeze(0)

            hidden = self._run_layers(
                ids, paddle.arange(length, dtype="int64"), lambda _layer: self_attention
            )
            last_hidden.append(hidden[-1])
        return paddle.matmul(paddle.stack(last_hidden), self.lm_head)

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
            max_context_len: at least the largest ``position + 1`` in the step; keys are
                looked up for positions ``0 .. max_context_len - 1``.
            kv_cache: written at ``slot_mapping``, then read through ``block_tables``.

        Each token attends to its sequence's keys at positions up to and including its own,
        all read back from the cache (so earlier steps' K/V must be there). Returns logits
        [B, vocab] of each row's last token; rows without a token get zeros.
        """
        block_size = kv_cache.block_size
        key_positions = paddle.arange(max_context_len, dtype="int64").unsqueeze(0)
        key_slots = slots_through_table(
            paddle.gather(block_tables, token_rows),
            key_positions.expand([input_ids.shape[0], max_context_len]),
            block_size,
        )  # [T, K]
        # Causal and in-table keys only; hidden keys read slot 0 and get zero weight.
        visible = (key_slots >= 0) & (key_positions <= positions.unsqueeze(1))
        key_slots = paddle.where(visible, key_slots, paddle.zeros_like(key_slots))
        visible = visible.unsqueeze(1).unsqueeze(1).unsqueeze(3)  # [T, 1, 1, 1, K]

        def paged_attention_for(layer: int) -> AttendFn:
            def attend(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
                kv_cache.write(layer, slot_mapping, k, v)
                keys, values = kv_cache.gather(layer, key_slots)  # [T, K, KVH, D] each
                # Each token is its own query batch of one, over its own key set.
                return self._grouped_attention(q.unsqueeze(1), keys, values, visible).squeeze(1)

            return attend

        hidden = self._run_layers(input_ids, positions, paged_attention_for)
        has_token = (last_token_index >= 0).unsqueeze(1)
        last_hidden = paddle.gather(hidden, paddle.clip(last_token_index, min=0))
        logits = paddle.matmul(last_hidden, self.lm_head)
        return paddle.where(has_token, logits, paddle.zeros_like(logits))
