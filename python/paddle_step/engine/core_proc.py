"""The engine process: builds the engine, then applies the server's commands between
steps and sends each step's results back (``core_messages``).

It steps while anything is waiting or running and sleeps on the command pipe otherwise.
It exits when told to (``Stop``), when the server's end of the pipe closes (the server
is gone, killed included), or after sending ``EngineFailed`` when the engine cannot be
built or raises inside ``step()``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from typing import NoReturn

from ..sampling_params import TokenConstraint
from .core_messages import AbortRequest, AddRequest, EngineFailed, Ready, StepOutput, Stop

__all__ = ["STOP_SIGNALS", "ignore_stop_signals", "run_engine"]

# Signals to the process group that the server handles for this process.
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})

# While idle, rank 0 broadcasts an empty batch this often, so the other ranks' wait in
# the collective never runs into the backend's timeout.
IDLE_TICK_S = 1.0


def run_engine(args: argparse.Namespace, commands, events) -> None:
    """The process target: ``commands`` is the read end of the server's pipe, ``events``
    the write end of the engine's.

    With ``--tp`` > 1 every rank's engine process runs this; rank 0's receives the
    commands from its server and broadcasts each batch of them to the others before
    applying it, so all ranks add and abort the same requests between the same steps
    and build the same schedule (the schedule itself is never sent).
    """
    # The server owns this process's lifetime: it stops it with a command, or by closing
    # the pipe (its own death included). Ctrl-C and a supervisor's SIGTERM reach the whole
    # process group; ignoring them lets the server drain its running requests first, or
    # stop this process itself while the model loads. The server started it with both
    # blocked (core_client): they wait, pending, while paddle's import installs its own
    # handlers (which print a crash report), and ignoring them drops those pending.
    import paddle  # noqa: F401

    from .arg_utils import build_engine

    ignore_stop_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        engine, loaded = build_engine(args)
    except Exception as error:  # noqa: BLE001 - sent to the server, which raises it
        reason = str(error) or ("out of memory" if isinstance(error, MemoryError) else "")
        _send(events, EngineFailed(f"{type(error).__name__}: {reason}", traceback.format_exc()))
        sys.exit(1)
    ignore_stop_signals()  # again: the tensor-parallel setup may install paddle's
    config = engine.config
    group = loaded.tensor_parallel
    leader = group is None or group.rank == 0
    info = {"name": loaded.name, "max_model_len": config.max_model_len,
            "max_batch": config.max_batch,
            "vocab_size": loaded.model.config.vocab_size,
            "eos_token_ids": list(engine.eos_token_ids),
            "kv_total_blocks": config.num_decoder_blocks,
            "kv_encoder_total_blocks": config.num_encoder_blocks,
            "threads": engine.threads}  # fmt: skip
    if not _send(events, Ready(info, _stats(engine))):
        return
    request_ids: dict[int, int] = {}  # server key -> engine request id
    keys: dict[int, int] = {}  # engine request id -> server key
    draws: dict[int, dict[int, list[int]]] = {}  # best_of > n: request -> draw -> tokens
    constraints: dict[int, TokenConstraint] = {}  # request -> its structured output
    while True:
        output = StepOutput()
        batch = _next_commands(engine, commands) if leader else []
        if not leader and _server_gone(commands):  # the others' next collective then fails
            return
        if group is not None:
            try:
                batch = _broadcast(batch)
            except RuntimeError as error:  # a rank's process ended, or its link broke
                _rank_gone(events, group.rank, error)
        for command in batch:
            if isinstance(command, Stop):
                return
            if isinstance(command, AddRequest):
                try:
                    request_id = engine.add_request(command.prompt_ids, command.params)
                except ValueError as error:
                    output.refused.append((command.key, str(error)))
                    continue
                request_ids[command.key], keys[request_id] = request_id, command.key
                params = command.params
                if params.best_of is not None and params.best_of > params.n:
                    draws[request_id] = {draw: [] for draw in range(params.best_of)}
                if params.constraint is not None:
                    constraints[request_id] = params.constraint
            elif isinstance(command, AbortRequest) and command.key in request_ids:
                request_id = request_ids.pop(command.key)
                draws.pop(request_id, None)
                constraints.pop(request_id, None)
                engine.abort(request_id)
        if engine.has_unfinished():
            try:
                finished = engine.step()  # its time goes into engine.stats.elapsed
            except Exception as error:  # noqa: BLE001 - every client gets it
                if group is not None and _is_peer_gone(error):  # mid-step, in a collective
                    _rank_gone(events, group.rank, error)
                message = f"engine step failed: {type(error).__name__}: {error}"
                _send(events, EngineFailed(message, traceback.format_exc()))
                sys.exit(1)
            output.prompt_logprobs = [(keys[request_id], [_logprobs(entry) for entry in entries])
                                      for request_id, entries
                                      in engine.last_step_prompt_logprobs.items()
                                      if request_id in keys]  # fmt: skip
            # A failed constraint's last token ends nothing: its error follows (refused).
            output.tokens = [(keys[token.request_id],
                              (token.index, token.token_id, _logprobs(token.logprobs),
                               None if _constraint_error(constraints.get(token.request_id))
                               else token.finish_reason))
                             for token in engine.last_step_outputs
                             if token.request_id in keys]  # fmt: skip
            for token in engine.last_step_outputs:
                if token.request_id in draws:
                    draws[token.request_id][token.index].append(token.token_id)
            output.cached = [(keys[request_id], cached)
                             for request_id, cached in engine.last_step_admitted
                             if request_id in keys]  # fmt: skip
            for result in finished:
                key = keys.pop(result.request_id)
                request_ids.pop(key, None)
                drawn = draws.pop(result.request_id, None)
                failure = _constraint_failure(constraints.pop(result.request_id, None), result)
                if failure:
                    output.refused.append((key, failure))
                else:
                    output.finished.append((key, _returned(result, drawn)))
        if leader and (output.tokens or output.finished or output.refused or batch
                       or engine.has_unfinished()):  # fmt: skip
            output.stats = _stats(engine)
            if not _send(events, output):
                return


def _constraint_error(constraint: TokenConstraint | None) -> str:
    """The constraint's ``error`` ('' for none, or for a constraint without one)."""
    return getattr(constraint, "error", "")


