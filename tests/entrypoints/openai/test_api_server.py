"""The OpenAI-compatible server, over real HTTP on 127.0.0.1 with the official client.

A real uvicorn server runs in a thread of this process (a subprocess for the start-up
test); every request loop is bounded and every server is shut down at the end.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest

from paddle_step.engine.arg_utils import build_engine
from paddle_step.entrypoints.openai import cli as serve
from paddle_step.sampling_params import SamplingParams
from paddle_step.testing.server_process import metric, serve_in_thread, server_process
from paddle_step.tokenizer.chat_template import ChatTemplateOptions

GOLDEN_LLAMA = Path(__file__).resolve().parents[2] / "data" / "hf-tiny" / "llama-tiny"
# ``greeting``: a variable of the template's own, as ``chat_template_kwargs`` sets it.
CHAT_TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPTS = [
    "Hello there",
    "The engine",
    "a b c d e f",
    "paged attention",
    "x",
    "Once upon",
    "def f(x):",
    "0 1 2 3 4 5 6 7 8 9",
]
SERVER_ARGS = [
    "--dtype",
    "float64",
    "--max-batch",
    "16",
    "--block-size",
    "4",
    "--max-model-len",
    "64",
    "--kv-blocks",
    "200",
    "--seed",
    "0",
    "--check-state",  # the engine process checks SPEC's invariants after every step
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The golden Llama with a chat template added (it ships none)."""
    folder = tmp_path_factory.mktemp("ckpt") / "llama-tiny"
    shutil.copytree(GOLDEN_LLAMA, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def served(checkpoint):
    args = serve.parse_args(["--model", str(checkpoint), *SERVER_ARGS])
    app, loop = serve.build_app(args)
    with serve_in_thread(app) as base_url:
        yield base_url, loop


@pytest.fixture(scope="module")
def offline(checkpoint):
    """Offline ``Engine.generate`` text for (prompt ids, max_tokens), same flags."""
    args = serve.parse_args(["--model", str(checkpoint), *SERVER_ARGS])
    engine, loaded = build_engine(args)
    tokenizer = loaded.tokenizer
    cache: dict = {}

    def text_of(prompt_ids: list[int], max_tokens: int) -> tuple[str, str, int]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            [result] = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens))
            reason = "length" if result.finish_reason == "length" else "stop"
            text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
            cache[key] = (text, reason, len(result.token_ids))
        return cache[key]

    text_of.tokenizer = tokenizer
    text_of.engine = engine
    return text_of


def client(base_url: str, **options):
    return openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60, **options
    )


def complete(api: openai.OpenAI, stream: bool, **request):
    """One completion, streamed (with the usage chunk) or whole: (text, finish_reason,
    usage)."""
    if not stream:
        response = api.completions.create(model="llama-tiny", **request)
        return response.choices[0].text, response.choices[0].finish_reason, response.usage
    chunks = list(
        api.completions.create(
            model="llama-tiny", stream=True, stream_options={"include_usage": True}, **request
        )
    )
    choices = [c.choices[0] for c in chunks if c.choices]
    return "".join(c.text for c in choices), choices[-1].finish_reason, chunks[-1].usage


def test_models_health_metrics(served):
    base_url, _loop = served
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    [model] = client(base_url).models.list().data
    assert model.id == "llama-tiny"
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    for name in (
        "paddle_step_kv_free_blocks",
        "paddle_step_kv_total_blocks",
        "paddle_step_requests_running",
        "paddle_step_requests_waiting",
        "paddle_step_preemptions_total",
        "paddle_step_generated_tokens_total",
    ):
        assert f"\n{name} " in metrics, name


