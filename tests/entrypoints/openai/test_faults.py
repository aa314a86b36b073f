"""The server under faults, as real processes on 127.0.0.1: its engine process killed,
crashing, exiting or raising inside ``step()`` while requests are in flight, and SIGTERM.

Every wait is bounded; every server is stopped (and killed if need be) on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from paddle_step.testing.faulty_serve import FAULT_VARIABLE
from paddle_step.testing.server_process import descendants, free_port, metrics, spawn_server

# The shipped model; 8 slots, so the 10 requests below run together.
FLAGS = ["--max-batch", "16", "--max-model-len", "256", "--kv-blocks", "400"]
STREAMS, WHOLES = 8, 2
# The issue asks for every request to end within 1 s of the engine's death; the
# assertion leaves room for the 2 shared cores this suite runs on.
END_WITHIN_S = 3.0


# Long enough to be running when a fault comes; the drain test runs its requests to their
# end, so it asks for fewer (a loaded machine decodes 10 rows at a few steps a second).
LONG_TOKENS, DRAINED_TOKENS = 240, 40


def request_body(stream: bool, max_tokens: int = LONG_TOKENS) -> dict:
    return {
        "model": "pydoc-tiny",
        "prompt": "A list is",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


async def in_flight_then(
    url: str, fault, settle: bool, max_tokens: int = LONG_TOKENS
) -> tuple[list, list, float]:
    """Starts ``STREAMS`` streaming and ``WHOLES`` whole completions, waits until every
    stream has a first chunk (and, with ``settle``, until the engine runs all of them),
    then calls ``fault()``. Returns each stream's data lines with the time it ended, each
    whole response with its time, and the time of the fault."""
    started = [asyncio.Event() for _ in range(STREAMS)]

    async def stream(client: httpx.AsyncClient, index: int):
        lines = []
        async with client.stream(
            "POST", f"{url}/v1/completions", json=request_body(True, max_tokens)
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: ") :])
                    started[index].set()
        return lines, time.monotonic()

    async def whole(client: httpx.AsyncClient):
        response = await client.post(f"{url}/v1/completions", json=request_body(False, max_tokens))
        return response, time.monotonic()

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as client:
        tasks = [asyncio.create_task(stream(client, i)) for i in range(STREAMS)]
        tasks += [asyncio.create_task(whole(client)) for _ in range(WHOLES)]
        if settle:
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(in_flight, url) < STREAMS + WHOLES:
                assert time.monotonic() < deadline, "the requests never ran together"
                await asyncio.sleep(0.05)
        fault_at = time.monotonic()
        fault()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return results[:STREAMS], results[STREAMS:], fault_at


def in_flight(url: str) -> int:
    values = metrics(url)
    return int(values["paddle_step_requests_running"] + values["paddle_step_requests_waiting"])


def check_error(body: dict, status: int) -> None:
    error = body["error"]
    assert error["code"] == status and error["type"] and error["message"], body


def check_ended_with_errors(streams, wholes, fault_at: float) -> None:
    """Every stream ended with an error event then ``[DONE]``; every whole request got a
    503 in OpenAI's error format; all within ``END_WITHIN_S`` of the fault."""
    latest = max(ended_at for _, ended_at in streams + wholes) - fault_at
    print(f"the last request ended {latest * 1e3:.0f} ms after the fault")
    for lines, ended_at in streams:
        assert lines[-1] == "[DONE]", lines[-3:]
        check_error(json.loads(lines[-2]), 503)
        assert ended_at - fault_at < END_WITHIN_S
    for response, ended_at in wholes:
        assert response.status_code == 503, response.text
        check_error(response.json(), 503)
        assert ended_at - fault_at < END_WITHIN_S


def check_refuses_then_exits(server, grace_s: float = 60.0) -> None:
    """``/health`` and new requests answer 503 at once; then the server exits non-zero."""
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    began = time.monotonic()
    refused = httpx.post(f"{server.url}/v1/completions", json=request_body(False), timeout=10)
    assert refused.status_code == 503 and time.monotonic() - began < END_WITHIN_S
    check_error(refused.json(), 503)
    assert server.process.wait(grace_s) != 0


def test_engine_killed_ends_every_request_and_the_server_exits():
    with spawn_server(FLAGS) as server:
        engine_pid = int(re.search(r"engine process (\d+)", server.log()).group(1))
        assert engine_pid in descendants(server.process.pid)
        streams, wholes, fault_at = asyncio.run(
            in_flight_then(server.url, lambda: os.kill(engine_pid, signal.SIGKILL), settle=True)
        )
        check_ended_with_errors(streams, wholes, fault_at)
        check_refuses_then_exits(server)
        log = server.log()
    assert log.count("engine failed:") == 1 and "killed by SIGKILL" in log, log[-3000:]


