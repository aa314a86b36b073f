"""Byte-level tokenizer: every UTF-8 byte is a token, plus three special tokens."""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """Maps text to its UTF-8 bytes (ids 0..255) and back.

    Special tokens sit just above the byte range: ``bos_id`` (256), ``eos_id`` (257) and
    ``pad_id`` (258), so ``vocab_size`` is 259. Any text round-trips; no training needed.
    """

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    @property
    def vocab_size(self) -> int:
        """Number of token ids: 256 bytes + 3 special tokens."""
        return 259

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids, prefixed with ``bos_id`` if asked."""
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Return the text of the byte ids in ``ids``. Special tokens have no text, so
        they are always skipped (``skip_special_tokens`` exists for ``HFTokenizer``'s
        signature).

        Bytes that are not valid UTF-8 (e.g. a multi-byte character cut by generation) become
        U+FFFD instead of raising.
        """
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def encode_chat(self, messages: list[dict], options: object = None) -> list[int]:
        """Raises ``ValueError``: the byte tokenizer has no chat template (``options``, a
        ``ChatTemplateOptions``, exists for ``HFTokenizer``'s signature)."""
        raise ValueError("this model's tokenizer has no chat template (byte tokenizer)")
