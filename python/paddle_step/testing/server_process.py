"""``python -m paddle_step.serve`` in a subprocess on 127.0.0.1, for tests and benchmarks:
started on a free port, waited for until ``/health`` answers, and always stopped; and the
helpers for any server so started (a free port, the health wait, a metric's value).
Standard library only: an install check runs this where only the runtime packages are."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO

__all__ = ["free_port", "metric", "server_process", "wait_for_health"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_health(
    url: str, process: subprocess.Popen, timeout_s: float, log: IO[str] | None = None
) -> None:
    """Returns once ``url``/health answers 200; raises ``RuntimeError`` if ``process`` (the
    server, or the launcher that runs it) exits first (with the end of ``log``) or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        if process.poll() is not None:
            output = ""
            if log is not None:
                log.seek(0)
                output = ": " + log.read()[-2000:]
            raise RuntimeError(f"the server exited ({process.returncode}){output}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server gave no /health answer within {timeout_s:.0f} s")
        time.sleep(0.3)


def metric(url: str, name: str) -> float:
    """The value of the unlabelled metric ``name`` on ``url``/metrics; raises ``KeyError``
    if the page has none."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(f"{url}/metrics has no metric {name}")


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
        wait_for_health(url, process, timeout_s, log)
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
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False
