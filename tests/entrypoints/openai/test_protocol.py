"""Request bodies to SamplingParams: every accepted field lands in the params or is
refused with an ApiError naming it. No server, no engine."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from paddle_step.entrypoints.openai.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
)
from paddle_step.sampling_params import SamplingParams

VOCAB = 100


def completion(**fields) -> CompletionRequest:
    fields.setdefault("prompt", "hi")
    return CompletionRequest(model="m", **fields)


def chat(**fields) -> ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ChatCompletionRequest(model="m", **fields)


def test_every_sampling_field_reaches_the_params():
    body = completion(
        temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.25, repetition_penalty=1.3, logit_bias={"7": -100, "11": 2.5},
        min_tokens=3, stop_token_ids=[4, 9], seed=42, n=2, ignore_eos=True, logprobs=3,
        prompt_logprobs=2, best_of=4,
    )  # fmt: skip
    body.check(VOCAB)
    params = body.sampling_params(12, VOCAB)
    assert params == SamplingParams(
        max_tokens=12, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.25, repetition_penalty=1.3, logit_bias={7: -100.0, 11: 2.5},
        min_tokens=3, stop_token_ids=[4, 9], eos_token_id=[], seed=42, logprobs=3,
        prompt_logprobs=2, n=2, best_of=4,
    )  # fmt: skip


def test_defaults_are_openai_defaults():
    params = completion().sampling_params(16, VOCAB)
    assert params == SamplingParams(max_tokens=16, temperature=1.0)


def test_completion_echo_and_logprobs():
    body = completion(echo=True, logprobs=2, max_tokens=0)
    body.check(VOCAB)
    assert body.prompt_logprobs_asked() == 2
    assert completion(logprobs=2).prompt_logprobs_asked() is None
    assert completion(prompt_logprobs=4).prompt_logprobs_asked() == 4
    assert completion(echo=True, logprobs=1, prompt_logprobs=3).prompt_logprobs_asked() == 3


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("abc", ["abc"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_batch_prompts(prompt, expected):
    assert CompletionRequest(model="m", prompt=prompt).prompts() == expected


FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"
ODD_PROMPTS = [
    (["a", [1, 2]], "a list mixing strings and lists"),
    ([1, "x"], "a list mixing numbers and strings"),
    ([[1, "x"]], '"x" at prompt[0][1]'),
    ([[1], [2, {"a": 1}]], "an object at prompt[1][1]"),
    ([[1, [2]]], "a list at prompt[0][1]"),
    ([1.5], "1.5 at prompt[0]"),
    ([True], "true at prompt[0]"),
    (None, "null"),
    ({"a": 1}, "an object"),
]


@pytest.mark.parametrize("prompt,got", ODD_PROMPTS)
def test_a_prompt_of_no_form_is_refused_naming_the_forms_and_where_it_strays(prompt, got):
    with pytest.raises(ValidationError) as error:
        completion(prompt=prompt)
    [first] = error.value.errors()
    assert first["loc"] == ("prompt",)
    assert first["msg"] == f"expected {FORMS}, got {got}"


@pytest.mark.parametrize(
    "prompt,got",
    [([], "expected at least one prompt, got []"),
     ("", "expected non-empty strings or token lists, got an empty one"),
     ([[]], "expected non-empty strings or token lists, got an empty one at prompt[0]"),
     (["a", ""], "expected non-empty strings or token lists, got an empty one at prompt[1]")],
)  # fmt: skip
def test_empty_prompts_are_refused_saying_which(prompt, got):
    with pytest.raises(ApiError) as error:
        completion(prompt=prompt).prompts()
    assert error.value.message == f"'prompt': {got}" and error.value.param == "prompt"


BAD_COMPLETIONS = [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"100": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [100]}, "stop_token_ids"),
    ({"seed": -1}, "seed"),
    ({"n": 0}, "n"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[1]] * 200, "best_of": 2}, "prompt"),
    ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream_options": {"include_usage": False}}, "stream_options"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"logit_bias": {str(token): 1 for token in range(301)}}, "logit_bias"),
    ({"logit_bias": {" 5": 1}}, "logit_bias"),
    ({"logit_bias": {"5_0": 1}}, "logit_bias"),
    ({"logit_bias": {"\u0665": 1}}, "logit_bias"),  # an Arabic-Indic five: int() takes it
    ({"stop_token_ids": list(range(9))}, "stop_token_ids"),
    ({"min_tokens": 10, "max_tokens": 3}, "min_tokens"),
    ({"top_p": 1e-46}, "top_p"),  # 0 in float32
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),  # inf in float32
    ({"logit_bias": {"05": 1}}, "logit_bias"),  # a second key for token 5
    ({"max_tokens": -1}, "max_tokens"),  # not min_tokens, which it would exceed
    ({"n": 257}, "n"),
    ({"best_of": 257}, "best_of"),
    ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
]


@pytest.mark.parametrize("fields,param", BAD_COMPLETIONS, ids=[b[1] for b in BAD_COMPLETIONS])
def test_bad_completion_fields_are_refused_by_name(fields, param):
    with pytest.raises(ApiError) as error:
        body = completion(**fields)
        body.check(VOCAB)
        body.stop_strings()
        body.include_usage()
    assert error.value.param == param and error.value.status == 400
    assert f"'{param}'" in error.value.message


@pytest.mark.parametrize(
    "fields",
    [{"frobnicate": 1}, {"suffix": "tail"}, {"stream_options": {"continuous": True}},
     {"response_format": {"type": "xml"}}, {"top_k": 1.5}, {"echo": "yes"}],
)  # fmt: skip
def test_unknown_or_unsupported_fields_fail_validation(fields):
    with pytest.raises(ValidationError):
        completion(**fields)


def test_chat_messages_content_parts_and_null_assistant():
    body = chat(
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "a"},
                                           {"type": "text", "text": "b"}]},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "r", "name": "bob"},
        ]
    )  # fmt: skip
    assert [m.for_template() for m in body.messages] == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "r", "name": "bob"},
    ]


@pytest.mark.parametrize(
    "message",
    [{"role": "user", "content": None},
     {"role": "tool", "content": "x", "tool_call_id": "1"},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
)  # fmt: skip
def test_chat_messages_refused(message):
    with pytest.raises(ApiError, match="messages"):
        chat(messages=[message]).messages[0].for_template()


def test_chat_image_part_fails_validation_saying_so():
    with pytest.raises(ValidationError) as error:
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "see"},
                        {"type": "image_url", "image_url": {}},
                    ],
                }
            ]
        )
    assert error.value.errors()[0]["loc"] == ("messages", 0, "content")
    assert error.value.errors()[0]["msg"] == (
        'only text parts are supported, got a part of type "image_url" at content[1]'
    )


def test_edge_values_that_stay_accepted():
    completion(min_tokens=3, max_tokens=3, top_p=1.5e-45, logit_bias={"7": 1, "0": 2}).check(VOCAB)
    completion(stream=True, stream_options={"include_usage": False}).check(VOCAB)
    completion(logit_bias={str(token): 1 for token in range(100)}).check(VOCAB)
    chat(max_completion_tokens=4, min_tokens=4).check(VOCAB)


def test_chat_max_completion_tokens_and_logprobs():
    body = chat(max_completion_tokens=8, logprobs=True, top_logprobs=3)
    body.check(VOCAB)
    assert body.token_limit() == ("max_completion_tokens", 8) and body.logprobs_asked() == 3
    assert chat(max_tokens=5).token_limit() == ("max_tokens", 5)
    assert chat(logprobs=True).logprobs_asked() == 0
    assert chat().logprobs_asked() is None
    params = body.sampling_params(8, VOCAB)
    assert params == SamplingParams(max_tokens=8, temperature=1.0, logprobs=3)


def test_best_of_reaches_the_params_only_above_n():
    assert completion(n=2, best_of=3).sampling_params(4, VOCAB).best_of == 3
    assert completion(n=2, best_of=2).sampling_params(4, VOCAB).best_of is None


BAD_CHATS = [
    ({"max_completion_tokens": 8, "max_tokens": 9}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"n": 1000}, "n"),
    ({"max_tokens": 0}, "max_tokens"),  # the field the client sent, not its other name
    ({"max_completion_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"continue_final_message": True}, "continue_final_message"),  # with the generation cue
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
]


@pytest.mark.parametrize("fields,param", BAD_CHATS, ids=[b[1] for b in BAD_CHATS])
def test_bad_chat_fields_are_refused_by_name(fields, param):
    with pytest.raises(ApiError) as error:
        chat(**fields).check(VOCAB)
    assert error.value.param == param and f"'{param}'" in error.value.message


def test_chat_fields_that_ask_for_what_the_server_does_anyway_are_accepted():
    chat(tools=[], tool_choice="none", functions=None, parallel_tool_calls=None).check(VOCAB)
    chat(tool_choice="auto", function_call="auto", parallel_tool_calls=False).check(VOCAB)
    chat(store=False, modalities=["text"]).check(VOCAB)
    chat(service_tier="auto", metadata={"team": "search"}).check(VOCAB)
    chat(service_tier="default", metadata={}).check(VOCAB)
    # A client that sends every field it knows, null when unset.
    chat(audio=None, prediction=None, reasoning_effort=None, web_search_options=None,
         service_tier=None, metadata=None).check(VOCAB)  # fmt: skip
    completion(suffix=None).check(VOCAB)


REFUSED_NO_TOOLS_FIELDS = [
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "f"}}},
    {"function_call": {"name": "f"}},
    {"parallel_tool_calls": "no"},
    {"store": True},
    {"modalities": ["text", "audio"]},
    {"modalities": ["audio"]},
    {"modalities": []},
    {"service_tier": "flex"},
    {"metadata": {"n": 1}},
    {"metadata": {"k" * 65: "v"}},
    {"metadata": {str(key): "v" for key in range(17)}},
    {"audio": {"voice": "alloy", "format": "wav"}},
    {"prediction": {"type": "content", "content": "x"}},
    {"reasoning_effort": "low"},
    {"web_search_options": {}},
]


@pytest.mark.parametrize("fields", REFUSED_NO_TOOLS_FIELDS, ids=str)
def test_chat_fields_that_ask_for_tools_storage_or_audio_fail_validation_by_name(fields):
    with pytest.raises(ValidationError) as error:
        chat(**fields)
    assert {e["loc"][0] for e in error.value.errors()} == set(fields)


ONLY_REFUSALS = [
    ({"store": True}, "this server stores no completions: expected false or null"),
    ({"store": 0}, "this server stores no completions: expected false or null"),  # not false
    ({"store": "false"}, "this server stores no completions: expected false or null"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}},
     'tool calls are not supported by this server: expected "none" or "auto"'),
    ({"service_tier": "priority"},
     'this server has one tier: expected "auto", "default" or null'),
    ({"audio": {"voice": "alloy"}}, "audio output is not supported by this server: expected null"),
    ({"reasoning_effort": "high"},
     "reasoning effort is not supported by this server: expected null"),
]  # fmt: skip


@pytest.mark.parametrize("fields,message", ONLY_REFUSALS, ids=str)
def test_a_field_the_server_does_not_do_says_what_it_takes(fields, message):
    """The message says what is taken; the error keeps the value received, which the
    server's error handler adds (cut to length)."""
    with pytest.raises(ValidationError) as error:
        chat(**fields)
    [first] = error.value.errors()
    [(name, value)] = fields.items()
    assert (first["loc"], first["msg"], first["input"]) == ((name,), message, value)


