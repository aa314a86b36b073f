"""Structured output: a ``GrammarConstraint`` that keeps a request's tokens inside a
grammar (a JSON schema's, a regular expression's, a list of choices' or a Lark grammar), by
llguidance's grammar matcher (token masks as NumPy arrays, no torch).

The HTTP process compiles and checks the grammar (one llguidance rejects is the client's
error); the constraint then travels to the engine process as its grammar and the tokenizer
file's path, and builds its matcher there on first use. No paddle.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from .sampling_params import unpack_token_mask

__all__ = ["KINDS", "GrammarConstraint", "compile_grammar"]

# What a constraint may be (vLLM's ``structured_outputs`` names), as the error names it: a
# JSON schema (a dict), a regular expression the whole output matches (llguidance's, Rust
# syntax), a list of strings the output is one of, a Lark grammar (llguidance's dialect).
KINDS = {
    "json": "JSON schema",
    "regex": "regular expression",
    "choice": "list of choices",
    "grammar": "Lark grammar",
}
# Compact JSON (no free whitespace between tokens): a sampling model could otherwise pad
# its output with whitespace until it runs out of tokens.
_COMPILE_DEFAULTS = {"whitespace_flexible": False}


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer_file: str, eos_token_ids: tuple[int, ...], vocab_size: int):
    """llguidance's view of a ``tokenizer.json`` (costly to build: one per process)."""
    source = Path(tokenizer_file).read_text()
    return llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def _grammar_of(kind: str, value: Any) -> str:
    """llguidance's grammar for a constraint of ``kind`` (one of ``KINDS``)."""
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(value), defaults=_COMPILE_DEFAULTS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":  # each a Lark string literal (JSON's escapes)
        return "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in value)
    return value  # a Lark grammar


def compile_grammar(
    kind: str,
    value: Any,
    tokenizer_file: str | Path,
    eos_token_ids: Sequence[int],
    vocab_size: int,
) -> str:
    """llguidance's grammar for a constraint of ``kind`` (``KINDS``) given by ``value``;
    raises ``ValueError`` with the library's message when it rejects it."""
    if kind not in KINDS:
        raise ValueError(
            f"compile_grammar: argument 'kind': expected one of {list(KINDS)}, got {kind!r}"
        )
    what = KINDS[kind]
    try:
        grammar = _grammar_of(kind, value)
    except ValueError as error:
        raise ValueError(f"not a usable {what}: {error}") from None
    tokenizer = _ll_tokenizer(str(tokenizer_file), tuple(eos_token_ids), vocab_size)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ValueError(f"not a usable {what}: {messages[0]}")
    return grammar


class GrammarConstraint:
    """Allows only the tokens that keep the text a prefix of what the grammar (from
    ``compile_grammar``) accepts; eos once the text is complete."""

    def __init__(
        self,
        grammar: str,
        tokenizer_file: str | Path,
        eos_token_ids: Sequence[int],
        vocab_size: int,
    ) -> None:
        self.grammar = grammar
        self.tokenizer_file = str(tokenizer_file)
        self.eos_token_ids = tuple(int(token) for token in eos_token_ids)
        self.vocab_size = int(vocab_size)
        self._matcher = None
        self._bitmask = None

    def __getstate__(self) -> dict:
        # The matcher is native state: the receiving process builds its own.
        return {**self.__dict__, "_matcher": None, "_bitmask": None}

    def _matcher_here(self):
        if self._matcher is None:
            tokenizer = _ll_tokenizer(self.tokenizer_file, self.eos_token_ids, self.vocab_size)
            self._matcher = llguidance.LLMatcher(tokenizer, self.grammar)
            self._bitmask = allocate_token_bitmask(1, self.vocab_size)
        return self._matcher

    def allowed_tokens(self, vocab_size: int) -> np.ndarray:
        return unpack_token_mask(self.allowed_bitmask(vocab_size), vocab_size)

    def allowed_bitmask(self, vocab_size: int) -> np.ndarray:
        """The allowed set as llguidance fills it (``pack_token_mask``'s layout); a view
        of this constraint's buffer, valid until the next call."""
        if vocab_size != self.vocab_size:
            raise ValueError(
                f"GrammarConstraint: argument 'vocab_size': expected {self.vocab_size} "
                f"(the size it was built for), got {vocab_size}"
            )
        matcher = self._matcher_here()
        fill_next_token_bitmask(matcher, self._bitmask)
        return self._bitmask[0]

    def accept_token(self, token_id: int) -> None:
        # A token outside the mask puts the matcher in its error state, where it is
        # stopped: is_finished() then ends the request.
        self._matcher_here().consume_token(int(token_id))

    def is_finished(self) -> bool:
        return self._matcher_here().is_stopped()

    @property
    def error(self) -> str:
        """The matcher's error ('' when none)."""
        return "" if self._matcher is None else self._matcher.get_error()
