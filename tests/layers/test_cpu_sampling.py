"""The fused CPU sampling op (layers/cpu_sampling.py) against a float64 NumPy reference
of sampler.py's semantics and against the paddle path (apply_controls, sample_tokens,
token_logprobs), on odd vocabulary sizes: each control alone and all of them mixed per
row, ties, the edges of top_p/top_k/min_p, uniforms near 0 and 1, greedy rows among
sampled ones."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import paddle_step_ops
from paddle_step.layers import cpu_linear, cpu_sampling
from paddle_step.layers.sampler import (
    SamplingControls,
    apply_controls,
    sample_tokens,
    token_logprobs,
    token_logprobs_and_ranks,
)
from paddle_step.sampling_params import pack_token_mask, unpack_token_mask

VOCABS = (1, 7, 1000, 2053)
CONTROLS = ("allowed", "stop", "bias", "penalties", "repetition", "top_k", "min_p", "top_p")


def padded(rows: list[list[int]], width: int) -> np.ndarray:
    out = np.full((len(rows), max(width, 1)), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        out[r, : len(row)] = row
    return out


class Batch:
    """Logits and per-row controls, as the slot state holds them; ``uses`` names the
    controls set for the batch (the others are None)."""

    def __init__(self, rows: int, vocab: int, uses: set[str], seed: int, ties: bool = False):
        rng = np.random.default_rng(seed)
        self.rows, self.vocab, self.uses = rows, vocab, uses
        scale = rng.uniform(0.5, 4.0, (rows, 1))
        logits = rng.normal(0, 1, (rows, vocab)) * scale
        if ties:  # few distinct values: ties everywhere, at every cut
            logits = np.round(logits * 2) / 2
        self.logits = logits.astype(np.float32)
        self.temperature = rng.choice([0.0, 0.3, 0.8, 1.0, 1.7], rows).astype(np.float32)
        self.uniforms = rng.uniform(0, 1, rows)
        self.uniforms[:2] = [0.0, 1 - 2.0**-53][: min(rows, 2)]  # the ends of the draw
        self.top_p = np.where(rng.uniform(0, 1, rows) < 0.7, rng.uniform(0.05, 1, rows), 1.0)
        self.top_p = (self.top_p if "top_p" in uses else np.ones(rows)).astype(np.float32)
        self.top_k = rng.choice([0, 1, 2, 5, vocab, vocab + 3], rows).astype(np.int64)
        self.min_p = rng.choice([0.0, 0.01, 0.2, 0.9, 1.0], rows).astype(np.float32)
        self.allowed = rng.uniform(0, 1, (rows, vocab)) < 0.6
        self.allowed[np.arange(rows), rng.integers(0, vocab, rows)] = True  # one at least
        self.allowed[-1] = True  # a row the mask leaves whole
        self.step_idx = rng.integers(0, 9, rows).astype(np.int64)
        self.min_tokens = rng.choice([0, 3, 20], rows).astype(np.int64)
        # Fewer stop ids than tokens: a row left nothing to draw has no defined draw.
        self.stop = [rng.choice(vocab, min(vocab - 1, 3), replace=False).tolist()
                     for _ in range(rows)]  # fmt: skip
        self.bias = [
            dict(zip(rng.choice(vocab, min(vocab, k), replace=False).tolist(),
                     rng.normal(0, 3, k).astype(np.float32).tolist()))
            for k in rng.integers(0, 5, rows)
        ]  # fmt: skip
        width = 12
        self.pre_ids = np.full((rows, width), -1, dtype=np.int64)
        for r in range(rows):
            self.pre_ids[r, 1 : self.step_idx[r] + 1] = rng.integers(0, vocab, self.step_idx[r])
        self.prompts = [rng.integers(0, vocab, rng.integers(1, 8)).tolist() for _ in range(rows)]
        self.presence = rng.choice([0.0, 0.5, -1.5, 2.0], rows).astype(np.float32)
        self.frequency = rng.choice([0.0, 0.25, 1.0, -0.75], rows).astype(np.float32)
        self.repetition = rng.choice([1.0, 1.3, 0.7, 2.0], rows).astype(np.float32)

    # ---- the three implementations ------------------------------------------------

    def op(self, logprobs_top: int | None = None, uniforms: bool = True):
        uses, t = self.uses, paddle.to_tensor
        controls = {}
        if "allowed" in uses:
            controls["allowed_bits"] = t(pack_token_mask(self.allowed))
        if "stop" in uses:
            controls.update(stop_ids=t(padded(self.stop, 3)), min_tokens=t(self.min_tokens))
        if "bias" in uses:
            ids, values = self._bias_table()
            controls.update(bias_ids=t(ids), bias_values=t(values))
        if uses & {"penalties", "repetition", "stop"}:
            controls["step_idx"] = t(self.step_idx)
        if uses & {"penalties", "repetition"}:
            controls["output_ids"] = t(self.pre_ids)
        if "penalties" in uses:
            controls.update(presence_penalty=t(self.presence), frequency_penalty=t(self.frequency))
        if "repetition" in uses:
            controls.update(repetition_penalty=t(self.repetition),
                            prompt_ids=t(padded(self.prompts, 9)))  # fmt: skip
        if "top_k" in uses:
            controls["top_k"] = t(self.top_k)
        if "min_p" in uses:
            controls["min_p"] = t(self.min_p)
        tokens, logprobs = cpu_sampling.sample(
            t(self.logits), t(self.temperature), t(self.top_p),
            t(self.uniforms) if uniforms else None, logprobs_top=logprobs_top, **controls,
        )  # fmt: skip
        return tokens.numpy(), logprobs

    def paddle_path(self, logprobs_top: int | None = None):
        uses, t = self.uses, paddle.to_tensor
        controls = SamplingControls()
        if "allowed" in uses:
            controls.allowed = t(self.allowed)
        if "stop" in uses:
            under = (self.step_idx < self.min_tokens)[:, None]
            controls.banned = t(np.where(under, padded(self.stop, 3), -1))
        if "bias" in uses:
            ids, values = self._bias_table()
            controls.bias_ids, controls.bias_values = t(ids), t(values)
        if uses & {"penalties", "repetition"}:
            columns = np.arange(self.pre_ids.shape[1])
            generated = (columns >= 1) & (columns <= self.step_idx[:, None])
            controls.output_tokens = t(np.where(generated, self.pre_ids, -1))
            on = "penalties" in uses  # repetition alone leaves them neutral (0)
            controls.presence_penalty = t(self.presence * on)
            controls.frequency_penalty = t(self.frequency * on)
        if "repetition" in uses:
            controls.repetition_penalty = t(self.repetition)
            controls.prompt_tokens = t(padded(self.prompts, 9))
        logits = t(self.logits)
        processed = apply_controls(logits, controls) if controls.changes_logits() else logits
        tokens = sample_tokens(
            processed, t(self.temperature), t(self.top_p), t(self.uniforms),
            top_k=t(self.top_k) if "top_k" in uses else None,
            min_p=t(self.min_p) if "min_p" in uses else None,
        )  # fmt: skip
        logprobs = None
        if logprobs_top is not None:
            logprobs = token_logprobs(logits, tokens, logprobs_top)
        return tokens.numpy(), logprobs

    def reference(self, uniforms: bool = True) -> np.ndarray:
        return np.array([self._reference_row(r, uniforms) for r in range(self.rows)])

    def reference_controls(self, r: int) -> np.ndarray:
        """Row ``r``'s controlled logits, in float64, in the documented order."""
        uses, vocab = self.uses, self.vocab
        row = self.logits[r].astype(np.float64)
        if "allowed" in uses:
            row[~self.allowed[r]] = -np.inf
        if "stop" in uses and self.step_idx[r] < self.min_tokens[r]:
            row[self.stop[r]] = -np.inf
        if "bias" in uses:
            for token, value in self.bias[r].items():
                row[token] += value
        outputs = self.pre_ids[r, 1 : self.step_idx[r] + 1]
        counts = np.bincount(outputs, minlength=vocab).astype(np.float64)
        if "repetition" in uses:
            seen = (counts > 0) | (np.bincount(self.prompts[r], minlength=vocab) > 0)
            penalty = np.float64(self.repetition[r])
            row[seen] = np.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
        if "penalties" in uses:
            presence, frequency = np.float64(self.presence[r]), np.float64(self.frequency[r])
            row -= counts * frequency + (counts > 0) * presence
        return row

    def _reference_row(self, r: int, uniforms: bool) -> int:
        row = self.reference_controls(r)
        if not uniforms or self.temperature[r] <= 0:
            return int(np.argmax(row))
        scaled = row / np.float64(self.temperature[r])
        e = np.exp(scaled - scaled.max())
        kept = e > 0
        if "min_p" in self.uses:
            kept &= e >= self.min_p[r]
        if "top_k" in self.uses and 0 < self.top_k[r] < kept.sum():
            kept &= e >= np.sort(e[kept])[::-1][self.top_k[r] - 1]
        if self.top_p[r] < 1:
            need = np.float64(self.top_p[r]) * e[kept].sum()
            mass, floor = 0.0, None
            for value in np.sort(e[kept])[::-1]:
                if floor is not None and mass >= need:
                    break
                floor, mass = value, mass + value
            kept &= e >= floor
        weights = np.where(kept, e, 0.0)
        cdf = np.cumsum(weights)
        past = np.flatnonzero(cdf > self.uniforms[r] * cdf[-1])
        return int(past[0]) if past.size else int(np.flatnonzero(kept)[-1])

    def _bias_table(self) -> tuple[np.ndarray, np.ndarray]:
        width = max(5, max(len(b) for b in self.bias))
        ids = padded([list(b) for b in self.bias], width)
        values = np.zeros((self.rows, width), dtype=np.float32)
        for r, b in enumerate(self.bias):
            values[r, : len(b)] = list(b.values())
        return ids, values


