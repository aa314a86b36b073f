"""The OpenAI request bodies this server accepts, and its error type.

Only the fields the engine can honour are accepted with values; a field OpenAI defines
that the engine cannot honour (``n`` > 1, ``logprobs``, ``best_of`` ...) is rejected with
a 400 naming it, rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
)

__all__ = ["ApiError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest"]


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "code"}}``."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind
        self.param = param

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


def _integral(value):
    """JSON has one kind of number: 7.0 is the integer 7, as JSON Schema's "integer" says
    (and schema-driven clients send it). Fractions, bools and strings stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[StrictInt, BeforeValidator(_integral)]
Number = StrictInt | StrictFloat


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints. Unknown fields are accepted and ignored, as
    OpenAI clients send extras; those listed in ``unsupported`` are refused."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Integer | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    seed: Integer | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Integer = 1
    ignore_eos: StrictBool = False  # vLLM's extension
    user: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not stop for stop in stops):
            raise ApiError("'stop': expected non-empty strings, got an empty string", param="stop")
        return stops

    def check_ranges(self) -> None:
        """The range checks pydantic's types do not express."""
        if self.n != 1:
            raise ApiError(f"'n': only n = 1 is supported, got {self.n}", param="n")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ApiError(
                f"'max_tokens': expected an integer >= 1, got {self.max_tokens}", param="max_tokens"
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise ApiError(
                f"'temperature': expected a number in [0, 2], got {self.temperature}",
                param="temperature",
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ApiError(f"'top_p': expected a number in (0, 1], got {self.top_p}", param="top_p")
        for name in (
            "logprobs",
            "top_logprobs",
            "best_of",
            "suffix",
            "echo",
            "tools",
            "functions",
            "logit_bias",
            "response_format",
        ):
            value = (self.model_extra or {}).get(name)
            if value not in (None, False, 1 if name == "best_of" else None):
                raise ApiError(f"'{name}': not supported by this server, got {value!r}", param=name)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: str | list[Integer] | list[str]

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(
                    f"'prompt': one prompt per request is supported, got a list of {len(prompt)}",
                    param="prompt",
                )
            prompt = prompt[0]
        if not prompt:
            raise ApiError(
                "'prompt': expected a non-empty string or token list, got an empty one",
                param="prompt",
            )
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages rendered by the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
