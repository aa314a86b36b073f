"""Llama-architecture decoder (Llama, Mistral and Qwen2 checkpoints) in Paddle ops,
runnable with and without a paged KV cache.

``LlamaForCausalLM.forward_naive`` recomputes every sequence from scratch and is the
reference; ``LlamaForCausalLM.forward_paged`` runs one flattened step that mixes prefill and
decode rows, keeps K/V in a ``PagedKVCache`` and reads them back through the block tables.
The two give the same logits up to float rounding, so greedy decoding with either gives the
same tokens. Without a checkpoint the weights are drawn from a seeded generator (the random
test model).

Typical engine step, from FastDeploy-style slot-indexed state::

    batch = build_flat_batch(input_ids, seq_lens_this_time, seq_lens_decoder,
                             block_tables, cache.block_size)
    logits = model.forward_paged(**batch, kv_cache=cache)   # [B, vocab]
    next_tokens = paddle.argmax(logits, axis=-1)
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import paddle
from paddle import nn

import paddle_step_ops

from ..config import ModelConfig
from ..layers import cpu_linear
from ..layers.dense_blocks import (
    AllReduceFn,
    DenseWeight,
    LayerFusion,
    ModelBlocks,
    check_packed_weights_run,
    model_blocks,
)
from ..layers.paged_attention import (
    KeptSlots,
    PagedKVCache,
    PrefillLayout,
    RowsRead,
    slots_through_table,
)

__all__ = ["DecoderLayer", "LlamaForCausalLM", "RMSNorm"]

# attend(q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> attention output [T, H * D]
AttendFn = Callable[[paddle.Tensor, paddle.Tensor, paddle.Tensor], paddle.Tensor]


# draw(rng) -> a parameter's seeded random values (drawn in a fixed order, parameter by
# parameter, so the random model does not change when parameters are added after them).
Draw = Callable[[np.random.Generator], np.ndarray]
# values(name, shape, draw) -> the array parameter ``name`` starts from: a checkpoint's, or
# with none, ``draw(rng)``.
ParameterValues = Callable[[str, list[int], Draw], np.ndarray]


# A matrix given as bfloat16 bits (uint16), as a bfloat16 checkpoint stores it: taken by a
# model packed in bfloat16 or int8 alone, and packed without a float32 copy
# (``_packed_product``).
BFLOAT16_BITS = np.dtype(np.uint16)


def _parameter(layer: nn.Layer, array: np.ndarray, dtype: str) -> paddle.Tensor:
    """A parameter of ``layer`` holding ``array`` cast to ``dtype``. Copied in with
    ``set_value``: Paddle's ``Assign`` initializer goes through a Python list of the values,
    about 40 bytes per weight at its peak (15 GB for a 0.5B model)."""
    if array.dtype == BFLOAT16_BITS:  # a cast would read the bits as integers
        raise ValueError(
            f"expected values of a float dtype, got bfloat16 bits ({array.dtype}) of shape "
            f"{list(array.shape)}: only the matrices of a packed model take bits"
        )
    param = layer.create_parameter(
        list(array.shape), dtype=dtype, default_initializer=nn.initializer.Constant(0.0)
    )
    param.set_value(np.ascontiguousarray(array, dtype=dtype))
    return param


class RMSNorm(nn.Layer):
    """The learned scale of an RMSNorm, which ``dense_blocks.rms_norm`` applies inside the
    blocks; a layer of its own so that the parameter is named ``<norm>.weight``."""

    def __init__(self, weight: np.ndarray, dtype: str) -> None:
        super().__init__()
        self.weight = _parameter(self, weight, dtype)


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


def _packed_product(weight_format: str, *arrays: np.ndarray) -> DenseWeight:
    """The product of ``arrays`` [in, out_i] side by side, packed in ``weight_format`` with
    no other copy kept. bfloat16 bits are packed from the [out, in] order a checkpoint stores
    them in (the arrays are then views of it): joined by rows, not widened or transposed."""
    bits = [array.dtype == BFLOAT16_BITS for array in arrays]
    if all(bits):
        stored = np.concatenate([array.T for array in arrays]) if len(arrays) > 1 else arrays[0].T
        return DenseWeight.packed_only(stored, weight_format, transposed=True)
    if any(bits):  # joined, the bits would be cast as integers
        raise ValueError(
            "expected the parts of one product all as bfloat16 bits or all as floats, got "
            f"dtypes {[str(array.dtype) for array in arrays]}"
        )
    joined = np.concatenate(arrays, axis=1) if len(arrays) > 1 else arrays[0]
    return DenseWeight.packed_only(joined.astype(np.float32, copy=False), weight_format)


class DecoderLayer(nn.Layer):
    """Pre-norm block: RMSNorm -> GQA attention -> residual, RMSNorm -> SwiGLU -> residual.

    How attention finds its keys is left to the caller (``attend``), which is the only thing
    that differs between the naive and the paged forward. Matrices are [in, out] (x @ W).
    The dense parts around attention are ``blocks`` (``paddle_step.layers.dense_blocks``), shared
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
            return _parameter(self, array, config.dtype)

        def linear(name: str, fan_in: int, fan_out: int) -> paddle.Tensor:
            return parameter(name, [fan_in, fan_out], _scaled_normal(fan_in, fan_out))

        def bias(name: str, size: int, present: bool) -> paddle.Tensor | None:
            return parameter(name, [size], _small_normal(size)) if present else None

        def norm(name: str) -> RMSNorm:
            weight = values(f"{prefix}.{name}.weight", [hidden], _ones(hidden))
            return RMSNorm(weight, config.dtype)

        if config.weight_format is not None:
            # No parameters: each product's weights packed once, as the blocks take them.
            def linear(name: str, fan_in: int, fan_out: int) -> np.ndarray:
                return values(
                    f"{prefix}.{name}", [fan_in, fan_out], _scaled_normal(fan_in, fan_out)
                )

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
        self._dense = None
        if config.weight_format is not None:
            self._dense = self._packed_weights(config.weight_format)

    def _packed_weights(self, weight_format: str) -> tuple:
        """``_dense_weights`` of a model whose weights exist only in ``weight_format``,
        packed from the arrays, which are dropped."""

        biases = (self.q_bias, self.k_bias, self.v_bias)
        dense = (
            _packed_product(weight_format, self.wq, self.wk, self.wv),
            None if self.q_bias is None else paddle.concat(biases),
            _packed_product(weight_format, self.wo),
            _packed_product(weight_format, self.w_gate, self.w_up),
            _packed_product(weight_format, self.w_down),
        )
        self.wq = self.wk = self.wv = self.wo = self.w_gate = self.w_up = self.w_down = None
        return dense

    def _dense_weights(self) -> tuple[DenseWeight, paddle.Tensor | None, DenseWeight, DenseWeight,
                                      DenseWeight]:  # fmt: skip
        """``[wq | wk | wv]`` (with their biases concatenated), ``wo``, ``[w_gate | w_up]``
        and ``w_down`` as the blocks take them, made on first use: one product instead of
        three and one instead of two; copies made after construction (so after any
        sharding), while the parameters keep their names for checkpoints. With the CPU op,
        each also packed once for it."""
        if self._dense is None:
            with_op = self.blocks.use_op
            biases = (self.q_bias, self.k_bias, self.v_bias)
            self._dense = (
                DenseWeight.of(paddle.concat([self.wq, self.wk, self.wv], axis=1), with_op),
                None if self.q_bias is None else paddle.concat(biases),
                DenseWeight.of(self.wo, with_op),
                DenseWeight.of(paddle.concat([self.w_gate, self.w_up], axis=1), with_op),
                DenseWeight.of(self.w_down, with_op),
            )
        return self._dense

    def forward(
        self,
        x: paddle.Tensor,
        rope: tuple[paddle.Tensor, paddle.Tensor],
        attend: AttendFn,
        output_rows: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """``x`` [T, hidden]; ``rope`` = (cos, sin) [T, 1, head_dim] for each token's
        position. With ``output_rows`` (int64 [R] token indices), only those tokens' rows
        [R, hidden]: every token's q/k/v and attention as without, the output product and
        the MLP on those rows alone."""
        w_qkv, qkv_bias, w_o, w_gate_up, w_down = self._dense_weights()
        cos, sin = rope
        q, k, v = self.blocks.attention_inputs(
            x, self.attn_norm.weight, w_qkv, cos, sin, *_present(qkv_bias)
        )
        attention = attend(q, k, v)
        if output_rows is not None:
            x, attention = paddle.gather(x, output_rows), paddle.gather(attention, output_rows)
        return self.blocks.output_and_mlp(
            x,
            attention,
            w_o,
            self.mlp_norm.weight,
            w_gate_up,
            w_down,
            *_present(self.o_bias),
        )

    def fused_weights(self, isa: str) -> tuple:
        """This layer's weights as ``paddle_step_ops.DecoderStack`` takes them, its
        products on path ``isa`` ("": the process's)."""
        w_qkv, qkv_bias, w_o, w_gate_up, w_down = self._dense_weights()

        def product(weight: DenseWeight, bias: paddle.Tensor | None = None) -> tuple:
            packed = weight.packed
            return (packed.weights, packed.scales, bias, packed.n, packed.group_size, isa)

        return (self.attn_norm.weight, product(w_qkv, qkv_bias), product(w_o, self.o_bias),
                self.mlp_norm.weight, product(w_gate_up), product(w_down))  # fmt: skip


class FusedStep(NamedTuple):
    """A step whose layers run as one CPU call (``LlamaForCausalLM._fused_layers``): the
    cache, each token's cache slot, block-table row and position ([T] int64), the block
    tables, and the op's path for the products ("": the process's)."""

    kv_cache: PagedKVCache
    slots: paddle.Tensor
    block_tables: paddle.Tensor
    rows: paddle.Tensor
    positions: paddle.Tensor
    isa: str


class LlamaForCausalLM(nn.Layer):
    """Llama-style decoder (inference only), with seeded random weights or given ones.

    Head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention);
    rotary embedding uses each token's absolute position.

    ``weights`` maps every parameter name (as ``named_parameters`` lists them, e.g.
    ``layers.0.wq``; matrices [in, out]) to its array; without it the weights are drawn from
    ``config.seed``. A model packed in bfloat16 or int8 also takes a matrix as bfloat16
    bits (uint16, e.g. a transposed view of a checkpoint's [out, in]).

    ``all_reduce``: for one tensor-parallel rank's shard (``config`` with this rank's head
    counts and intermediate size, ``weights`` its slices, see
    ``paddle_step.distributed.tensor_parallel``): sums the row-parallel products over the
    ranks.
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
                    raise ValueError(f"LlamaForCausalLM: argument 'weights': no array for {name!r}")
                array = np.asarray(weights[name])
                if list(array.shape) != shape:
                    raise ValueError(
                        f"LlamaForCausalLM: argument 'weights': {name!r}: expected shape {shape}, "
                        f"got {list(array.shape)}"
                    )
                return array

        hidden, vocab = config.hidden_size, config.vocab_size
        if config.weight_format is not None:
            check_packed_weights_run(config.weight_format)
        self.blocks = model_blocks(config, all_reduce)
        self.fusion = LayerFusion(self.blocks, config.num_layers)
        consumed = set()

        def parameter(name: str, shape: list[int], draw: Draw) -> paddle.Tensor:
            return _parameter(self, values(name, shape, draw), config.dtype)

        def tracked(name: str, shape: list[int], draw: Draw) -> np.ndarray:
            consumed.add(name)
            return values(name, shape, draw)

        # Unit-variance embeddings and an lm_head scaled for O(1) logits keep the logits
        # spread out, so greedy decoding wanders over many tokens instead of tying.
        def embedding(rng: np.random.Generator) -> np.ndarray:
            return rng.standard_normal((vocab, hidden))

        lm_head = _scaled_normal(hidden, vocab)
        self._embedding = None  # the packed embedding, for a packed-only model
        self._lm_head = None  # DenseWeight of the LM head, made on first use
        if config.weight_format is None:
            self.embed = parameter("embed", [vocab, hidden], embedding)
        else:
            # Packed as the LM head's [hidden, vocab]: a tied model keeps one copy.
            embed = tracked("embed", [vocab, hidden], embedding)
            if embed.dtype != BFLOAT16_BITS:
                embed = embed.astype(np.float32, copy=False)
            self.embed = None
            self._embedding = DenseWeight.packed_only(embed, config.weight_format, transposed=True)
            del embed
        self.layers = nn.LayerList(
            [
                DecoderLayer(config, f"layers.{i}", tracked, self.blocks)
                for i in range(config.num_layers)
            ]
        )
        self.final_norm = RMSNorm(
            values("final_norm.weight", [hidden], _ones(hidden)), config.dtype
        )
        if config.tie_word_embeddings:
            self.lm_head = None
            self._lm_head = self._embedding  # packed-only: the same copy; else made on use
        elif config.weight_format is None:
            self.lm_head = parameter("lm_head", [hidden, vocab], lm_head)
        else:
            self.lm_head = None
            head = tracked("lm_head", [hidden, vocab], lm_head)
            self._lm_head = _packed_product(config.weight_format, head)
        if weights is not None:
            known = {name for name, _ in self.named_parameters()} | consumed
            unused = sorted(set(weights) - known)
            if unused:
                raise ValueError(
                    f"LlamaForCausalLM: argument 'weights': arrays for no parameter: {unused}"
                )
        half = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
        inv_freq = 1.0 / config.rope_theta**half
        if config.rope_scaling is not None:
            inv_freq = config.rope_scaling.scale(inv_freq)
        self.inv_freq = paddle.to_tensor(inv_freq.astype(config.dtype))  # [head_dim / 2]
        self._rope_tables: tuple[paddle.Tensor, ...] | None = None  # CPU: _rope_table
        self._decoder_stacks: dict[str, paddle_step_ops.DecoderStack] = {}  # by the op's path
        for param in self.parameters():
            param.stop_gradient = True

    def _rope(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos and sin [T, 1, head_dim] of the tokens at ``positions`` [T] (rotate-half
        layout, broadcast over heads). On the CPU, rows of ``_rope_table`` (two gathers a
        step instead of six ops)."""
        if not positions.place.is_cpu_place():
            return self._rope_of(positions)
        cos, sin = self._rope_table(positions)
        return paddle.gather(cos, positions), paddle.gather(sin, positions)

    def _rope_table(
        self, positions: paddle.Tensor, flat: bool = False
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos and sin [P, 1, head_dim] of every position up to the largest seen, at least
        up to every one of ``positions`` [T] (a CPU tensor); with ``flat``, [P, head_dim]
        (as ``DecoderStack`` takes them). Kept in both shapes, no reshape a step."""
        needed = max([0, *positions.numpy().tolist()]) + 1  # Python: see _logits_of
        if self._rope_tables is None or self._rope_tables[0].shape[0] < needed:
            size = 1 << (needed - 1).bit_length()  # doubling: a few rebuilds in all
            cos, sin = self._rope_of(paddle.arange(size, dtype="int64"))
            flat_shape = [size, self.config.head_dim]
            self._rope_tables = (cos, sin, cos.reshape(flat_shape), sin.reshape(flat_shape))
        return self._rope_tables[2:] if flat else self._rope_tables[:2]

    def _rope_of(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``_rope`` computed: each value depends only on its position, so a table row
        equals the value computed for that position alone."""
        angles = positions.astype(self.config.dtype).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        angles = paddle.concat([angles, angles], axis=-1).unsqueeze(1)
        return paddle.cos(angles), paddle.sin(angles)

    def _run_layers(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        attend_for_layer: Callable[[int], AttendFn] | None,
        fused: FusedStep | None = None,
        layers: int | None = None,
        output_rows: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """Hidden states [T, hidden] of the tokens ``input_ids`` [T] after the first
        ``layers`` layers (None: all), before the final norm (``_logits`` applies it, to the
        rows it needs); with ``output_rows`` (int64 [R]), those tokens' rows [R, hidden]
        alone, the last layer's output product and MLP run on them only. With ``fused``,
        the layers run as ``_fused_layers``."""
        if self._embedding is None:
            x = paddle.gather(self.embed, input_ids)
        else:
            x = cpu_linear.columns(self._embedding.packed, input_ids)
        count = len(self.layers) if layers is None else layers
        if fused is not None:
            return self._fused_layers(x, fused, count, output_rows)
        if count == 0:
            return x if output_rows is None else paddle.gather(x, output_rows)
        rope = self._rope(positions)
        for index, layer in enumerate(itertools.islice(self.layers, count)):
            rows = output_rows if index == count - 1 else None
            x = layer(x, rope, attend_for_layer(index), rows)
        return x

    def _fused_layers(
        self,
        x: paddle.Tensor,
        step: FusedStep,
        layers: int,
        output_rows: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """``x`` [T, hidden] through the first ``layers`` layers in one call of our CPU op
        (``paddle_step_ops.DecoderStack``, built once per path): each layer writes the
        step's K/V into its layer of ``step.kv_cache`` and then attends through each token's
        block-table row (a token at position p sees the cache's keys 0..p, its own step's
        among them). For a float32 model whose cache ``uses_cpu_ops`` (float32 or bfloat16)
        and ``LayerFusion.fuse_layers``."""
        stack = self._decoder_stacks.get(step.isa)
        if stack is None:  # the same every step: built once, not per call
            cfg = self.config
            stack = paddle_step_ops.DecoderStack(
                tuple(layer.fused_weights(step.isa) for layer in self.layers),
                (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_eps),
            )
            self._decoder_stacks[step.isa] = stack
        cache = step.kv_cache.view(0, step.block_tables, step.rows, step.positions)
        rope = self._rope_table(step.positions, flat=True)
        return stack(x, (*rope, step.slots, cache), layers, output_rows)

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

    def _decode_attention(
        self,
        layer: int,
        q: paddle.Tensor,
        kv_cache: PagedKVCache,
        key_rows: paddle.Tensor,
        mask: paddle.Tensor,
    ) -> paddle.Tensor:
        """Decode tokens' attention over a gathered copy of their keys (a cache without
        ``uses_cpu_ops``): ``q`` [Td, H, D], ``key_rows`` from ``head_major_rows``,
        ``mask`` [Td, 1, 1, 1, K]. Returns [Td, H * D]."""
        cfg = self.config
        keys, values = kv_cache.gather_head_major(layer, key_rows)  # [Td, KVH, K, D]
        # Each token is its own query batch of one, over its own key set; with one query
        # per token, [Td, H, D] is [Td, KVH, G, 1, D] by a reshape.
        groups = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape([-1, cfg.num_kv_heads, groups, 1, cfg.head_dim])
        out = self._attention(q, keys, values, mask)
        return out.reshape([out.shape[0], -1])

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

    def _lm_head_weight(self) -> DenseWeight:
        """The LM head as the logits block takes it, made on first use."""
        if self._lm_head is None:
            tied = self.lm_head is None
            head = self.embed if tied else self.lm_head
            self._lm_head = DenseWeight.of(head, self.blocks.use_op, transposed=tied)
        return self._lm_head

    def _logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Logits [N, vocab] of hidden states [N, hidden] from ``_run_layers``."""
        return self.blocks.logits(hidden, self.final_norm.weight, self._lm_head_weight())

    def decode_products(self) -> list[cpu_linear.PackedWeights]:
        """The packed weights a decode step's products read, in the order it reads them:
        each layer's q/k/v, output, gate/up and down, then the LM head (empty where the
        CPU op does not run)."""
        if not self.blocks.use_op:
            return []
        products = []
        for layer in self.layers:
            w_qkv, _, w_o, w_gate_up, w_down = layer._dense_weights()
            products += [w_qkv.packed, w_o.packed, w_gate_up.packed, w_down.packed]
        return products + [self._lm_head_weight().packed]

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
        extra_index: paddle.Tensor | None = None,
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
        """One serving step over a flattened batch of T tokens from B block-table rows.

        Args (see ``FlatBatch``; ``build_flat_batch`` makes them from slot-indexed state):
            input_ids: [T] int64 token ids; prefill rows contribute several, decode rows one.
            positions: [T] int64 absolute position of each token in its sequence.
            slot_mapping: [T] int64 cache slot for each token's K/V; -1 writes nothing.
            token_rows: [T] int64 block-table row each token belongs to.
            last_token_index: [R] int64 flat index of the last token of each row whose
                logits are wanted (B rows, or only the rows sampled this step), -1 for a
                row with no token this step.
            block_tables: [B, M] int32/int64 block ids of each row's sequence, -1 unused.
            max_context_len: at least the largest ``position + 1`` in the step; decode
                tokens look their keys up for positions ``0 .. max_context_len - 1``.
            kv_cache: written at ``slot_mapping``, then read through ``block_tables``.

        Each token attends to its sequence's keys at positions up to and including its own.
        Tokens of a row starting at position 0 (a prefill) use the step's own K/V; the others
        read theirs back from the cache (so earlier steps' K/V must be there): once per row
        for a row of several tokens (a prompt chunk), once per token for a decode row. Where
        the layers fuse (a float32 model, a cache on the CPU ops, ``FusedStep``), every
        token reads its keys from the cache, written first with the step's own: the same
        values, except that a bfloat16 cache holds them rounded (a prompt's tokens then see
        their own keys rounded, where the dense blocks give them the step's float32 ones).
        Returns
        logits [R, vocab] of the tokens ``last_token_index`` names; -1 gets zeros (the LM
        head runs on every index given: pass only the rows that sample). With
        ``extra_index`` ([N] int64 flat token indices), also the logits [N, vocab] of those
        tokens (prompt logprobs), as a pair. The last layer finishes only the tokens the
        two name (``RowsRead``): the others' K/V is all a later step reads of them.
        """
        tokens = positions.shape[0]

        @functools.cache
        def layout() -> PrefillLayout:  # built at most once a step
            return PrefillLayout(positions.numpy(), token_rows.numpy())

        def every_token_decodes() -> bool:
            return layout().decode_tokens.size == tokens

        fuse = (
            kv_cache.uses_cpu_ops
            and self.config.dtype == "float32"
            # Prompt tokens attend through the cache too: each must have its slot.
            and (min(slot_mapping.numpy().tolist(), default=0) >= 0 or every_token_decodes())
            and self.fusion.fuse_layers(tokens)
        )

        # The last layer's output product and MLP run only on the rows the logits read
        # (llama.cpp's output ids): a prompt's last token, not the rest of it.
        read = RowsRead(tokens, last_token_index, extra_index)

        def fused(layers: int | None = None) -> paddle.Tensor:
            step = FusedStep(kv_cache, slot_mapping, block_tables, token_rows, positions,
                             self.fusion.op_path(tokens))  # fmt: skip
            rows = read.output_rows if layers is None else None
            return self._run_layers(input_ids, positions, None, step, layers, rows)

        def blocks(layers: int | None = None) -> paddle.Tensor:
            return self._hidden_through_blocks(
                layout(), input_ids, positions, slot_mapping, token_rows, block_tables,
                max_context_len, kv_cache, layers,
                read.output_rows if layers is None else None,
            )  # fmt: skip

        if fuse is None:
            hidden = self.fusion.choose(tokens, blocks, fused)
        else:
            hidden = fused() if fuse else blocks()
        return self._logits_of(hidden, read)

    def _hidden_through_blocks(
        self,
        layout: PrefillLayout,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        slot_mapping: paddle.Tensor,
        token_rows: paddle.Tensor,
        block_tables: paddle.Tensor,
        max_context_len: int,
        kv_cache: PagedKVCache,
        layers: int | None = None,
        output_rows: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """``forward_paged``'s hidden states through the dense blocks and a per-layer
        attention: over the step's own K/V for prompts from position 0, over keys read
        back from the cache for prompt chunks and decode tokens; after the first
        ``layers`` layers (None: all), of the tokens ``output_rows`` names (None: all)."""
        kept_slots = KeptSlots(slot_mapping)
        cfg = self.config
        groups = cfg.num_heads // cfg.num_kv_heads
        if layout.num_rows:
            prefill_mask = self._additive_mask(layout.causal)
        if layout.num_chunk_rows:
            chunk_rows, chunk_width = layout.num_chunk_rows, layout.chunk_width
            key_positions = paddle.arange(layout.chunk_context, dtype="int64")
            chunk_slots = slots_through_table(
                paddle.gather(block_tables, layout.chunk_table_rows),
                key_positions.unsqueeze(0).expand([chunk_rows, layout.chunk_context]),
                kv_cache.block_size,
            )  # [Rc, Kc]
            # [Rc, Lc, Kc]: in-table keys at or before each query's position.
            visible = (chunk_slots >= 0).unsqueeze(1) & (
                key_positions.reshape([1, 1, -1]) <= layout.chunk_query_positions.unsqueeze(2)
            )
            chunk_slots = paddle.where(
                chunk_slots >= 0, chunk_slots, paddle.zeros_like(chunk_slots)
            )
            chunk_key_rows = kv_cache.head_major_rows(chunk_slots)  # [Rc, KVH, Kc]
            chunk_mask = self._additive_mask(visible.unsqueeze(1).unsqueeze(1))  # [Rc,1,1,Lc,Kc]
        if layout.decode_tokens.size:
            decode_positions, decode_rows = positions, token_rows
            if layout.is_mixed:
                decode_tokens = paddle.to_tensor(layout.decode_tokens.astype(np.int64))
                decode_positions = paddle.gather(positions, decode_tokens)
                decode_rows = paddle.gather(token_rows, decode_tokens)
        if layout.decode_tokens.size and not kv_cache.uses_cpu_ops:
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
                if layout.num_chunk_rows:
                    keys, values = kv_cache.gather_head_major(layer, chunk_key_rows)
                    chunk_q = paddle.gather(q, layout.chunk_padded_index).reshape(
                        [chunk_rows, chunk_width, cfg.num_kv_heads, groups, cfg.head_dim]
                    )
                    chunk_q = chunk_q.transpose([0, 2, 3, 1, 4]).contiguous()  # [Rc,KVH,G,Lc,D]
                    out = self._attention(chunk_q, keys, values, chunk_mask)
                    out = out.transpose([0, 3, 1, 2, 4]).reshape([chunk_rows * chunk_width, -1])
                    outputs.append(paddle.gather(out, layout.chunk_unpad_index))
                if layout.decode_tokens.size:
                    decode_q = paddle.gather(q, decode_tokens) if layout.is_mixed else q
                    if kv_cache.uses_cpu_ops:
                        outputs.append(kv_cache.decode_attention(
                            layer, decode_q, block_tables, decode_rows, decode_positions,
                            1.0 / math.sqrt(cfg.head_dim),
                        ))  # fmt: skip
                    else:
                        outputs.append(self._decode_attention(
                            layer, decode_q, kv_cache, key_rows, decode_mask
                        ))  # fmt: skip
                if layout.is_mixed:
                    return paddle.gather(paddle.concat(outputs), layout.restore_order)
                return outputs[0]

            return attend

        return self._run_layers(
            input_ids, positions, paged_attention_for, layers=layers, output_rows=output_rows
        )

    def _logits_of(
        self, hidden: paddle.Tensor, read: RowsRead
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
        """``forward_paged``'s result from the hidden states of the tokens ``read`` names."""
        # The index is tested in plain Python, as read before the layers: after their
        # weights have streamed through the caches, a Paddle compare, any and sync, or even
        # a NumPy one, runs cold. A decode step at full batch wants every token's logits,
        # in order.
        index = read.last_rows
        if index == list(range(hidden.shape[0])):
            last_hidden = hidden
        else:
            last_hidden = paddle.gather(hidden, paddle.clip(read.last_token_index, min=0))
        logits = self._logits(last_hidden)
        # [R, vocab] of zeros and a select only when asked for.
        if min(index, default=0) < 0:
            no_token = (read.last_token_index < 0).unsqueeze(1)
            logits = paddle.where(no_token, paddle.zeros_like(logits), logits)
        if read.extra_index is None:
            return logits
        return logits, self._logits(paddle.gather(hidden, read.extra_index))
