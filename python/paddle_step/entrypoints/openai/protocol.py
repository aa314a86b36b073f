"""The OpenAI request bodies this server accepts, their mapping to one ``SamplingParams``
per choice, and the error type.

Every field a body may carry is declared here: an unknown field is a 400 naming it, and a
field OpenAI defines that this server cannot honour (``tools``, ``suffix``, ...) is
accepted only when absent, null or asking for what the server does anyway (``tool_choice``
"auto" without tools, ``store`` false). Nothing a client sends is silently ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)
from pydantic_core import PydanticCustomError

from ...engine.request import MAX_LOGIT_BIAS as MAX_LOGIT_BIAS_ENTRIES
from ...engine.request import MAX_STOP_TOKEN_IDS
from ...sampling_params import MAX_LOGPROBS, SamplingParams, TokenConstraint
from ...tokenizer.chat_template import TEMPLATE_VARIABLES, ChatTemplateOptions, reserved_among

__all__ = [
    "FLOAT32_LARGEST",
    "FLOAT32_SMALLEST",
    "MAX_CHOICES",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_STOP_TOKEN_IDS",
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "OutputConstraint",
    "ResponseFormat",
    "StructuredOutputs",
]

# The most choices (prompts x best_of) one request may ask for: each is an engine request.
MAX_CHOICES = 256
# OpenAI's bound on a logit_bias value.
MAX_LOGIT_BIAS = 100.0
# The smallest positive float32: the sampler computes in float32, where a smaller top_p
# or repetition_penalty would become 0 (top_p 1e-46 would mean "off", not "greedy").
FLOAT32_SMALLEST = 1.401298464324817e-45
FLOAT32_LARGEST = 3.4028234663852886e38

Number = StrictInt | StrictFloat


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

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


def _refuse_unless(condition: bool, name: str, expected: str, value: Any) -> None:
    if not condition:
        raise ApiError(f"'{name}': expected {expected}, got {value!r}", param=name)


def _integral(value):
    """JSON has one kind of number: 7.0 is the integer 7, as JSON Schema's "integer" says
    (and schema-driven clients send it). Fractions, bools and strings stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[StrictInt, BeforeValidator(_integral)]

_PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _json_kind(value) -> str:
    """What a JSON value is, as a client would name it."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    names = {str: "string", list: "list", dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _shown(value) -> str:
    """A JSON scalar as JSON writes it; anything else by its kind."""
    if _json_kind(value) in ("number", "string", "boolean", "null"):
        return json.dumps(value)
    kind = _json_kind(value)
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def whole_body_refusal(content_type: str, error: dict, body: Any) -> str:
    """The message for a request whose body as a whole is not a JSON object (``error``:
    FastAPI's first validation error, ``body``: what it parsed, if anything). FastAPI
    parses JSON only under a JSON content type, and curl's ``-d`` sends a form's."""
    if error.get("type") == "json_invalid":
        reason = error.get("ctx", {}).get("error", error.get("msg"))
        return f"malformed JSON body at character {error['loc'][-1]}: {reason}"
    media_type = content_type.split(";")[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        return (
            "expected a JSON object body with Content-Type application/json, "
            f"got Content-Type {content_type!r}"
        )
    if error.get("type") == "missing":
        return "expected a JSON object body, got an empty body"
    return f"expected a JSON object body, got {_shown(body)}"


def _is_token_id(value) -> bool:
    return _json_kind(value) == "number" and float(value).is_integer()


def _prompt_form(value):
    """``prompt`` as sent when it has one of its four forms; otherwise a refusal that says
    where it strays (the union of the four alone would name whichever form pydantic tried
    first: ``'prompt.str': Input should be a valid string``)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        got = _shown(value)
    elif all(isinstance(one, str) for one in value) or all(map(_is_token_id, value)):
        return value
    elif len(kinds := list(dict.fromkeys(map(_json_kind, value)))) > 1:
        got = f"a list mixing {' and '.join(kind + 's' for kind in kinds)}"
    elif kinds != ["list"]:
        index = next(i for i, one in enumerate(value) if not _is_token_id(one))
        got = f"{_shown(value[index])} at prompt[{index}]"
    else:
        bad = [(i, j, one) for i, row in enumerate(value) for j, one in enumerate(row)
               if not _is_token_id(one)]  # fmt: skip
        if not bad:
            return value
        i, j, one = bad[0]
        got = f"{_shown(one)} at prompt[{i}][{j}]"
    raise PydanticCustomError("prompt_form", f"expected {_PROMPT_FORMS}, got {{got}}", {"got": got})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's ``{name, description, schema, strict}``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr = "response"
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    """``{"type": "text"}``, ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_or_none(self) -> dict | None:
        """The JSON schema the output must follow; None for plain text."""
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise ApiError(
                    "'response_format.json_schema.schema': expected a JSON schema object "
                    "with type 'json_schema', got none",
                    param="response_format",
                )
            return self.json_schema.json_schema
        if self.json_schema is not None:
            raise ApiError(
                f"'response_format.json_schema': only allowed with type 'json_schema', "
                f"got type '{self.type}'",
                param="response_format",
            )
        return {"type": "object"} if self.type == "json_object" else None


class OutputConstraint(NamedTuple):
    """What structured output a request asks for: through which field (``param``), of which
    kind (``structured_output.KINDS``), given by ``value``."""

    param: str
    kind: str
    value: Any


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema (``json``, an object or
    its text), a regular expression the whole output matches (``regex``), strings the output
    is one of (``choice``), a Lark grammar (``grammar``) or any JSON object
    (``json_object: true``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_value: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None

    def constraint(self) -> OutputConstraint:
        given = {
            name: value
            for name, value in (
                ("json", self.json_value),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object),
            )  # fmt: skip
            if value is not None
        }
        if len(given) != 1:
            raise ApiError(
                "'structured_outputs': expected exactly one of json, regex, choice, grammar "
                f"and json_object, got {sorted(given) or 'none'}",
                param="structured_outputs",
            )
        [(kind, value)] = given.items()
        if kind == "json_object":
            if not value:
                raise ApiError("'structured_outputs.json_object': expected true, got false",
                               param="structured_outputs")  # fmt: skip
            return OutputConstraint("structured_outputs", "json", {"type": "object"})
        if kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise ApiError(f"'structured_outputs.json': not JSON text: {error}",
                               param="structured_outputs") from None  # fmt: skip
            if not isinstance(value, dict):
                raise ApiError(f"'structured_outputs.json': expected a JSON schema object, "
                               f"got {_shown(value)}", param="structured_outputs")  # fmt: skip
        return OutputConstraint("structured_outputs", kind, value)


class _RequestFields(_Strict):
    """Fields both endpoints share (OpenAI's, plus vLLM's sampling and text extensions)."""

    model: StrictStr
    max_tokens: Integer | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: Integer = 0  # vLLM's extension; 0 or -1: off
    min_p: Number = 0.0  # vLLM's extension
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0  # vLLM's extension
    logit_bias: dict[str, Number] | None = None
    min_tokens: Integer = 0  # vLLM's extension
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Integer] | None = None  # vLLM's extension
    ignore_eos: StrictBool = False  # vLLM's extension
    seed: Integer | None = None
    n: Integer = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension
    # An end-user id, for the operator's logs; as at OpenAI, it does not change the output.
    user: StrictStr | None = None
    # vLLM's text extensions: the server turns tokens into text, so they stay here, not in
    # SamplingParams.
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    truncate_prompt_tokens: Integer | None = None  # keep a prompt's last k tokens (-1: context)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not stop for stop in stops):
            raise ApiError("'stop': expected non-empty strings, got an empty string", param="stop")
        return stops

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def token_limit(self) -> tuple[str, int | None]:
        """The field that limits the tokens generated, as the client named it, and its
        value (None: what the context leaves)."""
        return "max_tokens", self.max_tokens

    def output_constraint(self) -> OutputConstraint | None:
        """The structured output asked for (``response_format`` or ``structured_outputs``,
        not both), or None."""
        schema = None if self.response_format is None else self.response_format.schema_or_none()
        if self.structured_outputs is None:
            return None if schema is None else OutputConstraint("response_format", "json", schema)
        if schema is not None:
            raise ApiError(
                "'structured_outputs': 'response_format' constrains the output too; send one",
                param="structured_outputs",
            )
        return self.structured_outputs.constraint()

    def check_common(self, vocab_size: int) -> None:
        """The range checks pydantic's types do not express."""
        _refuse_unless(0.0 <= self.temperature <= 2.0, "temperature", "a number in [0, 2]",
                       self.temperature)  # fmt: skip
        _refuse_unless(FLOAT32_SMALLEST <= self.top_p <= 1.0, "top_p",
                       f"a number in (0, 1], at least {FLOAT32_SMALLEST:.6g} (float32's smallest)",
                       self.top_p)  # fmt: skip
        _refuse_unless(self.top_k >= -1, "top_k", "an integer >= -1 (0 or -1: off)", self.top_k)
        _refuse_unless(0.0 <= self.min_p <= 1.0, "min_p", "a number in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _refuse_unless(-2.0 <= value <= 2.0, name, "a number in [-2, 2]", value)
        _refuse_unless(FLOAT32_SMALLEST <= self.repetition_penalty <= FLOAT32_LARGEST,
                       "repetition_penalty", "a number > 0 within float32's range "
                       f"[{FLOAT32_SMALLEST:.6g}, {FLOAT32_LARGEST:.6g}]",
                       self.repetition_penalty)  # fmt: skip
        _refuse_unless(self.min_tokens >= 0, "min_tokens", "an integer >= 0", self.min_tokens)
        limit_name, limit = self.token_limit()
        if limit is not None and limit >= 0:  # a negative limit is refused by its own name
            _refuse_unless(self.min_tokens <= limit, "min_tokens",
                           f"an integer <= '{limit_name}' ({limit})", self.min_tokens)  # fmt: skip
        _refuse_unless(self.n >= 1, "n", "an integer >= 1", self.n)
        _refuse_unless(self.seed is None or 0 <= self.seed < 2**63, "seed",
                       "an integer in [0, 2**63)", self.seed)  # fmt: skip
        stop_token_ids = self.stop_token_ids or []
        _refuse_unless(len(stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
                       f"at most {MAX_STOP_TOKEN_IDS} token ids",
                       f"{len(stop_token_ids)} ids")  # fmt: skip
        for token in stop_token_ids:
            _refuse_unless(0 <= token < vocab_size, "stop_token_ids",
                           f"token ids in [0, {vocab_size})", token)  # fmt: skip
        self.token_bias(vocab_size)
        if self.output_constraint() is not None and self.min_tokens:
            raise ApiError(
                "'min_tokens': not honoured with structured output, which ends when its "
                f"grammar is complete, got {self.min_tokens}",
                param="min_tokens",
            )
        keep = self.truncate_prompt_tokens
        _refuse_unless(keep is None or keep >= 1 or keep == -1, "truncate_prompt_tokens",
                       "an integer >= 1 (the prompt tokens kept) or -1 (the model's context)",
                       keep)  # fmt: skip
        if self.stream_options is not None and not self.stream:
            raise ApiError(
                "'stream_options': only allowed with 'stream': true, got stream false",
                param="stream_options",
            )

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """``prompt_ids`` cut to their last ``truncate_prompt_tokens``, -1 meaning
        ``max_model_len`` (vLLM's extension)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        return prompt_ids[-(max_model_len if keep == -1 else keep) :]

    def token_bias(self, vocab_size: int) -> dict[int, float]:
        """``logit_bias`` with its keys (token ids as strings, as JSON has them) as ints."""
        bias: dict[int, float] = {}
        entries = self.logit_bias or {}
        _refuse_unless(len(entries) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
                       f"at most {MAX_LOGIT_BIAS_ENTRIES} entries",
                       f"{len(entries)} entries")  # fmt: skip
        for key, value in entries.items():
            # Plain decimal digits, as str(id) writes them: int() would also take " 5",
            # "5_0" or "٥", and "05" would make a second entry for token 5.
            token = int(key) if key.isascii() and key.isdigit() and key == str(int(key)) else -1
            _refuse_unless(0 <= token < vocab_size, "logit_bias",
                           f"keys that are token ids in [0, {vocab_size})", key)  # fmt: skip
            bound = MAX_LOGIT_BIAS
            _refuse_unless(-bound <= value <= bound, "logit_bias",
                           f"values in [-{bound:g}, {bound:g}]", value)  # fmt: skip
            bias[token] = float(value)
        return bias

    def logprobs_asked(self) -> int | None:
        """Alternatives per generated token the engine computes (None: no logprobs)."""
        return None

    def prompt_logprobs_asked(self) -> int | None:
        """Alternatives per prompt token the engine computes (None: none)."""
        return None

    def samples_drawn(self) -> int:
        """Samples drawn per prompt, of which ``n`` are returned."""
        return self.n

    def sampling_params(
        self, max_tokens: int, vocab_size: int, constraint: TokenConstraint | None = None
    ) -> SamplingParams:
        """The ``SamplingParams`` of one prompt (its ``n`` samples) with this request's
        fields, ``max_tokens`` as granted and ``constraint`` (structured output)."""
        best_of = self.samples_drawn()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=self.top_k,
            min_p=float(self.min_p),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            logit_bias=self.token_bias(vocab_size),
            min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            eos_token_id=[] if self.ignore_eos else None,
            seed=self.seed,
            logprobs=self.logprobs_asked(),
            prompt_logprobs=self.prompt_logprobs_asked(),
            n=self.n,
            best_of=best_of if best_of > self.n else None,
            constraint=constraint,
        )


class CompletionRequest(_RequestFields):
    """``POST /v1/completions``: one prompt or a batch (strings or token-id lists)."""

    prompt: Annotated[
        StrictStr | list[StrictStr] | list[Integer] | list[list[Integer]],
        BeforeValidator(_prompt_form),
    ]
    echo: StrictBool = False
    logprobs: Integer | None = None
    prompt_logprobs: Integer | None = None  # vLLM's extension
    best_of: Integer | None = None
    suffix: Annotated[None, BeforeValidator(_only_null("insertion (suffix)"))] = None

    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt as text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        _refuse_unless(bool(prompts), "prompt", "at least one prompt", prompt)
        for index, one in enumerate(prompts):
            if not one:
                where = "" if prompts[0] is prompt else f" at prompt[{index}]"
                raise ApiError(f"'prompt': expected non-empty strings or token lists, got an "
                               f"empty one{where}", param="prompt")  # fmt: skip
        return prompts

    def check(self, vocab_size: int) -> None:
        self.check_common(vocab_size)
        if self.max_tokens is not None:
            _refuse_unless(self.max_tokens >= 1 or (self.max_tokens == 0 and self.echo),
                           "max_tokens", "an integer >= 1 (0 only with echo)",
                           self.max_tokens)  # fmt: skip
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _refuse_unless(value is None or 0 <= value <= MAX_LOGPROBS, name,
                           f"an integer in [0, {MAX_LOGPROBS}]", value)  # fmt: skip
        if self.stream and self.prompt_logprobs is not None:
            raise ApiError(
                "'prompt_logprobs': not available with 'stream': true (as in vLLM); use echo "
                f"with logprobs to stream the prompt's logprobs, got {self.prompt_logprobs}",
                param="prompt_logprobs",
            )
        best_of = self.samples_drawn()
        _refuse_unless(best_of >= self.n, "best_of", f"an integer >= n ({self.n})", best_of)
        if self.stream and best_of > self.n:
            raise ApiError(
                "'best_of': a stream cannot carry best_of > n (the best are known only at the "
                f"end), got best_of {best_of} with n {self.n}",
                param="best_of",
            )
        prompts = len(self.prompts())
        many = "prompt" if prompts > 1 else ("best_of" if self.best_of is not None else "n")
        _refuse_unless(prompts * best_of <= MAX_CHOICES, many,
                       f"prompts x best_of <= {MAX_CHOICES}", prompts * best_of)  # fmt: skip

    def samples_drawn(self) -> int:
        return self.n if self.best_of is None else self.best_of

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        """Prompt logprobs the engine computes: vLLM's ``prompt_logprobs``, or ``logprobs``
        when ``echo`` returns the prompt with them."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


def _text_parts_only(value):
    """A content list with a part other than text (an image, audio, a file) is refused by
    what it is; pydantic alone would report the first form of the union it tried
    (``'messages.0.content.str': Input should be a valid string``)."""
    if isinstance(value, list):
        for index, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise PydanticCustomError(
                    "content_part",
                    "only text parts are supported, got a part of type {kind} at content[{index}]",
                    {"kind": json.dumps(kind), "index": index},
                )
    return value


class ChatMessage(_Strict):
    """A message; ``content`` is a string, a list of text parts (joined with newlines) or,
    for an assistant, null."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[StrictStr | list[TextPart] | None, BeforeValidator(_text_parts_only)] = None
    name: StrictStr | None = None
    # Tool use is not supported: these are accepted only when absent or null/empty.
    tool_calls: list[Any] | None = None
    tool_call_id: StrictStr | None = None
    function_call: None = None
    refusal: StrictStr | None = None

    def for_template(self) -> dict:
        """The message as a chat template reads it: content as one string."""
        if self.tool_calls:
            raise ApiError("'messages.tool_calls': tool calls are not supported", param="messages")
        if self.role == "tool":
            raise ApiError("'messages.role': tool messages are not supported", param="messages")
        if self.content is None and self.role != "assistant":
            raise ApiError(
                f"'messages.content': expected a string or text parts for role '{self.role}', "
                "got null",
                param="messages",
            )
        if isinstance(self.content, list):
            content = "\n".join(part.text for part in self.content)
        else:
            content = self.content or ""
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


def _only(allowed: tuple, refusal: str):
    """A validator that passes the values of ``allowed`` (of their own JSON type: 0 is not
    false) and refuses any other with ``refusal``, which says what the server takes (the
    error handler adds the value received, cut to length)."""

    def check(value):
        if any(value is each or (type(value) is type(each) and value == each) for each in allowed):
            return value
        raise PydanticCustomError("not_supported", refusal)

    return check


def _only_null(what: str):
    """``_only`` null, for a field asking for ``what``, which this server does not do."""
    return _only((None,), f"{what} is not supported by this server: expected null")


# A choice that asks for no tool call: "none", or "auto", which OpenAI defines as the same
# when no tools are given (and tools are refused).
_NO_TOOLS = 'tool calls are not supported by this server: expected "none" or "auto"'
NoToolCall = Annotated[
    Literal["none", "auto"] | None, BeforeValidator(_only((None, "none", "auto"), _NO_TOOLS))
]


class ChatCompletionRequest(_RequestFields):
    """``POST /v1/chat/completions``: messages rendered by the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = None
    logprobs: StrictBool = False
    top_logprobs: Integer | None = None
    # Tool use is not supported: accepted only in forms that ask for no tool call (no
    # tools; a choice of "none", or "auto", which without tools OpenAI defines as the
    # same; parallel calls allowed or not, as none is ever made).
    tools: list[Any] | None = None
    tool_choice: NoToolCall = None
    functions: list[Any] | None = None
    function_call: NoToolCall = None
    parallel_tool_calls: StrictBool | None = None
    # Accepted where they ask for what the server does anyway: store nothing, output text.
    store: Annotated[
        Literal[False] | None,
        BeforeValidator(_only((None, False),
                              "this server stores no completions: expected false or null")),
    ] = None  # fmt: skip
    modalities: Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None = None
    service_tier: Annotated[
        Literal["auto", "default"] | None,
        BeforeValidator(_only((None, "auto", "default"),
                              'this server has one tier: expected "auto", "default" or null')),
    ] = None  # fmt: skip
    # Tags for the operator, as ``user`` is (OpenAI's limits: 16 pairs, keys of up to 64
    # characters, values of up to 512); they do not change the output.
    metadata: (
        Annotated[
            dict[
                Annotated[StrictStr, Field(max_length=64)],
                Annotated[StrictStr, Field(max_length=512)],
            ],
            Field(max_length=16),
        ]
        | None
    ) = None
    # What the server does not do: only null (a client that sends every field) is taken.
    audio: Annotated[None, BeforeValidator(_only_null("audio output"))] = None
    prediction: Annotated[None, BeforeValidator(_only_null("a predicted output"))] = None
    reasoning_effort: Annotated[None, BeforeValidator(_only_null("reasoning effort"))] = None
    web_search_options: Annotated[None, BeforeValidator(_only_null("web search"))] = None
    # vLLM's chat template extensions.
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self) -> ChatTemplateOptions:
        """How the chat template renders the messages."""
        extra = dict(self.chat_template_kwargs or {})
        return ChatTemplateOptions(self.add_generation_prompt, self.continue_final_message, extra)

    def check(self, vocab_size: int) -> None:
        self.check_common(vocab_size)
        if self.tools or self.functions:
            raise ApiError("'tools': tool calls are not supported by this server", param="tools")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ApiError(
                f"'max_completion_tokens' ({self.max_completion_tokens}) and the deprecated "
                f"'max_tokens' ({self.max_tokens}) disagree; send one",
                param="max_completion_tokens",
            )
        limit_name, limit = self.token_limit()
        _refuse_unless(limit is None or limit >= 1, limit_name, "an integer >= 1",
                       limit)  # fmt: skip
        if self.top_logprobs is not None:
            _refuse_unless(self.logprobs, "top_logprobs", "to come with 'logprobs': true",
                           self.top_logprobs)  # fmt: skip
            _refuse_unless(0 <= self.top_logprobs <= MAX_LOGPROBS, "top_logprobs",
                           f"an integer in [0, {MAX_LOGPROBS}]", self.top_logprobs)  # fmt: skip
        _refuse_unless(self.n <= MAX_CHOICES, "n", f"an integer <= {MAX_CHOICES}", self.n)
        self.check_template_fields()

    def check_template_fields(self) -> None:
        """The two ways to end the prompt exclude each other, a continued message must be
        the assistant's, and the template's own variables cannot be overridden."""
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ApiError(
                    "'continue_final_message': true continues the last message, so it needs "
                    "'add_generation_prompt': false, got both true",
                    param="continue_final_message",
                )
            last = self.messages[-1].role
            if last != "assistant":
                raise ApiError(
                    "'continue_final_message': expected the last message to be the "
                    f"assistant's, to continue, got a last message of role '{last}'",
                    param="continue_final_message",
                )
        reserved = reserved_among(self.chat_template_kwargs or {})
        if reserved:
            raise ApiError(
                f"'chat_template_kwargs': expected variables other than the template's own "
                f"{list(TEMPLATE_VARIABLES)}, got {reserved}",
                param="chat_template_kwargs",
            )

    def token_limit(self) -> tuple[str, int | None]:
        """``max_completion_tokens``, or the deprecated ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