def test_a_suffix_says_insertion_is_not_supported():
    with pytest.raises(ValidationError) as error:
        completion(suffix="def f():")
    [first] = error.value.errors()
    assert first["msg"] == "insertion (suffix) is not supported by this server: expected null"


def test_response_format():
    assert chat(response_format={"type": "text"}).output_constraint() is None
    assert chat(response_format={"type": "json_object"}).output_constraint() == (
        "response_format",
        "json",
        {"type": "object"},
    )
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                "strict": True}}
    )  # fmt: skip
    assert body.output_constraint() == ("response_format", "json", schema)
    with pytest.raises(ApiError, match="schema"):
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x"}}
        ).output_constraint()
    with pytest.raises(ApiError, match="json_schema"):
        chat(
            response_format={"type": "json_object", "json_schema": {"schema": schema}}
        ).output_constraint()


@pytest.mark.parametrize(
    "fields,expected",
    [({"json": {"type": "integer"}}, ("json", {"type": "integer"})),
     ({"json": '{"type": "integer"}'}, ("json", {"type": "integer"})),
     ({"regex": "[ab]+"}, ("regex", "[ab]+")),
     ({"choice": ["yes", "no"]}, ("choice", ["yes", "no"])),
     ({"grammar": 'start: "x"'}, ("grammar", 'start: "x"')),
     ({"json_object": True}, ("json", {"type": "object"}))],
)  # fmt: skip
def test_structured_outputs_name_one_constraint(fields, expected):
    for body in (chat(structured_outputs=fields), completion(structured_outputs=fields)):
        assert body.output_constraint() == ("structured_outputs", *expected)
    text = chat(structured_outputs=fields, response_format={"type": "text"})
    assert text.output_constraint() == ("structured_outputs", *expected)


