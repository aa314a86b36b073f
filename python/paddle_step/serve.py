"""``python -m paddle_step.serve``: the OpenAI-compatible server
(``paddle_step.entrypoints.openai.cli``)."""

try:
    from .entrypoints.openai.cli import main
except KeyboardInterrupt:  # Ctrl-C while the server's modules load: nothing to stop yet
    raise SystemExit(130) from None

if __name__ == "__main__":
    main()
