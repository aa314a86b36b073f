"""The sampler's per-row controls against plain NumPy references, on odd sizes: each row
of one batch uses its own mix of controls (or none)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddle_step.layers.sampler import (
    RANK_ROWS,
    SamplingControls,
    apply_controls,
    sample_tokens,
    token_logprobs,
    token_logprobs_and_ranks,
)

ROWS, VOCAB, WIDTH = 5, 37, 11


def padded(rows: list[list[int]], width: int) -> np.ndarray:
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        out[r, : len(row)] = row
    return out


@pytest.fixture()
def case():
    """Logits and per-row controls; row 4 uses none of them."""
    rng = np.random.default_rng(31)
    logits = rng.normal(0, 2, (ROWS, VOCAB))
    outputs = [rng.integers(0, VOCAB, n).tolist() for n in (7, 0, 11, 3, 5)]
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (4, 9, 1, 6, 2)]
    allowed = np.ones((ROWS, VOCAB), dtype=bool)
    allowed[1, ::3] = False  # row 1 is constrained
    banned = [[3, 8], [], [], [0], []]
    bias = [{5: 10.0, 6: -4.5}, {}, {0: 2.0}, {}, {}]
    presence = np.float32([0.5, 0.0, -1.5, 2.0, 0.0])
    frequency = np.float32([0.25, 0.0, 1.0, -0.75, 0.0])
    repetition = np.float32([1.3, 1.0, 0.7, 1.0, 1.0])
    return logits, outputs, prompts, allowed, banned, bias, presence, frequency, repetition


def reference_controls(logits, outputs, prompts, allowed, banned, bias, presence, frequency,
                       repetition) -> np.ndarray:  # fmt: skip
    """Row by row, token by token: the order apply_controls documents."""
    out = logits.copy()
    for r in range(ROWS):
        row = out[r]
        row[~allowed[r]] = -np.inf
        row[banned[r]] = -np.inf
        for token, value in bias[r].items():
            row[token] += np.float64(np.float32(value))
        counts = np.bincount(outputs[r], minlength=VOCAB).astype(np.float64)
        seen = (counts > 0) | (np.bincount(prompts[r], minlength=VOCAB) > 0)
        penalty = np.float64(repetition[r])
        for token in np.flatnonzero(seen):
            row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
        row -= counts * np.float64(frequency[r])
        row -= (counts > 0) * np.float64(presence[r])
    return out


def controls_of(case) -> SamplingControls:
    _, outputs, prompts, allowed, banned, bias, presence, frequency, repetition = case
    width = max(len(b) for b in bias)
    bias_ids = padded([list(b) for b in bias], width)
    bias_values = np.zeros((ROWS, width), dtype=np.float32)
    for r, b in enumerate(bias):
        bias_values[r, : len(b)] = list(b.values())
    return SamplingControls(
        allowed=paddle.to_tensor(allowed),
        banned=paddle.to_tensor(padded(banned, 2)),
        bias_ids=paddle.to_tensor(bias_ids),
        bias_values=paddle.to_tensor(bias_values),
        output_tokens=paddle.to_tensor(padded(outputs, WIDTH)),
        prompt_tokens=paddle.to_tensor(padded(prompts, WIDTH)),
        presence_penalty=paddle.to_tensor(presence),
        frequency_penalty=paddle.to_tensor(frequency),
        repetition_penalty=paddle.to_tensor(repetition),
    )


def test_controls_equal_the_reference_exactly(case):
    logits = case[0]
    got = apply_controls(paddle.to_tensor(logits), controls_of(case)).numpy()
    np.testing.assert_array_equal(got, reference_controls(*case))
    np.testing.assert_array_equal(got[4], logits[4])  # a row without controls is untouched


def test_greedy_rows_take_the_argmax_of_the_controlled_logits(case):
    controlled = apply_controls(paddle.to_tensor(case[0]), controls_of(case))
    tokens = sample_tokens(controlled, paddle.zeros([ROWS]), paddle.ones([ROWS]), None)
    expected = reference_controls(*case).argmax(axis=1)
    assert tokens.numpy().tolist() == expected.tolist()
    assert expected[0] == 5  # row 0's +10 bias wins


def reference_kept(logits, temperature, top_p, top_k, min_p) -> set[int]:
    """The tokens a row may draw: min_p, then top_k, then top_p of what is left."""
    probs = np.exp(logits / temperature - np.max(logits / temperature))
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    kept = [t for t in order if probs[t] > 0 and probs[t] >= min_p * probs[order[0]]]
    kept = kept[: top_k or len(kept)]
    mass, nucleus = 0.0, []
    total = probs[kept].sum()
    for token in kept:
        if mass >= top_p * total:
            break
        nucleus.append(int(token))
        mass += probs[token]
    return set(nucleus)


@pytest.mark.parametrize(
    "top_k, min_p, top_p", [(0, 0.0, 1.0), (4, 0.0, 1.0), (0, 0.2, 1.0), (6, 0.05, 0.7)]
)
def test_draws_reach_exactly_the_kept_tokens(top_k, min_p, top_p):
    rng = np.random.default_rng(top_k + 7)
    # Nine possible tokens, so a fine grid of draws lands on every kept one.
    logits = np.full((3, VOCAB), -np.inf)
    logits[:, :9] = rng.normal(0, 1, (3, 9))
    draws = (np.arange(1500) + 0.5) / 1500
    for r in range(3):
        rows = len(draws)
        tokens = sample_tokens(
            paddle.to_tensor(np.repeat(logits[r : r + 1], rows, axis=0)),
            paddle.full([rows], 0.9),
            paddle.full([rows], top_p),
            paddle.to_tensor(draws),
            top_k=paddle.full([rows], top_k, dtype="int64"),
            min_p=paddle.full([rows], min_p),
        )
        expected = reference_kept(logits[r], np.float64(np.float32(0.9)), top_p, top_k, min_p)
        assert set(tokens.numpy().tolist()) == expected, r


def test_logprobs_equal_a_float64_log_softmax():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (ROWS, VOCAB))
    tokens = rng.integers(0, VOCAB, ROWS)
    chosen, ids, values = token_logprobs(paddle.to_tensor(logits), paddle.to_tensor(tokens), 4)
    reference = logits - logits.max(axis=1, keepdims=True)
    reference -= np.log(np.exp(reference).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(chosen.numpy(), reference[np.arange(ROWS), tokens], rtol=1e-12)
    expected_ids = np.argsort(-reference, axis=1, kind="stable")[:, :4]
    np.testing.assert_array_equal(ids.numpy(), expected_ids)
    np.testing.assert_allclose(values.numpy(), np.take_along_axis(reference, expected_ids, 1),
                               rtol=1e-12)  # fmt: skip
    assert token_logprobs(paddle.to_tensor(logits), paddle.to_tensor(tokens), 0)[1] is None


@pytest.mark.parametrize("rows", [1, RANK_ROWS, 2 * RANK_ROWS + 3])
def test_ranks_count_the_tokens_at_least_as_likely(rows):
    """Rank = the count of tokens whose logprob is at least the token's, itself included
    (ties count against it, as vLLM's); rows counted in pieces give the same counts."""
    rng = np.random.default_rng(rows)
    logits = rng.integers(-4, 4, (rows, VOCAB)).astype(np.float64)  # many ties
    tokens = rng.integers(0, VOCAB, rows)
    chosen, _, _, ranks = token_logprobs_and_ranks(
        paddle.to_tensor(logits), paddle.to_tensor(tokens), 0
    )
    own = logits[np.arange(rows), tokens]
    assert ranks.dtype == paddle.int64
    np.testing.assert_array_equal(ranks.numpy(), (logits >= own[:, None]).sum(axis=1))
    assert chosen.shape == [rows]
