"""Turns a request's token stream into text deltas, honouring ``stop`` strings.

The detokenizer (``paddle_step.tokenizer.detokenizer.IncrementalDetokenizer``) already
holds back a character cut in the middle; on top of it, a tail that could still become a
stop string waits until it cannot, and when a stop string appears the text ends just
before it (or just after it, where the request keeps it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

__all__ = ["StopStrings", "TextOptions", "TextStream"]


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class StopStrings:
    """A request's stop strings with their Knuth-Morris-Pratt tables, built once for all
    its choices (900 strings of 1,000 characters take ~0.1 s). ``included``: the text keeps
    the stop string it ends with (vLLM's ``include_stop_str_in_output``)."""

    def __init__(self, stops: Sequence[str] = (), included: bool = False) -> None:
        self.strings = list(stops)
        self.fallbacks = [_prefix_function(stop) for stop in self.strings]
        self.included = included


class TextOptions(NamedTuple):
    """How a request's choices turn tokens into text: its stop strings, and whether
    special tokens (an end-of-turn marker, say) are left out."""

    stops: StopStrings
    skip_special_tokens: bool = True


class TextStream:
    """``add(token)`` returns the new final text; ``finish()`` the rest at the end."""

    def __init__(self, detokenizer: Detokenizer, stops: StopStrings | Sequence[str] = ()) -> None:
        self._detokenizer = detokenizer
        stops = stops if isinstance(stops, StopStrings) else StopStrings(stops)
        self._stops, self._fallbacks = stops.strings, stops.fallbacks
        self._stop_included = stops.included
        # Per stop string: the longest prefix of it that the text ends with, kept up to
        # date a character at a time (Knuth-Morris-Pratt), so a token costs the length of
        # its text per stop string, not the stop strings' lengths squared.
        self._matched = [0] * len(self._stops)
        self._text = ""  # decoded so far, held-back tail included
        self._emitted = 0  # characters of _text already returned
        self.num_tokens = 0
        self.stopped = False  # a stop string was found; the text is complete

    def add(self, token_id: int, stop_token: bool = False) -> str:
        """The text that became final with ``token_id`` ('' when none did). A
        ``stop_token`` (an eos or stop token id that ended the choice) adds its own text
        only where stop strings are kept, as in vLLM."""
        if self.stopped:
            return ""
        self.num_tokens += 1
        if stop_token and not self._stop_included:
            return ""
        piece = self._detokenizer.add(token_id)
        if not piece:
            return ""
        self._text += piece
        for stop in self._stops:
            # Only new text can complete a stop string: search from just before it.
            index = self._text.find(stop, max(0, self._emitted - len(stop) + 1))
            if index >= 0:
                self._text = self._text[: index + len(stop) if self._stop_included else index]
                self.stopped = True
                return self._take(len(self._text))
        self._follow(piece)
        return self._take(len(self._text) - max(self._matched, default=0))

    def finish(self) -> str:
        """The text still held back, once no token will follow."""
        if not self.stopped:
            self._text += self._detokenizer.flush()
        return self._take(len(self._text))

    def _follow(self, piece: str) -> None:
        """Extends each stop string's match by ``piece`` (which completes none of them:
        ``add`` has looked for whole ones first)."""
        for index, stop in enumerate(self._stops):
            fallback, matched = self._fallbacks[index], self._matched[index]
            for char in piece:
                while matched and stop[matched] != char:
                    matched = fallback[matched - 1]
                if stop[matched] == char:
                    matched += 1
                if matched == len(stop):  # only if add's search missed it; stay a prefix
                    matched = fallback[matched - 1]
            self._matched[index] = matched

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta


def _prefix_function(text: str) -> list[int]:
    """For each i, the length of the longest proper prefix of ``text[: i + 1]`` that is
    also its suffix (Knuth-Morris-Pratt's failure function)."""
    lengths = [0] * len(text)
    for i in range(1, len(text)):
        length = lengths[i - 1]
        while length and text[i] != text[length]:
            length = lengths[length - 1]
        lengths[i] = length + (text[i] == text[length])
    return lengths
