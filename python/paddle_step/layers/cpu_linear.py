"""Decode-row products ``y = x @ W (+ bias)`` on the CPU through the op library's own kernels.

The weights are packed once (``pack_float32``, ``pack_bfloat16``, ``pack_int8``, or ``pack``
with the format as an argument) into the panels the kernels stream
(ops/include/cpu_linear_kernel.h); the model keeps the ``PackedWeights`` instead of ``W``.
``linear`` takes float32 activations ``[M, K]`` whatever the weight format and accumulates in
float32. The instruction-set path is chosen from the CPU's flags (``best_isa``); ``set_isa`` or
``PADDLE_STEP_CPU_ISA`` forces a lower one. Products run on ``num_threads()`` threads, by
default the cores the process may run on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import paddle

import paddle_step_ops as _library

FORMATS = ("float32", "bfloat16", "int8")
BYTES_PER_WEIGHT = {"float32": 4, "bfloat16": 2, "int8": 1}
_PANEL_WIDTH = 32  # columns per panel (kPanelWidth)


@dataclass(frozen=True)
class PackedWeights:
    """``W`` [k, n] packed for ``linear``: ``weights`` holds the panels (its dtype is the
    format), ``scales`` the int8 format's float32 scale per column and group of
    ``group_size`` rows of ``k``."""

    format: str
    k: int
    n: int
    weights: paddle.Tensor
    scales: paddle.Tensor | None = None
    group_size: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: the panels (padding included) and the scales."""
        total = BYTES_PER_WEIGHT[self.format] * math.prod(self.weights.shape)
        if self.scales is not None:
            total += 4 * math.prod(self.scales.shape)
        return total


def _tensor(w) -> paddle.Tensor:
    return w if isinstance(w, paddle.Tensor) else paddle.to_tensor(np.ascontiguousarray(w))


def _k_n(w: paddle.Tensor, transposed: bool) -> tuple[int, int]:
    """K and N of a checked ``w`` (the op's packer checks it first)."""
    rows, columns = w.shape
    return (columns, rows) if transposed else (rows, columns)


def pack_float32(w, transposed: bool = False) -> PackedWeights:
    """``w`` float32 [K, N] (a paddle tensor or an array; a Linear's weight, [in, out]), or
    with ``transposed`` W stored as its transpose [N, K] (a tied LM head's embedding
    [vocab, hidden], packed without a transposed copy)."""
    w = _tensor(w)
    weights = _library.cpu_linear_pack_float32(w, transposed)  # checks w first
    return PackedWeights("float32", *_k_n(w, transposed), weights)


def pack_bfloat16(w, transposed: bool = False) -> PackedWeights:
    """``w`` float32 (rounded to nearest even) or bfloat16 (kept exactly) [K, N], or [N, K]
    with ``transposed``."""
    w = _tensor(w)
    weights = _library.cpu_linear_pack_bfloat16(w, transposed)  # checks w first
    return PackedWeights("bfloat16", *_k_n(w, transposed), weights)


def pack_int8(w, group_size: int | None = None, transposed: bool = False) -> PackedWeights:
    """``w`` float32 or bfloat16 [K, N] ([N, K] with ``transposed``) quantized to symmetric
    int8, one scale (max |w| / 127) per column and group of ``group_size`` rows of K; None:
    one scale per column."""
    w = _tensor(w)
    group = (w.shape[-1] if transposed else w.shape[0]) if group_size is None else group_size
    weights, scales = _library.cpu_linear_pack_int8(w, group, transposed)  # checks w first
    return PackedWeights("int8", *_k_n(w, transposed), weights, scales, group)


def pack(
    w, weight_format: str = "float32", group_size: int | None = None, transposed: bool = False
) -> PackedWeights:
    """``w`` [K, N] ([N, K] with ``transposed``) packed in ``weight_format`` (one of
    ``FORMATS``); ``group_size``: int8 only."""
    if weight_format == "int8":
        return pack_int8(w, group_size, transposed)
    if group_size is not None:
        raise ValueError(
            f"pack: argument 'group_size': expected None for {weight_format!r} weights, "
            f"got {group_size}"
        )
    if weight_format == "float32":
        return pack_float32(w, transposed)
    if weight_format == "bfloat16":
        return pack_bfloat16(w, transposed)
    raise ValueError(
        f"pack: argument 'weight_format': expected one of {FORMATS}, got {weight_format!r}"
    )


