"""A chat rendered with a checkpoint's Jinja chat template, as ``transformers`` renders it,
with vLLM's options: no generation prompt, a final assistant message left open to be
continued, and more variables for the template."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.sandbox

__all__ = ["TEMPLATE_VARIABLES", "ChatTemplateOptions", "render_chat", "reserved_among"]

# The variables the renderer itself gives every template.
TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token",
                      "raise_exception")  # fmt: skip


@dataclass(frozen=True)
class ChatTemplateOptions:
    """``add_generation_prompt``: end with the template's cue for the assistant's turn.
    ``continue_final_message``: end right after the last message's content instead (the
    assistant's, to be continued; the template's end-of-turn after it is cut off).
    ``extra``: more variables for the template (vLLM's ``chat_template_kwargs``, e.g.
    ``enable_thinking``); none may be one of ``TEMPLATE_VARIABLES``."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)


def reserved_among(names: Iterable[str]) -> list[str]:
    """Those of ``names`` that are ``TEMPLATE_VARIABLES`` (extra variables may not be),
    sorted."""
    return sorted(set(names) & set(TEMPLATE_VARIABLES))


def _raise_template_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    options: ChatTemplateOptions,
    bos_token: str,
    eos_token: str,
) -> str:
    """``messages`` ([{"role": .., "content": ..}, ..]) rendered with ``template``. Raises
    ``jinja2.TemplateError`` from the template, ``ValueError`` where the final message to
    continue does not appear in the rendered text."""
    reserved = reserved_among(options.extra)
    if reserved:
        raise ValueError(f"chat template variables {reserved} are the renderer's own")
    # As transformers renders it: a sandbox, block tags trimmed, raise_exception().
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise_template_exception
    text = environment.from_string(template).render(
        **options.extra,
        messages=list(messages),
        add_generation_prompt=options.add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    if options.continue_final_message:
        text = _up_to_final_message(text, messages[-1]["content"])
    return text


def _up_to_final_message(text: str, content: str) -> str:
    """``text`` cut just after the last occurrence of the final message's ``content`` (as
    written, else stripped: some templates trim messages), as ``transformers`` cuts it."""
    for final in (content, content.strip()):
        end = text.rfind(final)
        if end >= 0:
            return text[: end + len(final)]
    raise ValueError(
        "continue_final_message: the last message's content does not appear in the chat "
        f"as the template renders it, got content {content!r}"
    )
