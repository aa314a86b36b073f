"""Turns a request's token stream into text deltas, honouring ``stop`` strings.

The detokenizer (``paddle_step.tokenizer.detokenizer.IncrementalDetokenizer``) already
holds back a character cut in the middle; on top of it, a tail that could still become a
stop string waits until it cannot, and when a stop string appears the text ends just
before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["TextStream"]


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class TextStream:
    """``add(token)`` returns the new final text; ``finish()`` the rest at the end."""

    def __init__(self, detokenizer: Detokenizer, stops: Sequence[str] = ()) -> None:
        self._detokenizer = detokenizer
        self._stops = list(stops)
        self._text = ""  # decoded so far, held-back tail included
        self._emitted = 0  # characters of _text already returned
        self.num_tokens = 0
        self.stopped = False  # a stop string was found; the text is complete

    def add(self, token_id: int) -> str:
        """The text that became final with ``token_id`` ('' when none did)."""
        if self.stopped:
            return ""
        self.num_tokens += 1
        piece = self._detokenizer.add(token_id)
        if not piece:
            return ""
        self._text += piece
        for stop in self._stops:
            # Only new text can complete a stop string: search from just before it.
            index = self._text.find(stop, max(0, self._emitted - len(stop) + 1))
            if index >= 0:
                self._text = self._text[:index]
                self.stopped = True
                return self._take(len(self._text))
        return self._take(len(self._text) - self._stop_prefix_length())

    def finish(self) -> str:
        """The text still held back, once no token will follow."""
        if not self.stopped:
            self._text += self._detokenizer.flush()
        return self._take(len(self._text))

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        text, longest = self._text, 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta
