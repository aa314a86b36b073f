"""GrammarConstraint on the shipped model's tokenizer, driven by a random sampler: every
walk through its masks ends in text the grammar accepts (JSON that validates against the
schema, a match of the regular expression, one of the choices, a sentence of the Lark
grammar)."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

import paddle_step
from paddle_step.sampling_params import pack_token_mask, token_mask_words
from paddle_step.structured_output import GrammarConstraint, compile_grammar
from paddle_step.testing.constraints import OBJECT_SCHEMA
from paddle_step.tokenizer.hf import HFTokenizer

SHIPPED = Path(paddle_step.__file__).parent / "assets" / "pydoc-tiny"
TOKENIZER_FILE = SHIPPED / "tokenizer.json"
EOS = [1]
VOCAB = 2048


def walk(constraint: GrammarConstraint, rng: np.random.Generator, limit: int = 300):
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
    grammar = compile_grammar("json", OBJECT_SCHEMA, TOKENIZER_FILE, EOS, VOCAB)
    rng = np.random.default_rng(7)
    for _ in range(40):
        constraint = GrammarConstraint(grammar, TOKENIZER_FILE, EOS, VOCAB)
        tokens, how = walk(constraint, rng)
        assert how != "limit" and constraint.error == ""
        value = json.loads(tokenizer.decode(tokens))
        jsonschema.validate(value, OBJECT_SCHEMA)


def test_mask_allows_exactly_the_tokens_that_keep_the_text_valid():
    """At the start only '{' (or tokens beginning with it) may come; never eos."""
    tokenizer = HFTokenizer.from_dir(SHIPPED)
    constraint = GrammarConstraint(
        compile_grammar("json", OBJECT_SCHEMA, TOKENIZER_FILE, EOS, VOCAB),
        TOKENIZER_FILE,
        EOS,
        VOCAB,
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
    grammar = compile_grammar("json", OBJECT_SCHEMA, TOKENIZER_FILE, EOS, VOCAB)
    constraint = GrammarConstraint(grammar, TOKENIZER_FILE, EOS, VOCAB)
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
        compile_grammar("json", schema, TOKENIZER_FILE, EOS, VOCAB)
    assert message in str(error.value)


def test_wrong_vocab_size_is_refused():
    constraint = GrammarConstraint(
        compile_grammar("json", {"type": "object"}, TOKENIZER_FILE, EOS, VOCAB),
        TOKENIZER_FILE,
        EOS,
        VOCAB,
    )
    with pytest.raises(ValueError, match="'vocab_size': expected 2048"):
        constraint.allowed_tokens(VOCAB + 1)


def walk_to_text(kind: str, value, seed: int) -> list[str]:
    tokenizer = HFTokenizer.from_dir(SHIPPED)
    grammar = compile_grammar(kind, value, TOKENIZER_FILE, EOS, VOCAB)
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(30):
        constraint = GrammarConstraint(grammar, TOKENIZER_FILE, EOS, VOCAB)
        tokens, how = walk(constraint, rng, limit=60)
        assert how != "limit" and constraint.error == ""
        texts.append(tokenizer.decode(tokens))
    return texts


CHOICES = ["yes", "no", "maybe not", 'a "quoted" \\ back|slash (.*)', "ü"]


def test_random_walks_give_one_of_the_choices():
    texts = walk_to_text("choice", CHOICES, seed=1)
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1


def test_random_walks_match_the_regular_expression():
    pattern = r"[a-c]{2,4}-[0-9]+"
    texts = walk_to_text("regex", pattern, seed=2)
    assert all(re.fullmatch(pattern, text) for text in texts), texts


def test_random_walks_give_sentences_of_the_lark_grammar():
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[xy]/ | start'
    texts = walk_to_text("grammar", grammar, seed=3)
    assert all(re.fullmatch(r"[(),xy]+", text) and text.count("(") == text.count(")")
               for text in texts), texts  # fmt: skip


@pytest.mark.parametrize(
    "kind,value,message",
    [("regex", "((", "(?s)not a usable regular expression: .*unclosed group"),
     ("grammar", "start: foo", '(?s)not a usable Lark grammar: .*unknown name: "foo"'),
     ("yaml", "a: 1", "argument 'kind': expected one of")],
)  # fmt: skip
def test_a_grammar_the_library_rejects_raises_value_error(kind, value, message):
    with pytest.raises(ValueError, match=message):
        compile_grammar(kind, value, TOKENIZER_FILE, EOS, VOCAB)
