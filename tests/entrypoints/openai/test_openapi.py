"""The published OpenAPI document against the server: schemathesis generates requests from
``/openapi.json`` (valid ones and invalid ones) and checks that none gets a 5xx, and that
every answer has a documented status, content type, headers and body schema.

Bounded: a short context keeps each generated completion small, and each operation gets
a fixed number of examples.
"""

from __future__ import annotations

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from paddle_step.testing.server_process import spawn_server

FLAGS = ["--max-model-len", "10", "--max-batch", "8", "--api-key", "fuzz-key"]
AUTH = {"Authorization": "Bearer fuzz-key"}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# Examples per POST operation (each GET takes no input: one example covers it). Invalid
# requests are refused before the engine, so they are cheap.
POST_EXAMPLES = {"positive": 80, "negative": 200}


@pytest.fixture(scope="module")
def url():
    with spawn_server(FLAGS) as server:
        yield server.url


def test_metrics_is_text_and_health_json(url):
    document = httpx.get(f"{url}/openapi.json", timeout=10).json()
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    answer = httpx.get(f"{url}/metrics", timeout=10)
    assert answer.headers["content-type"].startswith("text/plain")
    completions = document["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "401", "413", "429", "503"} <= set(completions) and "422" not in completions


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_driven_requests_get_documented_answers_and_no_5xx(url, mode):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    generation = schemathesis.GenerationMode(mode)
    seen: dict[int, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        if generation is schemathesis.GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # the GETs take no input to break

        @given(case=operation.as_strategy(generation_mode=generation))
        @settings(
            max_examples=POST_EXAMPLES[mode],
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def check(case):
            response = case.call(base_url=url, headers=AUTH, timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            case.validate_response(response, checks=CHECKS)

        check()
    print(f"{mode}: statuses {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= POST_EXAMPLES[mode] and not any(status >= 500 for status in seen)
    if generation is schemathesis.GenerationMode.POSITIVE:  # valid requests are mostly served
        assert seen.get(200, 0) >= POST_EXAMPLES[mode] // 2, seen


# (body fields, whether the server serves them): the schema says so as well.
CONSTRAINT_BODIES = [
    ({"response_format": {"type": "json_schema"}}, False),
    ({"response_format": {"type": "json_object", "json_schema": {"schema": {}}}}, False),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
        True,
    ),  # fmt: skip
    ({"structured_outputs": {}}, False),
    ({"structured_outputs": {"regex": None}}, False),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, False),
    ({"structured_outputs": {"json_object": False}}, False),
    ({"structured_outputs": {"json_object": True}}, True),
    ({"structured_outputs": {"choice": ["a"], "grammar": None}}, True),
    (
        {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
        False,
    ),  # fmt: skip
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "text"}}, True),
    ({"structured_outputs": {"choice": ["a"]}, "min_tokens": 1}, False),
    ({"response_format": {"type": "json_object"}, "min_tokens": 1}, False),
    ({"response_format": {"type": "text"}, "min_tokens": 1}, True),
]


@pytest.mark.parametrize("fields, served", CONSTRAINT_BODIES)
def test_the_schema_states_the_constraint_rules_the_server_applies(url, fields, served):
    document = httpx.get(f"{url}/openapi.json", timeout=10).json()
    schema = {"$ref": "#/components/schemas/CompletionRequest", **document}
    body = {"model": "pydoc-tiny", "prompt": "a", "max_tokens": 2, **fields}
    valid = jsonschema.Draft202012Validator(schema).is_valid(body)
    response = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert (valid, response.status_code) == (served, 200 if served else 400), response.text
