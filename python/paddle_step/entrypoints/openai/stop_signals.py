"""SIGTERM and Ctrl-C before the server serves (its modules loading, the flags parsed, the
model loading): each handler records the signal, then raises ``StopSignal``, so that the
server exits 128 + the signal however the exception surfaced (a library may report it as
an error of its own). Standard library only: ``serve`` installs these before it imports
anything else."""

from __future__ import annotations

import functools
import signal

__all__ = ["StopSignal", "catch_stop_signals", "interrupt", "restore_handlers"]


class StopSignal(KeyboardInterrupt):
    """SIGTERM or Ctrl-C before serving. Not a plain KeyboardInterrupt: CPython (3.11 here)
    marks a plain one raised inside ``exec``/``eval`` of a string (namedtuple and dataclass
    code run so while modules import) as unhandled even once caught, and then ends a
    ``-m`` program by SIGINT, silently, instead of with its exit status."""


def interrupt(stopped_by: list[int], signum: int, _frame) -> None:
    stopped_by.append(signum)
    raise StopSignal


def catch_stop_signals(stopped_by: list[int], previous: dict) -> None:
    """``interrupt`` for SIGTERM, and for SIGINT unless it is ignored; ``previous`` gets
    each replaced handler as it is replaced (a signal may come between the two)."""
    previous[signal.SIGTERM] = signal.signal(
        signal.SIGTERM, functools.partial(interrupt, stopped_by)
    )
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when ignored
        previous[signal.SIGINT] = signal.signal(
            signal.SIGINT, functools.partial(interrupt, stopped_by)
        )


def restore_handlers(previous: dict) -> None:
    for stop_signal, handler in previous.items():
        signal.signal(stop_signal, handler)
