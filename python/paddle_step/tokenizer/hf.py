"""A Hugging Face ``tokenizer.json`` (through the ``tokenizers`` package), its chat template,
and a streaming detokenizer that emits text only once it is complete UTF-8."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from ..errors import CheckpointError
from .chat_template import ChatTemplateOptions, render_chat
from .detokenizer import IncrementalDetokenizer

__all__ = ["HFTokenizer", "IncrementalDetokenizer"]


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` gives it: a string or ``{"content": ..}``."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


class HFTokenizer:
    """Encodes as ``transformers``' ``tokenizer(text)`` does and decodes back.

    ``bos_token``/``eos_token`` are the strings of ``tokenizer_config.json`` (None if absent),
    ``eos_id`` the id of ``eos_token`` (None if absent). ``chat_template`` is the Jinja source
    or None. ``tokenizer_file`` is the ``tokenizer.json`` it was read from (None when built
    in memory): structured output builds its own view of the vocabulary from it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        tokenizer_file: Path | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tokenizer_file = tokenizer_file
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Reads ``tokenizer.json``, plus ``tokenizer_config.json`` and ``chat_template.jinja``
        where present (transformers writes the template to either)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(
                f"{path}: no tokenizer.json (only the `tokenizers` format is supported)"
            )
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # the Rust side raises plain Exception
            raise CheckpointError(f"{tokenizer_file}: not a readable tokenizer: {error}") from None
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": .., "template": ..}]
            template = {entry["name"]: entry["template"] for entry in template}.get("default")
        template_file = path / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        return cls(
            tokenizer,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            chat_template=template,
            tokenizer_file=tokenizer_file.resolve(),
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``; ``add_special_tokens`` applies the checkpoint's own post-processor
        (e.g. a leading BOS), as ``transformers``' ``tokenizer(text)`` does by default."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; incomplete UTF-8 becomes U+FFFD (as ``transformers`` decodes)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = False
    ) -> IncrementalDetokenizer:
        """A streaming decoder for a sequence that starts with ``prompt_ids`` (not emitted)."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: ChatTemplateOptions | None = None,
    ) -> str:
        """``messages`` ([{"role": .., "content": ..}, ..]) rendered with the chat template
        (``options``: none given, it ends with the generation prompt)."""
        if self.chat_template is None:
            raise CheckpointError(
                "chat template: the checkpoint has none (no 'chat_template' in "
                "tokenizer_config.json and no chat_template.jinja)"
            )
        return render_chat(self.chat_template, messages, options or ChatTemplateOptions(),
                           self.bos_token or "", self.eos_token or "")  # fmt: skip

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], options: ChatTemplateOptions | None = None
    ) -> list[int]:
        """Prompt ids of a chat. The template writes its own special tokens (e.g. BOS), so
        none are added on top, as ``transformers``' ``apply_chat_template`` does."""
        text = self.apply_chat_template(messages, options)
        return self.encode(text, add_special_tokens=False)
