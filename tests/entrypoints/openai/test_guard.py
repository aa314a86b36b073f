"""What a client cannot get past: the API key, the body size limit, the waiting-queue
limit, prompts longer than the context, and text that is not Unicode. Each refusal is in
OpenAI's error format, and the next request succeeds. One real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from paddle_step.testing.server_process import spawn_server

KEY = "test-key-0123"
MAX_REQUEST_BYTES = 200_000
MAX_BATCH, MAX_WAITING = 2, 2
FLAGS = [
    "--api-key", KEY,
    "--max-request-bytes", str(MAX_REQUEST_BYTES),
    "--max-batch", str(MAX_BATCH),
    "--max-waiting", str(MAX_WAITING),
    "--max-model-len", "256",
]  # fmt: skip
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def url():
    with spawn_server(FLAGS) as server:
        yield server.url


def post(url: str, body, path: str = "/v1/completions", headers=AUTH) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def check_error(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] and words in error["message"], error


def check_serving(url: str) -> None:
    good = post(url, {"model": "pydoc-tiny", "prompt": "A list is", "max_tokens": 3})
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Bearer"}],
    ids=["none", "wrong", "no-bearer", "empty"],
)
def test_v1_needs_the_api_key(url, headers):
    body = {"model": "pydoc-tiny", "prompt": "A list is", "max_tokens": 3}
    check_error(post(url, body, headers=headers), 401, "API key")
    response = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
    check_error(response, 401, "API key")
    assert response.headers["www-authenticate"] == "Bearer"
    check_serving(url)


def test_the_bearer_scheme_is_case_insensitive(url):
    body = {"model": "pydoc-tiny", "prompt": "A list is", "max_tokens": 3}
    for scheme in ("bearer", "BEARER"):
        response = post(url, body, headers={"Authorization": f"{scheme} {KEY}"})
        assert response.status_code == 200, response.text
    check_error(post(url, body, headers={"Authorization": f"Basic {KEY}"}), 401, "API key")


def test_health_and_metrics_stay_open(url):
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    metrics = httpx.get(f"{url}/metrics", timeout=10)
    assert metrics.status_code == 200 and "paddle_step_kv_free_blocks" in metrics.text
    assert httpx.get(f"{url}/v1/models", headers=AUTH, timeout=10).status_code == 200


def test_body_over_the_limit_gets_413(url):
    body = {"model": "pydoc-tiny", "prompt": "x" * MAX_REQUEST_BYTES, "max_tokens": 3}
    check_error(post(url, body), 413, f"limit of {MAX_REQUEST_BYTES} bytes")

    def chunked():  # no content-length: the limit holds while reading
        yield b'{"model": "pydoc-tiny", "prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 10_000 + 1):
            yield b"y" * 10_000
        yield b'"}'

    response = httpx.post(
        f"{url}/v1/completions",
        content=chunked(),
        headers={**AUTH, "content-type": "application/json"},
        timeout=60,
    )
    check_error(response, 413, "limit")
    check_serving(url)


def test_prompt_longer_than_the_context_gets_400_without_tokenizing(url):
    # 150 kB of text is far past what 256 tokens of this tokenizer can hold.
    for path, body in [
        ("/v1/completions", {"prompt": "The for statement " * 8_000}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab " * 50_000}]}),
    ]:
        response = post(url, {"model": "pydoc-tiny", "max_tokens": 3, **body}, path)
        check_error(response, 400, "longer than the model's context of 256 tokens")
    check_serving(url)


async def _hold_one(client: httpx.AsyncClient, url: str, body: dict, opened: asyncio.Event):
    """Streams one completion; sets ``opened`` once the server has queued it (a streamed
    response's headers come after the submit) and returns its completion tokens and when
    its last chunk came."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200, await r.aread()
        opened.set()
        usage = None
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[len("data: ") :]).get("usage") or usage
    return usage["completion_tokens"], time.monotonic()


