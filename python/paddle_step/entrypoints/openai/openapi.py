"""The OpenAPI document as the server behaves: FastAPI's, amended with what it cannot
know from the request models.

- The bounds the server enforces on request fields (``max_tokens``, the sampling
  controls, ``n``, ``logprobs``, the served ``model``, non-empty prompts and stop strings,
  token ids within the vocabulary, the number of ``logit_bias`` entries and
  ``stop_token_ids``).
- The error statuses it answers, all in OpenAI's error shape: 400 for any invalid request
  (FastAPI's 422 never happens), 404 for a model it does not serve, 401 with an API key,
  413, 429 and 503; ``/health``'s 503.
- The rules between fields JSON Schema can state: ``stream_options`` only with a stream,
  ``response_format``'s ``json_schema`` exactly with its type, one kind of
  ``structured_outputs`` and one constraint a request, no ``min_tokens`` with one.
- That streams are ``text/event-stream`` and ``/metrics`` is Prometheus text.

Some checks compare values of several fields (the prompt's tokens plus ``max_tokens``
within the context, say): a request the schema allows can still get 400 for these, as the
400 response's description says. Without a chat template the chat endpoint is left out.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ...sampling_params import MAX_LOGPROBS
from .protocol import (
    FLOAT32_LARGEST,
    FLOAT32_SMALLEST,
    MAX_CHOICES,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_TOKEN_IDS,
    StructuredOutputs,
)

__all__ = ["install_openapi"]

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}

# One server-sent event: its data is a JSON chunk (or an error object), the last one
# "[DONE]".
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}},
}

# Rules between fields of a request body, in JSON Schema's if/then.
_STREAM_OPTIONS_NEED_STREAM = {  # stream_options (not null) only with stream true
    "if": {"properties": {"stream_options": {"type": "object"}}, "required": ["stream_options"]},
    "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
}
_ZERO_TOKENS_NEED_ECHO = {  # a completion's max_tokens 0 only with echo
    "if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
    "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]},
}
_PROMPT_LOGPROBS_UNSTREAMED = {  # prompt_logprobs (not null) only without stream
    "if": {"properties": {"prompt_logprobs": {"type": "integer"}}, "required": ["prompt_logprobs"]},
    "then": {"properties": {"stream": {"const": False}}},
}
_TOP_LOGPROBS_NEED_LOGPROBS = {  # chat's top_logprobs (not null) only with logprobs true
    "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}
_NOT_NULL = {"not": {"type": "null"}}
# response_format: json_schema (with its schema) exactly with type json_schema.
_JSON_SCHEMA_WITH_ITS_TYPE = {
    "if": {"properties": {"type": {"const": "json_schema"}}},
    "then": {
        "required": ["json_schema"],
        "properties": {
            "json_schema": {"required": ["schema"], "properties": {"schema": {"type": "object"}}}
        },
    },
    "else": {"properties": {"json_schema": {"type": "null"}}},
}
# Its fields as JSON names them (``json`` is an alias).
_STRUCTURED_OUTPUT_KINDS = [
    field.alias or name for name, field in StructuredOutputs.model_fields.items()
]
# structured_outputs: exactly one kind given (not null), json_object only as true.
_ONE_STRUCTURED_OUTPUT_KIND = [
    {
        "oneOf": [
            {"required": [kind], "properties": {kind: _NOT_NULL}}
            for kind in _STRUCTURED_OUTPUT_KINDS
        ]
    },
    {"properties": {"json_object": {"enum": [True, None]}}},
]
# A request that gives structured_outputs (not null).
_STRUCTURED_OUTPUTS_GIVEN = {
    "required": ["structured_outputs"],
    "properties": {"structured_outputs": _NOT_NULL},
}
_CONSTRAINED = {  # a request whose output is constrained (structured_outputs or JSON)
    "anyOf": [
        _STRUCTURED_OUTPUTS_GIVEN,
        {
            "required": ["response_format"],
            "properties": {
                "response_format": {
                    "required": ["type"],
                    "properties": {"type": {"enum": ["json_object", "json_schema"]}},
                }
            },
        },
    ]
}
_CONSTRAINTS_ALONE = [
    {  # one constraint: structured_outputs with a plain-text response_format at most
        "if": _STRUCTURED_OUTPUTS_GIVEN,
        "then": {
            "properties": {
                "response_format": {
                    "anyOf": [
                        {"type": "null"},
                        {"properties": {"type": {"const": "text"}}},
                    ]
                }
            }
        },
    },
    {  # min_tokens does not hold a grammar open: 0 (or absent) with a constraint
        "if": _CONSTRAINED,
        "then": {"properties": {"min_tokens": {"const": 0}}},
    },
]
_CONTENT_UNLESS_ASSISTANT = {  # content may be null (or absent) for an assistant only
    "if": {"properties": {"role": {"const": "assistant"}}},
    "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
}

_ERRORS = {
    "400": "Invalid request: a field out of its bounds, malformed JSON, a string that is not "
    "Unicode text, or a check the schema cannot express: the prompt's tokens plus "
    "max_tokens beyond the context, prompts x n (or best_of) past the choices one request "
    "may ask for, max_tokens and max_completion_tokens that disagree, a structured output "
    "its compiler refuses.",
    "401": "Missing or wrong API key (Authorization: Bearer KEY).",
    "404": "No model of that id is served.",
    "413": "The request body exceeds the server's limit.",
    "429": "Too many requests waiting for a batch slot; retry after Retry-After seconds.",
    "503": "The engine has failed or the server is shutting down.",
}


def install_openapi(
    app: FastAPI,
    *,
    model_name: str,
    max_model_len: int,
    vocab_size: int,
    api_key: bool,
    chat: bool,
) -> None:
    """Makes ``app.openapi()`` return the amended document (built once, on first use).
    ``chat`` False (a checkpoint without a chat template, whose chat requests all get
    400) leaves ``/v1/chat/completions`` out of it."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _amend(document, model_name, max_model_len, vocab_size, api_key)
            if not chat:
                document["paths"].pop("/v1/chat/completions", None)
                document["components"]["schemas"].pop("ChatCompletionRequest", None)
                document["components"]["schemas"].pop("ChatMessage", None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi


def _amend(
    document: dict, model_name: str, max_model_len: int, vocab_size: int, api_key: bool
) -> None:
    schemas = document.get("components", {}).get("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    bounds = {
        "model": {"string": {"enum": [model_name]}},
        # 0 only for completions with echo (the prompt's logprobs alone).
        "max_tokens": {"number": {"minimum": 0, "maximum": max_model_len - 1}},
        "max_completion_tokens": {"number": {"minimum": 1, "maximum": max_model_len - 1}},
        "temperature": {"number": {"minimum": 0, "maximum": 2}},
        "top_p": {"number": {"minimum": FLOAT32_SMALLEST, "maximum": 1}},
        "top_k": {"number": {"minimum": -1}},
        "min_p": {"number": {"minimum": 0, "maximum": 1}},
        "presence_penalty": {"number": {"minimum": -2, "maximum": 2}},
        "frequency_penalty": {"number": {"minimum": -2, "maximum": 2}},
        "repetition_penalty": {"number": {"minimum": FLOAT32_SMALLEST, "maximum": FLOAT32_LARGEST}},
        # At most max_tokens, itself at most what the context leaves.
        "min_tokens": {"number": {"minimum": 0, "maximum": max_model_len - 1}},
        "seed": {"number": {"minimum": 0, "maximum": 2**63 - 1}},
        "stop_token_ids": {
            "number": {"minimum": 0, "maximum": vocab_size - 1},
            "array": {"maxItems": MAX_STOP_TOKEN_IDS},
        },
        "logit_bias": {
            "object": {
                "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
                "propertyNames": {"pattern": "^[0-9]+$"},
            },
        },
        "tools": {"array": {"maxItems": 0}},
        "functions": {"array": {"maxItems": 0}},
        "n": {"number": {"minimum": 1, "maximum": MAX_CHOICES}},
        "best_of": {"number": {"minimum": 1, "maximum": MAX_CHOICES}},
        "logprobs": {"number": {"minimum": 0, "maximum": MAX_LOGPROBS}},
        "top_logprobs": {"number": {"minimum": 0, "maximum": MAX_LOGPROBS}},
        "prompt_logprobs": {"number": {"minimum": 0, "maximum": MAX_LOGPROBS}},
        "stop": {"string": {"minLength": 1}},
        "prompt": {
            "string": {"minLength": 1},
            "number": {"minimum": 0, "maximum": vocab_size - 1},
            "array": {"minItems": 1},
            "array of string": {"maxItems": MAX_CHOICES},
            "array of integer": {"maxItems": max_model_len - 1},
            "array of array": {"maxItems": MAX_CHOICES},
        },
    }
    # Chat has no echo: its max_tokens is at least 1, as max_completion_tokens.
    chat_bounds = {"max_tokens": bounds["max_completion_tokens"]}
    for name, overrides in (("CompletionRequest", {}), ("ChatCompletionRequest", chat_bounds)):
        properties = schemas.get(name, {}).get("properties", {})
        for field, bound in {**bounds, **overrides}.items():
            if field in properties:
                _bound(properties[field], bound)
        rules = [_STREAM_OPTIONS_NEED_STREAM, *_CONSTRAINTS_ALONE]
        if name == "CompletionRequest":
            rules += [_ZERO_TOKENS_NEED_ECHO, _PROMPT_LOGPROBS_UNSTREAMED]
        else:
            rules.append(_TOP_LOGPROBS_NEED_LOGPROBS)
        if name in schemas:
            schemas[name]["allOf"] = rules
    if "ResponseFormat" in schemas:
        schemas["ResponseFormat"]["allOf"] = [_JSON_SCHEMA_WITH_ITS_TYPE]
    if "StructuredOutputs" in schemas:
        schemas["StructuredOutputs"]["allOf"] = _ONE_STRUCTURED_OUTPUT_KIND
    message = schemas.get("ChatMessage")
    if message is not None:  # tool messages and tool calls are refused
        message["properties"]["role"]["enum"].remove("tool")
        _bound(message["properties"]["tool_calls"], {"array": {"maxItems": 0}})
        message["allOf"] = [_CONTENT_UNLESS_ASSISTANT]
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if path.startswith("/v1/"):
                statuses = ["401"] if api_key else []
                if path.startswith("/v1/models/"):
                    statuses.append("404")
                if method == "post":
                    statuses = ["400", *statuses, "404", "413", "429", "503"]
                    responses["200"] = {
                        "description": "The completion, whole (JSON) or streamed (server-sent "
                        "events ending with data: [DONE]).",
                        "content": {
                            "application/json": {"schema": {"type": "object"}},
                            "text/event-stream": {"schema": _SSE_EVENT},
                        },
                    }
                for status in statuses:
                    responses[status] = _error_response(_ERRORS[status])
    health = document["paths"]["/health"]["get"]["responses"]
    health["200"] = _json_response("The engine takes requests.", {"type": "object"})
    health["503"] = _json_response(
        "The engine has failed or the server is shutting down.", {"type": "object"}
    )
    document["paths"]["/metrics"]["get"]["responses"] = {
        "200": {
            "description": "Prometheus text format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    }


def _bound(schema: dict, bound: dict) -> None:
    """Adds ``bound``'s keywords to each branch of ``schema`` by its type: ``string``,
    ``number`` (integers too), ``object``, ``array`` (and ``array of string`` etc. by item
    type); array items are bounded like values."""
    for branch in schema.get("anyOf", [schema]):
        kind = branch.get("type")
        if kind == "string":
            branch.update(bound.get("string", {}))
        elif kind == "object":
            branch.update(bound.get("object", {}))
        elif kind in ("integer", "number"):
            branch.update(bound.get("number", {}))
        elif kind == "array":
            branch.update(bound.get("array", {}))
            items = branch.get("items", {})
            branch.update(bound.get(f"array of {items.get('type')}", {}))
            _bound(items, bound)


def _error_response(description: str) -> dict:
    return _json_response(description, {"$ref": "#/components/schemas/ErrorResponse"})


def _json_response(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}
