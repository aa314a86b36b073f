"""The OpenAI-compatible HTTP API over an ``EngineLoop``.

Handlers validate a request, tokenize it, submit it to the engine process and relay its
tokens: as server-sent events (``stream: true``, one chunk per token that completes
text, then ``data: [DONE]``) or as one JSON body. A client that disconnects aborts its
request, which returns its slot and KV blocks to the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ...engine.core_client import (
    EngineLoop,
    EngineUnavailable,
    RequestError,
    RequestHandle,
    SamplingParams,
)
from ...tokenizer.detokenizer import IncrementalDetokenizer
from .guard import RequestGuard
from .metrics import metrics_registry
from .openapi import install_openapi
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest
from .text_stream import TextStream

__all__ = ["create_app"]

# How often a non-streaming handler checks that its client is still there.
_DISCONNECT_POLL_S = 0.5


def create_app(
    loop: EngineLoop,
    tokenizer,
    model_name: str,
    *,
    api_key: str | None = None,
    max_request_bytes: int = 1 << 20,
    max_waiting: int = 1024,
) -> FastAPI:
    """The app over a started ``loop``; it stops the loop on shutdown.

    ``tokenizer`` needs ``encode(text)``, ``decode(ids, skip_special_tokens)``,
    ``vocab_size`` and ``encode_chat(messages)`` (the checkpoint's chat template; raises
    ``ValueError`` when the checkpoint has none). ``api_key`` and ``max_request_bytes``:
    see ``RequestGuard``. A request that would be the ``max_waiting``-th one waiting for
    a batch slot gets 429.
    """

    max_model_len = loop.info["max_model_len"]
    # Prompt ids index the model's embedding rows (the engine checks the same bound).
    vocab_size = loop.info["vocab_size"]
    max_in_flight = loop.info["max_batch"] + max_waiting
    max_prompt_bytes = _max_prompt_bytes(tokenizer, max_model_len)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        loop.stop()

    app = FastAPI(title="paddle_step", version="0.1.0", lifespan=lifespan)
    app.add_middleware(
        RequestGuard, loop=loop, api_key=api_key, max_request_bytes=max_request_bytes
    )
    install_openapi(
        app,
        model_name=model_name,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        api_key=api_key is not None,
        chat=getattr(tokenizer, "chat_template", "") is not None,
    )
    registry = metrics_registry(loop)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = f"'{where}': {first.get('msg')}" if where else first.get("msg", "bad request")
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', message)}"
        return JSONResponse(ApiError(message, param=where or None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(
            ApiError(str(error.detail), status=error.status_code).body(),
            status_code=error.status_code,
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        if loop.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": loop.refusal}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "paddle_step",
                    "max_model_len": max_model_len,
                }
            ],
        }

    def prepare(
        body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int]
    ) -> tuple[RequestHandle, TextStream]:
        """Checks what depends on the model, then the handle and text stream."""
        if body.model != model_name:
            raise ApiError(
                f"'model': expected '{model_name}', got '{body.model}'",
                param="model",
                kind="model_not_found",
            )
        outside = [token for token in prompt_ids if not 0 <= token < vocab_size]
        if outside:
            raise ApiError(
                f"'prompt': token ids must be in [0, {vocab_size}), got {outside[:5]}",
                param="prompt",
            )
        room = max_model_len - len(prompt_ids)
        if room < 1:
            raise ApiError(
                f"the prompt ({len(prompt_ids)} tokens) leaves no room in the model's context "
                f"of {max_model_len} tokens",
                param="prompt" if isinstance(body, CompletionRequest) else "messages",
            )
        max_tokens = body.max_tokens if body.max_tokens is not None else room
        if max_tokens > room:
            raise ApiError(
                f"the prompt ({len(prompt_ids)} tokens) plus 'max_tokens' ({max_tokens}) "
                f"exceeds the model's context of {max_model_len} tokens",
                param="max_tokens",
            )
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=float(body.temperature),
            top_p=float(body.top_p),
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
        text = TextStream(detokenizer, body.stop_strings())
        return RequestHandle(prompt_ids, params), text

    def check_prompt_size(text_size: int, param: str) -> None:
        """Refuses, before tokenizing, a text too long for the context in any tokenization."""
        if text_size > max_prompt_bytes:
            raise ApiError(
                f"the prompt ({text_size} bytes of text) is longer than the model's context "
                f"of {max_model_len} tokens",
                param=param,
            )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_text(body)
        body.check_ranges()
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            check_prompt_size(len(prompt.encode()), "prompt")
        prompt_ids = list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
        handle, text = prepare(body, prompt_ids)
        return await respond(request, body, handle, text, _CompletionFormat())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_text(body)
        body.check_ranges()
        messages = [message.model_dump() for message in body.messages]
        check_prompt_size(sum(len(m.content.encode()) for m in body.messages), "messages")
        try:
            prompt_ids = tokenizer.encode_chat(messages)
        except ValueError as error:
            raise ApiError(str(error), param="messages") from None
        handle, text = prepare(body, prompt_ids)
        return await respond(request, body, handle, text, _ChatFormat())

    async def respond(
        request: Request, body, handle: RequestHandle, text: TextStream, fmt: _Format
    ) -> Response:
        if loop.num_in_flight >= max_in_flight:
            error = ApiError(
                f"the server is at capacity ({max_waiting} requests waiting for a slot); "
                "retry later",
                status=429,
                kind="rate_limit_exceeded",
            )
            return JSONResponse(error.body(), status_code=429, headers={"Retry-After": "1"})
        try:
            loop.submit(handle)
        except EngineUnavailable as error:
            raise ApiError(str(error), status=503, kind="service_unavailable") from None
        fmt.start(model_name, len(handle.prompt_ids))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(loop, handle, text, fmt, include_usage), media_type="text/event-stream"
            )
        pieces: list[str] = []
        try:
            async for piece in _relay(handle, text, fmt, request.is_disconnected):
                pieces.append(piece)
        finally:
            _abort_unless_done(loop, handle)
        if fmt.error is not None:
            raise _api_error(fmt.error)
        return JSONResponse(fmt.whole("".join(pieces), fmt.finish_reason, text.num_tokens))

    return app


def _max_prompt_bytes(tokenizer, max_model_len: int) -> int:
    """A text longer than this (UTF-8 bytes) cannot fit ``max_model_len`` tokens: no token
    stands for more bytes than the longest one decodes to. Twice that leaves room for
    normalizers that shrink text before it is split."""
    longest = max(
        len(tokenizer.decode([token], skip_special_tokens=False).encode("utf-8", "replace"))
        for token in range(tokenizer.vocab_size)
    )
    return 2 * max(longest, 1) * max_model_len


def _check_text(body) -> None:
    """Refuses a string that is not Unicode text (a lone surrogate, which JSON's \\u
    escapes can carry) in any field of ``body``, before anything encodes it."""

    def bad_field(value, where: str) -> str | None:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(value, dict):
            for key, item in value.items():
                found = bad_field(key, where) or bad_field(item, f"{where}.{key}")
                if found:
                    return found
        elif isinstance(value, list):
            for index, item in enumerate(value):
                found = bad_field(item, f"{where}[{index}]")
                if found:
                    return found
        return None

    for name, value in body.model_dump().items():
        where = bad_field(value, name)
        if where is not None:
            where = where.encode("utf-8", "backslashreplace").decode()
            raise ApiError(
                f"'{where}': expected Unicode text, got a string with a lone surrogate",
                param=where,
            )


def _api_error(error: RequestError) -> ApiError:
    if error.unavailable:  # the engine failed or the server is shutting down
        return ApiError(error.message, status=503, kind="service_unavailable")
    return ApiError(error.message)


def _abort_unless_done(loop: EngineLoop, handle: RequestHandle) -> None:
    if not handle.done:
        loop.abort(handle)
        handle.done = True


async def _relay(
    handle: RequestHandle, text: TextStream, fmt: _Format, is_disconnected: Callable | None = None
) -> AsyncIterator[str]:
    """Text deltas of ``handle``'s request, until it ends; records on ``fmt`` why it ended
    (``finish_reason``) or failed (``error``). With ``is_disconnected``, stops early once
    the client has gone."""
    while True:
        if is_disconnected is None:
            kind, value = await handle.events.get()
        else:
            try:
                kind, value = await asyncio.wait_for(handle.events.get(), _DISCONNECT_POLL_S)
            except TimeoutError:
                if await is_disconnected():
                    return
                continue
        if kind == "cached":
            fmt.cached_tokens = value
        elif kind == "token":
            delta = text.add(value)
            if text.stopped:  # a stop string ended the text: the request is done
                fmt.finish_reason = "stop"
                yield delta
                return
            if delta:
                yield delta
        elif kind == "finish":
            handle.done = True
            fmt.finish_reason = "length" if value == "length" else "stop"
            yield text.finish()
            return
        else:
            handle.done = True
            fmt.error = value
            return


async def _sse(
    loop: EngineLoop, handle: RequestHandle, text: TextStream, fmt: _Format, include_usage: bool
) -> AsyncIterator[str]:
    try:
        first = fmt.first_chunk()
        if first is not None:
            yield _event(first)
        async for delta in _relay(handle, text, fmt):
            if delta:
                yield fmt.text_event(delta)
        if fmt.error is not None:
            yield _event(_api_error(fmt.error).body())
        else:
            yield _event(fmt.chunk("", fmt.finish_reason))
            if include_usage:
                yield _event(fmt.usage_chunk(text.num_tokens))
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away and the response was cancelled
        _abort_unless_done(loop, handle)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Format:
    """The response objects of one endpoint (ids, chunks, the final body)."""

    object_name = ""
    id_prefix = ""

    def start(self, model_name: str, prompt_tokens: int) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_name
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied
        self.finish_reason: str | None = None
        self.error: RequestError | None = None
        self._text_event_parts: list[str] | None = None

    def text_event(self, delta: str) -> str:
        """``_event(self.chunk(delta))`` from a template rendered once per request: only
        the text changes from token to token, and this runs for every token."""
        if self._text_event_parts is None:
            marker = "\x00delta\x00"  # JSON escapes it, so no text can look like it
            encoded = json.dumps(marker)
            self._text_event_parts = _event(self.chunk(marker)).split(encoded)
        head, tail = self._text_event_parts
        return head + json.dumps(delta, ensure_ascii=False) + tail

    def usage(self, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def envelope(self, object_name: str, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def first_chunk(self) -> dict | None:
        return None

    def usage_chunk(self, completion_tokens: int) -> dict:
        return self.envelope(self.object_name, [], usage=self.usage(completion_tokens))


class _CompletionFormat(_Format):
    object_name = "text_completion"
    id_prefix = "cmpl"

    def chunk(self, delta: str, finish_reason: str | None = None) -> dict:
        return self.envelope(
            self.object_name,
            [{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}],
        )

    def whole(self, text: str, finish_reason: str, completion_tokens: int) -> dict:
        return self.envelope(
            self.object_name,
            [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            usage=self.usage(completion_tokens),
        )


class _ChatFormat(_Format):
    object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def first_chunk(self) -> dict:
        return self.chunk(None, role="assistant")

    def chunk(self, delta: str | None, finish_reason: str | None = None, role=None) -> dict:
        message = {"role": role} if role else ({"content": delta} if delta else {})
        return self.envelope(
            self.object_name,
            [{"index": 0, "delta": message, "logprobs": None, "finish_reason": finish_reason}],
        )

    def whole(self, text: str, finish_reason: str, completion_tokens: int) -> dict:
        return self.envelope(
            "chat.completion",
            [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ],
            usage=self.usage(completion_tokens),
        )
