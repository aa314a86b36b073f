"""TextStream: final text only, multi-byte characters whole, stop strings honoured."""

from paddle_step.serving.text_stream import TextStream


def byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def feed(stream, text):
    return [stream.add(byte) for byte in text.encode("utf-8")]


def test_multibyte_character_waits_for_its_last_byte():
    stream = TextStream(byte_decode)
    deltas = feed(stream, "a✓b")
    assert deltas == ["a", "", "", "✓", "b"]
    assert stream.finish() == ""


def test_stop_string_ends_text_before_it():
    stream = TextStream(byte_decode, stops=["END"])
    deltas = feed(stream, "abcENDxyz")
    assert "".join(deltas) + stream.finish() == "abc"
    assert stream.stopped
    assert stream.num_tokens == 6  # tokens after the stop are not taken


def test_possible_stop_prefix_is_held_then_released():
    stream = TextStream(byte_decode, stops=["STOP"])
    deltas = feed(stream, "aST")
    assert deltas == ["a", "", ""]  # "S", "ST" could begin "STOP"
    assert stream.add(ord("x")) == "STx"
    assert not stream.stopped


def test_unfinished_prefix_released_at_the_end():
    stream = TextStream(byte_decode, stops=["STOP"])
    assert "".join(feed(stream, "abSTO")) == "ab"
    assert stream.finish() == "STO"


def test_stop_spanning_tokens_and_several_stops():
    stream = TextStream(byte_decode, stops=["zz", "\n\n"])
    text = "".join(feed(stream, "one\ntwo\n\nthree"))
    assert text + stream.finish() == "one\ntwo"
