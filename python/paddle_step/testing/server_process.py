"""A server for tests and benchmarks on 127.0.0.1: ``python -m paddle_step.serve`` in a
subprocess (``server_process``: started on a free port, waited for until ``/health``
answers, and always stopped), or an app served by uvicorn in a thread of this process
(``serve_in_thread``)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import httpx

__all__ = ["free_port", "serve_in_thread", "server_process"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def server_process(flags: Sequence[str] = (), timeout_s: float = 120.0) -> Iterator[str]:
    """Yields the URL of a server started with ``flags``; raises ``RuntimeError`` (with
    the server's output) if it exits or does not answer ``/health`` within ``timeout_s``."""
    port = free_port()
    command = [sys.executable, "-m", "paddle_step.serve", "--port", str(port), *flags]
    # Its log goes to a file: a pipe nobody reads would fill up and stall the server.
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the server exited: {log.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server gave no /health answer within {timeout_s:.0f} s")
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def serve_in_thread(app, timeout_s: float = 30.0) -> Iterator[str]:
    """Serves ``app`` on 127.0.0.1 (a free port) in a thread; yields the base URL and
    shuts the server down at the end."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
