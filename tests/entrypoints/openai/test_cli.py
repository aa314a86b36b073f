"""``python -m paddle_step.serve`` without the serving stack: one line that names what to
install, before any model is loaded."""

import subprocess
import sys


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
