"""Logprobs in the shapes OpenAI clients parse: the completions API's ``{tokens,
token_logprobs, top_logprobs, text_offset}``, the chat API's ``content`` list, and vLLM's
``prompt_logprobs``.

An entry is what the engine reports for one position: ``(logprob, [(token_id, logprob),
..], rank)``, the token's own logprob, the most likely alternatives and, at a prompt
position, the token's rank (None elsewhere), or None where there is none (the first prompt
token). Tokens are shown as their own decoded text, so a token
holding part of a multi-byte character shows U+FFFD (as vLLM's do).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["LogprobFormatter"]

Entry = tuple[float, list[tuple[int, float]], int | None] | None


class LogprobFormatter:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """The token's own text (special tokens included), cached per id."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def completion(self, tokens: Sequence[int], entries: Sequence[Entry], offset: int) -> dict:
        """The completions API's object for ``tokens`` (whose text starts at character
        ``offset`` of the choice's text); ``top_logprobs`` maps each alternative's text
        to its logprob and holds the token itself too."""
        texts, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token, entry in zip(tokens, entries):
            text = self.text(token)
            texts.append(text)
            text_offset.append(offset)
            offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            logprob, top, _rank = entry
            token_logprobs.append(logprob)
            alternatives = {self.text(other): other_logprob for other, other_logprob in top}
            alternatives.setdefault(text, logprob)
            top_logprobs.append(alternatives)
        return {
            "tokens": texts,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }

    def _chat_token(self, token: int, logprob: float) -> dict:
        text = self.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, tokens: Sequence[int], entries: Sequence[Entry]) -> list[dict]:
        """The chat API's ``logprobs.content``: per token, its logprob and
        ``top_logprobs`` (the asked number of most likely tokens)."""
        content = []
        for token, (logprob, top, _rank) in zip(tokens, entries):
            item = self._chat_token(token, logprob)
            item["top_logprobs"] = [self._chat_token(other, value) for other, value in top]
            content.append(item)
        return content

    def vllm_prompt(self, prompt_ids: Sequence[int], entries: Sequence[Entry]) -> list:
        """vLLM's ``prompt_logprobs``: None for the first token, then per position a map
        from token id (as a string key) to ``{logprob, rank, decoded_token}``; ``rank`` (1
        = most likely) is the place in the list of a listed alternative, and for a prompt
        token outside the list the engine's count of tokens at least as likely."""
        result: list = [None]
        for token, (logprob, top, rank) in zip(prompt_ids[1:], entries):
            ranks = {other: rank for rank, (other, _value) in enumerate(top, start=1)}
            position = {
                str(other): {"logprob": value, "rank": ranks[other],
                             "decoded_token": self.text(other)}
                for other, value in top
            }  # fmt: skip
            position.setdefault(
                str(token),
                {
                    "logprob": logprob,
                    "rank": ranks.get(token, rank),
                    "decoded_token": self.text(token),
                },
            )
            result.append(position)
        return result
