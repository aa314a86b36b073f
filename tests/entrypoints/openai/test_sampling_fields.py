"""The sampling fields that need the engine (controls, logprobs, echo, n, best_of,
structured output) through the official ``openai`` client on the shipped model: each
answer equals the offline engine's result for the same ``SamplingParams``."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from paddle_step.engine.arg_utils import build_engine
from paddle_step.entrypoints.openai import cli as serve
from paddle_step.sampling_params import SamplingParams
from paddle_step.testing.constraints import OBJECT_SCHEMA
from paddle_step.testing.server_process import serve_in_thread

MODEL = "pydoc-tiny"
SERVER_ARGS = ["--max-batch", "16", "--seed", "0", "--threads", "1"]
PROMPT = "A list is"


@pytest.fixture(scope="module")
def served():
    app, _loop = serve.build_app(serve.parse_args(SERVER_ARGS))
    with serve_in_thread(app) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def offline():
    """``(result, tokenizer)`` of the offline engine for (prompt ids, SamplingParams)."""
    engine, loaded = build_engine(serve.parse_args(SERVER_ARGS))

    def generate(prompt_ids: list[int], params: SamplingParams):
        [result] = engine.generate([prompt_ids], params)
        return result

    generate.tokenizer = loaded.tokenizer
    return generate


# The server's engine process and the offline engine may time their dense blocks into
# different ways of computing (eager, our op, compiled), so float32 logprobs agree to
# rounding, not bit for bit.
TOLERANCE = 1e-4


def assert_close(got: dict, expected: dict) -> None:
    """Two completions logprob objects: the same tokens, offsets and alternatives, the
    logprobs within TOLERANCE."""
    assert got["tokens"] == expected["tokens"]
    assert got["text_offset"] == expected["text_offset"]
    assert got["token_logprobs"] == [
        None if value is None else pytest.approx(value, abs=TOLERANCE)
        for value in expected["token_logprobs"]
    ]
    assert got["top_logprobs"] == [
        None if top is None else {text: pytest.approx(v, abs=TOLERANCE) for text, v in top.items()}
        for top in expected["top_logprobs"]
    ]


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def text_of(tokenizer, token_ids) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def completion_logprobs(tokenizer, tokens, entries, offset=0) -> dict:
    """The completions API's logprobs object, built from the engine's TokenLogprobs."""
    texts = [tokenizer.decode([t]) for t in tokens]
    offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    top = []
    for text, entry in zip(texts, entries):
        if entry is None:
            top.append(None)
            continue
        alternatives = {tokenizer.decode([other]): value for other, value in entry.top}
        alternatives.setdefault(text, entry.logprob)
        top.append(alternatives)
    return {
        "tokens": texts,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_offline(served, offline, stream):
    tokenizer = offline.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    result = offline(prompt_ids, SamplingParams(max_tokens=8, logprobs=3))
    sample = result.outputs[0]
    expected = completion_logprobs(tokenizer, sample.token_ids, sample.logprobs)
    api = client(served)
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    if stream:
        got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in api.completions.create(stream=True, **request):
            for choice in chunk.choices:
                if choice.logprobs is not None:  # null on the chunks without a token
                    assert choice.logprobs.tokens, chunk
                    for key in got:
                        got[key] += getattr(choice.logprobs, key)
    else:
        response = api.completions.create(**request)
        got = response.choices[0].logprobs.model_dump()
        assert response.choices[0].text == text_of(tokenizer, sample.token_ids)
    assert_close(got, expected)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_as_lm_eval_sends(served, offline, max_tokens):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, max_tokens 0/1."""
    tokenizer = offline.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    result = offline(
        prompt_ids, SamplingParams(max_tokens=max_tokens, logprobs=1, prompt_logprobs=1)
    )
    generated = result.outputs[0].token_ids[:max_tokens]
    response = client(served).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=1, echo=True
    )
    choice = response.choices[0]
    assert choice.text == PROMPT + text_of(tokenizer, generated)
    entries = [None, *result.prompt_logprobs, *result.outputs[0].logprobs[:max_tokens]]
    assert_close(
        choice.logprobs.model_dump(),
        completion_logprobs(tokenizer, prompt_ids + generated, entries),
    )
    assert response.usage.completion_tokens == len(generated)
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client(served).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=1, echo=True,
        stream=True,
    ):  # fmt: skip
        for streamed in chunk.choices:
            text += streamed.text
            if streamed.logprobs is not None:
                for key in merged:
                    merged[key] += getattr(streamed.logprobs, key)
    assert text == choice.text
    assert_close(merged, choice.logprobs.model_dump())


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_offline(served, offline, stream):
    tokenizer = offline.tokenizer
    messages = [{"role": "user", "content": "What is a dict?"}]
    result = offline(tokenizer.encode_chat(messages), SamplingParams(max_tokens=6, logprobs=2))
    sample = result.outputs[0]
    api = client(served)
    request = dict(model=MODEL, messages=messages, max_completion_tokens=6, temperature=0,
                   logprobs=True, top_logprobs=2)  # fmt: skip
    if stream:
        content = []
        for chunk in api.chat.completions.create(stream=True, **request):
            for choice in chunk.choices:
                if choice.logprobs is not None:  # null on the chunks without a token
                    assert choice.logprobs.content, chunk
                    content += choice.logprobs.content
    else:
        content = api.chat.completions.create(**request).choices[0].logprobs.content
    assert [item.logprob for item in content] == [
        pytest.approx(e.logprob, abs=TOLERANCE) for e in sample.logprobs
    ]
    assert [item.token for item in content] == [tokenizer.decode([t]) for t in sample.token_ids]
    for item, entry in zip(content, sample.logprobs):
        assert [(top.token, top.logprob) for top in item.top_logprobs] == [
            (tokenizer.decode([other]), pytest.approx(value, abs=TOLERANCE))
            for other, value in entry.top
        ]


