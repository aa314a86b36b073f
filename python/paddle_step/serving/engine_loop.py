"""The one thread that steps the engine, and how HTTP handlers talk to it.

Handlers never touch the engine: they post commands (add a request, abort one) to this
thread and read their request's events from an ``asyncio.Queue``. The thread applies the
commands between steps, steps while anything is waiting or running, and sleeps otherwise.
A request arriving mid-generation therefore joins the very next step (continuous
batching), and an abort takes effect before the next step, through the engine's own free
path.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from ..engine import Engine

__all__ = ["EngineLoop", "RequestHandle", "SamplingParams"]

logger = logging.getLogger("paddle_step.serve")


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the engine, already validated."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False


@dataclass
class RequestHandle:
    """A submitted request as its HTTP handler sees it.

    Events arrive on ``events``: ``("token", id)`` per generated token, then one of
    ``("finish", reason)`` or ``("error", message)``.
    """

    prompt_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int | None = None  # the engine's id, set by the loop thread
    done: bool = False  # set by the handler once it has read the last event


class EngineLoop:
    """Runs ``engine`` on a daemon thread; ``start()`` it once, ``stop()`` at shutdown."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.healthy = True
        self.preemptions = 0
        self.generated_tokens = 0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._handles: dict[int, tuple[RequestHandle, asyncio.AbstractEventLoop]] = {}
        self._thread = threading.Thread(target=self._run, name="paddle_step-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)

    def submit(self, handle: RequestHandle) -> None:
        """Queues ``handle``'s request; call from the event loop that reads its events."""
        self._post(("add", handle, asyncio.get_running_loop()))

    def abort(self, handle: RequestHandle) -> None:
        """Cancels ``handle``'s request (a no-op once it has finished)."""
        self._post(("abort", handle, None))

    # ---------------------------------------------------------------- engine thread

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        while not self._stopping:
            # Cleared before the commands are read, so a command posted after the read
            # sets it again and the wait below returns at once.
            self._wakeup.clear()
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._wakeup.wait()
                continue
            try:
                finished = self.engine.step()
            except Exception as error:  # noqa: BLE001 - reported to every client below
                logger.exception("engine step failed")
                self.healthy = False
                self._fail_all(f"engine step failed: {error}")
                return
            self.preemptions = self.engine.stats.preemptions
            self.generated_tokens += len(self.engine.last_step_tokens)
            events = [
                (request_id, ("token", token)) for request_id, token in self.engine.last_step_tokens
            ]
            events += [(result.request_id, ("finish", result.finish_reason)) for result in finished]
            self._emit_all(events)
            for result in finished:
                self._handles.pop(result.request_id, None)
        self._fail_all("server shutting down")

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, handle, event_loop = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(handle, event_loop)
            elif handle.request_id is not None and handle.request_id in self._handles:
                self._handles.pop(handle.request_id)
                self.engine.abort(handle.request_id)

    def _add(self, handle: RequestHandle, event_loop: asyncio.AbstractEventLoop) -> None:
        params = handle.params
        try:
            request_id = self.engine.add_request(
                handle.prompt_ids,
                params.max_new_tokens,
                eos_token_id=[] if params.ignore_eos else None,
                temperature=params.temperature,
                top_p=params.top_p,
                seed=params.seed,
            )
        except ValueError as error:  # the handler checked; the engine has the last word
            _deliver(handle, event_loop, ("error", str(error)))
            return
        handle.request_id = request_id
        self._handles[request_id] = (handle, event_loop)

    def _emit_all(self, events: list[tuple[int, tuple]]) -> None:
        """Delivers a step's events with one wake-up per event loop, not one per token:
        each wake-up costs the loop thread a turn at the GIL the engine thread needs."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, event in events:
            entry = self._handles.get(request_id)
            if entry is not None:
                handle, event_loop = entry
                by_loop.setdefault(event_loop, []).append((handle.events, event))
        for event_loop, deliveries in by_loop.items():
            try:
                event_loop.call_soon_threadsafe(_put_all, deliveries)
            except RuntimeError:  # its event loop has closed: nobody is listening any more
                pass

    def _fail_all(self, message: str) -> None:
        for handle, event_loop in self._handles.values():
            _deliver(handle, event_loop, ("error", message))
        self._handles.clear()
        while True:  # requests posted but never added
            try:
                kind, handle, event_loop = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                _deliver(handle, event_loop, ("error", message))


def _put_all(deliveries: list[tuple[asyncio.Queue, tuple]]) -> None:
    for events, event in deliveries:
        events.put_nowait(event)


def _deliver(handle: RequestHandle, event_loop: asyncio.AbstractEventLoop, event: tuple) -> None:
    """Puts ``event`` on ``handle``'s queue from the engine thread."""
    try:
        event_loop.call_soon_threadsafe(handle.events.put_nowait, event)
    except RuntimeError:  # its event loop has closed: nobody is listening any more
        pass
