"""The server on the shipped model, through clients nobody here wrote: the official
``openai`` client and LangChain's ``ChatOpenAI``. Greedy answers are compared with the
offline engine's tokens for the same prompt."""

from __future__ import annotations

import httpx
import openai
import pytest

from paddle_step.engine.arg_utils import build_engine
from paddle_step.entrypoints.openai import cli as serve
from paddle_step.sampling_params import SamplingParams
from paddle_step.testing.server_process import serve_in_thread

MODEL = "pydoc-tiny"
SERVER_ARGS = ["--max-batch", "8", "--seed", "0", "--threads", "1"]
PROMPTS = ["A list is", "The for statement", "def "]


@pytest.fixture(scope="module")
def served():
    args = serve.parse_args(SERVER_ARGS)
    app, _loop = serve.build_app(args)
    with serve_in_thread(app) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def offline():
    """Greedy ``(text, finish_reason, tokens)`` of the offline engine, same flags."""
    engine, loaded = build_engine(serve.parse_args(SERVER_ARGS))
    tokenizer = loaded.tokenizer

    def generate(prompt_ids: list[int], max_tokens: int) -> tuple[str, str, int]:
        [result] = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens))
        reason = "length" if result.finish_reason == "length" else "stop"
        return tokenizer.decode(result.token_ids, True), reason, len(result.token_ids)

    generate.tokenizer = tokenizer
    return generate


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("as_ids", [False, True])
def test_batch_prompts_answer_in_order(served, offline, as_ids):
    prompts = [offline.tokenizer.encode(p) for p in PROMPTS] if as_ids else PROMPTS
    response = client(served).completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, temperature=0
    )
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    total = 0
    for prompt, choice in zip(PROMPTS, response.choices):
        text, reason, count = offline(offline.tokenizer.encode(prompt), 6)
        assert (choice.text, choice.finish_reason) == (text, reason)
        total += count
    assert response.usage.completion_tokens == total
    assert response.usage.prompt_tokens == sum(len(offline.tokenizer.encode(p)) for p in PROMPTS)


def test_batch_prompts_stream_each_choice_by_index(served, offline):
    texts = ["", "", ""]
    finished = {}
    for chunk in client(served).completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    for index, prompt in enumerate(PROMPTS):
        text, reason, _count = offline(offline.tokenizer.encode(prompt), 6)
        assert (texts[index], finished[index]) == (text, reason)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_the_prompt(served, offline, max_tokens):
    response = client(served).completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0, echo=True
    )
    generated, _reason, count = (
        offline(offline.tokenizer.encode(PROMPTS[0]), 1) if max_tokens else ("", "length", 0)
    )
    assert response.choices[0].text == PROMPTS[0] + generated
    assert response.usage.completion_tokens == count


def test_models_retrieve(served):
    api = client(served)
    assert api.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4")


def test_chat_content_parts_null_assistant_and_max_completion_tokens(served, offline):
    api = client(served)
    messages = [
        {"role": "system", "content": "You document Python."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "And a tuple?"},
    ]
    as_parts = [
        {**m, "content": [{"type": "text", "text": m["content"]}]} if m["content"] else m
        for m in messages
    ]
    expected_ids = offline.tokenizer.encode_chat(
        [{**m, "content": m["content"] or ""} for m in messages]
    )
    text, reason, count = offline(expected_ids, 8)
    for body in (messages, as_parts):
        response = api.chat.completions.create(
            model=MODEL, messages=body, max_completion_tokens=8, temperature=0
        )
        choice = response.choices[0]
        assert (choice.message.content, choice.finish_reason) == (text, reason)
        assert response.usage.completion_tokens == count <= 8
        assert response.usage.prompt_tokens == len(expected_ids)


def test_langchain_chat_openai_invoke_and_stream(served, offline):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{served}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=8,
        max_retries=0,
        timeout=120,
    )
    question = "What does the for statement do?"
    prompt_ids = offline.tokenizer.encode_chat([{"role": "user", "content": question}])
    text, _reason, count = offline(prompt_ids, 8)
    answer = llm.invoke(question)
    assert answer.content == text
    assert answer.usage_metadata["output_tokens"] == count <= 8
    pieces = [chunk.content for chunk in llm.stream(question)]
    assert "".join(pieces) == text and len(pieces) > 1


def test_bad_schema_is_refused(served):
    response = httpx.post(
        f"{served}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        },
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert "nonsense" in response.json()["error"]["message"]


def test_engine_refusal_is_a_400(served):
    """A request the engine itself refuses (more stop_token_ids than it keeps per slot)
    answers 400 with the engine's message, and the server goes on serving."""
    api = client(served)
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        api.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=2,
            extra_body={"stop_token_ids": list(range(2, 40))},
        )
    after = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert after.usage.completion_tokens >= 1
