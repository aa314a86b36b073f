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

__all__ = ["EngineLoop", "RequestHandle", "unsupported_fields"]

logger = logging.getLogger("paddle_step.serve")

# How long the child may take to load the model and build the engine.
START_TIMEOUT_S = 600.0


# The SamplingParams fields the engine applies today; the server refuses requests that
# set any other away from its default (with a 400 naming it) rather than ignore it.
ENGINE_SAMPLING_FIELDS = frozenset(
    {"max_tokens", "temperature", "top_p", "seed", "eos_token_id", "stop_token_ids"}
)


def unsupported_fields(params: SamplingParams) -> list[str]:
    """The fields of ``params`` set to something the engine cannot apply yet."""
    defaults = SamplingParams()
    return [
        name
        for name in params.__dataclass_fields__
        if name not in ENGINE_SAMPLING_FIELDS and getattr(params, name) != getattr(defaults, name)
    ]


@dataclass
class RequestHandle:
    """A submitted request as its HTTP handler sees it.

    Events arrive on ``events`` as ``(index, kind, value)``, ``index`` being the handle's
    own (a handler may share one queue among the handles of a batch):

    - ``("prompt_logprobs", entries)`` once the prompt is prefilled, when the request
      asked for them: per prompt position after the first, ``(logprob, [(id, logprob),
      ..])``, the prompt token's logprob and the asked number of most likely tokens;
    - ``("token", (sample, token_id, logprobs))`` per generated token of sample ``sample``
      (0 .. best_of-1), ``logprobs`` in the form above or None when not asked;
    - then one ``("finish", returned)``: the samples to answer with, in choice order, as
      ``(sample, finish_reason)`` (the ``n`` best of ``best_of``); or one ``("refused",
      message)`` when the engine refused the request (the client's error), or one
      ``("error", message)`` when the engine failed.

    The engine process turns ``outputs``' objects into these plain tuples, so the HTTP
    process needs none of the engine's classes.
    """

    prompt_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    index: int = 0  # the handler's tag (e.g. the prompt's place in a batch)
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
                if event_kind in ("finish", "refused", "error"):
                    self._handles.pop(key, None)

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
            "eos_token_ids": list(engine.eos_token_ids),
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
                except ValueError as error:  # the client's to fix: the server answers 400
                    step_events.append((key, ("refused", str(error))))
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
            step_events += [(keys[token.request_id], ("token", (token.index, token.token_id,
                                                                 _entry(token.logprobs))))
                            for token in engine.last_step_outputs
                            if token.request_id in keys]  # fmt: skip
            for result in finished:
                key = keys.pop(result.request_id)
                request_ids.pop(key, None)
                if result.prompt_logprobs is not None:
                    prompt_logprobs = [_entry(entry) for entry in result.prompt_logprobs]
                    step_events.append((key, ("prompt_logprobs", prompt_logprobs)))
                returned = [(output.index, output.finish_reason) for output in result.outputs]
                step_events.append((key, ("finish", returned)))
        if leader and (step_events or batch or engine.has_unfinished()):
            events.send(("step", (step_events, _stats(engine))))


def _entry(logprobs) -> tuple[float, list[tuple[int, float]]] | None:
    """An ``outputs.TokenLogprobs`` as the plain tuple the server reads."""
    if logprobs is None:
        return None
    return float(logprobs.logprob), [(int(token), float(value)) for token, value in logprobs.top]


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
