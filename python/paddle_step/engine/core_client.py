"""The server's side of the engine process (``core_proc``): how HTTP handlers talk to it.

The engine steps in a child process (as vLLM's engine core does), so its Python work
and the server's (HTTP, JSON, detokenizing) run on two cores instead of taking turns at
one interpreter lock. Handlers never touch the engine: they post commands (add a
request, abort one) down a pipe and read their request's events from an
``asyncio.Queue``. A reader thread receives each step's tokens and finishes, with the
counters ``/metrics`` shows, in one message, and wakes each handler's event loop once.

The reader also watches the process itself, so an engine that is killed, crashes, exits
or raises is noticed at once: every request in flight gets an error event, and new ones
are refused (``EngineUnavailable``) from then on.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import wait as wait_for_ready

from ..sampling_params import SamplingParams
from .core_messages import AbortRequest, AddRequest, EngineFailed, Ready, StepOutput, Stop
from .core_proc import STOP_SIGNALS, run_engine

__all__ = [
    "EngineLoop",
    "EngineUnavailable",
    "RequestError",
    "RequestHandle",
]

logger = logging.getLogger("paddle_step.serve")

# How long the child may take to load the model and build the engine.
START_TIMEOUT_S = 600.0


class EngineUnavailable(Exception):
    """The engine takes no new request: it has failed, or the server is shutting down."""


@dataclass(frozen=True)
class RequestError:
    """Why a request ended without finishing. ``unavailable``: the server could not finish
    it (engine failed, shutdown), otherwise the engine refused the request itself."""

    message: str
    unavailable: bool = True


@dataclass
class RequestHandle:
    """A submitted request as its HTTP handler sees it.

    Events arrive on ``events`` as ``(index, kind, value)``, ``index`` being the handle's
    own (a handler may share one queue among the handles of a batch):

    - ``("cached", n)`` once admitted: n prompt tokens came from the prefix cache;
    - ``("prompt_logprobs", entries)``, when the request asked for them: per prompt
      position after the first, ``(logprob, [(id, logprob), ..])``, the prompt token's
      logprob and the asked number of most likely tokens;
    - ``("token", (sample, token_id, logprobs, finish_reason))`` per generated token of
      sample ``sample`` (0 .. best_of-1), ``logprobs`` in the form above or None when not
      asked, ``finish_reason`` when this token ended the sample (else None);
    - then one ``("finish", returned)``: the samples to answer with, in choice order, as
      ``(sample, finish_reason)`` (the ``n`` best of ``best_of``); or one ``("error",
      RequestError)``.
    """

    prompt_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    index: int = 0  # the handler's tag (e.g. the prompt's place in a batch)
    key: int | None = None  # the request's id between this process and the engine's
    done: bool = False  # set by the handler once it has read the last event

    @property
    def num_sequences(self) -> int:
        """The batch slots the request takes: one per sample drawn."""
        return self.params.best_of or self.params.n


class EngineLoop:
    """Starts the engine of ``args`` (the engine flags) in a child process.

    ``start()`` waits until the model is loaded and fills ``info`` (model name,
    ``max_model_len``, pool sizes); ``stats`` holds the counters of the latest step.
    ``failed`` is set once the engine can no longer run anything; ``failure`` says why.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        context = multiprocessing.get_context("spawn")  # paddle is not fork-safe
        self._commands_in, self._commands_out = context.Pipe(duplex=False)
        self._events_in, self._events_out = context.Pipe(duplex=False)
        self._process = context.Process(
            target=run_engine,
            args=(args, self._commands_in, self._events_out),
            name="paddle_step-engine",
            daemon=True,
        )
        self.info: dict = {}
        self.stats: dict = {}
        self.failure: str | None = None
        self.failed = threading.Event()
        self._refusal: str | None = "the engine has not started"
        self._stopping = False
        self._keys = itertools.count()
        self._lock = threading.Lock()  # guards _refusal and _handles against the reader
        self._send_lock = threading.Lock()
        self._handles: dict[int, tuple[RequestHandle, asyncio.AbstractEventLoop]] = {}
        self._reader = threading.Thread(target=self._read_events, daemon=True)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def healthy(self) -> bool:
        """True while new requests are taken (started, not failed, not shutting down)."""
        return self._refusal is None

    @property
    def refusal(self) -> str | None:
        """Why new requests are refused; None while they are taken."""
        return self._refusal

    @property
    def num_in_flight(self) -> int:
        """Engine sequences in flight: each request's samples (``best_of`` or ``n``), as
        each takes a batch slot of its own."""
        return sum(handle.num_sequences for handle, _loop in list(self._handles.values()))

    def start(self) -> None:
        """Starts the child and waits for its model; raises ``RuntimeError`` with the
        child's error if it cannot build the engine."""
        with _stop_signals_held():
            self._process.start()
            # The child ignores SIGTERM (a drain needs the server's say), so
            # multiprocessing's own exit handler, which terminates then joins it, would
            # wait forever on an interpreter that exits without stop(): Ctrl-C or an error
            # between here and serving. Registered after multiprocessing's, this runs first.
            atexit.register(self.stop, 0)
        # The child holds its ends now. Without our copies, each side's read sees EOF
        # as soon as the other process is gone, however it went.
        self._commands_in.close()
        self._events_out.close()
        ready = wait_for_ready([self._events_in, self._process.sentinel], START_TIMEOUT_S)
        if not ready:
            self._process.kill()
            raise RuntimeError(f"the engine process did not start within {START_TIMEOUT_S:.0f} s")
        try:
            message = self._events_in.recv()
        except (EOFError, OSError):
            self._process.join(10)
            message = EngineFailed(f"it exited ({_exit_status(self._process.exitcode)})")
        if not isinstance(message, Ready):
            self._process.join(10)
            raise RuntimeError(f"the engine process failed to start: {message.message}")
        self.info, self.stats = message.info, message.stats
        self._refusal = None
        self._reader.start()

    def wait(self) -> None:
        """Blocks until the engine process exits and its end is known (``failure``): a
        ``--tp`` follower rank's whole job. The reader joins the process first: two
        threads' joins race to reap it, and the loser read no exit status."""
        self._reader.join()
        self._process.join()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the engine process (killed if it does not exit within ``timeout``)."""
        self._stopping = True
        self.refuse_new("the server is shutting down")
        if self._process.pid is None:  # never started (interrupted before)
            return
        self._send(Stop())
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout)

    def submit(self, handle: RequestHandle) -> None:
        """Queues ``handle``'s request; call from the event loop that reads its events.
        Raises ``EngineUnavailable`` once the engine takes no new requests."""
        with self._lock:
            if self._refusal is not None:
                raise EngineUnavailable(self._refusal)
            handle.key = next(self._keys)
            self._handles[handle.key] = (handle, asyncio.get_running_loop())
        self._send(AddRequest(handle.key, handle.prompt_ids, handle.params))

    def abort(self, handle: RequestHandle) -> None:
        """Cancels ``handle``'s request (a no-op once it has finished)."""
        if self._handles.pop(handle.key, None) is not None:
            self._send(AbortRequest(handle.key))

    def refuse_new(self, reason: str) -> None:
        """From now on ``submit`` raises ``EngineUnavailable(reason)``; requests in flight
        go on."""
        with self._lock:
            if self._refusal is None:
                self._refusal = reason

    def end_all(self, message: str) -> None:
        """Ends every request in flight with ``RequestError(message)`` and aborts it in
        the engine (a shutdown that cannot wait any longer)."""
        with self._lock:
            ended = list(self._handles)
        self._deliver_all([(key, ("error", RequestError(message))) for key in ended])
        for key in ended:
            if self._handles.pop(key, None) is not None:
                self._send(AbortRequest(key))

    def _send(self, command) -> None:
        with self._send_lock:
            try:
                self._commands_out.send(command)
            except (BrokenPipeError, OSError):  # the child is gone; the reader reports it
                pass

    def _read_events(self) -> None:
        """Hands each step's events to the handlers' event loops, one wake-up per loop,
        until the engine process is gone."""
        while True:
            wait_for_ready([self._events_in, self._process.sentinel])
            try:
                message = self._events_in.recv()  # what it sent before exiting comes first
            except (EOFError, OSError):
                message = None
            if isinstance(message, StepOutput):
                self._deliver_step(message)
                continue
            if isinstance(message, EngineFailed):
                self._fail(message.message, message.details)
            elif not self._stopping:  # else it exited because it was told to
                self._process.join(5)
                # 0: a --tp follower's engine, stopped by rank 0 (it takes no commands).
                if self._process.exitcode != 0:
                    status = _exit_status(self._process.exitcode)
                    self._fail(f"the engine process exited unexpectedly ({status})")
            return

    def _deliver_step(self, output: StepOutput) -> None:
        events = [(key, ("cached", cached)) for key, cached in output.cached]
        events += [(key, ("prompt_logprobs", entries)) for key, entries in output.prompt_logprobs]
        events += [(key, ("token", token)) for key, token in output.tokens]
        events += [(key, ("finish", returned)) for key, returned in output.finished]
        events += [(key, ("error", RequestError(why, unavailable=False)))
                   for key, why in output.refused]  # fmt: skip
        self.stats = output.stats
        self._deliver_all(events)
        for key, _reason in output.finished:
            self._handles.pop(key, None)
        for key, _why in output.refused:
            self._handles.pop(key, None)

    def _fail(self, message: str, details: str = "") -> None:
        """The engine is gone: logs why once, refuses new requests and ends the others."""
        logger.error("engine failed: %s%s", message, f"\n{details.rstrip()}" if details else "")
        with self._lock:
            self.failure = message
            self._refusal = f"the engine has failed: {message}"
            ended = list(self._handles)
        self._deliver_all([(key, ("error", RequestError(message))) for key in ended])
        self._handles.clear()
        self.failed.set()

    def _deliver_all(self, events: list[tuple[int, tuple]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for key, event in events:
            entry = self._handles.get(key)
            if entry is not None:
                handle, event_loop = entry
                by_loop.setdefault(event_loop, []).append((handle.events, (handle.index, *event)))
        for event_loop, deliveries in by_loop.items():
            try:
                event_loop.call_soon_threadsafe(_put_all, deliveries)
            except RuntimeError:  # its event loop has closed: nobody is listening any more
                pass


def _put_all(deliveries: list[tuple[asyncio.Queue, tuple]]) -> None:
    for events, event in deliveries:
        events.put_nowait(event)


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Holds Ctrl-C and SIGTERM (they reach the whole process group) while the engine
    process starts, and takes them after, as if they came then.

    The child inherits this thread's signal mask: with both blocked they stay pending in
    it, not raised, while its new interpreter imports its target and paddle, until
    run_engine ignores them (a KeyboardInterrupt there printed multiprocessing's
    traceback, a SIGTERM paddle's crash report). Here, another thread may take a signal
    the mask holds, and Python runs its handler in this thread anyway: a recorder stands in
    for the handlers meanwhile (one raised inside start() left the child without its
    start-up data). The resource tracker is started first: starting it unblocks both.
    """
    resource_tracker.ensure_running()
    taken: list[int] = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():  # where handlers can be set
        for stop_signal in STOP_SIGNALS:
            if signal.getsignal(stop_signal) is not None:  # None: not set from Python
                handlers[stop_signal] = signal.signal(
                    stop_signal, lambda signum, _frame: taken.append(signum)
                )
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        for stop_signal, handler in handlers.items():
            signal.signal(stop_signal, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending one is taken here
        if taken:
            signal.raise_signal(taken[0])


def _exit_status(code: int | None) -> str:
    if code is None:
        return "its pipe closed, but it has not exited"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
