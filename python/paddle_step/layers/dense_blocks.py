"""The model's dense blocks, as plain Paddle functions that run eagerly or compiled onto oneDNN.

Why compile: Paddle's eager CPU ``matmul`` calls MKL, and on a CPU that is not Intel's MKL
takes its generic path. On this project's AMD EPYC the [8, 512] x [512, 32000] LM head of a
batch-8 decode step takes 19 ms eagerly (~14 GFLOP/s). Paddle's static-graph executor with
``FLAGS_use_mkldnn`` runs oneDNN's kernels instead, which are generated for the CPU's own
instruction set (AVX-512 here): 4 ms for the same product. A compiled call costs 0.3 to
0.5 ms more than the same eager ops, so a block runs compiled only when its products are
big enough (``MIN_COMPILED_MACS``, measured here); below that, and for float64, off the
CPU, on Paddle before 3.0, in a tensor-parallel layer (its all-reduce sits inside the
block) or with ``PADDLE_STEP_ONEDNN=0``, the same function runs eagerly.

The same Python function is traced for the compiled program and called for the eager path,
so the two compute the same expression; they differ only in float rounding (a different
GEMM's summation order).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import paddle
from paddle import nn
from paddle.static import InputSpec

if TYPE_CHECKING:
    from ..config import ModelConfig

# Multiply-adds of a call (rows x the block's weight elements) from which it runs
# compiled: the compiled call's fixed cost is repaid from about there, measured per
# block on the Llama shape (hidden 512) and on the shipped model's (hidden 128),
# one thread. One row is a matrix-vector product, which eager MKL does at memory speed:
# never compiled.
MIN_COMPILED_MACS = 12_000_000

ENV_SWITCH = "PADDLE_STEP_ONEDNN"

# Row counts up to this go to a compiled program as they are; above it they are padded
# (``padded_rows``).
EXACT_ROWS = 16


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to one of 8 sizes per power of two (at most 1/8 more), exact up
    to ``EXACT_ROWS``.

    Each new row count costs a compiled program about 3 ms (oneDNN generates kernels for
    the shape) and about 100 KB that Paddle keeps for good: measured here, RSS grew by
    147 MiB over 1,500 distinct counts and did not level off. A serving step's token count
    changes every step, so compiled calls see these sizes only: about 100 up to 16,384
    rows.
    """
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)  # 2^k <= rows < 2^(k+1): steps of 2^(k-3)
    return -(-rows // step) * step


def _pad_rows(x: paddle.Tensor, rows: int) -> paddle.Tensor:
    """``x`` [T, ...] with zero rows appended up to ``rows`` (a zero row stays finite
    through every block: RMSNorm's eps keeps its scale finite)."""
    padding = paddle.zeros([rows - x.shape[0], *x.shape[1:]], dtype=x.dtype)
    return paddle.concat([x, padding])


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """Root-mean-square norm over the last axis, times ``weight``.

    The mean is a sum divided by the width (bit-identical to ``paddle.mean`` eagerly): a
    compiled ``mean`` makes Paddle 3.3 print "ReduceMeanCheckIfOneDNNSupport" on stdout,
    which would land in ``generate.py --json``'s output."""
    mean_square = paddle.sum(x * x, axis=-1, keepdim=True) / x.shape[-1]
    scale = paddle.rsqrt(mean_square + eps)
    return x * scale * weight


def rotate_half(x: paddle.Tensor) -> paddle.Tensor:
    """[a, b] -> [-b, a] over the last axis (rotary embedding's rotate-half layout)."""
    first, second = paddle.chunk(x, 2, axis=-1)
    return paddle.concat([-second, first], axis=-1)


# all_reduce(partial) -> the sum of ``partial`` over the tensor-parallel ranks (every rank
# gets the same tensor); see ``paddle_step.distributed.tensor_parallel``.
AllReduceFn = Callable[[paddle.Tensor], paddle.Tensor]


def _copy_if(copy_outputs: bool, x: paddle.Tensor) -> paddle.Tensor:
    """``x``, copied for a compiled program: a program whose output comes straight from a
    oneDNN kernel crashes Paddle 3.3's to_static when it hands the tensor back
    (segmentation fault, seen with matmul, reshape, concat and scale as the last op); with
    a plain copy as the last op it does not. The eager path needs no copy."""
    return x.clone() if copy_outputs else x


def make_attention_inputs(
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float, copy_outputs: bool = False
):
    """``attention_inputs(x, norm_weight, w_qkv, cos, sin[, qkv_bias]) -> (q, k, v)``:
    RMSNorm, the fused q/k/v product, rotary embedding on q and k. ``x`` [T, hidden],
    ``cos``/``sin`` [T, 1, head_dim]; q [T, num_heads, head_dim], k and v [T, num_kv_heads,
    head_dim]. ``copy_outputs``: for the compiled program (``_copy_if``)."""

    def attention_inputs(x, norm_weight, w_qkv, cos, sin, qkv_bias=None):
        qkv = paddle.matmul(rms_norm(x, norm_weight, eps), w_qkv)
        if qkv_bias is not None:
            qkv = qkv + qkv_bias
        qkv = qkv.reshape([-1, num_heads + 2 * num_kv_heads, head_dim])
        qk, v = paddle.split(qkv, [num_heads + num_kv_heads, num_kv_heads], axis=1)
        qk = qk * cos + rotate_half(qk) * sin
        q, k = paddle.split(qk, [num_heads, num_kv_heads], axis=1)
        return _copy_if(copy_outputs, q), _copy_if(copy_outputs, k), _copy_if(copy_outputs, v)

    return attention_inputs


def make_output_and_mlp(
    eps: float, all_reduce: AllReduceFn | None = None, copy_outputs: bool = False
):
    """``output_and_mlp(x, attn, w_o, norm_weight, w_gate_up, w_down[, o_bias]) -> x``:
    the attention output projection and its residual, RMSNorm, SwiGLU and its residual.
    With ``all_reduce`` (a tensor-parallel shard, ``w_o``/``w_down`` row slices) each
    product is summed over the ranks before the bias and the residual."""

    def reduced(x):
        return x if all_reduce is None else all_reduce(x)

    def output_and_mlp(x, attn, w_o, norm_weight, w_gate_up, w_down, o_bias=None):
        out = reduced(paddle.matmul(attn, w_o))
        if o_bias is not None:
            out = out + o_bias
        x = x + out
        gate, up = paddle.split(paddle.matmul(rms_norm(x, norm_weight, eps), w_gate_up), 2, axis=1)
        out = x + reduced(paddle.matmul(nn.functional.silu(gate) * up, w_down))
        return _copy_if(copy_outputs, out)

    return output_and_mlp


def make_logits(eps: float, tied: bool, copy_outputs: bool = False):
    """``logits(hidden, norm_weight, weight) -> [T, vocab]``: the final RMSNorm and the LM
    head (``weight`` [hidden, vocab], or the [vocab, hidden] embedding when ``tied``)."""

    def logits(hidden, norm_weight, weight):
        out = paddle.matmul(rms_norm(hidden, norm_weight, eps), weight, transpose_y=tied)
        return _copy_if(copy_outputs, out)

    return logits


def onednn_available(dtype: str) -> bool:
    """Whether compiled blocks can run here: float32 on the CPU, Paddle 3 (its PIR executor
    is where this was verified), a oneDNN build, and not switched off by the environment."""
    switch = os.environ.get(ENV_SWITCH, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH} must be '0' or '1', got {switch!r}")
    major = paddle.__version__.split(".")[0]
    return (
        switch == "1"
        and dtype == "float32"
        and (major == "0" or int(major) >= 3)  # 0.0.0 is a development build
        and paddle.get_device() == "cpu"
        and paddle.base.core.is_compiled_with_mkldnn()
    )


@contextlib.contextmanager
def _onednn_kernels() -> Iterator[None]:
    """``FLAGS_use_mkldnn`` on for one compiled call, then back as it was: the flag also
    steers the user's own static programs, so it is not left on."""
    previous = paddle.get_flags(["FLAGS_use_mkldnn"])["FLAGS_use_mkldnn"]
    paddle.set_flags({"FLAGS_use_mkldnn": True})
    try:
        yield
    finally:
        paddle.set_flags({"FLAGS_use_mkldnn": previous})


class DenseBlock:
    """One of the blocks above (``make(copy_outputs)`` builds its function), called eagerly,
    or compiled when ``compile`` and its first argument has at least ``min_rows`` rows:
    2, or enough that rows x ``macs_per_row`` reaches ``MIN_COMPILED_MACS``. A compiled
    call pads its per-row arguments to ``padded_rows`` and returns the real rows.

    ``input_spec``: one ``InputSpec`` per tensor argument, leading dimension None for the
    per-row ones (the program is traced once, at its first compiled call).
    """

    def __init__(
        self,
        make: Callable[[bool], Callable],
        input_spec: list[InputSpec],
        macs_per_row: int,
        compile: bool,
    ) -> None:
        self.function = make(False)
        self.min_rows = max(2, -(-MIN_COMPILED_MACS // macs_per_row))
        self.per_row = [spec.shape[0] == -1 for spec in input_spec]  # None reads as -1
        self.compiled = (
            paddle.jit.to_static(make(True), input_spec=input_spec, full_graph=True)
            if compile
            else None
        )

    def __call__(self, *args):
        rows = args[0].shape[0]
        if self.compiled is None or rows < self.min_rows:
            return self.function(*args)
        padded = padded_rows(rows)
        if padded != rows:
            args = [
                _pad_rows(arg, padded) if per_row else arg
                for arg, per_row in zip(args, self.per_row)
            ]
        with _onednn_kernels():
            outputs = self.compiled(*args)
        if padded == rows:
            return outputs
        if isinstance(outputs, tuple):
            return tuple(output[:rows] for output in outputs)
        return outputs[:rows]


class ModelBlocks(NamedTuple):
    """The three blocks of one model shape, shared by all its layers."""

    attention_inputs: DenseBlock  # (x, norm_weight, w_qkv, cos, sin[, qkv_bias])
    output_and_mlp: DenseBlock  # (x, attn, w_o, norm_weight, w_gate_up, w_down[, o_bias])
    logits: DenseBlock  # (hidden, norm_weight, lm_head or tied embedding)


def model_blocks(config: ModelConfig, all_reduce: AllReduceFn | None = None) -> ModelBlocks:
    """The blocks for a model built from ``config`` (one tensor-parallel rank's config
    when ``all_reduce`` is given: that rank's head counts and intermediate size)."""
    compile = onednn_available(config.dtype)
    hidden, head_dim, eps = config.hidden_size, config.head_dim, config.rms_eps
    q_width = config.num_heads * head_dim
    qkv_width = q_width + 2 * config.num_kv_heads * head_dim
    intermediate = config.intermediate_size
    vocab_shape = [hidden, config.vocab_size]
    if config.tie_word_embeddings:
        vocab_shape = vocab_shape[::-1]

    def spec(*shape: int | None) -> InputSpec:
        return InputSpec(list(shape), config.dtype)

    rows = None  # any number of tokens
    return ModelBlocks(
        attention_inputs=DenseBlock(
            lambda copy: make_attention_inputs(
                config.num_heads, config.num_kv_heads, head_dim, eps, copy
            ),
            [spec(rows, hidden), spec(hidden), spec(hidden, qkv_width)]
            + [spec(rows, 1, head_dim)] * 2
            + ([spec(qkv_width)] if config.qkv_bias else []),
            hidden * qkv_width,
            compile,
        ),
        output_and_mlp=DenseBlock(
            lambda copy: make_output_and_mlp(eps, all_reduce, copy),
            [
                spec(rows, hidden),
                spec(rows, q_width),
                spec(q_width, hidden),
                spec(hidden),
                spec(hidden, 2 * intermediate),
                spec(intermediate, hidden),
            ]
            + ([spec(hidden)] if config.o_proj_bias else []),
            (q_width + 3 * intermediate) * hidden,
            compile and all_reduce is None,  # the all-reduce runs between its products
        ),
        logits=DenseBlock(
            lambda copy: make_logits(eps, config.tie_word_embeddings, copy),
            [spec(rows, hidden), spec(hidden), spec(*vocab_shape)],
            hidden * config.vocab_size,
            compile,
        ),
    )
