"""Token ids to text pieces, each complete UTF-8, for streaming. No paddle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer", "TokenDecoder"]


class TokenDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (``HFTokenizer`` is one)."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, each complete UTF-8.

    As vLLM does: the new tokens are decoded together with a few tokens before them
    (``prefix_offset``), since some decoders drop a leading space or join bytes across
    tokens; a piece is emitted only when that text grew and does not end in U+FFFD, the
    mark of a multi-byte character still cut short.
    """

    # Tokens of context before the unread ones (vLLM uses 5 too).
    CONTEXT_TOKENS = 5

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = [int(i) for i in prompt_ids]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - self.CONTEXT_TOKENS)

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], self._skip_special_tokens)

    def add(self, token_id: int) -> str:
        """The text ``token_id`` completes ("" while a character is still cut short)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back at the end of the stream (U+FFFD for cut characters)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]
