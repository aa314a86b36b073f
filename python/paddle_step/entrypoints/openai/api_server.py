"""The OpenAI-compatible HTTP API over an ``EngineLoop``.

Handlers validate a request, tokenize it, submit one engine request per prompt (its ``n``
samples drawn by the engine) and relay their tokens: as server-sent events (``stream:
true``, one chunk per piece of text that became final, then ``data: [DONE]``) or as one
JSON body. A client that disconnects aborts its requests, which returns their slots and
KV blocks to the engine.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ...engine.core_client import (
    EngineLoop,
    EngineUnavailable,
    RequestError,
    RequestHandle,
)
from ...engine.outputs import FINISH_EOS, FINISH_STOP
from ...sampling_params import SamplingParams
from ...tokenizer.detokenizer import IncrementalDetokenizer
from .guard import RequestGuard
from .logprobs import LogprobFormatter
from .metrics import metrics_registry
from .openapi import install_openapi
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, whole_body_refusal
from .text_stream import StopStrings, TextOptions, TextStream

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
    ``ValueError`` when the checkpoint has none); structured output needs its
    ``tokenizer_file``. ``api_key`` and ``max_request_bytes``: see ``RequestGuard``. A
    request that would make more than ``max_waiting`` engine requests wait for a batch
    slot gets 429.
    """

    max_model_len = loop.info["max_model_len"]
    # Prompt ids index the model's embedding rows (the engine checks the same bound).
    vocab_size = loop.info["vocab_size"]
    eos_token_ids = loop.info.get("eos_token_ids", [])
    max_in_flight = loop.info["max_batch"] + max_waiting
    max_prompt_bytes = _max_prompt_bytes(tokenizer, max_model_len)
    formatter = LogprobFormatter(tokenizer)

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
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        first = errors[0]
        where = _field_of(first)
        message = first.get("msg", "bad request")
        if where:
            detail = _union_message(errors, first)
            if " got " not in detail:  # our own checks name the value already
                detail += _received(first)
            message = f"'{where}': {detail}"
        # Malformed JSON's loc is ("body", character offset): the offset is not a field.
        if first.get("type") == "json_invalid" or not (where or isinstance(error.body, dict)):
            where = None
            message = whole_body_refusal(request.headers.get("content-type", ""), first, error.body)
        return JSONResponse(ApiError(message, param=where or None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = str(error.detail)
        if isinstance(error.__cause__, UnicodeDecodeError):  # FastAPI's detail names no cause
            message = f"the body is not UTF-8 text: {error.__cause__}"
        if isinstance(error.__cause__, RecursionError):  # past the parser's recursion limit
            message = "the body's JSON is nested too deeply to parse"
        allowed = (error.headers or {}).get("Allow")
        if error.status_code == 405 and allowed:
            message = f"{request.url.path} takes {allowed}, got {request.method}"
        # Starlette's headers (a 405's Allow, which RFC 9110 requires) go out with the body.
        return JSONResponse(
            ApiError(message, status=error.status_code).body(),
            status_code=error.status_code,
            headers=error.headers,
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        if loop.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": loop.refusal}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "paddle_step",
            "max_model_len": max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != model_name:
            raise ApiError(
                f"model '{model_id}' does not exist; this server serves '{model_name}'",
                status=404,
                param="model",
                kind="model_not_found",
            )
        return model_card()

    def check_model_and_prompt(body, prompt_ids: list[int]) -> None:
        if body.model != model_name:
            raise ApiError(  # 404, as OpenAI and vLLM answer a model they do not serve
                f"'model': expected '{model_name}', got '{body.model}'",
                status=404,
                param="model",
                kind="model_not_found",
            )
        outside = [token for token in prompt_ids if not 0 <= token < vocab_size]
        if outside:
            raise ApiError(
                f"'prompt': token ids must be in [0, {vocab_size}), got {outside[:5]}",
                param="prompt",
            )

    def token_budget(
        prompt_ids: list[int], asked: int | None, name: str, prompt_param: str, min_tokens: int
    ) -> int:
        """``asked`` (None: all the room left), checked against the context and
        ``min_tokens``."""
        room = max_model_len - len(prompt_ids)
        if room < 1:
            raise ApiError(
                f"the prompt ({len(prompt_ids)} tokens) leaves no room in the model's context "
                f"of {max_model_len} tokens",
                param=prompt_param,
            )
        max_tokens = asked if asked is not None else room
        if max_tokens > room:
            raise ApiError(
                f"the prompt ({len(prompt_ids)} tokens) plus '{name}' ({max_tokens}) "
                f"exceeds the model's context of {max_model_len} tokens",
                param=name,
            )
        if min_tokens > max_tokens:  # an explicit limit below min_tokens is refused earlier
            raise ApiError(
                f"'min_tokens' ({min_tokens}) exceeds the {max_tokens} tokens the model's "
                f"context of {max_model_len} leaves after the prompt ({len(prompt_ids)} tokens)",
                param="min_tokens",
            )
        return max_tokens

    async def constraints_of(body) -> Callable[[], object | None]:
        """A maker of the structured-output constraint the request asks for
        (``response_format`` or ``structured_outputs``; one per prompt: each keeps its own
        state); it makes None without one. The grammar is compiled once, in a worker
        thread: the first compile also builds llguidance's view of the vocabulary (up to a
        second for a large one), which must not stall the streams in flight."""
        asked = body.output_constraint()
        if asked is None:
            return lambda: None
        tokenizer_file = getattr(tokenizer, "tokenizer_file", None)
        if tokenizer_file is None:
            raise ApiError(
                f"'{asked.param}': structured output needs a Hugging Face tokenizer.json; "
                "this model has none",
                param=asked.param,
            )
        if body.samples_drawn() > 1:
            raise ApiError(
                f"'{asked.param}': structured output draws one sample per prompt, got "
                f"n {body.n} and best_of {body.samples_drawn()}",
                param=asked.param,
            )
        from ...structured_output import GrammarConstraint, compile_grammar

        try:
            grammar = await asyncio.to_thread(
                compile_grammar, asked.kind, asked.value, tokenizer_file, eos_token_ids, vocab_size
            )
        except ValueError as error:
            raise ApiError(f"'{asked.param}': {error}", param=asked.param) from None
        return lambda: GrammarConstraint(grammar, tokenizer_file, eos_token_ids, vocab_size)

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
        body.check(vocab_size)
        prompts = body.prompts()
        for prompt in prompts:
            if isinstance(prompt, str) and body.truncate_prompt_tokens is None:
                check_prompt_size(len(prompt.encode()), "prompt")
        prompt_ids_list = [
            body.truncated(
                list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt),
                max_model_len,
            )
            for prompt in prompts
        ]
        runs: list[_Run] = []
        new_constraint = await constraints_of(body)
        for index, (prompt, prompt_ids) in enumerate(zip(prompts, prompt_ids_list)):
            check_model_and_prompt(body, prompt_ids)
            max_tokens = token_budget(
                prompt_ids, body.max_tokens, "max_tokens", "prompt", body.min_tokens
            )
            params = body.sampling_params(max_tokens, vocab_size, new_constraint())
            echo = None
            if body.echo:  # the prompt as the model saw it (truncate_prompt_tokens)
                whole = isinstance(prompt, str) and body.truncate_prompt_tokens is None
                echo = prompt if whole else tokenizer.decode(prompt_ids)
            runs.append(_Run(index, prompt_ids, params, echo))
        fmt = _CompletionFormat(model_name, formatter, body.logprobs, body.prompt_logprobs)
        return await respond(request, body, runs, fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_text(body)
        body.check(vocab_size)
        messages = [message.for_template() for message in body.messages]
        if body.truncate_prompt_tokens is None:  # a longer one is what truncation is for
            check_prompt_size(sum(len(m["content"].encode()) for m in messages), "messages")
        try:
            prompt_ids = body.truncated(
                tokenizer.encode_chat(messages, body.template_options()), max_model_len
            )
        except (ValueError, TemplateError) as error:
            raise ApiError(f"'messages': {error}", param="messages") from None
        check_model_and_prompt(body, prompt_ids)
        limit_name, limit = body.token_limit()
        max_tokens = token_budget(prompt_ids, limit, limit_name, "messages", body.min_tokens)
        params = body.sampling_params(max_tokens, vocab_size, (await constraints_of(body))())
        fmt = _ChatFormat(model_name, formatter, body.logprobs_asked())
        return await respond(request, body, [_Run(0, prompt_ids, params, None)], fmt)

    async def respond(request: Request, body, runs: list[_Run], fmt: _Format) -> Response:
        events: asyncio.Queue = asyncio.Queue()
        # Shared by every choice of the request.
        text_options = TextOptions(
            StopStrings(body.stop_strings(), body.include_stop_str_in_output),
            body.skip_special_tokens,
        )
        for run in runs:
            run.start(tokenizer, text_options, events)
        handles = [run.handle for run in runs if run.handle is not None]
        sequences = sum(handle.num_sequences for handle in handles)
        if sequences > max_in_flight:  # would never fit: retrying cannot help
            many = "prompt" if len(runs) > 1 else "n"
            if body.samples_drawn() > body.n and len(runs) == 1:
                many = "best_of"
            raise ApiError(
                f"'{many}': the request needs {sequences} batch slots (prompts x best_of), "
                f"more than the server ever holds: --max-batch + --max-waiting = {max_in_flight}",
                param=many,
            )
        if handles and loop.num_in_flight + sequences > max_in_flight:
            error = ApiError(
                f"the server is at capacity ({max_waiting} sequences may wait for a slot); "
                "retry later",
                status=429,
                kind="rate_limit_exceeded",
            )
            return JSONResponse(error.body(), status_code=429, headers={"Retry-After": "1"})
        try:
            for handle in handles:
                loop.submit(handle)
        except EngineUnavailable as error:
            _abort_all(loop, runs)
            raise ApiError(str(error), status=503, kind="service_unavailable") from None
        if body.stream:
            include_usage = body.include_usage()
            return StreamingResponse(
                _sse(loop, runs, events, fmt, include_usage), media_type="text/event-stream"
            )
        try:
            async for _update in _relay(loop, runs, events, request.is_disconnected):
                pass
        finally:
            _abort_all(loop, runs)
        error = next((run.error for run in runs if run.error is not None), None)
        if error is not None:
            raise error
        return JSONResponse(fmt.whole(runs))

    return app


class _Choice:
    """One sample of a run as the client sees it: its text so far, tokens, logprobs."""

    def __init__(self, run: _Run, sample: int, tokenizer, options: TextOptions) -> None:
        self.run = run
        self.sample = sample
        detokenizer = IncrementalDetokenizer(
            tokenizer, run.prompt_ids, skip_special_tokens=options.skip_special_tokens
        )
        self.text = TextStream(detokenizer, options.stops)
        self.pieces: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []  # (logprob, top, rank) per token, when asked
        self.unsent_logprobs = 0  # tokens whose logprobs no chunk has carried yet
        self.finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_id: int, logprobs, finish_reason: str | None = None) -> str:
        """The text ``token_id`` made final ('' when none); ``finish_reason``: the engine's,
        where this token ended the sample."""
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.unsent_logprobs += 1
        stop_token = finish_reason == FINISH_EOS or (
            finish_reason == FINISH_STOP and token_id in self.run.params.stop_token_ids
        )
        delta = self.text.add(token_id, stop_token)
        if self.text.stopped:  # a stop string ended this choice's text
            self.finish_reason = "stop"
        self.pieces.append(delta)
        return delta

    def finish(self, reason: str) -> str:
        """The text held back until the end; records why it ended."""
        delta = "" if self.done else self.text.finish()
        if not self.done:
            self.finish_reason = "length" if reason == "length" else "stop"
        self.pieces.append(delta)
        return delta


class _Run:
    """One prompt's engine request and its choices (one per sample drawn)."""

    def __init__(
        self, index: int, prompt_ids: list[int], params: SamplingParams, echo: str | None
    ) -> None:
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.echo = echo  # the prompt's text when the answer repeats it
        self.handle: RequestHandle | None = None
        self.samples: dict[int, _Choice] = {}
        self.returned: list[_Choice] = []  # in choice order, once finished
        self.prompt_logprobs = None
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied
        self.error: ApiError | None = None
        self.finished = False

    def start(self, tokenizer, options: TextOptions, events: asyncio.Queue) -> None:
        drawn = self.params.best_of or self.params.n
        self.samples = {j: _Choice(self, j, tokenizer, options) for j in range(drawn)}
        if self.params.max_tokens == 0 and self.params.prompt_logprobs is None:
            # Nothing for the engine to compute: the answer is the echoed prompt alone.
            for choice in self.samples.values():
                choice.finish("length")
            self.returned = [self.samples[j] for j in range(self.params.n)]
            self.finished = True
            return
        self.handle = RequestHandle(self.prompt_ids, self.params, events=events, index=self.index)

    @property
    def num_returned(self) -> int:
        return self.params.n

    def completion_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.returned)


def _abort_all(loop: EngineLoop, runs: list[_Run]) -> None:
    for run in runs:
        handle = run.handle
        if handle is not None and not handle.done:
            loop.abort(handle)
            handle.done = True


async def _relay(
    loop: EngineLoop,
    runs: list[_Run],
    events: asyncio.Queue,
    is_disconnected: Callable | None = None,
) -> AsyncIterator[tuple[_Run, _Choice | None, str]]:
    """``(run, choice, text delta)`` as the runs' tokens arrive, and ``(run, None, "")``
    when a run's prompt logprobs arrive, until every run has ended; records on each run
    its choices' finish reasons or its error. With ``is_disconnected``, stops early once
    the client has gone."""
    pending = sum(not run.finished for run in runs)
    next_check = time.monotonic() + _DISCONNECT_POLL_S
    while pending:
        if is_disconnected is None:
            index, kind, value = await events.get()
        else:
            # Checked on a clock, not only when the tokens pause: a request whose tokens
            # keep coming would otherwise run to its end for a client long gone.
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + _DISCONNECT_POLL_S
                if await is_disconnected():
                    return
            try:
                index, kind, value = await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
            except TimeoutError:
                next_check = 0.0
                continue
        run = runs[index]
        if run.finished:
            continue
        if kind == "token":
            sample, token_id, logprobs, finish_reason = value
            choice = run.samples[sample]
            if choice.done:  # a stop string already ended it
                continue
            yield run, choice, choice.add(token_id, logprobs, finish_reason)
            if finish_reason is not None and not choice.done:  # its last token
                yield run, choice, choice.finish(finish_reason)
            if all(choice.done for choice in run.samples.values()):
                # Every sample stopped on a stop string: the engine need not go on.
                _abort_all(loop, [run])
                run.returned = _returned_choices(run, list(range(run.params.n)))
                run.finished = True
                pending -= 1
        elif kind == "cached":
            run.cached_tokens = value
        elif kind == "prompt_logprobs":
            run.prompt_logprobs = value
            yield run, None, ""
        elif kind == "finish":
            run.handle.done = True
            reasons = dict(value)
            run.returned = _returned_choices(run, [sample for sample, _reason in value])
            for choice in run.returned:  # each has ended on its last token already
                yield run, choice, choice.finish(reasons.get(choice.sample, "stop"))
            run.finished = True
            pending -= 1
        else:  # "error": the engine refused the request, or failed
            run.handle.done = True
            run.error = _api_error(value)
            run.finished = True
            pending -= 1


def _returned_choices(run: _Run, engine_order: list[int]) -> list[_Choice]:
    """The choices a finished run answers with. Without ``best_of`` > ``n``: every sample,
    in ``engine_order``. With it: the ``n`` draws whose tokens as returned (up to the one
    that completed a stop string, which the engine does not know of) have the highest
    cumulative logprob, ties to the earlier draw."""
    if len(run.samples) == run.params.n:
        return [run.samples[sample] for sample in engine_order]
    ranked = sorted(run.samples.values(), key=lambda choice: -_cumulative_logprob(choice))
    return ranked[: run.params.n]


def _cumulative_logprob(choice: _Choice) -> float:
    return sum(entry[0] for entry in choice.logprobs)  # (logprob, top, rank)


async def _sse(
    loop: EngineLoop, runs: list[_Run], events: asyncio.Queue, fmt: _Format, include_usage: bool
) -> AsyncIterator[str]:
    # A run whose first chunks (an echo with logprobs) wait for its prompt logprobs holds
    # its other chunks back until then, so each choice's chunks stay in order.
    held: dict[int, list[str]] = {
        run.index: [] for run in runs if fmt.waits_for_prompt_logprobs(run)
    }
    try:
        for run in runs:
            if run.index not in held:
                for chunk in fmt.first_chunks(run):
                    yield _event(chunk)
        ended: set[int] = set()  # the choices whose finish chunk has gone out (ids)
        async for run, choice, delta in _relay(loop, runs, events):
            if choice is None:
                if run.index in held:
                    for chunk in fmt.first_chunks(run):
                        yield _event(chunk)
                    for event in held.pop(run.index):
                        yield event
                continue
            out = []
            if delta or choice.unsent_logprobs:
                out.append(fmt.text_event(choice, delta))
            if choice.done and id(choice) not in ended:  # as at OpenAI: when it ends
                ended.add(id(choice))
                out.append(_event(fmt.chunk(choice, "", choice.finish_reason)))
            if run.index in held:
                held[run.index] += out
            else:
                for event in out:
                    yield event
        error = next((run.error for run in runs if run.error is not None), None)
        if error is not None:
            yield _event(error.body())
        else:
            for run in runs:
                for event in held.pop(run.index, []):
                    yield event
                for choice in run.returned:
                    if id(choice) not in ended:  # one that never ran (max_tokens 0)
                        yield _event(fmt.chunk(choice, "", choice.finish_reason))
            if include_usage:
                yield _event(fmt.envelope(fmt.chunk_object, [], usage=fmt.usage(runs)))
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away and the response was cancelled
        _abort_all(loop, runs)


# How much of a refused value an error message repeats.
RECEIVED_CHARS = 80

# The parts of a pydantic error location that name no field: the request body, and the
# member of a union that was tried ('temperature.int', 'stop.list[str]').
_UNION_MEMBER = re.compile(r"(int|float|str|bool|none|[a-z-]+\[.*\])")


def _loc_tag(part) -> bool:
    return part == "body" or (isinstance(part, str) and _UNION_MEMBER.fullmatch(part) is not None)


def _field_of(error: dict) -> str:
    """The field a pydantic error is about, dotted ('logit_bias.5'), without tags."""
    return ".".join(str(part) for part in error.get("loc", ()) if not _loc_tag(part))


def _union_member_error(error: dict) -> bool:
    """Whether a pydantic error is one union member's refusal ('temperature.int')."""
    loc = error.get("loc", ())
    return bool(loc) and loc[-1] != "body" and _loc_tag(loc[-1])


def _union_message(errors: list[dict], first: dict) -> str:
    """``first``'s message; for a value no member of a union took, every member's, so the
    client reads all the forms the field takes ('Input should be a valid integer or a
    valid number'), not only the one pydantic tried first."""
    if not _union_member_error(first):
        return first["msg"]
    field = _field_of(first)
    members = dict.fromkeys(
        error["msg"] for error in errors if _union_member_error(error) and _field_of(error) == field
    )
    first_message, *others = members
    others = [other.removeprefix("Input should be ") for other in others]
    return " or ".join([first_message, *others])


def _received(error: dict) -> str:
    """', got <the value>' for a pydantic error about a value the request sent (JSON, cut
    to ``RECEIVED_CHARS``), so the message names what came as well as what is expected."""
    if error.get("type") == "missing" or "input" not in error:
        return ""
    try:
        text = json.dumps(error["input"], ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON (pydantic may hand over a model)
        return ""
    if len(text) > RECEIVED_CHARS:
        text = text[: RECEIVED_CHARS - 3] + "..."
    return f", got {text}"


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


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Format:
    """The response objects of one endpoint (ids, chunks, the final body)."""

    chunk_object = ""
    id_prefix = ""

    def __init__(self, model_name: str, formatter: LogprobFormatter) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_name
        self.formatter = formatter
        self.logprobs: int | None = None
        self._templates: dict[int, list[str]] = {}

    def envelope(self, object_name: str, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    @staticmethod
    def choice_index(choice: _Choice, position: int | None = None) -> int:
        """Choices of a batch are numbered prompt by prompt: prompt i's k-th is i * n + k."""
        run = choice.run
        k = choice.sample if position is None else position
        return run.index * run.num_returned + k

    def usage(self, runs: list[_Run]) -> dict:
        prompt_tokens = sum(len(run.prompt_ids) for run in runs)
        completion_tokens = sum(run.completion_tokens() for run in runs)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(run.cached_tokens for run in runs)},
        }

    def first_chunks(self, run: _Run) -> list[dict]:
        return []

    def waits_for_prompt_logprobs(self, run: _Run) -> bool:
        """True when the first chunks carry prompt logprobs the engine has yet to send."""
        return False

    def text_event(self, choice: _Choice, delta: str) -> str:
        """``_event(self.chunk(choice, delta))``; without logprobs, from a template
        rendered once per choice, as only the text changes from token to token."""
        if self.logprobs is not None:
            return _event(self.chunk(choice, delta))
        parts = self._templates.get(id(choice))
        if parts is None:
            marker = "\x00delta\x00"  # JSON escapes it, so no text can look like it
            parts = _event(self.chunk(choice, marker)).split(json.dumps(marker))
            self._templates[id(choice)] = parts
        head, tail = parts
        return head + json.dumps(delta, ensure_ascii=False) + tail

    def take_logprobs(self, choice: _Choice) -> list:
        """The logprobs of the choice's tokens no chunk has carried yet."""
        count, choice.unsent_logprobs = choice.unsent_logprobs, 0
        return choice.logprobs[len(choice.logprobs) - count :] if count else []


class _CompletionFormat(_Format):
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(
        self,
        model_name: str,
        formatter: LogprobFormatter,
        logprobs: int | None,
        prompt_logprobs: int | None,
    ) -> None:
        super().__init__(model_name, formatter)
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self._offsets: dict[int, int] = {}  # text offset reached per streamed choice

    def first_chunks(self, run: _Run) -> list[dict]:
        """With ``echo``, each choice starts with the prompt (and its logprobs)."""
        if run.echo is None:
            return []
        chunks = []
        for k in range(run.num_returned):
            choice = run.samples[k]
            logprobs = self._echo_logprobs(run)
            if logprobs is not None:  # offsets go on from the prompt tokens' texts
                self._offsets[id(choice)] = sum(len(text) for text in logprobs["tokens"])
            chunks.append(
                self.envelope(
                    self.chunk_object,
                    [{"index": self.choice_index(choice), "text": run.echo,
                      "logprobs": logprobs, "finish_reason": None}],
                )
            )  # fmt: skip
        return chunks

    def waits_for_prompt_logprobs(self, run: _Run) -> bool:
        return run.echo is not None and self.logprobs is not None and run.handle is not None

    def _echo_logprobs(self, run: _Run) -> dict | None:
        if self.logprobs is None:
            return None
        return self.formatter.completion(run.prompt_ids, [None, *(run.prompt_logprobs or [])], 0)

    def chunk(self, choice: _Choice, delta: str, finish_reason: str | None = None) -> dict:
        logprobs = None
        # A chunk that carries no token (the finish, text held back until the end) has
        # null logprobs, as at OpenAI.
        entries = self.take_logprobs(choice) if self.logprobs is not None else []
        if entries:
            tokens = choice.token_ids[len(choice.token_ids) - len(entries) :]
            start = self._offsets.get(id(choice), 0)
            logprobs = self.formatter.completion(tokens, entries, start)
            self._offsets[id(choice)] = start + sum(len(t) for t in logprobs["tokens"])
        return self.envelope(
            self.chunk_object,
            [{"index": self.choice_index(choice), "text": delta, "logprobs": logprobs,
              "finish_reason": finish_reason}],
        )  # fmt: skip

    def whole(self, runs: list[_Run]) -> dict:
        choices = []
        for run in runs:
            for position, choice in enumerate(run.returned):
                text = "".join(choice.pieces)
                logprobs = None
                if self.logprobs is not None:
                    tokens = list(choice.token_ids[: len(choice.logprobs)])
                    entries = list(choice.logprobs)
                    if run.echo is not None:
                        tokens = run.prompt_ids + tokens
                        entries = [None, *(run.prompt_logprobs or []), *entries]
                    logprobs = self.formatter.completion(tokens, entries, 0)
                if run.echo is not None:
                    text = run.echo + text
                choice_body = {
                    "index": self.choice_index(choice, position),
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                }
                if self.prompt_logprobs is not None:
                    choice_body["prompt_logprobs"] = self.formatter.vllm_prompt(
                        run.prompt_ids, run.prompt_logprobs or []
                    )
                choices.append(choice_body)
        return self.envelope(self.chunk_object, choices, usage=self.usage(runs))


class _ChatFormat(_Format):
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model_name: str, formatter: LogprobFormatter, logprobs: int | None) -> None:
        super().__init__(model_name, formatter)
        self.logprobs = logprobs

    def first_chunks(self, run: _Run) -> list[dict]:
        return [
            self.envelope(
                self.chunk_object,
                [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}],
            )
            for k in range(run.num_returned)
        ]  # fmt: skip

    def _logprobs(self, tokens: list[int], entries: list) -> dict | None:
        if self.logprobs is None:
            return None
        return {"content": self.formatter.chat(tokens, entries), "refusal": None}

    def chunk(self, choice: _Choice, delta: str, finish_reason: str | None = None) -> dict:
        logprobs = None
        entries = self.take_logprobs(choice) if self.logprobs is not None else []
        if entries:  # null on a chunk that carries no token, as at OpenAI
            tokens = choice.token_ids[len(choice.token_ids) - len(entries) :]
            logprobs = self._logprobs(tokens, entries)
        return self.envelope(
            self.chunk_object,
            [{"index": choice.sample, "delta": {"content": delta} if delta else {},
              "logprobs": logprobs, "finish_reason": finish_reason}],
        )  # fmt: skip

    def whole(self, runs: list[_Run]) -> dict:
        [run] = runs
        choices = []
        for position, choice in enumerate(run.returned):
            logprobs = self._logprobs(
                choice.token_ids[: len(choice.logprobs)], list(choice.logprobs)
            )
            choices.append(
                {
                    "index": position,
                    "message": {"role": "assistant", "content": "".join(choice.pieces)},
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                }
            )
        return self.envelope("chat.completion", choices, usage=self.usage(runs))