@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_offline(served, offline, stream):
    base_url, _loop = served
    api = client(base_url)
    for prompt in PROMPTS[:4]:
        expected, reason, count = offline(offline.tokenizer.encode(prompt), 12)
        text, finish, usage = complete(api, stream, prompt=prompt, max_tokens=12, temperature=0)
        assert text == expected
        assert finish == reason
        assert usage.completion_tokens == count
        assert usage.prompt_tokens == len(offline.tokenizer.encode(prompt))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_offline(served, offline, stream):
    base_url, _loop = served
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    prompt_ids = offline.tokenizer.encode_chat(messages)
    expected, reason, _count = offline(prompt_ids, 10)
    api = client(base_url)
    if stream:
        chunks = list(
            api.chat.completions.create(
                model="llama-tiny", messages=messages, max_tokens=10, temperature=0, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        response = api.chat.completions.create(
            model="llama-tiny", messages=messages, max_tokens=10, temperature=0
        )
        text, finish = response.choices[0].message.content, response.choices[0].finish_reason
    assert (text, finish) == (expected, reason)


def test_stop_string_and_seeded_sampling(served, offline):
    base_url, _loop = served
    api = client(base_url)
    full, _reason, _count = offline(offline.tokenizer.encode(PROMPTS[0]), 20)
    stop = full[5:8]
    response = api.completions.create(
        model="llama-tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=[stop]
    )
    assert response.choices[0].text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    sampled = [
        api.completions.create(
            model="llama-tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0.8, seed=1234
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_kept_stop_string_ends_the_text(served, offline, stream):
    base_url, _loop = served
    full, _reason, _count = offline(offline.tokenizer.encode(PROMPTS[0]), 20)
    stop = full[5:8]
    text, finish, _usage = complete(client(base_url), stream, prompt=PROMPTS[0], max_tokens=20,
                                    temperature=0, stop=[stop],
                                    extra_body={"include_stop_str_in_output": True})  # fmt: skip
    assert (text, finish) == (full[: full.index(stop) + len(stop)], "stop")


def test_a_stop_token_adds_its_text_only_where_kept(served, offline):
    """As in vLLM: the token of ``stop_token_ids`` (or the eos) that ends a choice is
    generated and counted, but its text is left out unless ``include_stop_str_in_output``."""
    base_url, _loop = served
    prompt_ids = offline.tokenizer.encode(PROMPTS[2])
    [result] = offline.engine.generate([prompt_ids], SamplingParams(max_tokens=12))
    stop_token = result.token_ids[3]
    ends_at = result.token_ids.index(stop_token)
    before = offline.tokenizer.decode(result.token_ids[:ends_at], skip_special_tokens=True)
    with_it = offline.tokenizer.decode(result.token_ids[: ends_at + 1], skip_special_tokens=True)
    assert with_it != before  # the token has text of its own
    for stream in (False, True):
        for kept, expected in ((False, before), (True, with_it)):
            extra = {"stop_token_ids": [stop_token], "include_stop_str_in_output": kept}
            text, finish, usage = complete(client(base_url), stream, prompt=PROMPTS[2],
                                           max_tokens=12, temperature=0,
                                           extra_body=extra)  # fmt: skip
            assert (text, finish, usage.completion_tokens) == (expected, "stop", ends_at + 1)


def test_special_tokens_show_where_not_skipped(served, offline):
    base_url, _loop = served
    eos = offline.tokenizer.eos_id
    request = {"prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0}
    forced = {"ignore_eos": True, "logit_bias": {str(eos): 100}}  # eos, eos, eos
    api = client(base_url)
    shown = api.completions.create(model="llama-tiny", **request,
                                   extra_body={**forced, "skip_special_tokens": False})  # fmt: skip
    expected = offline.tokenizer.decode([eos] * 3, skip_special_tokens=False)
    assert shown.choices[0].text == expected and expected
    skipped = api.completions.create(model="llama-tiny", **request, extra_body=forced)
    assert skipped.choices[0].text == ""


@pytest.mark.parametrize("keep", [1, 3])
def test_truncate_prompt_tokens_keeps_the_last_ones(served, offline, keep):
    base_url, _loop = served
    api = client(base_url)
    prompt_ids = offline.tokenizer.encode(PROMPTS[6])
    expected, reason, _count = offline(prompt_ids[-keep:], 8)
    response = api.completions.create(model="llama-tiny", prompt=PROMPTS[6], max_tokens=8,
                                      temperature=0, echo=True,
                                      extra_body={"truncate_prompt_tokens": keep})  # fmt: skip
    echoed = offline.tokenizer.decode(prompt_ids[-keep:])
    assert response.choices[0].text == echoed + expected
    assert response.usage.prompt_tokens == keep
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    chat_ids = offline.tokenizer.encode_chat(messages)
    expected, reason, _count = offline(chat_ids[-keep:], 8)
    chat = api.chat.completions.create(model="llama-tiny", messages=messages, max_tokens=8,
                                       temperature=0,
                                       extra_body={"truncate_prompt_tokens": keep})  # fmt: skip
    assert (chat.choices[0].message.content, chat.usage.prompt_tokens) == (expected, keep)


def test_truncate_prompt_tokens_takes_a_prompt_longer_than_the_context(served, offline):
    """What truncation is for: a text far past what the context can hold, refused before
    tokenizing without it, is cut to its last k tokens. -1 keeps the context's worth
    (vLLM's reading): a short prompt whole, a long one with no room left to generate."""
    base_url, _loop = served
    api = client(base_url)
    text = "The engine serves many requests at once. " * 1500  # 61 kB
    prompt_ids = offline.tokenizer.encode(text)
    expected, _reason, _count = offline(prompt_ids[-5:], 8)
    keep_5, keep_context = {"truncate_prompt_tokens": 5}, {"truncate_prompt_tokens": -1}
    response = api.completions.create(model="llama-tiny", prompt=text, max_tokens=8,
                                      temperature=0, extra_body=keep_5)  # fmt: skip
    assert (response.choices[0].text, response.usage.prompt_tokens) == (expected, 5)
    messages = [{"role": "user", "content": text}]
    chat_ids = offline.tokenizer.encode_chat(messages)
    expected, _reason, _count = offline(chat_ids[-5:], 8)
    chat = api.chat.completions.create(model="llama-tiny", messages=messages, max_tokens=8,
                                       temperature=0, extra_body=keep_5)  # fmt: skip
    assert (chat.choices[0].message.content, chat.usage.prompt_tokens) == (expected, 5)
    with pytest.raises(openai.BadRequestError, match="longer than the model's context"):
        api.completions.create(model="llama-tiny", prompt=text, max_tokens=8)
    with pytest.raises(openai.BadRequestError, match=r"\(64 tokens\) leaves no room"):
        api.completions.create(model="llama-tiny", prompt=text, max_tokens=8,
                               extra_body=keep_context)  # fmt: skip
    short_ids = offline.tokenizer.encode(PROMPTS[6])
    expected, _reason, _count = offline(short_ids, 8)
    whole = api.completions.create(model="llama-tiny", prompt=PROMPTS[6], max_tokens=8,
                                   temperature=0, extra_body=keep_context)  # fmt: skip
    assert (whole.choices[0].text, whole.usage.prompt_tokens) == (expected, len(short_ids))


CONTINUED = [
    {"role": "user", "content": "Hello, who are you?"},
    {"role": "assistant", "content": "I am"},
]


@pytest.mark.parametrize(
    "fields, options",
    [
        ({"add_generation_prompt": False}, ChatTemplateOptions(add_generation_prompt=False)),
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True),
        ),
        (
            {"chat_template_kwargs": {"greeting": "Hi!"}},
            ChatTemplateOptions(extra={"greeting": "Hi!"}),
        ),
    ],
)
def test_chat_template_fields_render_as_offline(served, offline, fields, options):
    base_url, _loop = served
    prompt_ids = offline.tokenizer.encode_chat(CONTINUED, options)
    assert prompt_ids != offline.tokenizer.encode_chat(CONTINUED)  # the fields change it
    expected, reason, _count = offline(prompt_ids, 8)
    response = client(base_url).chat.completions.create(
        model="llama-tiny", messages=CONTINUED, max_tokens=8, temperature=0, extra_body=fields
    )
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert (response.choices[0].message.content, response.choices[0].finish_reason) == (
        expected,
        reason,
    )


BAD_REQUESTS = [
    ("malformed JSON", b"{not json", "malformed JSON body at character 1"),
    ("empty body", b"", "got an empty body"),
    ("a JSON list", b"[1, 2]", "expected a JSON object body, got a list"),
    ("JSON null", b"null", "expected a JSON object body, got null"),
    ("not UTF-8", b'{"prompt": "\xff"}', "the body is not UTF-8 text: 'utf-8' codec can't decode"),
    (
        "nested too deeply",
        b'{"prompt": "hi", "logit_bias": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "the body's JSON is nested too deeply to parse",
    ),
    (
        "curl -d's form type",
        (b'{"prompt": "hi"}', "application/x-www-form-urlencoded"),
        "Content-Type application/json, got Content-Type 'application/x-www-form-urlencoded'",
    ),
    ("wrong type", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("max_tokens < 1", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("too long", {"prompt": "hi " * 40, "max_tokens": 60}, "context"),
    ("temperature", {"prompt": "hi", "temperature": 2.5}, "temperature"),
    ("top_p", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("n < 1", {"prompt": "hi", "n": 0}, "'n'"),
    (
        "unknown field",
        {"prompt": "hi", "frobnicate": [1, "a"]},
        "'frobnicate': Extra inputs are not permitted, got [1, \"a\"]",
    ),
    ("suffix", {"prompt": "hi", "suffix": "x"}, "suffix"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("ids past the embedding", {"prompt": [5, 400]}, "token ids must be in [0, 400)"),
    # Refused before anything streams (the engine's own checks would answer a stream with
    # 200 and then an error event).
    (
        "stream_options unstreamed",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        "'stream_options': only allowed with 'stream': true",
    ),
    (
        "prompt_logprobs streamed",
        {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
        "'prompt_logprobs': not available with 'stream': true",
    ),
    (
        "301 logit_bias entries",
        {"prompt": "hi", "stream": True, "logit_bias": {str(token): 1 for token in range(301)}},
        "'logit_bias': expected at most 300 entries, got '301 entries'",
    ),
    (
        "9 stop_token_ids",
        {"prompt": "hi", "stream": True, "stop_token_ids": list(range(9))},
        "'stop_token_ids': expected at most 8 token ids, got '9 ids'",
    ),
    (
        "min_tokens over max_tokens",
        {"prompt": "hi", "max_tokens": 3, "min_tokens": 10},
        "'min_tokens': expected an integer <= 'max_tokens' (3), got 10",
    ),
    (
        "min_tokens over the context",
        {"prompt": "hi", "min_tokens": 70},
        "'min_tokens' (70) exceeds the",
    ),
    # The field by its name: pydantic's location says which member of a union it tried.
    # Every form the field takes, not only the union member pydantic tried first.
    (
        "number as a word",
        {"prompt": "hi", "temperature": "hot"},
        "'temperature': Input should be a valid integer or a valid number, got \"hot\"",
    ),
    (
        "bias as a word",
        {"prompt": "hi", "logit_bias": {"5": "up"}},
        "'logit_bias.5': Input should be a valid integer or a valid number",
    ),
    ("stop as a number", {"prompt": "hi", "stop": 5}, "'stop': Input should be a valid string or"),
    (
        "a long value, cut",
        {"prompt": "hi", "suffix": "y" * 500},
        f"'suffix': insertion (suffix) is not supported by this server: expected null, "
        f'got "{"y" * 76}...',
    ),
    (
        "best_of with a schema",
        {"prompt": "hi", "best_of": 2, "response_format": {"type": "json_object"}},
        "structured output draws one sample per prompt, got n 1 and best_of 2",
    ),
]


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("store", 0, "'store': this server stores no completions: expected false or null, got 0"),
        ("service_tier", "flex",
         "'service_tier': this server has one tier: expected \"auto\", \"default\" or null, "
         "got \"flex\""),
        ("audio", {"voice": "alloy"},
         "'audio': audio output is not supported by this server: expected null, got "
         "{\"voice\": \"alloy\"}"),
    ],
)  # fmt: skip
def test_a_chat_field_the_server_does_not_do_gets_400_naming_what_it_takes(
    served, field, value, message
):
    base_url, _loop = served
    body = {"model": "llama-tiny", "messages": [{"role": "user", "content": "hi"}], field: value}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == message
    assert response.json()["error"]["param"] == field


@pytest.mark.parametrize("what,body,message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_400_and_server_keeps_serving(served, what, body, message):
    base_url, _loop = served
    if isinstance(body, dict):
        response = httpx.post(
            f"{base_url}/v1/completions", json={"model": "llama-tiny", **body}, timeout=30
        )
    else:
        content, content_type = body if isinstance(body, tuple) else (body, "application/json")
        response = httpx.post(
            f"{base_url}/v1/completions",
            content=content,
            headers={"content-type": content_type},
            timeout=30,
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] and error["code"] == 400
    if not isinstance(body, dict):  # the body as a whole, no field to name
        assert error["param"] is None
    else:  # no union member's name ('temperature.int') in what names the field
        assert error["param"] is None or error["param"].split(".")[-1] not in ("int", "str")
    good = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": "llama-tiny", "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )
    assert good.status_code == 200


@pytest.mark.parametrize(
    "path, body",
    [
        ("completions", {"prompt": "hi"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_a_model_not_served_gets_404_and_server_keeps_serving(served, path, body):
    base_url, _loop = served
    response = httpx.post(f"{base_url}/v1/{path}", json={"model": "gpt-4", **body}, timeout=30)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == 404 and error["type"] == "model_not_found" and error["param"] == "model"
    assert "'model': expected 'llama-tiny', got 'gpt-4'" in error["message"]
    good = httpx.post(f"{base_url}/v1/{path}", json={"model": "llama-tiny", **body}, timeout=30)
    assert good.status_code == 200


@pytest.mark.parametrize(
    "method, path, allowed",
    [
        ("DELETE", "/v1/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("TRACE", "/health", "GET"),
    ],
)
def test_a_wrong_method_gets_405_naming_the_allowed_ones(served, method, path, allowed):
    base_url, _loop = served
    response = httpx.request(method, f"{base_url}{path}", timeout=30)
    assert response.status_code == 405, response.text
    assert response.headers["allow"] == allowed  # RFC 9110: a 405 lists what the path takes
    error = response.json()["error"]
    assert error["code"] == 405
    assert error["message"] == f"{path} takes {allowed}, got {method}"


def test_concurrent_streams_with_cancellations(served, offline):
    """64 concurrent streaming clients, 400 requests, 20% closed mid-stream."""
    base_url, loop = served
    rng = random.Random(7)
    plan = [
        (PROMPTS[rng.randrange(len(PROMPTS))], rng.randint(4, 24), rng.random() < 0.2)
        for _ in range(400)
    ]
    expected = {(p, n): offline(offline.tokenizer.encode(p), n) for p, n, _ in plan}
    api = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64)),
    )

    async def one(prompt, max_tokens, cancel, gate):
        async with gate:
            stream = await api.completions.create(
                model="llama-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
            )
            pieces, finish = [], None
            async for chunk in stream:
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                if cancel and len(pieces) >= 2:
                    await stream.close()
                    return None
            return "".join(pieces), finish

    async def run_all():
        gate = asyncio.Semaphore(64)
        return await asyncio.wait_for(
            asyncio.gather(*(one(p, n, c, gate) for p, n, c in plan)), timeout=600
        )

    outcomes = asyncio.run(run_all())
    for (prompt, max_tokens, cancel), outcome in zip(plan, outcomes):
        if not cancel:
            text, reason, _count = expected[(prompt, max_tokens)]
            assert outcome == (text, reason), (prompt, max_tokens)

    # Cancelled requests must have given back their slot and blocks.
    deadline = time.monotonic() + 30
    while metric(base_url, "paddle_step_requests_running") or metric(
        base_url, "paddle_step_requests_waiting"
    ):
        assert time.monotonic() < deadline, "requests still held after every client left"
        time.sleep(0.1)
    assert metric(base_url, "paddle_step_kv_free_blocks") == metric(
        base_url, "paddle_step_kv_total_blocks"
    )
    assert metric(base_url, "paddle_step_kv_encoder_free_blocks") == metric(
        base_url, "paddle_step_kv_encoder_total_blocks"
    )
    # --check-state raised nothing in any step (it would have failed the engine).
    assert loop.healthy and httpx.get(f"{base_url}/health", timeout=10).status_code == 200


def test_server_process_starts_and_answers_health():
    with server_process(timeout_s=120) as url:  # the shipped model, default flags
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == "pydoc-tiny"


@pytest.mark.parametrize("stream", [False, True])
def test_usage_reports_prompt_tokens_from_the_prefix_cache(served, offline, stream):
    """The second of two equal prompts finds its full blocks (4 tokens each, the last
    token always computed) cached; the counters count both lookups."""
    base_url, _loop = served
    api = client(base_url)
    prompt = f"{'streamed' if stream else 'whole'}: prefix caching sees the same words twice"
    prompt_len = len(offline.tokenizer.encode(prompt))
    queries, hits = (
        metric(base_url, f"paddle_step_prefix_cache_{n}_total") for n in ("queries", "hits")
    )
    cached = []
    for _ in range(2):
        _text, _finish, usage = complete(api, stream, prompt=prompt, max_tokens=3)
        cached.append(usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, (prompt_len - 1) // 4 * 4]
    assert metric(base_url, "paddle_step_prefix_cache_queries_total") == queries + 2 * prompt_len
    assert metric(base_url, "paddle_step_prefix_cache_hits_total") == hits + cached[1]
