"""Timed repeats of one generation, for ``bench_cpu.py``'s workers (imports no engine: each
worker runs in its own engine's environment)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

__all__ = ["median_of_repeats"]


def median_of_repeats(generate: Callable[[], dict], repeats: int) -> dict:
    """Runs ``generate()`` (which returns at least ``seconds`` and ``token_ids``) ``repeats``
    times, at least once. Returns the first run's result with ``seconds`` the median of the
    runs' (a shared machine slows single runs by 10-30%) and ``seconds_each`` all of them."""
    results = [generate() for _ in range(max(1, repeats))]
    median = dict(results[0])
    median["seconds_each"] = [result["seconds"] for result in results]
    median["seconds"] = statistics.median(median["seconds_each"])
    return median
