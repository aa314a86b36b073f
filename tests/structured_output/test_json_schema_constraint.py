"""JsonSchemaConstraint on the shipped model's tokenizer, driven by a random sampler: every
walk through its masks ends in JSON that parses and validates against the schema."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import jsonschema
import numpy as np
import pytest

import paddle_step
from paddle_step.sampling_params import pack_token_mask, token_mask_words
from paddle_step.structured_output import JsonSchemaConstraint, compile_json_schema
from paddle_step.testing.constraints import OBJECT_SCHEMA
from paddle_step.tokenizer.hf import HFTokenizer

SHIPPED = Path(paddle_step.__file__).parent / "assets" / "pydoc-tiny"
TOKENIZER_FILE = SHIPPED / "tokenizer.json"
EOS = [1]
VOCAB = 2048


def walk(constraint: JsonSchemaConstraint, rng: np.random.Generator, limit: int = 300):
    """Samples uniformly among the allowed tokens until eos or the constraint finishes."""
    tokens = []
    for _ in range(limit):
        allowed = np.flatnonzero(constraint.allowed_tokens(VOCAB))
        assert allowed.size > 0
        token = int(rng.choice(allowed))
        if token in EOS:
            return tokens, "eos"
        constraint.accept_token(token)
        tokens.append(token)
        if constraint.is_finished():
            return tokens, "finished"
    return tokens, "limit"


def test_random_walks_give_valid_json():
    tokenizer = HFTokenizer.from_dir(SHIPPED)
    grammar = compile_json_schema(OBJECT_SCHEMA, TOKENIZER_FILE, EOS, VOCAB)
    rng = np.random.default_rng(7)
    for _ in range(40):
        constraint = JsonSchemaConstraint(grammar, TOKENIZER_FILE, EOS, VOCAB)
        tokens, how = walk(constraint, rng)
        assert how != "limit" and constraint.error == ""
        value = json.loads(tokenizer.decode(tokens))
        jsonschema.validate(value, OBJECT_SCHEMA)


def test_mask_allows_exactly_the_tokens_that_keep_the_text_valid():
    """At the start only '{' (or tokens beginning with it) may come; never eos."""
    tokenizer = HFTokenizer.from_dir(SHIPPED)
    constraint = JsonSchemaConstraint(
        compile_json_schema(OBJECT_SCHEMA, TOKENIZER_FILE, EOS, VOCAB), TOKENIZER_FILE, EOS, VOCAB
    )
    mask = constraint.allowed_tokens(VOCAB)
    assert mask.dtype == bool and mask.shape == (VOCAB,)
    allowed = np.flatnonzero(mask)
    assert allowed.size > 0 and not mask[EOS].any()
    assert all(tokenizer.decode([int(token)]).startswith("{") for token in allowed)
    brace = tokenizer.tokenizer.token_to_id("{")
    assert mask[brace]
    # The packed form the engine takes is the same set.
    words = constraint.allowed_bitmask(VOCAB)
    assert words.dtype == np.int32 and words.shape == (token_mask_words(VOCAB),)
    np.testing.assert_array_equal(words, pack_token_mask(mask))


def test_pickles_without_its_matcher_and_resumes_fresh():
    grammar = compile_json_schema(OBJECT_SCHEMA, TOKENIZER_FILE, EOS, VOCAB)
    constraint = JsonSchemaConstraint(grammar, TOKENIZER_FILE, EOS, VOCAB)
    first = constraint.allowed_tokens(VOCAB)
    constraint.accept_token(int(np.flatnonzero(first)[0]))
    copy = pickle.loads(pickle.dumps(constraint))
    assert np.array_equal(copy.allowed_tokens(VOCAB), first)  # a fresh matcher


@pytest.mark.parametrize(
    "schema,message",
    [({"type": "nonsense"}, "nonsense"), ({"type": "string", "pattern": "(("}, "schema")],
)
def test_a_schema_the_library_rejects_raises_value_error(schema, message):
    with pytest.raises(ValueError, match="not a usable JSON schema") as error:
        compile_json_schema(schema, TOKENIZER_FILE, EOS, VOCAB)
    assert message in str(error.value)


def test_wrong_vocab_size_is_refused():
    constraint = JsonSchemaConstraint(
        compile_json_schema({"type": "object"}, TOKENIZER_FILE, EOS, VOCAB),
        TOKENIZER_FILE,
        EOS,
        VOCAB,
    )
    with pytest.raises(ValueError, match="'vocab_size': expected 2048"):
        constraint.allowed_tokens(VOCAB + 1)
