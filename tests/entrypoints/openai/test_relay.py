"""The handler side of one request, without a server or an engine: how ``_relay`` turns
engine events into choices, when it gives up on a client, which draws ``best_of``
answers with once stop strings have cut them, and when ``_sse`` ends a streamed choice."""

from __future__ import annotations

import asyncio
import json
import time

from paddle_step.entrypoints.openai.api_server import _CompletionFormat, _relay, _Run, _sse
from paddle_step.entrypoints.openai.text_stream import StopStrings, TextOptions
from paddle_step.sampling_params import SamplingParams
from paddle_step.tokenizer.byte import ByteTokenizer

A, B, C, X = (ord(letter) for letter in "abcx")


class RecordingLoop:
    """The part of ``EngineLoop`` ``_relay`` calls: aborts, recorded."""

    def __init__(self) -> None:
        self.aborted = []

    def abort(self, handle) -> None:
        self.aborted.append(handle)


def started_run(params: SamplingParams, stops: list[str]) -> tuple[_Run, asyncio.Queue]:
    events: asyncio.Queue = asyncio.Queue()
    run = _Run(0, [A], params, None)
    run.start(ByteTokenizer(), TextOptions(StopStrings(stops)), events)
    return run, events


async def relay_all(run: _Run, events: asyncio.Queue, loop: RecordingLoop) -> None:
    async for _update in _relay(loop, [run], events):
        pass


def test_a_client_that_left_is_noticed_while_tokens_keep_coming():
    async def scenario() -> float:
        run, events = started_run(SamplingParams(max_tokens=10**6, eos_token_id=[]), [])
        loop = RecordingLoop()
        started = time.monotonic()

        async def gone() -> bool:
            return time.monotonic() - started > 0.05

        async def produce() -> None:
            while True:  # a token every millisecond: the queue is never empty for long
                events.put_nowait((0, "token", (0, X, None, None)))
                await asyncio.sleep(0.001)

        producer = asyncio.create_task(produce())
        try:
            async for _update in _relay(loop, [run], events, gone):
                pass
        finally:
            producer.cancel()
        return time.monotonic() - started

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) < 2.0


def token(sample: int, byte: int, logprob: float, finish_reason: str | None = None) -> tuple:
    return 0, "token", (sample, byte, (logprob, []), finish_reason)


def test_best_of_ranks_the_draws_as_cut_by_stop_strings():
    """Every draw stops on "b": the answer is the draw whose tokens up to the stop have the
    highest cumulative logprob, not the first."""
    run, events = started_run(SamplingParams(max_tokens=8, n=1, best_of=3, seed=0), ["b"])
    for event in [token(0, A, -1.0), token(0, B, -1.0),  # "a" + stop: -2
                  token(1, B, -3.0),                     # stop at once: -3
                  token(2, C, -0.5), token(2, B, -0.2),  # "c" + stop: -0.7
                  token(0, X, -0.01)]:  # fmt: skip
        events.put_nowait(event)
    loop = RecordingLoop()
    asyncio.run(asyncio.wait_for(relay_all(run, events, loop), 10))
    [chosen] = run.returned
    assert (chosen.sample, "".join(chosen.pieces), chosen.finish_reason) == (2, "c", "stop")
    assert loop.aborted == [run.handle], "the engine need not go on once every draw stopped"


def test_best_of_may_answer_with_a_draw_the_engine_did_not_pick():
    """The engine ranks draw 0 first on its whole tokens; draw 1 stopped on "b" after one
    token, which the engine does not know of, and ranks first on what is returned. Its
    finish reason comes from its own end: the stop string."""
    run, events = started_run(SamplingParams(max_tokens=2, n=1, best_of=2), ["b"])
    for event in [token(0, X, -2.0), token(1, B, -1.5), token(0, X, -2.0, "length"),
                  token(1, X, -0.1, "length"), (0, "finish", [(0, "length")])]:  # fmt: skip
        events.put_nowait(event)
    asyncio.run(asyncio.wait_for(relay_all(run, events, RecordingLoop()), 10))
    [chosen] = run.returned
    assert (chosen.sample, "".join(chosen.pieces), chosen.finish_reason) == (1, "", "stop")


def test_each_draw_ends_with_the_reason_of_its_last_token():
    """Draws 1 and 2 are answered though the engine reported 0 and 2: draw 1 ran to
    max_tokens ("length"), draw 2 ended on an eos token ("stop")."""
    run, events = started_run(SamplingParams(max_tokens=2, n=2, best_of=3), [])
    for event in [token(0, X, -9.0), token(1, X, -0.1), token(2, X, -0.3, "stop"),
                  token(0, X, -9.0, "length"), token(1, X, -0.1, "length"),
                  (0, "finish", [(0, "length"), (2, "stop")])]:  # fmt: skip
        events.put_nowait(event)
    asyncio.run(asyncio.wait_for(relay_all(run, events, RecordingLoop()), 10))
    assert [(c.sample, c.finish_reason) for c in run.returned] == [(1, "length"), (2, "stop")]


def test_a_streamed_choice_finishes_when_it_ends_not_with_the_last():
    """n = 2: choice 0 ends on its first token; its finish chunk comes before choice 1's
    later text, as OpenAI sends each choice's finish when that choice ends."""
    run, events = started_run(SamplingParams(max_tokens=3, n=2), [])
    for sample, byte, reason in [(0, A, "stop"), (1, A, None), (1, B, None), (1, C, "length")]:
        events.put_nowait((0, "token", (sample, byte, None, reason)))  # no logprobs asked
    events.put_nowait((0, "finish", [(0, "stop"), (1, "length")]))
    fmt = _CompletionFormat("m", None, None, None)

    async def stream() -> list[dict]:
        lines = [line async for line in _sse(RecordingLoop(), [run], events, fmt, False)]
        return [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: {")]

    chunks = [chunk["choices"][0] for chunk in asyncio.run(asyncio.wait_for(stream(), 10))]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in chunks] == [
        (0, "a", None), (0, "", "stop"),
        (1, "a", None), (1, "b", None), (1, "c", None), (1, "", "length"),
    ]  # fmt: skip


def test_the_choices_of_a_request_share_its_stop_string_tables():
    """Built once per request: 900 stop strings of 1,000 characters take ~0.1 s, which
    64 choices each building their own held the event loop for seconds."""
    stops = StopStrings(["ab" * 500, "ba" * 500])
    run, _events = started_run(SamplingParams(max_tokens=4, n=3, seed=0), [])
    run.start(ByteTokenizer(), TextOptions(stops), asyncio.Queue())
    assert all(choice.text._fallbacks is stops.fallbacks for choice in run.samples.values())
