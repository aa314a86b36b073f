"""The OpenAPI document as the server behaves: FastAPI's, amended with what it cannot
know from the request models.

- The bounds the server enforces on request fields (``max_tokens``, the sampling
  controls, ``n``, ``logprobs``, the served ``model``, non-empty prompts and stop strings,
  token ids within the vocabulary).
- The error statuses it answers, all in OpenAI's error shape: 400 for any invalid request
  (FastAPI's 422 never happens), 404 for a model it does not serve, 401 with an API key,
  413, 429 and 503; ``/health``'s 503.
- That streams are ``text/event-stream`` and ``/metrics`` is Prometheus text.

Some checks depend on more than one field (the prompt's tokens plus ``max_tokens`` within
the context): a request the schema allows can still get 400 for these, as the 400
response's description says. Without a chat template the chat endpoint is left out.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ...sampling_params import MAX_LOGPROBS
from .protocol import MAX_CHOICES

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

_ERRORS = {
    "400": "Invalid request: a field out of its bounds, malformed JSON, a string that is not "
    "Unicode text, or a check the schema cannot express (the prompt's tokens plus "
    "max_tokens beyond the context).",
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
        "top_p": {"number": {"exclusiveMinimum": 0, "maximum": 1}},
        "top_k": {"number": {"minimum": -1}},
        "min_p": {"number": {"minimum": 0, "maximum": 1}},
        "presence_penalty": {"number": {"minimum": -2, "maximum": 2}},
        "frequency_penalty": {"number": {"minimum": -2, "maximum": 2}},
        "repetition_penalty": {"number": {"exclusiveMinimum": 0}},
        "min_tokens": {"number": {"minimum": 0}},
        "seed": {"number": {"minimum": 0, "maximum": 2**63 - 1}},
        "stop_token_ids": {"number": {"minimum": 0, "maximum": vocab_size - 1}},
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
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = schemas.get(name, {}).get("properties", {})
        for field, bound in bounds.items():
            if field in properties:
                _bound(properties[field], bound)
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
    ``number`` (integers too), ``array`` (and ``array of string`` etc. by item type);
    array items are bounded like values."""
    for branch in schema.get("anyOf", [schema]):
        kind = branch.get("type")
        if kind == "string":
            branch.update(bound.get("string", {}))
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