@pytest.mark.parametrize("kind", ["raise", "exit", "abort"])
def test_engine_fault_in_step_ends_every_request_and_the_server_exits(kind):
    env = {FAULT_VARIABLE: f"{kind}@{STREAMS + WHOLES}"}
    with spawn_server(FLAGS, module="paddle_step.testing.faulty_serve", env=env) as server:
        streams, wholes, fault_at = asyncio.run(
            in_flight_then(server.url, lambda: None, settle=False)
        )
        check_ended_with_errors(streams, wholes, fault_at=min(t for _, t in streams + wholes))
        check_refuses_then_exits(server)
        log = server.log()
    assert log.count("engine failed:") == 1, log[-3000:]
    if kind == "raise":  # the engine's traceback, logged once by the server
        assert log.count("Traceback (most recent call last)") == 1, log[-3000:]
        assert "RuntimeError: planted fault" in log
    else:
        assert ("exit code 3" if kind == "exit" else "killed by SIGABRT") in log, log[-3000:]


def engine_pid_of(server) -> int:
    return int(re.search(r"engine process (\d+)", server.log()).group(1))


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie not yet reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def check_no_orphans(pids: list[int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if not gone(pid)]
        time.sleep(0.1)


def test_sigterm_lets_running_requests_finish_then_exits_leaving_no_process():
    with spawn_server([*FLAGS, "--shutdown-timeout", "60"]) as server:
        children = descendants(server.process.pid)
        assert engine_pid_of(server) in children
        streams, wholes, _sent_at = asyncio.run(
            in_flight_then(
                server.url,
                lambda: server.process.send_signal(signal.SIGTERM),
                settle=True,
                max_tokens=DRAINED_TOKENS,
            )
        )
        for lines, _ended_at in streams:  # every stream ran to its length
            assert lines[-1] == "[DONE]"
            assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "length", lines[-2]
        for response, _ended_at in wholes:
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == DRAINED_TOKENS
        # uvicorn ends a SIGTERM'd process by the same signal once it has shut down.
        assert server.process.wait(60) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/health", timeout=5)
        check_no_orphans(children)


def test_sigterm_ends_requests_still_running_after_the_shutdown_timeout():
    drain_s = 2.0
    with spawn_server([*FLAGS, "--shutdown-timeout", str(drain_s)]) as server:
        children = descendants(server.process.pid)
        engine_pid = engine_pid_of(server)

        def stall_engine_then_terminate():
            os.kill(engine_pid, signal.SIGSTOP)  # nothing can finish in time
            server.process.send_signal(signal.SIGTERM)

        try:
            streams, wholes, sent_at = asyncio.run(
                in_flight_then(server.url, stall_engine_then_terminate, settle=True)
            )
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        for lines, ended_at in streams:
            assert lines[-1] == "[DONE]", lines[-3:]
            check_error(json.loads(lines[-2]), 503)
            assert drain_s - 0.5 < ended_at - sent_at < drain_s + END_WITHIN_S
        for response, _ended_at in wholes:
            assert response.status_code == 503, response.text
            check_error(response.json(), 503)
        assert server.process.wait(60) in (0, -signal.SIGTERM)
        check_no_orphans(children)


def test_ctrl_c_exits_without_a_traceback_leaving_no_process():
    """Ctrl-C reaches the whole process group; the engine process ignores it and the
    server stops it."""
    with spawn_server(FLAGS) as server:
        children = descendants(server.process.pid)
        os.kill(server.process.pid, signal.SIGINT)
        for child in children:
            os.kill(child, signal.SIGINT)
        # 130 once the KeyboardInterrupt uvicorn re-raises reaches main(); in one loaded
        # full-suite run asyncio's runner ended the loop without it (exit 0) instead.
        assert server.process.wait(60) in (0, 130), server.log()
        assert "Traceback" not in server.log(), server.log()
        check_no_orphans(children)


def test_ctrl_c_twice_ends_running_requests_with_their_error_at_once():
    """A second Ctrl-C was uvicorn's forced exit: the running streams were cut mid-write
    (no error event, no ``[DONE]``) with a CancelledError traceback each in the log. Now
    each request ends at once with its error, and the server exits quietly."""
    with spawn_server([*FLAGS, "--shutdown-timeout", "60"]) as server:
        children = descendants(server.process.pid)

        def ctrl_c_twice():
            server.process.send_signal(signal.SIGINT)
            time.sleep(0.3)  # the first only starts the drain, for up to 60 s
            server.process.send_signal(signal.SIGINT)

        streams, wholes, fault_at = asyncio.run(
            in_flight_then(server.url, ctrl_c_twice, settle=True)
        )
        check_ended_with_errors(streams, wholes, fault_at)
        for lines, _ended_at in streams:
            assert "Ctrl-C twice" in json.loads(lines[-2])["error"]["message"]
        assert server.process.wait(60) in (0, 130), server.log()
        assert "Traceback" not in server.log(), server.log()
        check_no_orphans(children)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "term"])
