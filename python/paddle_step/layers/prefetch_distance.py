"""How far ahead of its loads the CPU op's products ask for weights, chosen by timing on the
machine at hand (``cpu_linear``'s prefetch distance; it never changes a result).

A tile of the op computes between its loads, so it keeps fewer reads in flight than memory
needs when the weights stream from memory rather than from the cache; asking for the line a
distance ahead makes up for it. The best distance depends on the CPU, its memory, the thread
count and the rows of the tile: on one AMD EPYC (Zen 5), 8-16 KB made float32 products of 8
rows 15-20% faster than 2 KB, while one row did best with none. So ``choose`` times a set of
distances on weights larger than the last-level cache, for one row and for several, and keeps
the fastest of each.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import paddle

from . import cpu_linear

if TYPE_CHECKING:
    from ..config import ModelConfig

__all__ = [
    "CANDIDATES",
    "PrefetchChoice",
    "choose",
    "choose_for_model",
    "last_level_cache_bytes",
    "streamed_weight_bytes",
]

CANDIDATES = (0, 1024, 2048, 4096, 8192, 16384, 32768)  # bytes
# The rows timed for each setting: a single-sequence decode step, and a batch's.
ONE_ROW, SEVERAL_ROWS = 1, 8
REPEATS = 5  # timed calls of each distance, interleaved; the median counts
# Where the cache size cannot be read: a common server last-level cache.
FALLBACK_CACHE_BYTES = 32 << 20
_BYTES_PER_WEIGHT = {"float32": 4, "bfloat16": 2, "int8": 1}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefetchChoice:
    """The distances kept, and the median ms of a timed product at each (by rows)."""

    one_row: int
    several_rows: int
    timings: dict[int, dict[int, float]]


_chosen: dict[tuple[int, str, int], PrefetchChoice] = {}


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 as sysfs reports it, else ``FALLBACK_CACHE_BYTES``."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[-1:] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=FALLBACK_CACHE_BYTES)


def streamed_weight_bytes(config: ModelConfig) -> int:
    """Bytes of the weights a decode step's products read: every layer's, and the LM head."""
    bytes_per_weight = _BYTES_PER_WEIGHT.get(config.weight_format or config.dtype, 4)
    hidden, head_dim = config.hidden_size, config.head_dim
    q_width = config.num_heads * head_dim
    qkv_width = q_width + 2 * config.num_kv_heads * head_dim
    layer = hidden * qkv_width + q_width * hidden + 3 * hidden * config.intermediate_size
    return (config.num_layers * layer + hidden * config.vocab_size) * bytes_per_weight


def choose(k: int, weight_format: str = "float32") -> PrefetchChoice:
    """Times products of ``k``-row weights in ``weight_format`` (twice the last-level
    cache's bytes, so they come from memory) at each of ``CANDIDATES``, for ``ONE_ROW`` and
    ``SEVERAL_ROWS`` rows of x on the op's threads; sets and returns the fastest of each.
    Remembered per (k, format, threads) for the process."""
    key = (k, weight_format, cpu_linear.num_threads())
    if key in _chosen:
        choice = _chosen[key]
        cpu_linear.set_prefetch_bytes(choice.one_row, choice.several_rows)
        return choice
    per_column = k * _BYTES_PER_WEIGHT[weight_format]
    n = -(-2 * last_level_cache_bytes() // per_column)
    packed = cpu_linear.pack(paddle.full([k, n], 0.5, "float32"), weight_format)
    kept = cpu_linear.prefetch_bytes()
    timings: dict[int, dict[int, float]] = {}
    try:
        for rows in (ONE_ROW, SEVERAL_ROWS):
            x = paddle.full([rows, k], 0.25, "float32")
            cpu_linear.linear(x, packed)  # warms the threads and the page tables
            samples: dict[int, list[float]] = {bytes_: [] for bytes_ in CANDIDATES}
            for _ in range(REPEATS):
                for bytes_ in CANDIDATES:
                    cpu_linear.set_prefetch_bytes(bytes_, bytes_)
                    started = time.perf_counter()
                    cpu_linear.linear(x, packed)
                    samples[bytes_].append((time.perf_counter() - started) * 1e3)
            timings[rows] = {b: statistics.median(s) for b, s in samples.items()}
    finally:
        cpu_linear.set_prefetch_bytes(*kept)
    best = {rows: min(times, key=times.get) for rows, times in timings.items()}
    choice = PrefetchChoice(best[ONE_ROW], best[SEVERAL_ROWS], timings)
    cpu_linear.set_prefetch_bytes(choice.one_row, choice.several_rows)
    _chosen[key] = choice
    for rows, times in timings.items():
        logger.info(
            "prefetch distance, [%d, %d] x %s [%d, %d] on %d threads: %s -> %d bytes",
            rows, k, weight_format, k, n, key[2],
            ", ".join(f"{b} B {ms:.3f} ms" for b, ms in times.items()), best[rows],
        )  # fmt: skip
    return choice


def choose_for_model(config: ModelConfig) -> PrefetchChoice | None:
    """``choose`` for a model whose products run on the CPU op and whose weights do not fit
    the last-level cache (where they do, they come from the cache and the distance hardly
    matters); None otherwise."""
    if streamed_weight_bytes(config) <= last_level_cache_bytes():
        return None
    return choose(config.hidden_size, config.weight_format or "float32")
