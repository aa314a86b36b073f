"""How far ahead of its loads the CPU op's products ask for weights, chosen by timing on the
machine at hand (``cpu_linear``'s prefetch distance; it never changes a result).

A tile of the op computes between its loads, so it keeps fewer reads in flight than memory
needs when the weights stream from memory rather than from the cache; asking for the line a
distance ahead makes up for it. The best distance depends on the CPU, its memory, the thread
count, the rows of the tile and the products' sizes: on one AMD EPYC (Zen 5), 16 KB made a
decode step's float32 products of 8 rows 20% faster than 2 KB, while products of one row ran
best at 2 to 8 KB. So ``choose`` times a set of distances on the model's own products, in
the order a decode step runs them, for one row and for several, and keeps for each the
shortest distance within ``NEAR_BEST`` of the fastest: a longer one asks for lines past the
end of each product's weights and holds more of the cache, which the products timed back to
back do not show but a decode step, with attention and norms between them, does (one row,
one thread: steps 2.4% slower at 8 KB than at 2 KB and 10% at 16 KB, where the products
alone were fastest at 8 KB and within 4% of it at 16 KB). After those come distances that
also ask for lines further ahead into the second-level cache: on an Intel Xeon (Emerald
Rapids, 2 cores of a VM), 2 KB into L1 with 8 KB into L2 streamed products of 1 and 8 rows
10-16% faster than 2 KB alone.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import paddle

from . import cpu_linear

if TYPE_CHECKING:
    from ..models.llama import LlamaForCausalLM

__all__ = [
    "CANDIDATES",
    "PrefetchChoice",
    "choose",
    "choose_for_model",
    "describe",
    "last_level_cache_bytes",
]

# In order of preference (the first near the fastest is kept): into L1 alone, nearest
# first, then also into L2 further ahead.
CANDIDATES = tuple(cpu_linear.Prefetch(l1) for l1 in (0, 1024, 2048, 4096, 8192, 16384, 32768)) + (
    cpu_linear.Prefetch(2048, 8192),
    cpu_linear.Prefetch(2048, 16384),
    cpu_linear.Prefetch(0, 16384),
)
# The rows timed for each setting: a single-sequence decode step, and a batch's.
ONE_ROW, SEVERAL_ROWS = 1, 8
REPEATS = 5  # timed passes of each distance, interleaved; the median counts
NEAR_BEST = 0.05  # a distance this much slower than the fastest counts as fast
# Where the cache size cannot be read: a common server last-level cache.
FALLBACK_CACHE_BYTES = 32 << 20

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefetchChoice:
    """The distances kept, and the median ms of a timed pass at each (by rows)."""

    one_row: cpu_linear.Prefetch
    several_rows: cpu_linear.Prefetch
    timings: dict[int, dict[cpu_linear.Prefetch, float]]


_chosen: dict[tuple, PrefetchChoice] = {}


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


def choose(products: Sequence[cpu_linear.PackedWeights]) -> PrefetchChoice:
    """Times passes over ``products`` (each multiplied by ``ONE_ROW``, then
    ``SEVERAL_ROWS`` rows of x, in order) at each of ``CANDIDATES``, on the op's threads;
    sets and returns, for each row count, the shortest distance within ``NEAR_BEST`` of the
    fastest. Remembered per (products'
    shapes and formats, threads) for the process."""
    key = (tuple((p.format, p.k, p.n) for p in products), cpu_linear.num_threads())
    if key in _chosen:
        choice = _chosen[key]
        cpu_linear.set_prefetch_bytes(choice.one_row, choice.several_rows)
        return choice
    kept = cpu_linear.prefetch_bytes()
    timings: dict[int, dict[cpu_linear.Prefetch, float]] = {}
    try:
        for rows in (ONE_ROW, SEVERAL_ROWS):
            inputs = {k: paddle.full([rows, k], 0.25, "float32") for k in {p.k for p in products}}

            def run_pass() -> None:
                for packed in products:
                    cpu_linear.linear(inputs[packed.k], packed)

            run_pass()  # warms the threads and the page tables
            samples: dict[cpu_linear.Prefetch, list[float]] = {d: [] for d in CANDIDATES}
            for _ in range(REPEATS):
                for distance in CANDIDATES:
                    cpu_linear.set_prefetch_bytes(distance, distance)
                    started = time.perf_counter()
                    run_pass()
                    samples[distance].append((time.perf_counter() - started) * 1e3)
            timings[rows] = {d: statistics.median(s) for d, s in samples.items()}
    finally:
        cpu_linear.set_prefetch_bytes(*kept)
    best = {rows: _first_near_best(times) for rows, times in timings.items()}
    choice = PrefetchChoice(best[ONE_ROW], best[SEVERAL_ROWS], timings)
    cpu_linear.set_prefetch_bytes(choice.one_row, choice.several_rows)
    _chosen[key] = choice
    megabytes = sum(p.nbytes for p in products) / 1e6
    for rows, times in timings.items():
        logger.debug(
            "prefetch distance, %d row(s) x %d products (%.1f MB) on %d threads: %s -> %s",
            rows, len(products), megabytes, key[1],
            ", ".join(f"{describe(d)} {ms:.3f} ms" for d, ms in times.items()),
            describe(best[rows]),
        )  # fmt: skip
    return choice


def _first_near_best(times: dict[cpu_linear.Prefetch, float]) -> cpu_linear.Prefetch:
    """The first distance (in ``times``' order, ``CANDIDATES``') whose time is within
    ``NEAR_BEST`` of the fastest."""
    fastest = min(times.values())
    return next(d for d, ms in times.items() if ms <= fastest * (1 + NEAR_BEST))


def describe(distance: cpu_linear.Prefetch) -> str:
    """``distance`` in words, e.g. "2048 B (L2 8192 B)"."""
    return f"{distance.l1} B" + (f" (L2 {distance.l2} B)" if distance.l2 else "")


def choose_for_model(model: LlamaForCausalLM) -> PrefetchChoice | None:
    """``choose`` on the leading products of ``model``'s decode step, whole layers until
    they pass twice the last-level cache (so that they come from memory, as in a step),
    for a model whose products run on the CPU op and do not fit that cache; None
    otherwise (from the cache, the distance hardly matters)."""
    products = model.decode_products()
    cache = last_level_cache_bytes()
    if sum(p.nbytes for p in products) <= cache:
        return None
    timed: list[cpu_linear.PackedWeights] = []
    for start in range(0, len(products), 4):  # a layer's four products, or the LM head
        timed += products[start : start + 4]
        if sum(p.nbytes for p in timed) >= 2 * cache:
            break
    return choose(timed)
