"""Ways in: the OpenAI-compatible server (``openai``)."""
