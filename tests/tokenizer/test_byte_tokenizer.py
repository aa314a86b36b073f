"""The byte tokenizer (``--model random``): round trips, special ids, cut characters."""

from paddle_step.tokenizer.byte import ByteTokenizer


def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 259
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3
    assert min(tok.bos_id, tok.eos_id, tok.pad_id) >= 256
    for text in ["", "hello world", "naïve café ✓ 日本語 🚀"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode([tok.bos_id, 104, 105, tok.eos_id, tok.pad_id]) == "hi"
    # A multi-byte character cut short decodes to U+FFFD instead of raising.
    assert tok.decode(tok.encode("é", add_bos=False)[:1]) == "\ufffd"
