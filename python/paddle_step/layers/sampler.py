"""Token sampling shared by the engine and the naive reference: per-row sampling controls
over a whole batch of logits, the draw, and logprobs.

Every control is per row, so one batch mixes requests that use any of them; each is a
few vectorized paddle ops (over [R, V], or only the ids rows list) and is skipped when no
row of the batch uses it (a ``SamplingControls`` field left None). The order is vLLM's:
the allowed-token mask (structured output), eos/stop masking under ``min_tokens``,
``logit_bias``, the penalties (repetition, then frequency and presence), then greedy rows
take the argmax and the others sample at their temperature from what ``min_p``, ``top_k``
and ``top_p`` keep.

Random draws come from a counter-based generator keyed by (request key, token index)
rather than from a stream consumed step by step, so a request samples the same tokens
whatever else shares its batch and whether or not it was preempted and recomputed. A
request's key comes from its own seed when it has one (so its output does not depend on
its arrival order), else from the engine's seed and its request id.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import paddle

__all__ = [
    "SamplingControls",
    "apply_controls",
    "log_softmax",
    "sample_tokens",
    "sample_key",
    "sampling_key",
    "sampling_uniforms",
    "token_logprobs",
    "token_logprobs_and_ranks",
]

# Rows whose ranks token_logprobs_and_ranks counts at a time.
RANK_ROWS = 64
# put_along_axis broadcasts its indices unless told not to (paddle >= 2.6).
_PUT_OPTIONS = (
    {"broadcast": False}
    if "broadcast" in inspect.signature(paddle.put_along_axis).parameters
    else {}
)

_MASK64 = (1 << 64) - 1


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a well-mixed uint64 for each uint64 input (wraps mod 2**64)."""
    z = values + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sampling_key(seed: int, request_id: int = 0) -> int:
    """The key of a request's draws: a mix of a seed and (for engine-seeded requests) the
    request id."""
    mixed = np.array([(seed & _MASK64) ^ (request_id & _MASK64)], dtype=np.uint64)
    return int(_splitmix64(mixed)[0])


def sample_key(key: int, index: int) -> int:
    """The key of sample ``index`` of a request keyed ``key`` (``n`` > 1): sample 0 keeps
    the request's key, so it draws what the request would alone."""
    return key if index == 0 else sampling_key(key, index)