@pytest.mark.parametrize(
    "since, after_s",
    # From 0.15 s: before, the interpreter itself may be starting (runpy's imports), where
    # Ctrl-C prints Python's own traceback whatever the program.
    [("server", 0.15), ("server", 0.3), ("engine", 0.0), ("engine", 0.1), ("engine", 1.0)],
)
def test_ctrl_c_while_the_model_loads_exits_without_a_traceback(
    tmp_path, since, after_s, stop_signal
):
    """Ctrl-C or SIGTERM to the process group before the server serves, ``after_s`` after
    the server or its engine process started (the server's first moments: its interpreter
    importing, the flags parsed): the server stops its engine process, which ignores both
    while it loads (paddle's handler would print a crash report), and exits quietly (130 or
    143, or the signal's own status where it came before the handlers were set, or once
    uvicorn serves); nothing is left behind. The engine's first moments are the new
    interpreter importing its target (the test below covers each moment of it)."""
    with starting_server(tmp_path) as (process, log_path):
        if since == "engine":
            wait_for_engine(process, log_path)
        time.sleep(after_s)
        children = descendants(process.pid)
        os.killpg(process.pid, stop_signal)
        assert process.wait(60) in (0, 128 + stop_signal, -stop_signal), log_path.read_text()
    assert_quiet_exit(log_path, children)


STOP_PROBE = """
import functools, os, signal
from paddle_step.entrypoints.openai import stop_signals

stopped_by = []
signal.signal(signal.SIGTERM, functools.partial(stop_signals.interrupt, stopped_by))
try:  # a string run by exec, as namedtuple and dataclasses do while modules import
    exec("os.kill(os.getpid(), signal.SIGTERM)\\nfor _ in range(10**6): pass")
except KeyboardInterrupt:
    raise SystemExit(128 + stopped_by[0]) from None
"""


