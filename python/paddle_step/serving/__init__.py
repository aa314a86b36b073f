"""An OpenAI-compatible HTTP server over the engine (``python -m paddle_step.serve``).

- ``engine_loop``: the one thread that steps the engine; handlers post to it.
- ``api``: the FastAPI app: completions, chat completions, models, health, metrics.
- ``protocol``: request bodies and the OpenAI-style error.
- ``text_stream``: token ids to final text deltas, with stop strings.
- ``metrics``: the Prometheus collector.
"""
