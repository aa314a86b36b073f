"""The OpenAI-compatible HTTP server (``python -m paddle_step.serve``): ``api_server``
(the FastAPI app), ``protocol`` (request bodies, errors), ``text_stream`` (token ids to
text deltas with stop strings), ``metrics`` (Prometheus), ``cli`` (the command line) and
``stop_signals`` (SIGTERM and Ctrl-C before it serves). No paddle in this process: the
engine runs in its own."""
