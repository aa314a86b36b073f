"""A server for tests and benchmarks on 127.0.0.1: ``python -m paddle_step.serve`` in a
subprocess (``server_process``: started on a free port, waited for until ``/health``
answers, and always stopped), or an app served by uvicorn in a thread of this process
(``serve_in_thread``); and the helpers for any server so started (a free port, the health
wait, a metric's value). Standard library only at import: an install check runs this
where only the runtime packages are."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

__all__ = [
    "ServerProcess",
    "descendants",
    "free_port",
    "metric",
    "metrics",
    "serve_in_thread",
    "server_process",
    "spawn_server",
    "wait_for_health",
]


# paddle.distributed.launch gives its ranks ports from this range (its PORT_RANGE default).
_LAUNCHER_PORTS_START = 35100
_LOWEST_PORT = 10000
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the ports others are given without asking
    for one: the kernel's ephemeral range (bind to port 0, outgoing connections) and
    paddle.distributed.launch's. Between this probe and the server's bind (a second or
    more for a launcher) nothing else then takes it by chance, as a port the kernel picked
    could be. Never the same port twice in one process (a server's and its launcher's
    master port are drawn one after the other, both still free)."""
    start = min(_ephemeral_ports_start(), _LAUNCHER_PORTS_START)
    draw = random.SystemRandom()  # not the tests' seeded generator
    for _ in range(100):
        port = draw.randrange(_LOWEST_PORT, start) if start > _LOWEST_PORT else 0
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = probe.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free TCP port in [{_LOWEST_PORT}, {start}) on 127.0.0.1")


def _ephemeral_ports_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def wait_for_health(
    url: str,
    process: subprocess.Popen,
    timeout_s: float,
    log: Callable[[], str] | None = None,
) -> None:
    """Returns once ``url``/health answers 200; raises ``RuntimeError`` if ``process`` (the
    server, or the launcher that runs it) exits first (with the end of ``log()``) or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        if process.poll() is not None:
            output = f": {log()[-2000:]}" if log is not None else ""
            raise RuntimeError(f"the server exited ({process.returncode}){output}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server gave no /health answer within {timeout_s:.0f} s")
        time.sleep(0.3)


def metrics(url: str) -> dict[str, float]:
    """The unlabelled metrics on ``url``/metrics, by name (one scrape)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value and not line.startswith("#") and "{" not in name:
            values[name] = float(value.split()[0])
    return values


def metric(url: str, name: str) -> float:
    """The value of the unlabelled metric ``name`` on ``url``/metrics; raises ``KeyError``
    if the page has none."""
    values = metrics(url)
    if name not in values:
        raise KeyError(f"{url}/metrics has no metric {name}")
    return values[name]


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log_file: IO[str]

    def log(self) -> str:
        """Everything the server printed so far."""
        self.log_file.flush()
        self.log_file.seek(0)
        return self.log_file.read()


@contextmanager
def spawn_server(
    flags: Sequence[str] = (),
    timeout_s: float = 120.0,
    module: str = "paddle_step.serve",
    env: Mapping[str, str] | None = None,
) -> Iterator[ServerProcess]:
    """Runs ``python -m module --port P flags`` (with ``env`` added to the environment)
    and yields it once ``/health`` answers 200; raises ``RuntimeError`` (with the
    server's output) if it exits or does not answer within ``timeout_s``. The server is
    terminated, then killed, on the way out if it still runs."""
    port = free_port()
    command = [sys.executable, "-m", module, "--port", str(port), *flags]
    # Its log goes to a file: a pipe nobody reads would fill up and stall the server.
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
    )
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_for_health(server.url, process, timeout_s, server.log)
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        log.close()


@contextmanager
def server_process(flags: Sequence[str] = (), timeout_s: float = 120.0) -> Iterator[str]:
    """``spawn_server(flags, timeout_s)``'s URL."""
    with spawn_server(flags, timeout_s) as server:
        yield server.url


def descendants(pid: int) -> list[int]:
    """The ids of ``pid``'s children, their children, and so on (Linux ``/proc``)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for thread in threads:
            try:
                with open(f"/proc/{parent}/task/{thread}/children") as children:
                    kids = [int(child) for child in children.read().split()]
            except FileNotFoundError:
                continue
            found += kids
            pending += kids
    return found


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
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