def test_sampling_controls_equal_offline(served, offline):
    tokenizer = offline.tokenizer
    controls = dict(top_k=20, min_p=0.02, presence_penalty=0.5, frequency_penalty=0.3,
                    repetition_penalty=1.2, min_tokens=4, seed=11)  # fmt: skip
    bias = {tokenizer.encode(" the", add_special_tokens=False)[0]: -100.0}
    result = offline(
        tokenizer.encode(PROMPT),
        SamplingParams(max_tokens=12, temperature=0.9, logit_bias=bias, **controls),
    )
    response = client(served).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.9,
        logit_bias={str(k): v for k, v in bias.items()}, extra_body=controls, seed=11,
    )  # fmt: skip
    assert response.choices[0].text == text_of(tokenizer, result.token_ids)


def test_a_top_k_past_int64_answers_and_the_engine_serves_on(served, offline):
    """JSON's integers have no bound: a top_k past int64 once failed the engine's step,
    which took the server's engine down (every later request a 503). Past the vocabulary
    it keeps every token, as 0 does."""
    tokenizer = offline.tokenizer
    result = offline(
        tokenizer.encode(PROMPT), SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    )
    response = client(served).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5,
        extra_body={"top_k": 10**23},
    )  # fmt: skip
    assert response.choices[0].text == text_of(tokenizer, result.token_ids)
    chat = client(served).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_body={"top_k": 2**64},
    )  # fmt: skip
    assert chat.choices[0].finish_reason == "length"
    assert httpx.get(f"{served}/health", timeout=10).status_code == 200


def test_n_and_best_of_equal_offline(served, offline):
    tokenizer = offline.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    api = client(served)
    result = offline(prompt_ids, SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3))
    response = api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=3
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [
        text_of(tokenizer, sample.token_ids) for sample in result.outputs
    ]
    assert response.usage.completion_tokens == sum(len(s.token_ids) for s in result.outputs)
    streamed = ["", "", ""]
    for chunk in api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=3, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in response.choices]
    best = offline(
        prompt_ids, SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=2, best_of=4)
    )
    response = api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=2, best_of=4
    )
    assert [c.text for c in response.choices] == [
        text_of(tokenizer, sample.token_ids) for sample in best.outputs
    ]
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=1.0, seed=3, n=2,
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]


