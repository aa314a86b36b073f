"""``python -m paddle_step.serve``: the OpenAI-compatible server
(``paddle_step.entrypoints.openai.cli``)."""

from .entrypoints.openai.cli import main

if __name__ == "__main__":
    main()
