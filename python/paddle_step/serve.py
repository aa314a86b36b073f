"""``python -m paddle_step.serve``: the OpenAI-compatible server
(``paddle_step.entrypoints.openai.cli``)."""

import signal

_stopped_by: list[int] = []


def _stop_while_loading(signum: int, _frame) -> None:
    _stopped_by.append(signum)
    raise KeyboardInterrupt


# Ctrl-C or SIGTERM while the server's modules load: nothing to stop yet, so it exits
# 128 + the signal. The signal is recorded, not only raised: an extension module that
# imports a module of its own while the KeyboardInterrupt comes may report it as an
# error of its own (NumPy: an ImportError, the interrupt gone).
_previous = {
    stop_signal: signal.signal(stop_signal, _stop_while_loading)
    for stop_signal, default in (
        (signal.SIGINT, signal.default_int_handler),
        (signal.SIGTERM, signal.SIG_DFL),
    )
    if signal.getsignal(stop_signal) is default  # not when ignored
}
try:
    from .entrypoints.openai.cli import main
except BaseException:
    if _stopped_by:
        raise SystemExit(128 + _stopped_by[0]) from None
    raise
finally:
    for _stop_signal, _handler in _previous.items():
        signal.signal(_stop_signal, _handler)

if __name__ == "__main__":
    main()