@pytest.mark.parametrize(
    "prompt,message",
    [(["a", [1, 2]], "got a list mixing strings and lists"),
     ([[1, "x"]], 'got "x" at prompt[0][1]'),
     ([[]], "got an empty one at prompt[0]"),
     ([], "expected at least one prompt, got []")],
)  # fmt: skip
def test_a_prompt_of_odd_shape_answers_400_naming_prompt(served, prompt, message):
    response = httpx.post(f"{served}/v1/completions",
                          json={"model": MODEL, "prompt": prompt}, timeout=30)  # fmt: skip
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"].startswith("'prompt': expected ") and message in error["message"]


def test_structured_output_100_requests_at_temperature_1(served):
    api = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0,
                             timeout=300)  # fmt: skip
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": OBJECT_SCHEMA},
    }

    async def one(i: int) -> str:
        response = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Describe type {i} as JSON."}],
            temperature=1.0, seed=i, max_completion_tokens=120, response_format=response_format,
        )  # fmt: skip
        return response.choices[0].message.content

    async def run_all() -> list[str]:
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(100))), 600)

    outputs = asyncio.run(run_all())
    for output in outputs:
        jsonschema.validate(json.loads(output), OBJECT_SCHEMA)
    assert len(set(outputs)) > 10  # sampled, not one answer repeated
    plain = client(served).completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    text = plain.choices[0].text
    assert text.startswith("{")
    if plain.choices[0].finish_reason == "stop":  # else the context ran out first
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "constraint,accepts",
    [({"choice": ["yes", "no", "a list"]}, lambda text: text in ("yes", "no", "a list")),
     ({"regex": "[a-z]{3}-[0-9]{2}"}, lambda text: re.fullmatch("[a-z]{3}-[0-9]{2}", text))],
    ids=["choice", "regex"],
)  # fmt: skip
def test_structured_outputs_at_temperature_1(served, constraint, accepts):
    """vLLM's ``structured_outputs``, through both endpoints, sampled: every answer is one
    the constraint accepts, and they differ."""
    api = client(served)
    texts = []
    for seed in range(12):
        chat = api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is it?"}], temperature=1.0,
            seed=seed, max_tokens=20, extra_body={"structured_outputs": constraint},
        )  # fmt: skip
        completion = api.completions.create(
            model=MODEL, prompt=PROMPT, temperature=1.0, seed=seed, max_tokens=20,
            extra_body={"structured_outputs": constraint},
        )  # fmt: skip
        for choice, text in ((chat.choices[0], chat.choices[0].message.content),
                             (completion.choices[0], completion.choices[0].text)):  # fmt: skip
            assert choice.finish_reason == "stop" and accepts(text), text
            texts.append(text)
    assert len(set(texts)) > 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_past_the_matchers_limits_is_an_error_not_an_answer(served, stream):
    """A regular expression too large for llguidance's lexer (a million repeats): refused
    when compiled, or failed on the first token. Either way the client gets the error,
    never a cut answer that says it stopped."""
    request = {"url": f"{served}/v1/completions", "timeout": 120, "json": {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 20, "stream": stream,
        "structured_outputs": {"regex": "a{1000000}"}}}  # fmt: skip
    response = httpx.post(**request)
    if response.status_code == 400 or not stream:
        assert response.status_code == 400
        message = response.json()["error"]["message"]
    else:  # refused mid-stream: an error event ends it
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        message = json.loads(events[-2])["error"]["message"]
    assert "structured output failed after 1 token: lexer error" in message or (
        "not a usable regular expression" in message
    ), message
