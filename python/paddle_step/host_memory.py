"""How the process's host memory is handed back or kept, where glibc's malloc serves it.

glibc hands out blocks above a threshold (128 KiB, raised to the largest block freed, at
most 32 MiB) with their own mmap and unmaps them on free, and gives back freed memory at
the top of its heap beyond 128 KiB; freed blocks below the top stay in the heap.

- After a checkpoint load (``return_freed_memory``): the checkpoint's arrays and their
  float32 copies, each under the threshold once it has grown, leave holes in the heap
  (measured on a 0.5B bfloat16 model: 2.6 GB resident after the load, 1.2 GB after the
  trim, for 0.94 GB of weights).
- Between a CPU engine's steps (``keep_freed_memory``): a step allocates and frees its
  activations layer by layer (a prefill of 512 rows on Qwen2.5-0.5B's shape: a 20 MB
  gate/up product, a 10 MB activation), so each new buffer cost page faults and the kernel
  zeroing its pages: 12% of that prefill on one thread, 16% on two (AMD EPYC, Zen 5).
  Serving blocks up to 32 MiB from the heap and never trimming it keeps those pages
  mapped; the process then holds the high-water mark of its buffers. A later load still
  trims (``malloc_trim`` ignores the trim threshold).

- A large buffer written as it is used (``untouched_zeros``, the CPU KV cache): taken
  from calloc, which serves it by its own mmap, whose pages the kernel maps, zeroed, when
  they are first written. Writing zeros up front (``paddle.zeros``) maps every page before
  the first request: 0.76 to 1.07 s and 1.6 GB resident for the example's KV cache on
  Qwen2.5-0.5B's shape (Intel Xeon, 2 cores).

Where the C library is not glibc the first two do nothing. An allocator preloaded in
malloc's place (tcmalloc, jemalloc) keeps freed memory by its own rules, which these calls
do not touch.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "available_memory_bytes",
    "keep_freed_memory",
    "refuse_past_available_memory",
    "return_freed_memory",
    "untouched_zeros",
]

# A cache line: rows that start on one are read in the fewest lines.
_ALIGNMENT = 64
# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit systems (HEAP_MAX_SIZE / 2).
_LARGEST_HEAP_BLOCK = 32 << 20
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's own symbols, where they are glibc's (the C library is loaded)."""
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def return_freed_memory() -> None:
    """Hands the heap pages freed so far back to the OS."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def keep_freed_memory() -> bool:
    """Sets glibc's malloc to serve blocks up to 32 MiB from its heap and never trim it,
    once per process. Returns whether glibc took the settings."""
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success; setting either threshold ends glibc's adjusting them.
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, _LARGEST_HEAP_BLOCK)
        and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)
    )


def available_memory_bytes() -> int | None:
    """What the kernel says can still be allocated without swapping (``MemAvailable`` in
    /proc/meminfo), or None where it does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def refuse_past_available_memory(needed: int, what: str, sizes: str, remedy: str) -> None:
    """Raises ``MemoryError`` ("``what`` needs X GiB (``sizes``), more than the Y GiB
    available: ``remedy``") when ``needed`` bytes pass what the machine has available;
    nothing where it does not say. Named at once, where NumPy's, Python's or paddle's own
    refusal names no flag (paddle's comes after seconds of trying)."""
    available = available_memory_bytes()
    if available is not None and needed > available:
        raise MemoryError(
            f"{what} needs {needed / 2**30:.1f} GiB ({sizes}), more than the "
            f"{available / 2**30:.1f} GiB available: {remedy}"
        )


def untouched_zeros(shape: Sequence[int], dtype: np.dtype | str) -> np.ndarray:
    """A C-ordered array of zeros of ``shape`` and ``dtype``, starting on a cache line,
    whose pages nothing has written yet: they cost no time or resident memory until they
    are first written."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    raw = np.zeros(size + _ALIGNMENT, dtype=np.uint8)  # calloc: no zeros written
    start = -raw.ctypes.data % _ALIGNMENT
    return raw[start : start + size].view(dtype).reshape(shape)
