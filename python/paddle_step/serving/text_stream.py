"""Turns a request's token stream into text deltas, honouring ``stop`` strings.

Text is emitted only once it is final: a token that ends inside a multi-byte character
(the decoder shows U+FFFD) waits for the rest, and a tail that could still become a stop
string waits until it cannot. When a stop string appears, the text ends just before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextStream"]


class TextStream:
    """``add(token)`` returns the new final text; ``finish()`` the rest at the end."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = list(stops)
        self._token_ids: list[int] = []
        self._text = ""  # decoded so far, held-back tail included
        self._emitted = 0  # characters of _text already returned
        self.stopped = False  # a stop string was found; the text is complete

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    def add(self, token_id: int) -> str:
        """The text that became final with ``token_id`` ('' when none did)."""
        if self.stopped:
            return ""
        self._token_ids.append(token_id)
        text = self._decode(self._token_ids)
        if text.endswith("\ufffd"):
            return ""  # a character cut in the middle: wait for its other bytes
        self._text = text
        for stop in self._stops:
            # Only new text can complete a stop string: search from just before it.
            index = text.find(stop, max(0, self._emitted - len(stop) + 1))
            if index >= 0:
                self._text = text[:index]
                self.stopped = True
                return self._take(len(self._text))
        return self._take(len(text) - self._stop_prefix_length(text))

    def finish(self) -> str:
        """The text still held back, once no token will follow."""
        return self._take(len(self._text))

    @property
    def text(self) -> str:
        return self._text

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        longest = 0
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
