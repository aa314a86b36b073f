"""setup_ops.py's dependency step: pip runs only when a runtime requirement is missing
(or installed in a version its pin excludes), with requirements.txt, and a failed pip
stops the install with one line to run by hand. Every header is a build dependency."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_ops():
    spec = importlib.util.spec_from_file_location("setup_ops", REPO / "setup_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: builds nothing
    return module


def requirements(tmp_path, text):
    path = tmp_path / "requirements.txt"
    path.write_text(text)
    return str(path)


def test_requirements(setup_ops, tmp_path):
    path = requirements(
        tmp_path, "# runtime\nnumpy>=1.24\n\nJinja2  # templates\nprometheus-client\n"
    )
    assert setup_ops.requirements(path) == [
        ("numpy", ">=1.24"), ("Jinja2", ""), ("prometheus-client", "")
    ]  # fmt: skip


def test_an_installed_version_the_pin_excludes_runs_pip(setup_ops, tmp_path, monkeypatch):
    """pytest is installed, but not in a version >= 1000: pip gets the file (it upgrades
    what is unmet and leaves the rest); one the pin allows runs no pip."""
    commands = []
    monkeypatch.setattr(setup_ops.subprocess, "call", lambda command: commands.append(command) or 0)
    setup_ops.install_runtime_requirements(requirements(tmp_path, "pytest>=1\n"))
    assert commands == []
    path = requirements(tmp_path, "numpy\npytest>=1000\n")
    setup_ops.install_runtime_requirements(path)
    assert commands == [[sys.executable, "-m", "pip", "install", "-r", path]]


def test_nothing_missing_runs_no_pip(setup_ops, tmp_path, monkeypatch):
    def no_pip(command):
        raise AssertionError(f"pip ran: {command}")

    monkeypatch.setattr(setup_ops.subprocess, "call", no_pip)
    setup_ops.install_runtime_requirements(requirements(tmp_path, "numpy\nJinja2\npytest\n"))


def test_missing_requirement_runs_pip_on_the_file(setup_ops, tmp_path, monkeypatch):
    commands = []
    monkeypatch.setattr(setup_ops.subprocess, "call", lambda command: commands.append(command) or 0)
    path = requirements(tmp_path, "numpy\npaddle-step-absent-package\n")
    setup_ops.install_runtime_requirements(path)
    assert commands == [[sys.executable, "-m", "pip", "install", "-r", path]]


def test_pip_failure_stops_with_one_line(tmp_path):
    # A real pip without an index (as without a registry) cannot install the package.
    path = requirements(tmp_path, "paddle-step-absent-package\n")
    setup_file = str(REPO / "setup_ops.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('setup_ops', {setup_file!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        f"module.install_runtime_requirements({path!r})\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "paddle_step: could not install paddle-step-absent-package; run "
        f"`{sys.executable} -m pip install -r {path}` where a package index is reachable, "
        "then `python setup_ops.py install` again"
    )


def test_every_header_is_a_dependency_of_the_library(setup_ops):
    """An edited header rebuilds the library: setuptools compares ``depends`` with it."""
    headers = {str(path) for path in (REPO / "ops").glob("*/*.h")}
    assert headers and headers <= set(setup_ops.make_extension().depends)
