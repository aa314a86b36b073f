"""How many threads the CPU math runs on: by default every core this process may run on
(its affinity mask, as a container or ``taskset`` sets it), shared out among the
tensor-parallel ranks. ``import paddle`` sets ``OMP_NUM_THREADS=1``, so without this the
engine would compute on one core."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["available_cores", "default_threads", "one_math_thread", "set_compute_threads"]


def available_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def default_threads(world_size: int = 1) -> int:
    """This process's share of the cores when ``world_size`` ranks share the machine."""
    if world_size < 1:
        raise ValueError(f"default_threads: argument 'world_size': expected >= 1, got {world_size}")
    return max(1, available_cores() // world_size)


def set_compute_threads(threads: int) -> None:
    """Runs Paddle's CPU kernels (MKL, oneDNN) and this package's CPU op on ``threads``
    threads."""
    from paddle.base import core

    from ..layers import cpu_linear

    core.set_num_threads(threads)
    cpu_linear.set_num_threads(threads)


@contextmanager
def one_math_thread(threads: int) -> Iterator[None]:
    """Runs Paddle's CPU kernels on one thread inside, and on ``threads`` after: for ops
    too small to gain from threads, whose fork and join then cost more than the work (on
    a busy machine, a [64, 2048] softmax takes ~10x longer on two threads than on one).
    Each row of such an op is one thread's work, so the results do not change."""
    from paddle.base import core

    core.set_num_threads(1)
    try:
        yield
    finally:
        core.set_num_threads(threads)
