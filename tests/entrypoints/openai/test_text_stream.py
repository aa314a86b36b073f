"""TextStream: final text only, multi-byte characters whole, stop strings honoured."""

from paddle_step.entrypoints.openai.text_stream import StopStrings, TextStream
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


def test_a_kept_stop_string_ends_the_text_after_it():
    stream = byte_stream(StopStrings(["END", "cE"], included=True))
    deltas = feed(stream, "abcENDxyz")
    assert "".join(deltas) + stream.finish() == "abcE"  # "cE" completes first
    assert stream.stopped and stream.num_tokens == 4


def test_a_stop_token_adds_text_only_where_stops_are_kept():
    for included, expected in ((False, "ab"), (True, "abc")):
        stream = byte_stream(StopStrings([], included))
        deltas = [stream.add(ord("a")), stream.add(ord("b")), stream.add(ord("c"), stop_token=True)]
        assert "".join(deltas) + stream.finish() == expected
        assert stream.num_tokens == 3  # counted either way


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


def held_back_reference(text: str, stops: list[str]) -> int:
    """The longest tail of ``text`` that begins some stop string, by brute force."""
    return max(
        (length for stop in stops for length in range(1, min(len(stop) - 1, len(text)) + 1)
         if text.endswith(stop[:length])),
        default=0,
    )  # fmt: skip


def test_held_back_tail_equals_brute_force_on_random_texts():
    """Each delta releases exactly the text no stop string could still begin: stop strings
    with repeats (aab, abab, aaaa) over a 3-letter alphabet, where the matches overlap."""
    import random

    rng = random.Random(5)
    for _ in range(300):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(2, 5))) for _ in range(3)]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 40)))
        stream, sent = byte_stream(stops), ""
        for index, char in enumerate(text):
            sent += stream.add(ord(char))
            seen = text[: index + 1]
            if stream.stopped:  # the text ends just before the stop string just completed
                assert seen.startswith(sent) and any(seen[len(sent) :] == s for s in stops)
                break
            assert sent == seen[: len(seen) - held_back_reference(seen, stops)], (stops, seen)


def test_many_long_stop_strings_cost_little_per_token():
    """900 stop strings of ~1,000 characters: each token costs its own length per stop
    string (every tail length was compared before: tens of ms a token)."""
    import time

    stops = [f"{index:04d}" + "x" * 1000 for index in range(900)]
    stream = byte_stream(stops)
    started = time.perf_counter()
    deltas = feed(stream, "the quick brown fox " * 30)
    assert "".join(deltas) == "the quick brown fox " * 30
    assert time.perf_counter() - started < 5.0  # 600 tokens: ~0.2 s here, ~14 s before
