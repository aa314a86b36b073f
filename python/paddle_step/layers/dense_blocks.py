"""The model's dense blocks, as plain Paddle functions run one of three ways, chosen by
measurement on the machine at hand.

- ``eager``: the function with ``paddle.matmul`` (MKL on the CPU).
- ``op``: the same function with this package's CPU op for the products
  (``layers.cpu_linear``: weights packed once, streamed by AVX-512 / AVX2 kernels chosen at
  run time from the CPU's flags, on the engine's threads).
- ``compiled``: the eager function traced by ``paddle.jit.to_static`` and run on Paddle's
  static executor with ``FLAGS_use_mkldnn`` (oneDNN's kernels, generated for the CPU's
  instruction set; MKL's generic path on a CPU that is not Intel's is several times
  slower). A compiled call has a fixed cost of a few tenths of a millisecond.

Which one wins depends on the CPU, the thread count, the shape and the number of rows, so
each block times every way it can run the first time a row count class
(``padded_rows``) appears, and keeps the fastest for that class (``DenseBlock``).
``PADDLE_STEP_DENSE`` forces one way where it can run (``eager``, ``op``, ``op_widened``,
``compiled``; default ``auto``); ``PADDLE_STEP_ONEDNN=0`` leaves ``compiled`` out. float64,
Paddle before 3.0 and devices other than the CPU run eagerly. A model whose weights are kept
in bfloat16 or int8 (``ModelConfig.weight_format``) has them only packed, and runs the op
alone, one way for every row count (not timed: the ways round x differently, and a
token's result must not depend on its batch). On a CPU with AVX512-BF16 and VNNI (the op's
``avx512_bf16`` path) that is ``op``: bfloat16 weights times x rounded to bfloat16
(``vdpbf16ps``: two multiply-adds a lane per instruction), int8 weights times x quantized
to 8 bits per row (``vpdpbusd``: four). ``PADDLE_STEP_DENSE=op_widened`` widens the weights
to float32 in registers instead and multiplies by x as it is (the AVX-512 path).

The same Python function makes all three, so they compute the same expression and differ
only in float rounding (summation order); the op's ways also take the logits' RMSNorm from
the op (``op_rms_norm``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import paddle
from paddle import nn
from paddle.static import InputSpec

import paddle_step_ops

from . import cpu_linear

if TYPE_CHECKING:
    from ..config import ModelConfig

ENV_SWITCH = "PADDLE_STEP_ONEDNN"
ENV_METHOD = "PADDLE_STEP_DENSE"
METHODS = ("eager", "op", "op_widened", "compiled")
# The op's path for ``op_widened``: AVX-512 without the dot-product instructions.
WIDENED_ISA = "avx512"
OP_WAYS = ("op", "op_widened")
# Timed calls of each way when a row count class first appears (after one untimed call,
# which traces the compiled program and warms the kernels), in rounds that call every way
# in turn, so that a burst of another job on a shared machine slows one round of all of
# them rather than every call of one: the fastest of each way's calls counts.
TIMED_CALLS = 3
# Timed runs of each way of a step's layers (``LayerFusion.choose``), alternating, over the
# first 1 / FUSION_LAYERS_DIVISOR of the layers (at least one): every layer has the same
# shapes, so a few time both ways as the whole stack would, at a fraction of its cost.
FUSION_ROUNDS = 2
FUSION_LAYERS_DIVISOR = 8

logger = logging.getLogger(__name__)

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


# product(x [T, K], weight) -> x @ W [T, N]: paddle.matmul on a [K, N] tensor, or the CPU
# op on packed weights.
Product = Callable[[paddle.Tensor, object], paddle.Tensor]


def make_attention_inputs(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    copy_outputs: bool = False,
    product: Product = paddle.matmul,
):
    """``attention_inputs(x, norm_weight, w_qkv, cos, sin[, qkv_bias]) -> (q, k, v)``:
    RMSNorm, the fused q/k/v product, rotary embedding on q and k. ``x`` [T, hidden],
    ``cos``/``sin`` [T, 1, head_dim]; q [T, num_heads, head_dim], k and v [T, num_kv_heads,
    head_dim]. ``copy_outputs``: for the compiled program (``_copy_if``)."""

    def attention_inputs(x, norm_weight, w_qkv, cos, sin, qkv_bias=None):
        qkv = product(rms_norm(x, norm_weight, eps), w_qkv)
        if qkv_bias is not None:
            qkv = qkv + qkv_bias
        qkv = qkv.reshape([-1, num_heads + 2 * num_kv_heads, head_dim])
        qk, v = paddle.split(qkv, [num_heads + num_kv_heads, num_kv_heads], axis=1)
        qk = qk * cos + rotate_half(qk) * sin
        q, k = paddle.split(qk, [num_heads, num_kv_heads], axis=1)
        return _copy_if(copy_outputs, q), _copy_if(copy_outputs, k), _copy_if(copy_outputs, v)

    return attention_inputs


def make_output_and_mlp(
    eps: float,
    all_reduce: AllReduceFn | None = None,
    copy_outputs: bool = False,
    product: Product = paddle.matmul,
):
    """``output_and_mlp(x, attn, w_o, norm_weight, w_gate_up, w_down[, o_bias]) -> x``:
    the attention output projection and its residual, RMSNorm, SwiGLU and its residual.
    With ``all_reduce`` (a tensor-parallel shard, ``w_o``/``w_down`` row slices) each
    product is summed over the ranks before the bias and the residual."""

    def reduced(x):
        return x if all_reduce is None else all_reduce(x)

    def output_and_mlp(x, attn, w_o, norm_weight, w_gate_up, w_down, o_bias=None):
        out = reduced(product(attn, w_o))
        if o_bias is not None:
            out = out + o_bias
        x = x + out
        gate, up = paddle.split(product(rms_norm(x, norm_weight, eps), w_gate_up), 2, axis=1)
        out = x + reduced(product(nn.functional.silu(gate) * up, w_down))
        return _copy_if(copy_outputs, out)

    return output_and_mlp


def make_logits(
    eps: float,
    copy_outputs: bool = False,
    product: Product = paddle.matmul,
    norm: Callable[[paddle.Tensor, paddle.Tensor, float], paddle.Tensor] = rms_norm,
):
    """``logits(hidden, norm_weight, weight) -> [T, vocab]``: the final RMSNorm (``norm``)
    and the LM head (``product`` reads the tied [vocab, hidden] embedding transposed)."""

    def logits(hidden, norm_weight, weight):
        out = product(norm(hidden, norm_weight, eps), weight)
        return _copy_if(copy_outputs, out)

    return logits


def op_rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """``rms_norm`` as the CPU op computes a decoder layer's norms, in one call
    (ops/cpu_decoder_layer.cc; float32, the sum in its own order). After a decode step's
    weights have streamed through the caches, each of the eager expression's seven ops
    runs cold: the final norm took 0.11-0.15 ms a step where it takes 0.012 ms warm."""
    return paddle_step_ops.cpu_rms_norm(x, weight, eps)


# The products of the op's ways; their logits normalize with the op too.
OP_PRODUCTS = {
    "op": cpu_linear.linear,
    "op_widened": functools.partial(cpu_linear.linear, isa=WIDENED_ISA),
}


def norm_for(product: Product) -> Callable[[paddle.Tensor, paddle.Tensor, float], paddle.Tensor]:
    """The final norm that goes with ``product``: the op's beside the op's products."""
    return op_rms_norm if any(product is p for p in OP_PRODUCTS.values()) else rms_norm


def _on_cpu_in_float32(dtype: str) -> bool:
    return dtype == "float32" and paddle.get_device() == "cpu"


def onednn_available(dtype: str) -> bool:
    """Whether compiled blocks can run here: float32 on the CPU, Paddle 3 (its PIR executor
    is where this was verified), a oneDNN build, and not switched off by the environment."""
    switch = os.environ.get(ENV_SWITCH, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH} must be '0' or '1', got {switch!r}")
    major = paddle.__version__.split(".")[0]
    return (
        switch == "1"
        and _on_cpu_in_float32(dtype)
        and (major == "0" or int(major) >= 3)  # 0.0.0 is a development build
        and paddle.base.core.is_compiled_with_mkldnn()
    )


def op_available(dtype: str) -> bool:
    """Whether the CPU op can run the products: float32 activations on the CPU."""
    return _on_cpu_in_float32(dtype)


def check_packed_weights_run(weight_format: str) -> None:
    """Raises ``ValueError`` naming ``weight_format`` and what is missing when the CPU op
    cannot run it fast here (a model with packed-only weights has no other way to run)."""
    device = paddle.get_device()
    if device != "cpu":
        raise ValueError(
            f"weights in {weight_format}: the CPU op that runs them has no kernel for device "
            f"{device!r} (load in float32 there)"
        )
    if cpu_linear.best_isa() == "scalar":
        raise ValueError(
            f"weights in {weight_format}: the CPU op needs AVX2 and FMA (or AVX-512), which "
            "this CPU lacks (load in float32 instead)"
        )


def forced_method() -> str | None:
    """The way ``PADDLE_STEP_DENSE`` forces, or None for ``auto`` (measure)."""
    value = os.environ.get(ENV_METHOD, "auto")
    if value != "auto" and value not in METHODS:
        raise ValueError(f"{ENV_METHOD} must be 'auto' or one of {METHODS}, got {value!r}")
    return None if value == "auto" else value


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


# int8 weights: one scale per output column (None) or per group of this many rows of K.
INT8_GROUP_SIZE: int | None = None


class DenseWeight(NamedTuple):
    """One product's weight in the forms the ways read: ``tensor`` for ``paddle.matmul``
    ([K, N]; the tied LM head's [vocab, hidden] embedding, read transposed; None for a
    model whose weights are packed only), ``packed`` for the CPU op (None where it does not
    run)."""

    tensor: paddle.Tensor | None
    packed: cpu_linear.PackedWeights | None

    @classmethod
    def of(cls, tensor: paddle.Tensor, with_op: bool, transposed: bool = False) -> DenseWeight:
        """``tensor`` with its packed copy when ``with_op`` (packed from [K, N], or from
        [N, K] with ``transposed``)."""
        if not with_op:
            return cls(tensor, None)
        return cls(tensor, cpu_linear.pack_float32(tensor, transposed))

    @classmethod
    def packed_only(cls, w, weight_format: str, transposed: bool = False) -> DenseWeight:
        """``w`` float32 [K, N] (an array; [N, K] with ``transposed``) packed in
        ``weight_format`` ('bfloat16': rounded to nearest even, exact for a bfloat16
        checkpoint; 'int8': quantized, ``INT8_GROUP_SIZE``), with no other copy kept."""
        group = INT8_GROUP_SIZE if weight_format == "int8" else None
        return cls(None, cpu_linear.pack(w, weight_format, group, transposed))


class DenseBlock:
    """One of the blocks above, run the fastest way measured for each row count class.

    ``make(copy_outputs, product)`` builds its function; ``weights``: the positions of its
    ``DenseWeight`` arguments; ``methods``: the ways it may run here. A compiled call pads
    its per-row arguments to ``padded_rows`` and returns the real rows. ``agree`` (a
    tensor-parallel all-reduce) sums the timings over the ranks, so every rank keeps the
    same way (a replicated product computed two ways could round differently).

    ``input_spec``: one ``InputSpec`` per tensor argument, leading dimension None for the
    per-row ones (the program is traced once, at its first compiled call).
    """

    def __init__(
        self,
        name: str,
        make: Callable[[bool, Product], Callable],
        input_spec: list[InputSpec],
        weights: Sequence[int],
        methods: Sequence[str],
        tied: bool = False,
        agree: AllReduceFn | None = None,
    ) -> None:
        self.name = name
        self.weights = frozenset(weights)
        self.per_row = [spec.shape[0] == -1 for spec in input_spec]  # None reads as -1
        self.agree = agree
        matmul = functools.partial(paddle.matmul, transpose_y=True) if tied else paddle.matmul
        self._functions = {}
        if "eager" in methods:
            self._functions["eager"] = make(False, matmul)
        for way, product in OP_PRODUCTS.items():
            if way in methods:
                self._functions[way] = make(False, product)
        if "compiled" in methods:
            self._functions["compiled"] = paddle.jit.to_static(
                make(True, matmul), input_spec=input_spec, full_graph=True
            )
        forced = forced_method()
        self.forced = forced if forced in self._functions else None
        self.choice: dict[int, str] = {}  # padded row count -> way
        self.timings: dict[int, dict[str, float]] = {}  # padded row count -> way -> seconds

    @property
    def methods(self) -> tuple[str, ...]:
        """The ways this block may run here."""
        return tuple(self._functions)

    def run(self, method: str, *args):
        """The block's outputs computed ``method``'s way."""
        if method in OP_WAYS:
            args = [arg.packed if i in self.weights else arg for i, arg in enumerate(args)]
            return self._functions[method](*args)
        args = [arg.tensor if i in self.weights else arg for i, arg in enumerate(args)]
        if method == "eager":
            return self._functions["eager"](*args)
        rows = args[0].shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            args = [
                _pad_rows(arg, padded) if per_row else arg
                for arg, per_row in zip(args, self.per_row)
            ]
        with _onednn_kernels():
            outputs = self._functions["compiled"](*args)
        if padded == rows:
            return outputs
        if isinstance(outputs, tuple):
            return tuple(output[:rows] for output in outputs)
        return outputs[:rows]

    def way_for(self, rows: int) -> str | None:
        """The way a call with ``rows`` rows runs, or None while that is not measured yet."""
        if len(self._functions) == 1:
            return next(iter(self._functions))
        return self.forced or self.choice.get(padded_rows(rows))

    def __call__(self, *args):
        if len(self._functions) == 1:
            return self.run(next(iter(self._functions)), *args)
        if self.forced is not None:
            return self.run(self.forced, *args)
        rows_class = padded_rows(args[0].shape[0])
        method = self.choice.get(rows_class)
        if method is not None:
            return self.run(method, *args)
        return self._measure(rows_class, args)

    def _measure(self, rows_class: int, args):
        """Times every way on ``args``, keeps the fastest for ``rows_class``, returns its
        outputs."""
        outputs = {method: self.run(method, *args) for method in self._functions}  # warm-up
        times: dict[str, list[float]] = {method: [] for method in self._functions}
        for _ in range(TIMED_CALLS):
            for method in self._functions:
                started = time.perf_counter()
                outputs[method] = self.run(method, *args)
                times[method].append(time.perf_counter() - started)
        best = [min(times[method]) for method in self._functions]
        if self.agree is not None:
            best = self.agree(paddle.to_tensor(best, dtype="float64")).numpy().tolist()
        timings = dict(zip(self._functions, best))
        method = min(timings, key=timings.get)
        self.choice[rows_class] = method
        self.timings[rows_class] = timings
        logger.debug(
            "%s, %d rows: %s -> %s",
            self.name,
            rows_class,
            ", ".join(f"{m} {t * 1e3:.3f} ms" for m, t in timings.items()),
            method,
        )
        return outputs[method]


# A step's first n layers run one way (None: all), returning the hidden states after them.
RunLayers = Callable[[int | None], paddle.Tensor]


class ModelBlocks(NamedTuple):
    """The three blocks of one model shape, shared by all its layers."""

    attention_inputs: DenseBlock  # (x, norm_weight, w_qkv, cos, sin[, qkv_bias])
    output_and_mlp: DenseBlock  # (x, attn, w_o, norm_weight, w_gate_up, w_down[, o_bias])
    logits: DenseBlock  # (hidden, norm_weight, lm_head or tied embedding)

    @property
    def use_op(self) -> bool:
        """Whether the layers must hand the blocks packed weights too."""
        return any("op" in block.methods for block in self)

    @property
    def layer_blocks(self) -> tuple[DenseBlock, DenseBlock]:
        """The two blocks of a decoder layer (``logits`` runs once, after the layers)."""
        return self.attention_inputs, self.output_and_mlp

    def layer_way(self, rows: int) -> str | None:
        """The way both of a layer's blocks run ``rows`` rows, or None where they differ
        or are not measured yet."""
        ways = {block.way_for(rows) for block in self.layer_blocks}
        return ways.pop() if len(ways) == 1 else None


class LayerFusion:
    """Whether a step's layers run as one CPU call (``ops/cpu_decoder_layer.cc``)
    instead of ``blocks`` and a per-layer attention, per row count class. Where both blocks
    keep a way of our op, the fused layer runs the same products with fewer crossings. Where
    they keep another (oneDNN's compiled program for long prompts, say), the fused layer's
    own products, threaded norms, rotary, SwiGLU and attention may still be faster: only
    timing tells, so the first step of such a class runs its first layers both ways (of
    ``num_layers``, ``timed_layers``), and keeps the faster."""

    def __init__(self, blocks: ModelBlocks, num_layers: int) -> None:
        self.blocks = blocks
        self.timed_layers = max(1, num_layers // FUSION_LAYERS_DIVISOR)
        self.choice: dict[int, bool] = {}  # padded row count -> fused

    def fuse_layers(self, rows: int) -> bool | None:
        """Whether a layer over ``rows`` tokens runs as one CPU call, on one rank (a
        tensor-parallel shard all-reduces between products) where both dense blocks can
        run our op: yes where both keep the same way of it (measured or forced); no where
        they are forced another way; else as timed, None while that is still to do
        (``choose``)."""
        dense = self.blocks.layer_blocks
        if dense[0].agree is not None or any(
            not set(OP_WAYS) & set(block.methods) for block in dense
        ):
            return False
        if self.blocks.layer_way(rows) in OP_WAYS:
            return True
        if any(block.forced for block in dense):
            return False
        return self.choice.get(padded_rows(rows))

    def op_path(self, rows: int) -> str:
        """The op's path for a fused layer's products over ``rows`` rows: ``WIDENED_ISA``
        where the blocks keep ``op_widened``, else "" (the process's path)."""
        return WIDENED_ISA if self.blocks.layer_way(rows) == "op_widened" else ""

    def choose(self, rows: int, blocks: RunLayers, fused: RunLayers) -> paddle.Tensor:
        """A step's hidden states over ``rows`` tokens where ``fuse_layers`` is None.
        ``blocks(n)`` and ``fused(n)`` run the step's first n layers (None: all) each way
        and return the hidden states after them; both write the same cache slots. First
        ``blocks(1)`` if the blocks have not measured the class yet (they time their ways
        on that call), and then all layers fused if the blocks keep our op; else the first
        ``timed_layers`` timed both ways, ``FUSION_ROUNDS`` times each, alternating, the
        faster (by its fastest run) kept for the class, and all layers run that way, last,
        so that the result and the cache are that way's alone."""
        if any(block.way_for(rows) is None for block in self.blocks.layer_blocks):
            blocks(1)
            fuse = self.fuse_layers(rows)
            if fuse is not None:
                return fused(None) if fuse else blocks(None)
        timings = {False: math.inf, True: math.inf}
        for _ in range(FUSION_ROUNDS):
            for fuse, run in ((False, blocks), (True, fused)):
                started = time.perf_counter()
                run(self.timed_layers)
                timings[fuse] = min(timings[fuse], time.perf_counter() - started)
        fuse = timings[True] < timings[False]
        rows_class = padded_rows(rows)
        self.choice[rows_class] = fuse
        logger.debug(
            "layers, %d rows (the first %d): blocks %.3f ms, fused %.3f ms -> %s", rows_class,
            self.timed_layers, timings[False] * 1e3, timings[True] * 1e3,
            "fused" if fuse else "blocks",
        )  # fmt: skip
        return fused(None) if fuse else blocks(None)


def model_blocks(config: ModelConfig, all_reduce: AllReduceFn | None = None) -> ModelBlocks:
    """The blocks for a model built from ``config`` (one tensor-parallel rank's config
    when ``all_reduce`` is given: that rank's head counts and intermediate size)."""
    methods = ["eager"]
    if op_available(config.dtype):
        methods.append("op")
    if onednn_available(config.dtype):
        methods.append("compiled")
    if config.weight_format is not None:  # the weights exist only packed for the op
        # One way, not timed: op_widened multiplies x as it is, op rounds it (avx512_bf16),
        # so a per-row-class timing would make a token's result depend on its batch and
        # flip between runs on near-ties. PADDLE_STEP_DENSE=op_widened forces the other.
        methods = ["op"]
        if cpu_linear.isa() == "avx512_bf16" and forced_method() == "op_widened":
            methods = ["op_widened"]
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
            "attention_inputs",
            lambda copy, product: make_attention_inputs(
                config.num_heads, config.num_kv_heads, head_dim, eps, copy, product
            ),
            [spec(rows, hidden), spec(hidden), spec(hidden, qkv_width)]
            + [spec(rows, 1, head_dim)] * 2
            + ([spec(qkv_width)] if config.qkv_bias else []),
            weights=[2],
            methods=methods,
            agree=all_reduce,
        ),
        output_and_mlp=DenseBlock(
            "output_and_mlp",
            lambda copy, product: make_output_and_mlp(eps, all_reduce, copy, product),
            [
                spec(rows, hidden),
                spec(rows, q_width),
                spec(q_width, hidden),
                spec(hidden),
                spec(hidden, 2 * intermediate),
                spec(intermediate, hidden),
            ]
            + ([spec(hidden)] if config.o_proj_bias else []),
            weights=[2, 4, 5],
            # The all-reduce runs between its products: not in a compiled program.
            methods=[m for m in methods if all_reduce is None or m != "compiled"],
            agree=all_reduce,
        ),
        logits=DenseBlock(
            "logits",
            lambda copy, product: make_logits(eps, copy, product, norm_for(product)),
            [spec(rows, hidden), spec(hidden), spec(*vocab_shape)],
            weights=[2],
            methods=methods,
            tied=config.tie_word_embeddings,
            agree=all_reduce,
        ),
    )