def test_more_than_max_waiting_gets_429_with_retry_after(url):
    held = MAX_BATCH + MAX_WAITING  # requests in flight the server takes
    long = {"model": "pydoc-tiny", "prompt": "A list is", "max_tokens": 240, "ignore_eos": True}
    short = {"model": "pydoc-tiny", "prompt": "A list is", "max_tokens": 3}

    async def fill_then_overflow():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as c:
            holders = []
            for _ in range(held):  # one after the other: each is in flight once it opens
                opened = asyncio.Event()
                holders.append(asyncio.create_task(_hold_one(c, url, long, opened)))
                await asyncio.wait_for(opened.wait(), 120)
            overflow = await asyncio.gather(
                *(c.post(f"{url}/v1/completions", json=short, headers=AUTH) for _ in range(3))
            )
            answered = time.monotonic()
            return overflow, answered, await asyncio.gather(*holders)

    # The server holds the four only until the first two finish (~240 steps of a tiny
    # model); a run where one finished before the overflow was answered proves nothing
    # and is tried again.
    for _attempt in range(3):
        overflow, answered, held_runs = asyncio.run(fill_then_overflow())
        assert [tokens for tokens, _ in held_runs] == [240] * held
        if all(ended > answered for _, ended in held_runs):
            break
    else:
        pytest.fail("in 3 tries a held request always finished before the overflow's answers")
    for response in overflow:
        check_error(response, 429, "retry later")
        assert response.headers["retry-after"] == "1"
    check_serving(url)


@pytest.mark.parametrize(
    "fields,param",
    [({"prompt": ["A list is"] * (MAX_BATCH + MAX_WAITING + 1)}, "prompt"),
     ({"n": MAX_BATCH + MAX_WAITING + 1}, "n"),
     ({"best_of": MAX_BATCH + MAX_WAITING + 1}, "best_of")],
    ids=["prompts", "n", "best_of"],
)  # fmt: skip
def test_more_sequences_than_the_server_holds_get_400_not_429(url, fields, param):
    """A request that could never fit (each prompt's each sample takes a slot) is refused
    for good: a 429 would have its client retry forever."""
    body = {"model": "pydoc-tiny", "prompt": "A list is", "max_tokens": 3, **fields}
    response = post(url, body)
    check_error(response, 400, f"more than the server ever holds: --max-batch + --max-waiting "
                               f"= {MAX_BATCH + MAX_WAITING}")  # fmt: skip
    assert response.json()["error"]["param"] == param
    fits = {**body, **{key: value[:-1] if key == "prompt" else value - 1
                       for key, value in fields.items()}}  # fmt: skip
    assert post(url, fits).status_code == 200
    check_serving(url)


SURROGATE = "x\ud800y"
SURROGATE_BODIES = {
    "prompt": ("/v1/completions", {"prompt": SURROGATE}),
    "prompt-list": ("/v1/completions", {"prompt": [SURROGATE]}),
    "stop": ("/v1/completions", {"prompt": "hi", "stop": SURROGATE}),
    "stop-list": ("/v1/completions", {"prompt": "hi", "stop": ["a", SURROGATE]}),
    "model": ("/v1/completions", {"prompt": "hi", "model": SURROGATE}),
    "user": ("/v1/completions", {"prompt": "hi", "user": SURROGATE}),
    # A dict key (unknown fields are refused by name before this check).
    "dict-key": ("/v1/completions", {"prompt": "hi", "logit_bias": {SURROGATE: 1}}),
    "chat-content": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": SURROGATE}]},
    ),
    "chat-model": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "model": SURROGATE},
    ),
    "chat-stop": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stop": [SURROGATE]},
    ),
    "chat-user": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "user": SURROGATE},
    ),
}


@pytest.mark.parametrize("field", list(SURROGATE_BODIES))
def test_a_lone_surrogate_in_any_string_gets_400(url, field):
    path, fields = SURROGATE_BODIES[field]
    body = {"model": "pydoc-tiny", "max_tokens": 3, **fields}
    raw = json.dumps(body).encode()  # ASCII JSON: the surrogate travels as \ud800
    assert b"\\ud800" in raw
    response = httpx.post(
        f"{url}{path}",
        content=raw,
        headers={**AUTH, "content-type": "application/json"},
        timeout=60,
    )
    check_error(response, 400, "lone surrogate")
    check_serving(url)