def test_sigterm_during_a_string_exec_exits_143_not_by_sigint(tmp_path):
    """The server's SIGTERM handler, taken inside ``exec`` of a string in a ``-m`` program
    (the server's own start): it exits 143. A plain KeyboardInterrupt there made CPython
    end the process by SIGINT instead, silently (about 1 start in 3 stopped 0.3 s in)."""
    (tmp_path / "stop_probe.py").write_text(STOP_PROBE)
    probe = subprocess.run(
        [sys.executable, "-m", "stop_probe"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert probe.returncode == 128 + signal.SIGTERM, probe.stderr
    assert probe.stderr == ""


LOAD_INTERRUPT_PROBE = """
import os, runpy, signal, sys, types

def interrupted_import(name):
    # As an extension module importing a module of its own when Ctrl-C comes: it reports an
    # ImportError of its own, the KeyboardInterrupt gone (NumPy's did, 0.15 s into a start).
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**7):
            pass
    except KeyboardInterrupt:
        pass
    raise ImportError("PyCapsule_Import could not import module 'datetime'")

cli = types.ModuleType("paddle_step.entrypoints.openai.cli")
cli.__getattr__ = interrupted_import
sys.modules[cli.__name__] = cli
runpy.run_module("paddle_step.serve", run_name="__main__")
"""


def test_ctrl_c_a_module_reports_as_an_import_error_while_the_server_loads_exits_130():
    """Ctrl-C while the server's modules load, turned by an extension module into an
    ImportError: the server still exits 130, quietly (it printed NumPy's ImportError and
    exited 1)."""
    probe = subprocess.run(
        [sys.executable, "-c", LOAD_INTERRUPT_PROBE], capture_output=True, text=True,
        timeout=60, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert probe.returncode == 128 + signal.SIGINT, probe.stderr
    assert probe.stderr == ""


def test_a_stop_signal_a_library_reports_as_its_own_error_still_exits_quietly(monkeypatch):
    """SIGTERM while the server starts, which a library turns into an error of its own
    (pydantic-core building a schema wraps it in a SchemaError): the server still exits
    143, not with that error's traceback."""
    from paddle_step.entrypoints.openai import cli

    def build_app(_args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt as interrupt:
            raise Exception("Error building `literal` serializer") from interrupt

    monkeypatch.setattr(cli, "build_app", build_app)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--port", str(free_port())])
    assert stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers given back


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "term"])
@pytest.mark.parametrize("moment", ["flags", "bind", "server"])
def test_a_stop_signal_while_the_server_starts_stops_the_engine_and_exits_quietly(
    monkeypatch, stop_signal, moment
):
    """Ctrl-C or SIGTERM while the flags are parsed (argparse asks the terminal's size), while
    rank 0 binds its address (resolving it imports the idna codec: a CI run's SIGTERM there
    ended the server with a traceback and status 1), or after the model has loaded, while
    uvicorn imports and the server is made (it ended by SIGINT with a traceback there, the
    engine not stopped): the server exits 130 or 143, stopping the engine if it runs, and
    gives the signal handlers back."""
    from paddle_step.entrypoints.openai import cli

    stopped = []

    class Loop:
        def stop(self):
            stopped.append(True)

    def stop_signal_then_wait(*_args):
        os.kill(os.getpid(), stop_signal)
        time.sleep(5)
        raise AssertionError(f"signal {stop_signal} did not stop the server's start")

    monkeypatch.setattr(cli, "build_app", lambda _args: (object(), Loop()))
    if moment == "flags":
        parse_args = cli.parse_args
        monkeypatch.setattr(
            cli, "parse_args", lambda argv: (parse_args(argv), stop_signal_then_wait())
        )
    else:
        monkeypatch.setattr(cli, f"_{moment}", stop_signal_then_wait)
    # Ctrl-C as a terminal delivers it: a job started in the background (CI) has SIGINT
    # ignored, which the server leaves so.
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    handlers = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    try:
        # BaseException: an escaped interrupt must fail this test, not end the session.
        with pytest.raises(BaseException) as stopped_server:
            cli.main(["--port", str(free_port())])
        given_back = {s: signal.getsignal(s) for s in handlers}
    finally:
        signal.signal(signal.SIGINT, outer)
    assert stopped_server.type is SystemExit, stopped_server.getrepr()
    assert stopped_server.value.code == 128 + stop_signal
    assert stopped == ([True] if moment == "server" else [])
    assert given_back == handlers


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "term"])
def test_the_engine_process_takes_no_ctrl_c_from_its_first_moment(tmp_path, stop_signal):
    """SIGINT or SIGTERM sent to the engine process every few ms from the moment it exists,
    while its new interpreter imports its target and then loads the model: it must neither
    die nor print anything (a KeyboardInterrupt there printed multiprocessing's traceback
    and the server could not start). Then Ctrl-C ends the server as usual."""
    with starting_server(tmp_path) as (process, log_path):
        engine = wait_for_engine(process, log_path)
        hammer_until = time.monotonic() + 1.0
        while time.monotonic() < hammer_until:
            os.kill(engine, stop_signal)
            time.sleep(0.003)
        assert process.poll() is None and engine_process(process.pid) == engine, (
            log_path.read_text()
        )
        children = descendants(process.pid)
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(60) in (0, 130), log_path.read_text()
    assert_quiet_exit(log_path, children)


@contextlib.contextmanager
def starting_server(tmp_path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """``serve`` just started, in a session of its own and taking Ctrl-C (a background job
    of a non-interactive shell ignores it), its output in a file; killed at the end if it
    is still running."""
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "paddle_step.serve", "--port", str(free_port())],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
    try:
        yield process, log_path
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def wait_for_engine(process: subprocess.Popen, log_path: Path) -> int:
    """The server's engine process, as soon as it exists."""
    deadline = time.monotonic() + 60
    while not (engine := engine_process(process.pid)):
        assert time.monotonic() < deadline and process.poll() is None, log_path.read_text()
        time.sleep(0.001)
    return engine


def engine_process(server_pid: int) -> int | None:
    """The server's engine process once it runs (its new interpreter runs spawn_main)."""
    for child in descendants(server_pid):
        try:
            with open(f"/proc/{child}/cmdline") as command_line:
                if "spawn_main" in command_line.read():
                    return child
        except OSError:
            continue
    return None


def assert_quiet_exit(log_path: Path, children: list[int]) -> None:
    """No Python traceback nor paddle's crash report in the output, no process left."""
    output = log_path.read_text()
    assert "Traceback" not in output and "SignalInfo" not in output, output
    check_no_orphans(children)


def test_an_interpreter_that_exits_without_stopping_its_engine_does_not_hang():
    """The engine process ignores SIGTERM, which is all multiprocessing's exit handler
    sends before it joins: an exit between start() and serving (Ctrl-C while the app is
    built, an error) must still end it."""
    code = (
        "from paddle_step.entrypoints.openai.cli import parse_args\n"
        "from paddle_step.engine.core_client import EngineLoop\n"
        "loop = EngineLoop(parse_args(['--model', 'random', '--max-model-len', '64']))\n"
        "loop.start()\n"
        "print(loop.pid, flush=True)\n"
        "raise SystemExit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    check_no_orphans([int(done.stdout.split()[-1])])