def reference_logprobs(logits: np.ndarray, tokens: np.ndarray, top: int):
    x = logits.astype(np.float64)
    logprobs = x - x.max(axis=1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(axis=1, keepdims=True))
    ids = np.argsort(-logprobs, axis=1, kind="stable")[:, :top]
    return logprobs[np.arange(len(x)), tokens], ids, np.take_along_axis(logprobs, ids, 1)


def assert_reference_logprobs(logits, tokens, top, chosen, ids, values) -> None:
    """The op's chosen logprobs, and its top ``top`` ids and values (None for top 0), equal
    ``reference_logprobs``' within float32 rounding."""
    ref_chosen, ref_ids, ref_values = reference_logprobs(logits, tokens, top)
    np.testing.assert_allclose(chosen.numpy(), ref_chosen, rtol=2e-6, atol=2e-6)
    if top == 0:
        assert ids is None and values is None
        return
    np.testing.assert_array_equal(ids.numpy(), ref_ids)
    np.testing.assert_allclose(values.numpy(), ref_values, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("control", (*CONTROLS, "none", "all"))
def test_each_control_equals_the_reference_and_the_paddle_path(float_isa_path, vocab, control):
    uses = set(CONTROLS) if control == "all" else set() if control == "none" else {control}
    batch = Batch(rows=23, vocab=vocab, uses=uses, seed=vocab + len(control))
    tokens, _ = batch.op()
    np.testing.assert_array_equal(tokens, batch.reference())
    assert_equal_but_the_last_draw(tokens, batch.paddle_path()[0])


def assert_equal_but_the_last_draw(tokens: np.ndarray, paddle_tokens: np.ndarray) -> None:
    """The paddle path's tokens but for row 1's, whose uniform is 1 - 2**-53: that path
    rounds the draw to float32 (1.0), which lands on the last token of nonzero float32
    probability, a denormal one the op and the reference weigh 0."""
    np.testing.assert_array_equal(np.delete(tokens, 1), np.delete(paddle_tokens, 1))


@pytest.mark.parametrize("vocab", (7, 1000, 2053))
def test_ties_keep_the_lowest_id_greedy_and_every_tied_token_at_each_cut(float_isa_path, vocab):
    batch = Batch(rows=31, vocab=vocab, uses=set(CONTROLS), seed=5, ties=True)
    tokens, _ = batch.op()
    np.testing.assert_array_equal(tokens, batch.reference())
    assert_equal_but_the_last_draw(tokens, batch.paddle_path()[0])
    greedy, _ = batch.op(uniforms=False)
    np.testing.assert_array_equal(greedy, batch.reference(uniforms=False))


@pytest.mark.parametrize("top_k, min_p, top_p", [
    (1, 0.0, 1.0), (2, 0.0, 1.0), (0, 1.0, 1.0), (0, 0.0, 1e-6), (3, 0.5, 0.5), (0, 0.0, 0.999),
])  # fmt: skip
def test_draws_reach_exactly_the_kept_tokens(float_isa_path, top_k, min_p, top_p):
    """A fine grid of uniforms over one row: the drawn set is exactly the kept set, and
    each token's share of the grid is its probability among the kept."""
    rng = np.random.default_rng(top_k + 11)
    vocab, rows = 101, 4000
    logits = np.full(vocab, -np.inf, dtype=np.float32)
    logits[rng.choice(vocab, 12, replace=False)] = rng.normal(0, 1, 12)
    batch = Batch(rows=rows, vocab=vocab, uses={"top_k", "min_p", "top_p"}, seed=1)
    batch.logits[:] = logits
    batch.temperature[:] = 0.9
    batch.top_k[:], batch.min_p[:], batch.top_p[:] = top_k, min_p, top_p
    batch.uniforms = (np.arange(rows) + 0.5) / rows
    tokens, _ = batch.op()
    np.testing.assert_array_equal(tokens, batch.reference())
    e = np.exp(logits / np.float32(0.9) - np.max(logits / np.float32(0.9)))
    kept = sorted(set(tokens.tolist()))
    shares = np.bincount(tokens, minlength=vocab)[kept] / rows
    np.testing.assert_allclose(shares, e[kept] / e[kept].sum(), atol=2 / rows)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("top", (0, 1, 5))
def test_logprobs_are_the_raw_log_softmax(float_isa_path, vocab, top):
    top = min(top, vocab)
    batch = Batch(rows=9, vocab=vocab, uses=set(CONTROLS), seed=vocab + top)
    batch.logits[0, :3] = batch.logits[0].max()  # ties among the most likely
    tokens, (chosen, ids, values) = batch.op(logprobs_top=top)
    assert_reference_logprobs(batch.logits, tokens, top, chosen, ids, values)
    paddle_chosen = token_logprobs(paddle.to_tensor(batch.logits), paddle.to_tensor(tokens), 1)[0]
    np.testing.assert_allclose(chosen.numpy(), paddle_chosen.numpy(), rtol=2e-6, atol=2e-6)


def test_logprobs_equal_the_paddle_path_and_sampling_is_unchanged_by_them():
    batch = Batch(rows=17, vocab=1000, uses=set(CONTROLS), seed=8)
    tokens, (chosen, ids, values) = batch.op(logprobs_top=4)
    np.testing.assert_array_equal(tokens, batch.op()[0])
    paddle_tokens, (p_chosen, p_ids, p_values) = batch.paddle_path(logprobs_top=4)
    assert_equal_but_the_last_draw(tokens, paddle_tokens)
    np.testing.assert_allclose(chosen.numpy(), p_chosen.numpy(), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(ids.numpy(), p_ids.numpy())
    np.testing.assert_allclose(values.numpy(), p_values.numpy(), rtol=2e-6, atol=2e-6)


def test_rows_split_over_threads_equal_the_reference():
    """Rows run in parallel on the CPU kernels' threads: a large batch over 3 threads."""
    batch = Batch(rows=520, vocab=2053, uses=set(CONTROLS), seed=12)
    threads = cpu_linear.num_threads()
    try:
        cpu_linear.set_num_threads(3)
        tokens, (chosen, ids, _) = batch.op(logprobs_top=2)
    finally:
        cpu_linear.set_num_threads(threads)
    np.testing.assert_array_equal(tokens, batch.reference())
    ref_chosen, ref_ids, _ = reference_logprobs(batch.logits, tokens, 2)
    np.testing.assert_allclose(chosen.numpy(), ref_chosen, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(ids.numpy(), ref_ids)


def test_rows_of_a_column_slice_and_a_batch_of_one_row():
    batch = Batch(rows=6, vocab=1000, uses=set(CONTROLS), seed=4)
    wide = paddle.to_tensor(np.concatenate([batch.logits, batch.logits[:, :5]], axis=1))
    t = paddle.to_tensor
    tokens, _ = cpu_sampling.sample(wide[:, :1000], t(batch.temperature), t(batch.top_p),
                                    t(batch.uniforms))  # fmt: skip
    plain = Batch(rows=6, vocab=1000, uses={"top_p"}, seed=4)
    np.testing.assert_array_equal(tokens.numpy(), plain.reference())
    one, _ = cpu_sampling.sample(t(batch.logits[:1]), t(batch.temperature[:1]),
                                 t(batch.top_p[:1]), None)  # fmt: skip
    assert one.numpy().tolist() == [int(np.argmax(batch.logits[0]))]


def test_bad_arguments_name_the_argument_the_expected_and_the_received():
    t = paddle.to_tensor
    logits = t(np.zeros((3, 7), dtype=np.float32))
    temperature, top_p = t(np.ones(3, np.float32)), t(np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"'logits': expected dtype float32, got dtype float64"):
        cpu_sampling.sample(t(np.zeros((3, 7))), temperature, top_p, None)
    with pytest.raises(ValueError, match=r"'top_p': expected shape \[3\], got shape \[2\]"):
        cpu_sampling.sample(logits, temperature, top_p[:2], None)
    ids = t(np.zeros((3, 2), np.int64))
    with pytest.raises(ValueError, match=r"'top_logprobs': expected -1 .* or 0 .. 7, got 8"):
        cpu_sampling.sample(logits, temperature, top_p, None, logprobs_top=8)
    with pytest.raises(ValueError, match=r"'bias_values': expected a tensor \(bias_ids is given\)"):
        cpu_sampling.sample(logits, temperature, top_p, None, bias_ids=ids)
    with pytest.raises(ValueError, match=r"'step_idx': expected a tensor \(output_ids is given"):
        cpu_sampling.sample(logits, temperature, top_p, None,
                            output_ids=ids, repetition_penalty=temperature)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"'allowed_bits': expected shape \[3, 1\], got shape \[3, 2\]"
    ):
        cpu_sampling.sample(
            logits, temperature, top_p, None, allowed_bits=t(np.ones((3, 2), np.int32))
        )
    with pytest.raises(TypeError, match=r"unknown controls \['top_q'\], expected some of \["):
        cpu_sampling.sample(logits, temperature, top_p, None, top_k=ids[:, 0], top_q=top_p)


@pytest.mark.parametrize("vocab", (1, 31, 32, 33, 1000, 2053))
def test_token_masks_pack_as_llguidance_lays_them_out(vocab):
    """Bit j of int32 word w is token 32 w + j; the bits past the vocabulary are 0."""
    mask = np.random.default_rng(vocab).uniform(0, 1, (3, vocab)) < 0.5
    words = pack_token_mask(mask)
    assert words.dtype == np.int32 and words.shape == (3, (vocab + 31) // 32)
    for token in range(vocab):
        bit = (int(words[1, token // 32]) >> (token % 32)) & 1
        assert bit == mask[1, token]
    assert not unpack_token_mask(words, 32 * words.shape[1])[:, vocab:].any()
    np.testing.assert_array_equal(unpack_token_mask(words, vocab), mask)


def test_supports_only_float32_on_the_cpu():
    assert cpu_sampling.supports(paddle.zeros([2, 3], dtype="float32"))
    assert not cpu_sampling.supports(paddle.zeros([2, 3], dtype="float64"))
    assert not cpu_sampling.supports(paddle.zeros([2, 3], dtype="bfloat16"))


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("top", (0, 1, 5))
def test_prompt_logprobs_and_ranks_equal_the_references(float_isa_path, vocab, top):
    """Logprobs of given tokens (prompt positions) in one call: the float64 reference's,
    the paddle path's ids and ranks, and ranks that count ties against the token."""
    top = min(top, vocab)
    rng = np.random.default_rng(vocab * 7 + top)
    rows = 70  # more than one task per thread
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    logits[: rows // 2] = np.round(logits[: rows // 2])  # many exact ties
    tokens = rng.integers(0, vocab, rows)
    chosen, ids, values, ranks = cpu_sampling.token_logprobs_and_ranks(
        paddle.to_tensor(logits), paddle.to_tensor(tokens), top
    )
    assert_reference_logprobs(logits, tokens, top, chosen, ids, values)
    own = logits[np.arange(rows), tokens]
    np.testing.assert_array_equal(ranks.numpy(), (logits >= own[:, None]).sum(axis=1))
    paddle_path = token_logprobs_and_ranks(paddle.to_tensor(logits), paddle.to_tensor(tokens), top)
    np.testing.assert_array_equal(ranks.numpy(), paddle_path[3].numpy())


def test_prompt_logprobs_name_a_bad_argument():
    logits = paddle.zeros([3, 7], "float32")
    tokens = paddle.to_tensor([0, 6, 2])
    token_logprobs_op = paddle_step_ops.cpu_token_logprobs
    with pytest.raises(ValueError, match=r"'tokens': expected ids in \[0, 7\), got 7 at row 1"):
        token_logprobs_op(logits, paddle.to_tensor([0, 7, 2]), 1)
    with pytest.raises(ValueError, match=r"'tokens': expected shape \[3\], got shape \[2\]"):
        token_logprobs_op(logits, tokens[:2], 1)
    with pytest.raises(ValueError, match=r"'logits': expected dtype float32, got dtype float64"):
        token_logprobs_op(logits.astype("float64"), tokens, 1)
    with pytest.raises(ValueError, match=r"'top_logprobs': expected 0 .. 7, got 8"):
        token_logprobs_op(logits, tokens, 8)
