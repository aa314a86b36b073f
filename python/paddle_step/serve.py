"""``python -m paddle_step.serve``: the OpenAI-compatible server
(``paddle_step.entrypoints.openai.cli``)."""

from .entrypoints.openai.stop_signals import catch_stop_signals, restore_handlers

# Ctrl-C or SIGTERM while the server's modules load: nothing to stop yet, so it exits
# 128 + the signal. The signal is recorded, not only raised: an extension module that
# imports a module of its own while the interrupt comes may report it as an error of its
# own (NumPy: an ImportError, the interrupt gone).
_stopped_by: list[int] = []
_previous: dict = {}
try:
    catch_stop_signals(_stopped_by, _previous)
    from .entrypoints.openai.cli import main
except BaseException:
    if _stopped_by:
        raise SystemExit(128 + _stopped_by[0]) from None
    raise
finally:
    restore_handlers(_previous)

if __name__ == "__main__":
    main()
