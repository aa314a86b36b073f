"""Serve a model over an OpenAI-compatible HTTP API.

    python -m paddle_step.serve --model path/to/checkpoint [--host 127.0.0.1 --port 8000]

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. The model id is the checkpoint
folder's name unless ``--served-model-name`` says otherwise; the engine flags are
``examples/generate.py``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from ...engine.arg_utils import (
    add_engine_arguments,
    check_engine_arguments,
    load_tokenizer,
)
from ...engine.core_client import EngineLoop
from ...engine.core_proc import ignore_stop_signals
from .stop_signals import catch_stop_signals, restore_handlers

__all__ = ["build_app", "main", "missing_serving_packages", "parse_args"]

# The serving stack (requirements.txt): module -> distribution to pip-install.
SERVING_PACKAGES = {
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "prometheus_client": "prometheus-client",
    "llguidance": "llguidance",  # structured output (response_format)
}


def missing_serving_packages() -> list[str]:
    """The distributions of the serving stack that cannot be imported."""
    return [
        dist
        for module, dist in SERVING_PACKAGES.items()
        if importlib.util.find_spec(module) is None
    ]


# After the engine fails, the server answers 503 this long (so clients and a load
# balancer see why), then exits non-zero for its supervisor to restart it.
ENGINE_FAILURE_GRACE_S = 5.0
# How often a --tp rank checks that its launcher is still there.
ORPHAN_CHECK_S = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m paddle_step.serve", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (0: any free one)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id in the API (default: the checkpoint folder's name)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="on SIGTERM, how long running requests may go on before they end with an "
        "error (seconds; new requests are refused at once)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PADDLE_STEP_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $PADDLE_STEP_API_KEY; "
        "/health and /metrics stay open)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=1 << 20,
        help="the largest request body taken (bytes; larger ones get 413)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="requests that may wait for a batch slot; more get 429 with Retry-After",
    )
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    check_engine_arguments(parser, args)
    if not 0 <= args.port <= 65535:  # checked before the model loads, not by bind()
        parser.error(f"argument --port: expected an integer in [0, 65535], got {args.port}")
    if not args.shutdown_timeout >= 0:
        parser.error(f"argument --shutdown-timeout: expected >= 0, got {args.shutdown_timeout}")
    for name in ("max_request_bytes", "max_waiting"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"argument {flag}: expected an integer >= 1, got {getattr(args, name)}")
    for flag in ("api_key", "host", "served_model_name"):  # '' would mean all, or nothing
        if getattr(args, flag) == "":
            parser.error(f"argument --{flag.replace('_', '-')}: expected a non-empty value, got ''")
    return args


def build_app(args: argparse.Namespace):
    """``(app, loop)``: the engine started in its own process (``loop``), and the FastAPI
    app over it, which stops it on shutdown. Raises ``ValueError`` for flags or a
    checkpoint the engine cannot run."""
    from .api_server import create_app

    tokenizer = load_tokenizer(args)  # the engine process loads the model
    loop = EngineLoop(args)
    try:
        try:
            loop.start()
        except RuntimeError as error:
            raise ValueError(str(error)) from None
        return _app_over(loop, tokenizer, args, create_app), loop
    except BaseException:  # a stop signal or an error before serving: nothing to drain, and
        loop.stop(timeout=0)  # the engine process ignores stop signals, so stop it here
        raise


def _app_over(loop: EngineLoop, tokenizer, args: argparse.Namespace, create_app):
    """The FastAPI app over the started ``loop``."""
    name = args.served_model_name or loop.info["name"]
    print(
        f"paddle_step.serve: model {name}, {loop.info['threads']} CPU threads per engine, "
        f"engine process {loop.pid}",
        file=sys.stderr,
    )
    if args.api_key is None and not _is_loopback(args.host):
        print(
            f"paddle_step.serve: WARNING: serving on {args.host} without --api-key: anyone "
            "who can reach this address can use the model",
            file=sys.stderr,
        )
    return create_app(
        loop,
        tokenizer,
        name,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        max_waiting=args.max_waiting,
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def main(argv: list[str] | None = None) -> None:
    # Everything from the first handler on is inside the try: a stop signal may come at
    # any bytecode (parsing the flags, binding the address, loading the model).
    stopped_by, previous, listening = [], {}, None
    try:
        # SIGTERM while the model loads stops as Ctrl-C does (nothing to drain yet): the
        # engine process ignores both, so the server must stop it.
        catch_stop_signals(stopped_by, previous)
        missing = missing_serving_packages()
        if missing:
            raise SystemExit(
                f"paddle_step.serve: the serving stack is not installed ({', '.join(missing)}); "
                f"run `{sys.executable} -m pip install {' '.join(missing)}`"
            )
        args = parse_args(argv)
        # The engine process inherits it: paddle's C++ INFO and WARNING lines about its
        # internals stay out of the server log (errors still show; the environment wins).
        os.environ.setdefault("GLOG_minloglevel", "2")
        # With --tp > 1 (under paddle.distributed.launch) rank 0 serves HTTP; every rank
        # runs an engine process, and rank 0's hands the others each batch of requests.
        rank = int(os.environ.get("PADDLE_TRAINER_ID", "0")) if args.tp > 1 else 0
        launcher = os.getppid()
        if rank == 0 and args.tp > 1:  # drains, then its engine stops the others' (Stop)
            _when_orphaned(launcher, lambda: os.kill(os.getpid(), signal.SIGTERM))
        if rank == 0:
            # Bound before the model loads: a taken address is refused at once, and the
            # port stays this server's while it loads (seconds to minutes).
            listening = _bind(args.host, args.port)
            app, loop = build_app(args)
            try:
                # While a stop signal still stops the start: importing uvicorn takes a
                # moment, and Ctrl-C then ended the process by SIGINT with a traceback,
                # nothing having stopped its engine.
                server = _server(app, loop, args)
            except BaseException:
                loop.stop()
                raise
        else:
            follower = EngineLoop(args)
            follower.start()
    except BaseException as error:
        if listening is not None:
            listening.close()
        # A stop signal before serving (the engine is stopped), however it surfaced: the
        # exception it raises may come back wrapped in a library's own error (pydantic-core
        # building a schema reports it as a SchemaError).
        if stopped_by or isinstance(error, KeyboardInterrupt):
            raise SystemExit(128 + (stopped_by[0] if stopped_by else signal.SIGINT)) from None
        if isinstance(error, (ValueError, RuntimeError)):  # a checkpoint or budget it cannot run
            raise SystemExit(f"paddle_step.serve: {error}") from None
        raise
    finally:
        restore_handlers(previous)
    if rank != 0:
        # Its engine lives as long as rank 0's: stopped by its Stop, or ended when rank 0
        # is gone. Stopping here would end rank 0's drain (the collectives need every
        # rank), so the launcher's SIGTERM and Ctrl-C are left to rank 0; a rank whose
        # launcher is gone stops after rank 0's drain would have ended.
        ignore_stop_signals()
        drained_s = args.shutdown_timeout + ENGINE_FAILURE_GRACE_S
        _when_orphaned(launcher, lambda: (time.sleep(drained_s), follower.stop(timeout=0)))
        follower.wait()
        if follower.failure is not None:
            raise SystemExit(f"paddle_step.serve, rank {rank}: {follower.failure}")
        return
    try:
        threading.Thread(target=_exit_after_failure, args=(loop, server), daemon=True).start()
        server.run(sockets=[listening])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down
        raise SystemExit(130) from None
    finally:
        # Also when uvicorn fails before its shutdown stops the engine (it cannot listen):
        # the engine process ignores SIGTERM, so interpreter exit would wait on it forever.
        loop.stop()
        listening.close()
    if loop.failure is not None:
        raise SystemExit(f"paddle_step.serve: exiting with status 1 ({loop.failure})")


def _server(app, loop: EngineLoop, args: argparse.Namespace):
    """uvicorn's server, whose shutdown (SIGTERM, Ctrl-C) refuses new requests at once,
    lets running ones go on for up to ``--shutdown-timeout`` and then ends them with an
    error, before the engine process is stopped. A second Ctrl-C ends them at once."""
    import uvicorn

    drain_s = args.shutdown_timeout

    class DrainingServer(uvicorn.Server):
        event_loop: asyncio.AbstractEventLoop | None = None
        ended_early = False

        def handle_exit(self, sig: int, frame) -> None:
            # uvicorn takes a second Ctrl-C as a forced exit: it stops waiting, and asyncio
            # then cancels the running streams mid-write (a cut stream for the client, a
            # CancelledError traceback each in the log). Here the second ends them at once
            # with their error, and the shutdown finishes as a graceful one; a third still
            # forces it. The signal handler only schedules: end_all takes locks.
            second = self.should_exit and sig == signal.SIGINT
            if second and not self.ended_early and self.event_loop is not None:
                self.ended_early = True
                message = "the server was stopped (Ctrl-C twice) before the request finished"
                self.event_loop.call_soon_threadsafe(loop.end_all, message)
                return
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            self.event_loop = asyncio.get_running_loop()
            await super().startup(sockets)
            if self.started:  # uvicorn says where only for a socket it bound itself
                host, port = sockets[0].getsockname()[:2]
                address = f"[{host}]" if ":" in host else host
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", address, port
                )

        async def shutdown(self, sockets=None) -> None:
            loop.refuse_new("the server is shutting down")
            message = f"the server shut down before the request finished ({drain_s:g} s drain)"
            timer = asyncio.get_running_loop().call_later(drain_s, loop.end_all, message)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    # uvicorn's own limit is a backstop: by then every request has had its error event.
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=drain_s + 5.0,
    )
    return DrainingServer(config)


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` as uvicorn binds (SO_REUSEADDR), not yet listening,
    for uvicorn to serve on; exits with one line when the address cannot be bound (in use,
    or not this machine's). Held while the model loads, the port cannot be given to
    anything else meanwhile: a free port let go then could be (the kernel hands ports of
    its ephemeral range to outgoing connections and to bind(0), as the ranks' collectives
    use), and uvicorn failed only once the model had loaded."""
    bound = None
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        bound = socket.socket(family, kind, proto)
        bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bound.bind(address)
        return bound
    except OSError as error:
        if bound is not None:
            bound.close()
        raise SystemExit(
            f"paddle_step.serve: cannot listen on {host}:{port}: {error.strerror or error}"
        ) from None


def _when_orphaned(launcher: int, stop: Callable[[], object]) -> None:
    """Runs ``stop`` in a thread of its own once this ``--tp`` rank's launcher is gone
    (killed): nothing supervises the rank then."""

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(ORPHAN_CHECK_S)
        print("paddle_step.serve: the launcher is gone; stopping", file=sys.stderr)
        stop()

    threading.Thread(target=watch, daemon=True).start()


def _exit_after_failure(loop: EngineLoop, server) -> None:
    loop.failed.wait()
    print(
        f"paddle_step.serve: the engine failed; exiting in {ENGINE_FAILURE_GRACE_S:g} s",
        file=sys.stderr,
    )
    time.sleep(ENGINE_FAILURE_GRACE_S)
    server.should_exit = True


if __name__ == "__main__":
    main()
