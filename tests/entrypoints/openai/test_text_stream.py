"""TextStream: final text only, multi-byte characters whole, stop strings honoured."""

from paddle_step.entrypoints.openai.text_stream import TextStream
from paddle_step.tokenizer.byte import ByteTokenizer
from paddle_step.tokenizer.detokenizer import IncrementalDetokenizer


def byte_stream(stops=()):
    return TextStream(IncrementalDetokenizer(ByteTokenizer(), skip_special_tokens=True), stops)


def feed(stream, text):
    return [stream.add(byte) for byte in text.encode("utf-8")]


def test_multibyte_character_waits_for_its_last_byte():
    stream = byte_stream()
    deltas = feed(stream, "a✓b")
    assert deltas == ["a", "", "", "✓", "b"]
    assert stream.finish() == ""


def test_stop_string_ends_text_before_it():
    stream = byte_stream(["END"])
    deltas = feed(stream, "abcENDxyz")
    assert "".join(deltas) + stream.finish() == "abc"
    assert stream.stopped
    assert stream.num_tokens == 6  # tokens after the stop are not taken


def test_possible_stop_prefix_is_held_then_released():
    stream = byte_stream(["STOP"])
    deltas = feed(stream, "aST")
    assert deltas == ["a", "", ""]  # "S", "ST" could begin "STOP"
    assert stream.add(ord("x")) == "STx"
    assert not stream.stopped


def test_unfinished_prefix_released_at_the_end():
    stream = byte_stream(["STOP"])
    assert "".join(feed(stream, "abSTO")) == "ab"
    assert stream.finish() == "STO"


def test_stop_spanning_tokens_and_several_stops():
    stream = byte_stream(["zz", "\n\n"])
    text = "".join(feed(stream, "one\ntwo\n\nthree"))
    assert text + stream.finish() == "one\ntwo"


def test_cut_character_at_the_end_is_flushed_as_replacement():
    stream = byte_stream()
    assert feed(stream, "a") == ["a"]
    assert stream.add(0xE2) == ""  # the first byte of a three-byte character
    assert stream.finish() == "\ufffd"
