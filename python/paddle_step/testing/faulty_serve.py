"""``python -m paddle_step.serve`` with a fault planted in its engine process, for the
fault tests: with ``PADDLE_STEP_PLANTED_FAULT=KIND@N`` the engine's first ``step()`` with
N requests or more in flight (holding a slot or queued)

- ``raise``: raises ``RuntimeError`` (an engine bug),
- ``exit``: ends the process with exit code 3 (``os._exit``, no clean-up),
- ``abort``: crashes it with SIGABRT (as a fault in native code does).

Run it as ``python -m paddle_step.testing.faulty_serve FLAGS`` (the server's flags). The
engine process is started with multiprocessing's spawn, which imports this module there
as ``__mp_main__``: that is where the fault is planted; the server process is untouched.
"""

from __future__ import annotations

import os
import signal

__all__ = ["FAULT_VARIABLE"]

FAULT_VARIABLE = "PADDLE_STEP_PLANTED_FAULT"


def _plant(spec: str) -> None:
    kind, _, at = spec.partition("@")
    if kind not in ("raise", "exit", "abort") or not at.isdigit():
        raise ValueError(f"{FAULT_VARIABLE}: expected KIND@N (raise, exit, abort), got {spec!r}")
    from paddle_step.engine.llm_engine import Engine

    original_step = Engine.step

    def step(self):
        if self.num_active + self.num_waiting >= int(at):
            if kind == "raise":
                raise RuntimeError(f"planted fault with {at} requests in flight")
            if kind == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGABRT)
        return original_step(self)

    Engine.step = step


if __name__ == "__mp_main__" and os.environ.get(FAULT_VARIABLE):
    _plant(os.environ[FAULT_VARIABLE])

if __name__ == "__main__":
    from paddle_step.entrypoints.openai.cli import main

    main()