@pytest.mark.parametrize(
    "fields,message",
    [({}, "expected exactly one of json, regex, choice, grammar and json_object, got none"),
     ({"regex": "a", "choice": ["a"]}, "got ['choice', 'regex']"),
     ({"json_object": False}, "'structured_outputs.json_object': expected true, got false"),
     ({"json": "{not json"}, "'structured_outputs.json': not JSON text: Expecting property"),
     ({"json": "[1]"}, "'structured_outputs.json': expected a JSON schema object, got a list")],
)  # fmt: skip
def test_structured_outputs_that_name_no_one_constraint_are_refused(fields, message):
    with pytest.raises(ApiError) as error:
        chat(structured_outputs=fields).check(VOCAB)
    assert error.value.param == "structured_outputs" and message in error.value.message


def test_structured_outputs_and_a_response_format_are_not_both_taken():
    body = chat(structured_outputs={"regex": "a"}, response_format={"type": "json_object"})
    with pytest.raises(ApiError, match="'response_format' constrains the output too; send one"):
        body.check(VOCAB)
    with pytest.raises(ApiError, match="'min_tokens': not honoured with structured output"):
        chat(structured_outputs={"choice": ["a"]}, min_tokens=1).check(VOCAB)


@pytest.mark.parametrize(
    "fields", [{"choice": []}, {"regex": 5}, {"whitespace_pattern": " "}, {"json": 3}], ids=str
)
def test_structured_outputs_fields_fail_validation_by_name(fields):
    with pytest.raises(ValidationError) as error:
        chat(structured_outputs=fields)
    assert {e["loc"][0] for e in error.value.errors()} == {"structured_outputs"}
