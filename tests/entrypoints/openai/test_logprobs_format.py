"""LogprobFormatter: the completions, chat and vLLM prompt shapes, on a toy tokenizer."""

from __future__ import annotations

from paddle_step.entrypoints.openai.logprobs import LogprobFormatter


class Letters:
    """Token i is the i-th letter; 3 is 'é' (two UTF-8 bytes)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("é" if i == 3 else "abcdefgh"[i] for i in ids)


def test_completion_shape_with_echoed_prompt():
    formatter = LogprobFormatter(Letters())
    tokens = [0, 3, 2]
    entries = [None, (-0.5, [(1, -0.25), (3, -0.5)], None), (-2.0, [(1, -0.1)], None)]
    assert formatter.completion(tokens, entries, 4) == {
        "tokens": ["a", "é", "c"],
        "token_logprobs": [None, -0.5, -2.0],
        "top_logprobs": [None, {"b": -0.25, "é": -0.5}, {"b": -0.1, "c": -2.0}],
        "text_offset": [4, 5, 6],
    }


def test_chat_shape():
    formatter = LogprobFormatter(Letters())
    assert formatter.chat([3], [(-1.5, [(3, -1.5), (0, -2.0)], None)]) == [
        {
            "token": "é",
            "logprob": -1.5,
            "bytes": [0xC3, 0xA9],
            "top_logprobs": [
                {"token": "é", "logprob": -1.5, "bytes": [0xC3, 0xA9]},
                {"token": "a", "logprob": -2.0, "bytes": [97]},
            ],
        }
    ]
    assert formatter.chat([], []) == []


def test_vllm_prompt_shape():
    formatter = LogprobFormatter(Letters())
    result = formatter.vllm_prompt([0, 1, 2], [(-0.5, [(1, -0.5)], 1), (-3.0, [(0, -0.1)], 7)])
    assert result == [
        None,
        {"1": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}},
        {
            "0": {"logprob": -0.1, "rank": 1, "decoded_token": "a"},
            "2": {"logprob": -3.0, "rank": 7, "decoded_token": "c"},
        },
    ]
