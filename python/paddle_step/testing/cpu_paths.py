"""The instruction-set paths of the CPU op library (``cpu_linear.set_isa``), for tests that
run a kernel on each path the CPU has."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..layers import cpu_linear

__all__ = ["ISA_PATHS", "on_isa", "runs_here"]

ISA_PATHS = ("scalar", "avx2", "avx512", "avx512_bf16")


def runs_here(path: str) -> bool:
    """Whether this CPU runs ``path``."""
    return ISA_PATHS.index(path) <= ISA_PATHS.index(cpu_linear.best_isa())


@contextmanager
def on_isa(path: str) -> Iterator[None]:
    """The CPU ops run on ``path`` inside, on the best one after."""
    cpu_linear.set_isa(path)
    try:
        yield
    finally:
        cpu_linear.set_isa("auto")
