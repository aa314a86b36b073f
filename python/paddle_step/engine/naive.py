"""Reference decoding without any cache: every step recomputes each whole sequence.

Slow and simple on purpose: it shares only the model and the sampler with ``Engine``, so
outputs of the two must match token for token (in float64 at least), sampled ones too:
it builds the same per-row sampling controls from plain lists, draws with the same keys,
and reports logprobs of the same raw logits (recomputed, so equal within rounding).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import paddle

from ..layers.sampler import (
    SamplingControls,
    apply_controls,
    sample_key,
    sample_tokens,
    sampling_key,
    sampling_uniforms,
    token_logprobs,
    token_logprobs_and_ranks,
)
from ..models.llama import LlamaForCausalLM
from ..sampling_params import SamplingParams
from .outputs import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationResult,
    GenerationStats,
    SampleOutput,
    TokenLogprobs,
)

__all__ = ["generate_naive"]


def _padded(rows: list[list[int]]) -> paddle.Tensor:
    out = np.full((len(rows), max(1, max(len(row) for row in rows))), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        out[r, : len(row)] = row
    return paddle.to_tensor(out)


class _Sequence:
    """One sample being decoded: its request's params, stop ids, draw key and tokens."""

    def __init__(self, index: int, prompt: list[int], params: SamplingParams,
                 eos: set[int], key: int) -> None:  # fmt: skip
        self.index, self.prompt, self.params, self.eos, self.key = index, prompt, params, eos, key
        self.generated: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.reason: str | None = None

    @property
    def stop_ids(self) -> list[int]:
        return sorted(self.eos) + list(self.params.stop_token_ids)


def _controls(rows: list[_Sequence], vocab: int) -> SamplingControls:
    """The controls of ``rows`` as the engine builds them from its slot state."""
    params = [row.params for row in rows]
    controls = SamplingControls()
    if any(p.constraint is not None for p in params):
        allowed = np.ones((len(rows), vocab), dtype=bool)
        for r, p in enumerate(params):
            mask = p.constraint.allowed_tokens(vocab) if p.constraint is not None else None
            if mask is not None:
                allowed[r] = mask
        controls.allowed = paddle.to_tensor(allowed)
    if any(p.min_tokens for p in params):
        controls.banned = _padded(
            [row.stop_ids if len(row.generated) < row.params.min_tokens else [] for row in rows]
        )
    if any(p.logit_bias for p in params):
        controls.bias_ids = _padded([list(p.logit_bias) for p in params])
        values = np.zeros(controls.bias_ids.shape, dtype=np.float32)
        for r, p in enumerate(params):
            values[r, : len(p.logit_bias)] = list(p.logit_bias.values())
        controls.bias_values = paddle.to_tensor(values)
    penalized = any(p.presence_penalty or p.frequency_penalty for p in params)
    repeated = any(p.repetition_penalty != 1.0 for p in params)
    if penalized or repeated:
        controls.output_tokens = _padded([row.generated for row in rows])
    if penalized:
        controls.presence_penalty = paddle.to_tensor([p.presence_penalty for p in params],
                                                     dtype="float32")  # fmt: skip
        controls.frequency_penalty = paddle.to_tensor([p.frequency_penalty for p in params],
                                                      dtype="float32")  # fmt: skip
    if repeated:
        controls.repetition_penalty = paddle.to_tensor([p.repetition_penalty for p in params],
                                                       dtype="float32")  # fmt: skip
        controls.prompt_tokens = _padded([row.prompt for row in rows])
    if any(p.top_k_cut(vocab) for p in params):
        controls.top_k = paddle.to_tensor([p.top_k_cut(vocab) for p in params], dtype="int64")
    if any(p.min_p > 0 for p in params):
        controls.min_p = paddle.to_tensor([p.min_p for p in params], dtype="float32")
    return controls


def _logprobs_of(
    ids, values, chosen: float, token: int, k: int, rank: int | None = None
) -> TokenLogprobs:
    top = [] if k == 0 else list(zip(ids[:k].tolist(), values[:k].tolist()))
    return TokenLogprobs(token, chosen, top, rank)


def _prompt_logprobs(model: LlamaForCausalLM, prompt: list[int], k: int) -> list[TokenLogprobs]:
    """Logprobs of prompt positions 1 .. P-1 from a full recompute of the prompt."""
    if len(prompt) < 2:
        return []
    logits = model.logits_all_positions(prompt)[:-1]
    chosen, ids, values, ranks = token_logprobs_and_ranks(logits, paddle.to_tensor(prompt[1:]), k)
    chosen, ranks = chosen.numpy().tolist(), ranks.numpy().tolist()
    ids = ids.numpy() if ids is not None else None
    values = values.numpy() if values is not None else None
    return [
        _logprobs_of(
            ids[i] if k else None, values[i] if k else None, chosen[i], prompt[i + 1], k, ranks[i]
        )
        for i in range(len(prompt) - 1)
    ]