def linear(
    x: paddle.Tensor,
    packed: PackedWeights,
    bias: paddle.Tensor | None = None,
    isa: str | None = None,
) -> paddle.Tensor:
    """``x`` float32 [M, K] @ ``packed`` (+ ``bias`` float32 [N]): a new float32 [M, N].
    ``isa``: the path of this product (at most ``isa()``); None: ``isa()``."""
    return _library.cpu_linear(
        x, packed.weights, packed.scales, bias, packed.n, packed.group_size, isa or ""
    )


def columns(packed: PackedWeights, ids: paddle.Tensor) -> paddle.Tensor:
    """Columns ``ids`` (int64 [T]) of the packed ``W`` [K, N] as float32 rows [T, K]: the
    values the products multiply by (bfloat16 widened, int8 times its scale). An embedding
    lookup reads the tied LM head ``W = embedding.T`` this way, so one packed copy serves
    both. Gathers straight from the panels (ops/include/cpu_linear_kernel.h's layout)."""
    k = packed.k
    panel, column = ids // _PANEL_WIDTH, (ids % _PANEL_WIDTH).unsqueeze(1)
    rows = paddle.arange(k, dtype="int64")
    flat = packed.weights.flatten()
    if packed.format == "bfloat16":  # [panels][ceil(K/2)][32][2]
        start = panel.unsqueeze(1) * (flat.shape[0] // packed.weights.shape[0])
        index = start + (rows // 2 * 2 * _PANEL_WIDTH + rows % 2) + 2 * column
    else:  # [panels][K][32]
        index = (panel * k).unsqueeze(1) * _PANEL_WIDTH + rows * _PANEL_WIDTH + column
    if packed.format == "int8":
        # paddle 2.6 has no CPU int8 gather: gather the same bytes viewed as uint8.
        picked = paddle.view(paddle.gather(paddle.view(flat, "uint8"), index.flatten()), "int8")
    else:
        picked = paddle.gather(flat, index.flatten())
    values = picked.astype("float32").reshape([-1, k])
    if packed.format != "int8":
        return values
    groups = packed.scales.shape[1]  # [panels][ceil(K/G)][32]
    scale_index = (panel * groups).unsqueeze(1) * _PANEL_WIDTH + column
    scale_index = scale_index + rows // packed.group_size * _PANEL_WIDTH
    return values * paddle.gather(packed.scales.flatten(), scale_index.flatten()).reshape([-1, k])


def set_num_threads(threads: int) -> None:
    """Threads each product runs on, the caller's included (e.g. the cores of
    ``os.sched_getaffinity(0)``, split across tensor-parallel ranks). Raises
    ``ValueError`` when the system cannot start that many."""
    try:
        _library.cpu_linear_set_num_threads(threads)
    except RuntimeError as error:  # std::thread's system_error: EAGAIN past the OS limit
        raise ValueError(f"threads: could not start {threads} threads: {error}") from None


def num_threads() -> int:
    return _library.cpu_linear_num_threads()


def set_isa(name: str) -> None:
    """Forces the path: ``"auto"`` (the best this CPU has) or one of ``"scalar"``,
    ``"avx2"``, ``"avx512"``, ``"avx512_bf16"`` that the CPU supports."""
    _library.cpu_linear_set_isa(name)


def isa() -> str:
    """The path products run on now."""
    return _library.cpu_linear_isa()


def best_isa() -> str:
    """The most capable path this CPU supports."""
    return _library.cpu_linear_best_isa()


class Prefetch(NamedTuple):
    """How far ahead of its loads a product asks for weights, in bytes (multiples of 64 up
    to 65,536): into the first-level cache (``l1``; 0 leaves it to the hardware prefetcher)
    and, besides, into the second-level cache (``l2``; 0: not at all)."""

    l1: int
    l2: int = 0


def set_prefetch_bytes(one_row: int | Prefetch, several_rows: int | Prefetch) -> None:
    """How far ahead of their loads products of one row of x and of several ask for
    weights (an int: ``Prefetch(l1)``). Never changes a result; the engine times the best
    (``layers.prefetch_distance``)."""
    one_row, several_rows = (Prefetch(*d) if isinstance(d, tuple) else Prefetch(d)
                             for d in (one_row, several_rows))  # fmt: skip
    _library.cpu_linear_set_prefetch_bytes(one_row.l1, several_rows.l1, one_row.l2,
                                           several_rows.l2)  # fmt: skip


def prefetch_bytes() -> tuple[Prefetch, Prefetch]:
    """The distances products use now: (one row, several rows)."""
    one_row, several_rows, l2_one_row, l2_several_rows = _library.cpu_linear_prefetch_bytes()
    return Prefetch(one_row, l2_one_row), Prefetch(several_rows, l2_several_rows)
