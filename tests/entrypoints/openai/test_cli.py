"""``python -m paddle_step.serve`` refusing to start: without the serving stack, or with a
flag out of range, one line says why before any model is loaded."""

import socket
import subprocess
import sys

import pytest


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
