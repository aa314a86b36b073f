"""The messages between the server's client (``core_client``) and its engine process
(``core_proc``), pickled over two one-way pipes. No paddle: the HTTP process imports them.

Server to engine: ``AddRequest``, ``AbortRequest``, ``Stop``. Engine to server: ``Ready``
once, then ``StepOutput`` after each step that produced anything, and ``EngineFailed``
as its last word if it cannot go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling_params import SamplingParams

__all__ = [
    "AbortRequest",
    "AddRequest",
    "EngineFailed",
    "Ready",
    "StepOutput",
    "Stop",
]


# ---------------------------------------------------------------- server -> engine


@dataclass(frozen=True)
class AddRequest:
    key: int  # the request's id between the two processes
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    key: int


@dataclass(frozen=True)
class Stop:
    """Finish nothing more and exit (the server's pipe closing means the same)."""


# ---------------------------------------------------------------- engine -> server


@dataclass
class Ready:
    """The model is loaded. ``info``: model name, ``max_model_len``, ``vocab_size``, pool
    sizes, threads; ``stats``: the counters ``/metrics`` shows."""

    info: dict
    stats: dict


# Logprobs as the server reads them: (the token's logprob, [(token id, logprob), ..] of
# the asked number of most likely tokens, most likely first, the token's rank at a prompt
# position or None).
Logprobs = tuple[float, list[tuple[int, float]], int | None]


@dataclass
class StepOutput:
    """One step's results, in one message. ``cached``: ``(key, prompt tokens from the
    prefix cache)`` of the requests it admitted; ``tokens``: ``(key, (sample, token id,
    logprobs or None))`` in the order generated; ``prompt_logprobs``: ``(key, [logprobs
    per prompt position after the first])`` of requests whose prompt it completed that
    asked; ``finished``: ``(key, [(sample, finish reason), ..])``, the samples to answer
    with in choice order (the ``n`` best of ``best_of``); ``refused``: ``(key, message)``
    for requests the engine would not add (a ``ValueError`` of its own)."""

    cached: list[tuple[int, int]] = field(default_factory=list)
    tokens: list[tuple[int, tuple[int, int, Logprobs | None]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, list[Logprobs]]] = field(default_factory=list)
    finished: list[tuple[int, list[tuple[int, str]]]] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


@dataclass
class EngineFailed:
    """The engine could not start or raised while stepping; it exits after sending this.
    ``details``: the traceback, which the server logs once."""

    message: str
    details: str = ""