def sampling_uniforms(keys: np.ndarray, token_index: np.ndarray) -> np.ndarray:
    """One float64 in [0, 1) per entry, a pure function of (key, token index)."""
    keys = np.asarray(keys).astype(np.uint64)
    token_index = np.asarray(token_index).astype(np.uint64)
    bits = _splitmix64(keys ^ _splitmix64(token_index))
    return (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass
class SamplingControls:
    """Per-row controls of one batch on the device ([R] unless noted). A field left None
    is off for every row; a row that does not use a control set for the batch holds its
    neutral value (0 for ``top_k``, penalties and ``min_p``, 1 for ``repetition_penalty``,
    -1 pads for the id tables).

    ``allowed`` [R, V] bool: the tokens a row may take next (structured output).
    ``banned`` [R, S] int64: ids a row may not take now (its eos and stop ids while under
    ``min_tokens``). ``bias_ids``/``bias_values`` [R, K]: ``logit_bias``.
    ``output_tokens`` [R, L] int64: the tokens each row generated so far, -1 pads (for
    ``presence_penalty``, ``frequency_penalty`` and ``repetition_penalty``);
    ``prompt_tokens`` [R, L'] int64: its prompt, -1 pads (``repetition_penalty`` only).
    """

    allowed: paddle.Tensor | None = None
    banned: paddle.Tensor | None = None
    bias_ids: paddle.Tensor | None = None
    bias_values: paddle.Tensor | None = None
    output_tokens: paddle.Tensor | None = None
    prompt_tokens: paddle.Tensor | None = None
    presence_penalty: paddle.Tensor | None = None
    frequency_penalty: paddle.Tensor | None = None
    repetition_penalty: paddle.Tensor | None = None
    top_k: paddle.Tensor | None = None
    min_p: paddle.Tensor | None = None

    def changes_logits(self) -> bool:
        """Whether ``apply_controls`` has anything to do."""
        return any(
            value is not None
            for value in (self.allowed, self.banned, self.bias_ids, self.output_tokens)
        )


def log_softmax(logits: paddle.Tensor) -> paddle.Tensor:
    """Row-wise log-softmax of [R, V] (paddle's own kernel is ~30x slower on the CPU)."""
    shifted = logits - paddle.max(logits, axis=-1, keepdim=True)
    return shifted - paddle.log(paddle.sum(paddle.exp(shifted), axis=-1, keepdim=True))


def apply_controls(logits: paddle.Tensor, controls: SamplingControls) -> paddle.Tensor:
    """The logits [R, V] after the controls that change them, in vLLM's order (the
    allowed mask, ``banned``, the bias, then the penalties); a new tensor.

    Every control but the allowed mask changes only the few ids a row lists, so each is a
    gather, a few ops on [R, N] and a put of those ids, not ops on all of [R, V]: each
    listed id gets exactly what the dense form gives it (the same ops on the same value,
    duplicates the same result) and every other id keeps its logit. Pads (-1) go to a
    scratch column V, dropped at the end."""
    vocab, dtype = logits.shape[1], logits.dtype
    if controls.allowed is not None:
        logits = paddle.where(controls.allowed, logits, paddle.full_like(logits, float("-inf")))
    logits = paddle.concat([logits, paddle.zeros([logits.shape[0], 1], dtype=dtype)], axis=1)
    if controls.banned is not None:
        ids = _to_scratch(controls.banned, vocab)
        logits = _put(logits, ids, paddle.full(ids.shape, float("-inf"), dtype=dtype))
    if controls.bias_ids is not None:
        ids = _to_scratch(controls.bias_ids, vocab)
        biased = paddle.take_along_axis(logits, ids, axis=1) + controls.bias_values.astype(dtype)
        logits = _put(logits, ids, biased)
    if controls.output_tokens is not None:
        logits = _penalize(logits, controls, vocab)
    return logits[:, :vocab]


def _to_scratch(ids: paddle.Tensor, vocab: int) -> paddle.Tensor:
    """``ids`` [R, N] with the pads (< 0) sent to the scratch column ``vocab``."""
    return paddle.where(ids >= 0, ids, paddle.full_like(ids, vocab))


def _put(logits: paddle.Tensor, ids: paddle.Tensor, values: paddle.Tensor) -> paddle.Tensor:
    return paddle.put_along_axis(logits, ids, values, axis=1, **_PUT_OPTIONS)


def _penalize(logits: paddle.Tensor, controls: SamplingControls, vocab: int) -> paddle.Tensor:
    """The penalties on [R, V + 1] logits (scratch column V), at the ids each row
    generated (and, for ``repetition_penalty``, its prompt ids): the only ids whose
    logits they change."""
    dtype = logits.dtype
    output = _to_scratch(controls.output_tokens, vocab)
    ids = output
    if controls.repetition_penalty is not None and controls.prompt_tokens is not None:
        ids = paddle.concat([output, _to_scratch(controls.prompt_tokens, vocab)], axis=1)
    values = paddle.take_along_axis(logits, ids, axis=1)
    if controls.repetition_penalty is not None:
        # vLLM's: over prompt and generated tokens, positive logits divided by the
        # penalty, negative ones multiplied.
        penalty = controls.repetition_penalty.astype(dtype).unsqueeze(1)
        values = paddle.where(values > 0, values / penalty, values * penalty)
    if controls.frequency_penalty is not None:
        # OpenAI's: over generated tokens, minus count * frequency, minus presence once;
        # a prompt id never generated has count 0, which leaves its logit as it is.
        ones = paddle.ones(output.shape, dtype=dtype)
        counts = paddle.zeros(logits.shape, dtype=dtype)
        counts = paddle.put_along_axis(counts, output, ones, axis=1, reduce="add", **_PUT_OPTIONS)
        counts = paddle.take_along_axis(counts, ids, axis=1)
        frequency = controls.frequency_penalty.astype(dtype).unsqueeze(1)
        presence = controls.presence_penalty.astype(dtype).unsqueeze(1)
        values = values - counts * frequency - (counts > 0).astype(dtype) * presence
    return _put(logits, ids, values)


def sample_tokens(
    logits: paddle.Tensor,
    temperature: paddle.Tensor,
    top_p: paddle.Tensor,
    uniforms: paddle.Tensor | None,
    top_k: paddle.Tensor | None = None,
    min_p: paddle.Tensor | None = None,
) -> paddle.Tensor:
    """Next token of each row of ``logits`` [R, V]: int64 [R].

    Rows with ``temperature`` 0 take the argmax (lowest id on ties). The others sample from
    ``softmax(logits / temperature)`` cut to the tokens whose probability is at least
    ``min_p`` times the largest, then to the ``top_k`` most likely (0: all), then to the
    smallest set of most likely tokens whose mass reaches ``top_p`` of what is left
    (nucleus sampling); a token tied with the last one kept is kept too. The draw inverts
    the CDF of the kept tokens, in id order, at ``uniforms`` [R]. ``uniforms`` may be None
    when every row is greedy; ``top_k`` and ``min_p`` None when no row uses them.

    Each cut is a threshold on the probabilities, so no row sorts its whole vocabulary
    unless its nucleus reaches past the ``_NUCLEUS_CANDIDATES`` most likely tokens.
    """
    greedy = paddle.argmax(logits, axis=-1)
    if uniforms is None:
        return greedy
    scale = paddle.clip(temperature, min=1e-6).astype(logits.dtype).unsqueeze(1)
    probs = paddle.nn.functional.softmax(logits / scale, axis=-1)
    cut = (top_p < 1.0).numpy()
    widest = int(paddle.max(top_k)) if top_k is not None else 0
    largest = None
    if widest > 0 or cut.any():
        # One top-W serves both cuts: the top_k floors and the nucleus candidates. It is
        # taken before the min_p cut (whose zeros slow a partition down) and cut alike:
        # the cut keeps the order, so it maps the W largest to the W largest after it.
        largest = _largest(probs, min(max(widest, _NUCLEUS_CANDIDATES), probs.shape[1]))
    if min_p is not None:
        floor = min_p.astype(probs.dtype).unsqueeze(1) * paddle.max(probs, axis=-1, keepdim=True)
        probs = _keep(probs, probs >= floor)
        if largest is not None:
            largest = _keep(largest, largest >= floor)
    if largest is not None:
        if widest > 0:
            probs, largest = _cut_to_top_k(probs, largest, top_k)
        if cut.any():
            floor = _nucleus_floor(probs, largest, top_p, cut)
            probs = _keep(probs, probs >= floor)
    cdf = paddle.cumsum(probs, axis=-1)
    target = uniforms.astype(probs.dtype).unsqueeze(1) * cdf[:, -1:]
    # The first token whose CDF passes the target has mass, so it is a kept one.
    sampled = paddle.clip(paddle.sum((cdf <= target).astype("int64"), axis=-1),
                          max=probs.shape[1] - 1)  # fmt: skip
    # Rounding can put a draw within float precision of 1 past the last kept token,
    # which is then the one drawn.
    chosen = paddle.take_along_axis(probs, sampled.unsqueeze(1), axis=-1).squeeze(1)
    positions = paddle.arange(1, probs.shape[1] + 1, dtype="int64")
    last = paddle.max((probs > 0).astype("int64") * positions, axis=-1) - 1
    sampled = paddle.where(chosen > 0, sampled, paddle.clip(last, min=0))
    return paddle.where(temperature > 0, sampled, greedy)


def _largest(probs: paddle.Tensor, width: int) -> paddle.Tensor:
    """[R, width]: each row's ``width`` largest values, descending. On the CPU, NumPy's
    partition and a sort of the slice give the same values about 3x faster than
    ``paddle.topk`` (NumPy has no bfloat16: those stay on paddle)."""
    if not probs.place.is_cpu_place() or probs.dtype not in (paddle.float32, paddle.float64):
        return paddle.topk(probs, width, axis=-1)[0]
    rows = probs.numpy()
    top = np.partition(rows, rows.shape[1] - width, axis=-1)[:, rows.shape[1] - width :]
    return paddle.to_tensor(np.flip(np.sort(top, axis=-1), axis=-1).copy(), place=probs.place)


def _keep(probs: paddle.Tensor, kept: paddle.Tensor) -> paddle.Tensor:
    """``probs`` where ``kept``, else 0. Probabilities are finite and non-negative, so a
    product with the 0/1 mask is exactly the selection, and on the CPU many times cheaper
    than ``paddle.where`` (which branches per element)."""
    return probs * kept.astype(probs.dtype)


# How many of a row's most likely tokens the nucleus search looks at before it sorts the
# whole row (a full sort of a 32k vocabulary costs far more than the rest of sampling).
_NUCLEUS_CANDIDATES = 64


def _cut_to_top_k(
    probs: paddle.Tensor, largest: paddle.Tensor, top_k: paddle.Tensor
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Keeps each row's ``top_k`` most likely tokens (and ties of the last); 0 keeps all.
    ``largest`` [R, W >= max top_k] are each row's W largest probabilities, descending;
    returns the cut probabilities and ``largest`` cut the same way."""
    width = largest.shape[1]
    position = paddle.clip(top_k - 1, min=0, max=width - 1).unsqueeze(1)
    floor = paddle.take_along_axis(largest, position, axis=-1)
    floor = paddle.where(top_k.unsqueeze(1) > 0, floor, paddle.zeros_like(floor))
    return _keep(probs, probs >= floor), _keep(largest, largest >= floor)


def _nucleus_floor(
    probs: paddle.Tensor, largest: paddle.Tensor, top_p: paddle.Tensor, cut: np.ndarray
) -> paddle.Tensor:
    """[R, 1]: the probability of the least likely token of each row's nucleus (0 for
    rows that ``cut`` leaves whole): of its tokens by decreasing probability, the last
    one whose predecessors' mass is under ``top_p`` of the row's total. ``largest`` are
    the row's most likely probabilities, descending (the candidates)."""
    need = top_p.astype(probs.dtype).unsqueeze(1) * paddle.sum(probs, axis=-1, keepdim=True)
    floor, covered = _floor_among(largest, need)
    # Rows whose nucleus may reach past the candidates sort their whole row.
    longer = np.flatnonzero(cut & ~covered.numpy())
    if longer.size and largest.shape[1] < probs.shape[1]:
        rows = paddle.to_tensor(longer)
        ordered = paddle.sort(paddle.gather(probs, rows), axis=-1, descending=True)
        floor = paddle.scatter(floor, rows, _floor_among(ordered, paddle.gather(need, rows))[0])
    keep_whole = paddle.to_tensor(~cut).unsqueeze(1)
    return paddle.where(keep_whole, paddle.zeros_like(floor), floor)


def _floor_among(
    ordered: paddle.Tensor, need: paddle.Tensor
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """For rows of probabilities in decreasing order [R, W]: the last value whose
    predecessors' mass is under ``need`` [R, 1], and whether the nucleus surely ends
    within these W values."""
    cumulative = paddle.cumsum(ordered, axis=-1)
    inside = paddle.sum((cumulative - ordered < need).astype("int64"), axis=-1, keepdim=True)
    floor = paddle.take_along_axis(ordered, paddle.clip(inside - 1, min=0), axis=-1)
    covered = (inside < ordered.shape[1]).squeeze(1) | (cumulative[:, -1:] >= need).squeeze(1)
    return floor, covered


def token_logprobs(
    logits: paddle.Tensor, tokens: paddle.Tensor, top: int
) -> tuple[paddle.Tensor, paddle.Tensor | None, paddle.Tensor | None]:
    """Logprobs of the raw distribution of each row of ``logits`` [R, V] (a log-softmax in
    the logits' dtype): of ``tokens`` [R], and the ``top`` most likely ids and their
    logprobs ([R, top] each, most likely first; None when ``top`` is 0)."""
    return _logprobs_of_tokens(log_softmax(logits), tokens, top)


def token_logprobs_and_ranks(
    logits: paddle.Tensor, tokens: paddle.Tensor, top: int
) -> tuple[paddle.Tensor, paddle.Tensor | None, paddle.Tensor | None, paddle.Tensor]:
    """``token_logprobs`` and each token's rank [R] (int64): how many tokens of its row
    have a logprob at least its own, itself included (1 = most likely; vLLM's rank).
    R >= 1 (paddle 2.6 reduces no empty tensor)."""
    logprobs = log_softmax(logits)
    chosen, ids, values = _logprobs_of_tokens(logprobs, tokens, top)
    # Counted RANK_ROWS rows at a time: a whole prefill's [R, V] comparison would take a
    # quarter of the memory of its logits more (a sum of booleans is int64).
    counts = [
        paddle.sum(logprobs[i : i + RANK_ROWS] >= chosen[i : i + RANK_ROWS].unsqueeze(1), axis=-1)
        for i in range(0, logprobs.shape[0], RANK_ROWS)
    ]
    ranks = paddle.concat(counts).astype("int64")
    return chosen, ids, values, ranks


def _logprobs_of_tokens(
    logprobs: paddle.Tensor, tokens: paddle.Tensor, top: int
) -> tuple[paddle.Tensor, paddle.Tensor | None, paddle.Tensor | None]:
    chosen = paddle.take_along_axis(logprobs, tokens.unsqueeze(1), axis=-1).squeeze(1)
    if top == 0:
        return chosen, None, None
    values, ids = paddle.topk(logprobs, top, axis=-1)
    return chosen, ids, values