def _constraint_failure(constraint: TokenConstraint | None, result) -> str:
    """Why a finished request's constraint failed ('' if it did not): a matcher that hit
    its own limits mid-way stops the request as if its grammar were complete, which the
    client must not take for a finished answer."""
    error = _constraint_error(constraint)
    if not error:
        return ""
    count = len(result.token_ids)
    return (f"structured output failed after {count} token{'s' * (count != 1)}: "
            f"{error.splitlines()[0]}")  # fmt: skip


def _returned(result, drawn: dict[int, list[int]] | None) -> list[tuple[int, str]]:
    """``(draw, finish reason)`` of each sample ``result`` returns, in its order. With
    ``best_of`` > ``n`` the engine numbers the returned samples 0 .. n-1; ``drawn`` (each
    draw's tokens, as streamed) gives back the draw each one is, which is how the server
    knows its tokens (draws with the same tokens are interchangeable)."""
    if drawn is None:
        return [(sample.index, sample.finish_reason) for sample in result.outputs]
    returned = []
    for sample in result.outputs:
        draw = next(d for d, tokens in drawn.items() if tokens == sample.token_ids)
        drawn.pop(draw)
        returned.append((draw, sample.finish_reason))
    return returned


def _logprobs(entry) -> tuple[float, list[tuple[int, float]], int | None] | None:
    """An ``outputs.TokenLogprobs`` as the plain tuple the server reads (the server needs
    none of the engine's classes)."""
    if entry is None:
        return None
    top = [(int(token), float(value)) for token, value in entry.top]
    return float(entry.logprob), top, entry.rank


def _next_commands(engine, commands) -> list:
    """The commands that arrived; waits for one only when there is nothing to step (at
    most ``IDLE_TICK_S``). A server that is gone counts as a stop."""
    batch: list = []
    wait = None if engine.has_unfinished() else IDLE_TICK_S
    try:
        while commands.poll(0 if batch or wait is None else wait):
            batch.append(commands.recv())
    except (EOFError, OSError):
        batch.append(Stop())
    return batch


def ignore_stop_signals() -> None:
    """SIGINT and SIGTERM ignored by this process: another decides when it stops."""
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, signal.SIG_IGN)


def _send(events, message) -> bool:
    """Sends ``message`` to the server; False when the server is gone (nobody to tell)."""
    try:
        events.send(message)
    except OSError:  # BrokenPipeError, or the pipe closed
        return False
    return True


def _server_gone(commands) -> bool:
    """Whether a follower rank's own server is gone (killed included): it sends nothing,
    so its pipe becomes readable only when it closes."""
    if not commands.poll():
        return False
    try:
        commands.recv()
    except (EOFError, OSError):
        return True
    return False


def _is_peer_gone(error: Exception) -> bool:
    """Whether a collective failed because another rank's process is gone (gloo names
    its transport: a reset or closed connection, or a timeout)."""
    return isinstance(error, RuntimeError) and "gloo" in str(error)


def _rank_gone(events, rank: int, error: Exception) -> NoReturn:
    """Ends this engine after another rank's process ended: rank 0 tells its server (every
    request ends with a 503), a follower says so on stderr; no traceback."""
    message = f"a tensor-parallel rank is gone ({' '.join(str(error).split())[:300]})"
    if rank == 0:
        _send(events, EngineFailed(message))
    else:
        print(f"paddle_step engine, rank {rank}: {message}", file=sys.stderr)
    sys.exit(1)


def _broadcast(batch: list) -> list:
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
        "prefix_cache_queries": engine.stats.prompt_tokens_queried,
        "prefix_cache_hits": engine.stats.prompt_tokens_hit,
    }