def generate_naive(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    eos_token_ids: Sequence[int] = (),
    seed: int = 0,
    max_model_len: int | None = None,
    on_finished: Callable[[int], object] | None = None,
) -> tuple[list[GenerationResult], GenerationStats]:
    """Decodes ``prompts`` with ``model.forward_naive``, one token per sample per step.

    ``params`` is one ``SamplingParams`` or one per prompt, as ``Engine.generate`` takes;
    ``eos_token_ids`` are the engine's (used where ``eos_token_id`` is None). Stops like
    ``Engine``: on an eos or stop token (not before ``min_tokens``), after
    ``max_tokens``, when its constraint finishes, or when a sequence reaches
    ``max_model_len`` tokens. Request ``i`` draws its random numbers as the engine's
    request ``i`` does (engine ``seed``), and sample ``j`` of it as the engine's sample
    ``j``, so sampled outputs agree too. ``on_finished(n)`` is called after each step
    that finished ``n > 0`` requests. Returns the results in prompt order and the stats
    (no cache: preemptions, recoveries and blocks are 0).
    """
    count = len(prompts)
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * count
    if len(params) != count:
        raise ValueError(
            f"generate_naive: argument 'params': expected one SamplingParams or {count} "
            f"(one per prompt), got {len(params)}"
        )
    prompts = [[int(token) for token in prompt] for prompt in prompts]
    vocab = model.config.vocab_size
    requests: list[list[_Sequence]] = []
    for i, (prompt, each) in enumerate(zip(prompts, params)):
        eos = each.eos_token_id if each.eos_token_id is not None else eos_token_ids
        eos = {int(eos)} if isinstance(eos, (int, np.integer)) else {int(t) for t in eos}
        key = sampling_key(each.seed) if each.seed is not None else sampling_key(seed, i)
        draws = each.best_of or each.n
        requests.append([_Sequence(j, prompt, each, eos, sample_key(key, j)) for j in range(draws)])
    stats = GenerationStats()
    started = time.perf_counter()

    active = [row for group in requests for row in group]
    while active:
        logits = model.forward_naive([row.prompt + row.generated for row in active])
        rows_params = [row.params for row in active]
        controls = _controls(active, vocab)
        processed = apply_controls(logits, controls) if controls.changes_logits() else logits
        uniforms = None
        if any(not p.greedy for p in rows_params):
            keys = np.array([row.key for row in active], dtype=np.uint64)
            token_index = np.array([len(row.generated) + 1 for row in active])
            uniforms = paddle.to_tensor(sampling_uniforms(keys, token_index))
        tokens = sample_tokens(
            processed,
            # float32, as the engine stores them, so both scale the logits identically.
            paddle.to_tensor([p.temperature for p in rows_params], dtype="float32"),
            paddle.to_tensor([p.top_p for p in rows_params], dtype="float32"),
            uniforms,
            top_k=controls.top_k,
            min_p=controls.min_p,
        )
        wanted = [_logprobs_wanted(p) for p in rows_params]
        if any(k is not None for k in wanted):
            top = max(k or 0 for k in wanted)
            chosen, ids, values = token_logprobs(logits, tokens, top)
            chosen = chosen.numpy().tolist()
            ids = ids.numpy() if ids is not None else None
            values = values.numpy() if values is not None else None
        tokens = tokens.numpy().tolist()

        still_active = []
        for r, (row, token) in enumerate(zip(active, tokens)):
            row.generated.append(token)
            if wanted[r] is not None:
                k = row.params.logprobs or 0
                row.logprobs.append(
                    _logprobs_of(
                        ids[r] if k else None, values[r] if k else None, chosen[r], token, k
                    )  # fmt: skip
                )
            constraint = row.params.constraint
            if constraint is not None:
                constraint.accept_token(token)
            limit = max(row.params.max_tokens, 1)
            if token in row.eos:
                row.reason = FINISH_EOS
            elif token in row.params.stop_token_ids or (
                constraint is not None and constraint.is_finished()
            ):
                row.reason = FINISH_STOP
            elif len(row.generated) >= limit or (
                max_model_len is not None and len(row.prompt) + len(row.generated) >= max_model_len
            ):
                row.reason = FINISH_LENGTH
            else:
                still_active.append(row)
        stats.steps += 1
        stats.generated_tokens += len(active)
        if on_finished is not None and len(still_active) < len(active):
            on_finished(len(active) - len(still_active))
        active = still_active

    stats.elapsed = time.perf_counter() - started
    results = []
    for i, group in enumerate(requests):
        each = params[i]
        outputs = [_output(row) for row in group]
        if len(outputs) > each.n:  # best_of: the n most likely draws
            outputs = sorted(outputs, key=lambda o: -o.cumulative_logprob)[: each.n]
            for index, output in enumerate(outputs):
                output.index = index
        prompt_logprobs = None
        if each.prompt_logprobs is not None:
            prompt_logprobs = _prompt_logprobs(model, prompts[i], each.prompt_logprobs)
        results.append(GenerationResult(i, prompts[i], outputs, prompt_logprobs))
    return results, stats


def _logprobs_wanted(params: SamplingParams) -> int | None:
    """The top-k a sample's tokens need logprobs for (0: only the token's own, for
    ``best_of``), or None."""
    if params.logprobs is not None:
        return params.logprobs
    return 0 if (params.best_of or params.n) > params.n else None


def _output(row: _Sequence) -> SampleOutput:
    params = row.params
    kept = row.generated[: params.max_tokens]
    reason = row.reason if params.max_tokens else FINISH_LENGTH
    logprobs = row.logprobs[: params.max_tokens] if params.logprobs is not None else None
    cumulative = None
    if _logprobs_wanted(params) is not None:
        cumulative = float(sum(entry.logprob for entry in row.logprobs[: params.max_tokens]))
    return SampleOutput(row.index, kept, reason, logprobs, cumulative)
