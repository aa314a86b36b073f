"""How many threads the CPU math runs on: by default every core this process may run on
(its affinity mask, as a container or ``taskset`` sets it), shared out among the
tensor-parallel ranks. ``import paddle`` sets ``OMP_NUM_THREADS=1``, so without this the
engine would compute on one core."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "available_cores",
    "default_threads",
    "one_math_thread",
    "release_idle_openmp_threads",
    "set_compute_threads",
]

# Intel's OpenMP runtime, which Paddle's MKL and oneDNN kernels run their threads on.
INTEL_OPENMP = "libiomp5.so"
BLOCKTIME_ENV = "KMP_BLOCKTIME"


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
    release_idle_openmp_threads()


def release_idle_openmp_threads() -> bool:
    """Makes the OpenMP threads of Paddle's kernels sleep as soon as a parallel region ends
    (Intel OpenMP's blocktime 0, for the teams the calling thread starts), unless
    ``KMP_BLOCKTIME`` is set in the environment; True where it did.

    By default they spin for 200 ms after each region, holding the cores that this
    package's own threads (the CPU op's pool) need next: one Paddle matmul in a decode step
    made the op's products as slow as on one thread (h512, B = 1, two threads on an Intel
    Xeon: 133 against 265 tok/s), and the dense blocks' timing then kept Paddle's kernels
    for the wrong reason. A region's threads that sleep cost a wake-up (microseconds) at the
    next one. The runtime must be loaded already (``import paddle`` loads it); where it is
    not (another BLAS build), nothing changes."""
    if BLOCKTIME_ENV in os.environ:
        return False
    try:
        runtime = ctypes.CDLL(INTEL_OPENMP, mode=os.RTLD_NOLOAD)
    except OSError:
        return False
    runtime.kmp_set_blocktime(ctypes.c_int(0))
    return True


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
