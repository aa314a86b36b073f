"""``python -m paddle_step.serve`` refusing to start: without the serving stack, or with a
flag out of range, one line says why before any model is loaded; and the address it binds
before loading, held until it serves there."""

import errno
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from paddle_step.testing.server_process import free_port


def test_missing_serving_stack_is_named_in_one_line():
    code = (
        "import sys; sys.modules['uvicorn'] = None; sys.modules['prometheus_client'] = None; "
        "import runpy; sys.argv = ['serve', '--model', 'no/such/dir']; "
        "runpy.run_module('paddle_step.serve', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("paddle_step.serve: the serving stack is not installed")
    assert lines[0].endswith(f"`{sys.executable} -m pip install uvicorn prometheus-client`")


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_refused_before_loading(port):
    """bind() would raise only after the model loaded, with a traceback (and the engine
    process, which ignores SIGTERM, kept the interpreter from exiting)."""
    done = subprocess.run(
        [sys.executable, "-m", "paddle_step.serve", "--model", "random", "--port", port],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"python -m paddle_step.serve: error: argument --port: expected an integer in "
        f"[0, 65535], got {port}"
    )


def test_a_port_in_use_is_refused_before_loading():
    """uvicorn found it taken only after the model had loaded (seconds to minutes)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "paddle_step.serve", "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"paddle_step.serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert "engine process" not in done.stderr  # no model was loaded


def test_the_port_is_held_while_the_model_loads(monkeypatch):
    """Bound before the model loads and kept until uvicorn listens on it. A port checked
    and let go could be handed to something else meanwhile: a --tp 2 server's collectives
    took it, and uvicorn failed (exit 3) once the model had loaded."""
    from paddle_step.entrypoints.openai import cli

    port = free_port()
    binds = []

    def build_app(_args):
        with socket.socket() as other:
            binds.append(other.connect_ex(("127.0.0.1", port)))  # not listening yet
            try:
                other.bind(("127.0.0.1", port))
                binds.append(0)
            except OSError as error:
                binds.append(error.errno)
        raise ValueError("the model could not load")

    monkeypatch.setattr(cli, "build_app", build_app)
    with pytest.raises(SystemExit) as exited:
        cli.main(["--port", str(port)])
    assert exited.value.code == "paddle_step.serve: the model could not load"
    assert binds == [errno.ECONNREFUSED, errno.EADDRINUSE]
    with socket.socket() as after:  # let go when the server does not start
        after.bind(("127.0.0.1", port))


def test_port_0_serves_on_a_free_port_and_says_which(tmp_path):
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "paddle_step.serve", "--port", "0"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (
            found := re.search(r"running on http://127\.0\.0\.1:(\d+) ", log_path.read_text())
        ):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        port = int(found.group(1))
        assert port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as answer:
            assert answer.status == 200
        process.terminate()
        assert process.wait(60) == -signal.SIGTERM, log_path.read_text()  # 143 in a shell
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.parametrize("flag", ["--host", "--served-model-name", "--api-key"])
def test_an_empty_value_is_refused(flag):
    """--host '' would bind every interface, --served-model-name '' fall back silently."""
    from paddle_step.entrypoints.openai.cli import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--model", "random", flag, ""])
    assert exited.value.code == 2


def test_a_model_that_is_not_a_directory_is_refused_before_loading():
    done = subprocess.run(
        [sys.executable, "-m", "paddle_step.serve", "--model", "no/such/dir"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "python -m paddle_step.serve: error: --model: expected a checkpoint directory or "
        "'random', got 'no/such/dir'"
    )
