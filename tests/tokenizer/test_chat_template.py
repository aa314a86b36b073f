"""The shipped model's chat template (tokenizer_config.json, written by train_tiny.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import paddle_step
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
    assert tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False) == (
        "<s>System: Answer briefly.\n\n"
    )


def test_train_tiny_writes_the_shipped_template():
    spec = importlib.util.spec_from_file_location("train_tiny_module", TRAIN_TINY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shipped = json.loads((SHIPPED / "tokenizer_config.json").read_text())["chat_template"]
    assert module.CHAT_TEMPLATE == shipped
    assert HFTokenizer.from_dir(SHIPPED).tokenizer_file == (SHIPPED / "tokenizer.json").resolve()
