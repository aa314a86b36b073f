"""The shipped model's chat template (tokenizer_config.json, written by train_tiny.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import paddle_step
from paddle_step.tokenizer.chat_template import ChatTemplateOptions, render_chat
from paddle_step.tokenizer.hf import HFTokenizer

SHIPPED = Path(paddle_step.__file__).parent / "assets" / "pydoc-tiny"
TRAIN_TINY = Path(__file__).resolve().parents[2] / "examples" / "train_tiny.py"


def test_shipped_model_renders_chats():
    tokenizer = HFTokenizer.from_dir(SHIPPED)
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "And a dict?"},
    ]
    text = tokenizer.apply_chat_template(messages)
    assert text == (
        "<s>System: Answer briefly.\n\nUser: What is a list?\n\nAssistant: \n\n"
        "User: And a dict?\n\nAssistant:"
    )
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == tokenizer.tokenizer.token_to_id("<s>") and ids.count(ids[0]) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text[len("<s>") :]
    no_cue = ChatTemplateOptions(add_generation_prompt=False)
    assert tokenizer.apply_chat_template(messages[:1], no_cue) == "<s>System: Answer briefly.\n\n"


def test_a_final_assistant_message_is_continued():
    tokenizer = HFTokenizer.from_dir(SHIPPED)
    messages = [{"role": "user", "content": "A list?"}, {"role": "assistant", "content": "A list"}]
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    # The template's end of turn ("\n\n") after the content is cut off.
    expected = "<s>User: A list?\n\nAssistant: A list"
    assert tokenizer.apply_chat_template(messages, options) == expected
    assert tokenizer.encode_chat(messages, options) == tokenizer.encode(
        expected, add_special_tokens=False
    )


# Templates that trim the messages (as Llama 3.1's does) or drop the final one's content.
TRIMMING = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | trim }}|{% endfor %}"
DROPPING = "{% for m in messages %}[{{ m['role'] }}]{% endfor %}"


def test_continuing_follows_a_trimmed_message_and_refuses_a_missing_one():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " Hello  "}]
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    assert render_chat(TRIMMING, messages, options, "", "") == "[user] hi|[assistant] Hello"
    with pytest.raises(ValueError, match="content does not appear.*' Hello  '"):
        render_chat(DROPPING, messages, options, "", "")


def test_extra_variables_reach_the_template_but_not_its_own():
    template = "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}"
    messages = [{"role": "user", "content": "hi"}]
    thinking = ChatTemplateOptions(extra={"enable_thinking": True})
    assert render_chat(template, messages, thinking, "", "") == "<think>hi"
    assert render_chat(template, messages, ChatTemplateOptions(), "", "") == "hi"
    with pytest.raises(ValueError, match=r"\['bos_token', 'messages'\] are the renderer's own"):
        own = ChatTemplateOptions(extra={"messages": [], "bos_token": ""})
        render_chat(template, messages, own, "", "")


def test_train_tiny_writes_the_shipped_template():
    spec = importlib.util.spec_from_file_location("train_tiny_module", TRAIN_TINY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shipped = json.loads((SHIPPED / "tokenizer_config.json").read_text())["chat_template"]
    assert module.CHAT_TEMPLATE == shipped
    assert HFTokenizer.from_dir(SHIPPED).tokenizer_file == (SHIPPED / "tokenizer.json").resolve()
