"""What every ``/v1/*`` request must pass before FastAPI parses it: the API key, an engine
that takes requests, and the body size limit.

A pure ASGI middleware, so a refused request is answered before its body is read, and a
body over the limit is never read past the limit (let alone parsed). ``/health``,
``/metrics`` and the OpenAPI pages stay open.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...engine.core_client import EngineLoop
from .protocol import ApiError

__all__ = ["RequestGuard"]


class RequestGuard:
    """``api_key``: every ``/v1/*`` request needs ``Authorization: Bearer <api_key>``
    (401 otherwise; None lets all in). ``max_request_bytes``: the largest body taken
    (413 beyond it). A POST while ``loop`` takes no requests gets 503 at once."""

    def __init__(
        self, app: ASGIApp, *, loop: EngineLoop, api_key: str | None, max_request_bytes: int
    ) -> None:
        self.app = app
        self.loop = loop
        self.expected = None if api_key is None else api_key.encode()
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected is not None and not hmac.compare_digest(
            _bearer_token(headers.get(b"authorization", b"")), self.expected
        ):
            error = ApiError("missing or wrong API key (Authorization: Bearer KEY)", status=401)
            await _answer(error, scope, receive, send, {"WWW-Authenticate": "Bearer"})
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if not self.loop.healthy:
            error = ApiError(str(self.loop.refusal), status=503, kind="service_unavailable")
            await _answer(error, scope, receive, send)
            return
        too_large = ApiError(
            f"the request body exceeds the server's limit of {self.max_request_bytes} bytes",
            status=413,
        )
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            await _answer(too_large, scope, receive, send)
            return
        body = await _read_body(receive, self.max_request_bytes)
        if body is None:
            await _answer(too_large, scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it is found to exceed ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: an empty body ends it
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body read already, then the client's own messages
    (so a disconnect still reaches the handler)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(
    error: ApiError, scope: Scope, receive: Receive, send: Send, headers: dict | None = None
) -> None:
    await JSONResponse(error.body(), status_code=error.status, headers=headers)(
        scope, receive, send
    )


def _bearer_token(authorization: bytes) -> bytes:
    """The credentials of a Bearer ``Authorization`` header; b"" for any other. The scheme
    is case-insensitive (RFC 9110): ``bearer KEY`` counts."""
    scheme, _, token = authorization.partition(b" ")
    return token.strip(b" ") if scheme.lower() == b"bearer" else b""
