"""The engine in a process of its own, and how HTTP handlers talk to it.

The engine steps in a child process (as vLLM's engine core does), so its Python work
and the server's (HTTP, JSON, detokenizing) run on two cores instead of taking turns at
one interpreter lock. Handlers never touch the engine: they post commands (add a
request, abort one) down a pipe and read their request's events from an
``asyncio.Queue``. The child applies the commands between steps, steps while anything
is waiting or running and sleeps on the pipe otherwise; after each step it sends that
step's tokens and finishes, with the counters ``/metrics`` shows, in one message. A
request arriving mid-generation joins the very next step (continuous batching), and an
abort takes effect before the next step, through the engine's own free path.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import multiprocessing
import signal
import threading
from dataclasses import dataclass, field

from ..sampling_params import SamplingParams

__all__ = ["EngineLoop", "RequestHandle"]

logger = logging.getLogger("paddle_step.serve")

# How long the child may take to load the model and build the engine.
START_TIMEOUT_S = 600.0


@dataclass
class RequestHandle:
    """A submitted request as its HTTP handler sees it.

    Events arrive on ``events`` (the objects are ``outputs``'): ``("prompt_logprobs",
    list[TokenLogprobs])`` once its prompt is prefilled, when it asked for them;
    ``("token", StepToken)`` per generated token (of any of its samples); then one of
    ``("finish", GenerationResult)`` or ``("error", message)``.
    """

    prompt_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    key: int | None = None  # the request's id between this process and the engine's
    done: bool = False  # set by the handler once it has read the last event


class EngineLoop:
    """Starts the engine of ``args`` (the engine flags) in a child process.

    ``start()`` waits until the model is loaded and fills ``info`` (model name,
    ``max_model_len``, pool sizes); ``stats`` holds the counters of the latest step.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        context = multiprocessing.get_context("spawn")  # paddle is not fork-safe
        self._commands_in, self._commands_out = context.Pipe(duplex=False)
        self._events_in, self._events_out = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_run_engine,
            args=(args, self._commands_in, self._events_out),
            name="paddle_step-engine",
            daemon=True,
        )
        self.healthy = False
        self.info: dict = {}
        self.stats: dict = {}
        self._keys = itertools.count()
        self._send_lock = threading.Lock()
        self._handles: dict[int, tuple[RequestHandle, asyncio.AbstractEventLoop]] = {}
        self._reader = threading.Thread(target=self._read_events, daemon=True)

    def start(self) -> None:
        """Starts the child and waits for its model; raises ``RuntimeError`` with the
        child's error if it cannot build the engine."""
        self._process.start()
        if not self._events_in.poll(START_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"the engine process did not start within {START_TIMEOUT_S:.0f} s")
        kind, payload = self._events_in.recv()
        if kind != "ready":
            self._process.join(10)
            raise RuntimeError(f"the engine process failed to start: {payload}")
        self.info, self.stats = payload
        self.healthy = True
        self._reader.start()

    def wait(self) -> None:
        """Blocks until the engine process exits (a ``--tp`` follower rank's whole job)."""
        self._process.join()

    def stop(self, timeout: float = 10.0) -> None:
        self._send(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout)

    def submit(self, handle: RequestHandle) -> None:
        """Queues ``handle``'s request; call from the event loop that reads its events."""
        handle.key = next(self._keys)
        self._handles[handle.key] = (handle, asyncio.get_running_loop())
        self._send(("add", handle.key, handle.prompt_ids, handle.params))

    def abort(self, handle: RequestHandle) -> None:
        """Cancels ``handle``'s request (a no-op once it has finished)."""
        if self._handles.pop(handle.key, None) is not None:
            self._send(("abort", handle.key))

    def _send(self, command: tuple) -> None:
        with self._send_lock:
            try:
                self._commands_out.send(command)
            except (BrokenPipeError, OSError):  # the child is gone; the reader reports it
                pass

    def _read_events(self) -> None:
        """Hands each step's events to the handlers' event loops, one wake-up per loop."""
        while True:
            try:
                kind, payload = self._events_in.recv()
            except (EOFError, OSError):
                kind, payload = "failed", "the engine process exited"
            if kind == "failed":
                logger.error("engine failed: %s", payload)
                self.healthy = False
                self._deliver_all([(key, ("error", payload)) for key in list(self._handles)])
                self._handles.clear()
                return
            events, self.stats = payload
            self._deliver_all(events)
            for key, (event_kind, _value) in events:
                if event_kind in ("finish", "error"):
                    self._handles.pop(key, None)

    def _deliver_all(self, events: list[tuple[int, tuple]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for key, event in events:
            entry = self._handles.get(key)
            if entry is not None:
                handle, event_loop = entry
                by_loop.setdefault(event_loop, []).append((handle.events, event))
        for event_loop, deliveries in by_loop.items():
            try:
                event_loop.call_soon_threadsafe(_put_all, deliveries)
            except RuntimeError:  # its event loop has closed: nobody is listening any more
                pass


def _put_all(deliveries: list[tuple[asyncio.Queue, tuple]]) -> None:
    for events, event in deliveries:
        events.put_nowait(event)


# ---------------------------------------------------------------- the child process


def _run_engine(args: argparse.Namespace, commands, events) -> None:
    """The child: builds the engine, then applies commands and steps until told to stop.

    With ``--tp`` > 1 every rank's engine process runs this; rank 0's receives the
    commands from its server and broadcasts each batch of them to the others before
    applying it, so all ranks add and abort the same requests between the same steps
    and build the same schedule (the schedule itself is never sent).
    """
    from .arg_utils import build_engine

    try:
        engine, loaded = build_engine(args)
    except Exception as error:  # noqa: BLE001 - sent to the parent, which raises it
        events.send(("failed", f"{type(error).__name__}: {error}"))
        return
    # Ctrl-C or a SIGTERM reaches the whole process group: the server stops this process
    # itself (a "stop" command, or its pipe closing), and paddle's own handler for these
    # signals would print a crash report for an ordinary shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    config = engine.config
    group = loaded.tensor_parallel
    leader = group is None or group.rank == 0
    info = {"name": loaded.name, "max_model_len": config.max_model_len,
            "vocab_size": loaded.model.config.vocab_size,
            "kv_total_blocks": config.num_decoder_blocks,
            "kv_encoder_total_blocks": config.num_encoder_blocks,
            "threads": engine.threads}  # fmt: skip
    events.send(("ready", (info, _stats(engine))))
    request_ids: dict[int, int] = {}  # parent key -> engine request id
    keys: dict[int, int] = {}  # engine request id -> parent key
    while True:
        step_events: list[tuple[int, tuple]] = []
        batch = _next_commands(engine, commands) if leader else []
        if group is not None:
            batch = _broadcast(batch)
        for command in batch:
            if command[0] == "stop":
                return
            if command[0] == "add":
                key, prompt_ids, params = command[1:]
                try:
                    request_id = engine.add_request(prompt_ids, params)
                except ValueError as error:
                    step_events.append((key, ("error", str(error))))
                    continue
                request_ids[key], keys[request_id] = request_id, key
            elif command[1] in request_ids:  # abort
                engine.abort(request_ids.pop(command[1]))
        if engine.has_unfinished():
            try:
                finished = engine.step()  # its time goes into engine.stats.elapsed
            except Exception as error:  # noqa: BLE001 - every client gets it
                events.send(("failed", f"engine step failed: {type(error).__name__}: {error}"))
                return
            step_events += [(keys[request_id], ("prompt_logprobs", entries))
                            for request_id, entries in engine.last_step_prompt_logprobs.items()
                            if request_id in keys]  # fmt: skip
            step_events += [(keys[token.request_id], ("token", token))
                            for token in engine.last_step_outputs
                            if token.request_id in keys]  # fmt: skip
            for result in finished:
                key = keys.pop(result.request_id)
                request_ids.pop(key, None)
                step_events.append((key, ("finish", result)))
        if leader and (step_events or batch or engine.has_unfinished()):
            events.send(("step", (step_events, _stats(engine))))


# While idle, rank 0 broadcasts an empty batch this often, so the other ranks' wait in
# the collective never runs into the backend's timeout.
IDLE_TICK_S = 1.0


def _next_commands(engine, commands) -> list[tuple]:
    """The commands that arrived; waits for one only when there is nothing to step (at
    most ``IDLE_TICK_S``). A server that is gone counts as a stop."""
    batch: list[tuple] = []
    wait = None if engine.has_unfinished() else IDLE_TICK_S
    try:
        while commands.poll(0 if batch or wait is None else wait):
            batch.append(commands.recv())
    except EOFError:
        batch.append(("stop",))
    return batch


def _broadcast(batch: list[tuple]) -> list[tuple]:
    """Rank 0's command batch, on every rank."""
    import paddle.distributed as dist

    holder = [batch]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _stats(engine) -> dict:
    """The counters ``/metrics`` shows, after the latest step."""
    return {
        "kv_free_blocks": engine.free_decoder_blocks,
        "kv_encoder_free_blocks": engine.encoder_blocks.num_free,
        "requests_running": engine.num_running,
        "requests_waiting": engine.num_waiting + engine.num_preempted,
        "preemptions": engine.stats.preemptions,
        "generated_tokens": engine.stats.generated_tokens,
        "step_seconds": engine.stats.elapsed,
    }
