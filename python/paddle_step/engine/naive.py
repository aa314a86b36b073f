"""Reference decoding without any cache: every step recomputes each whole sequence.

Slow and simple on purpose: it shares only the model and the sampler with ``Engine``, so
outputs of the two must match token for token (in float64 at least), sampled ones too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import paddle

from ..layers.sampler import sample_tokens, sampling_key, sampling_uniforms
from ..models.llama import LlamaForCausalLM
from ..sampling_params import SamplingParams
from .outputs import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationResult,
    GenerationStats,
    SampleOutput,
)

__all__ = ["generate_naive"]


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
    """Decodes ``prompts`` with ``model.forward_naive``, one token per request per step.

    ``params`` is one ``SamplingParams`` or one per prompt, as ``Engine.generate`` takes;
    ``eos_token_ids`` are the engine's (used where ``eos_token_id`` is None). Stops like
    ``Engine``: on an eos or stop token, after ``max_tokens``, or when a sequence reaches
    ``max_model_len`` tokens. Request ``i`` draws its random numbers as the engine's
    request ``i`` does (engine ``seed``), so sampled outputs agree too.
    ``on_finished(n)`` is called after each step that finished ``n > 0`` requests.
    Returns the results in prompt order and the stats (no cache: preemptions,
    recoveries and blocks are 0).
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
    eos_ids = []
    for each in params:
        eos = each.eos_token_id
        if eos is None:
            eos = eos_token_ids
        eos_ids.append({int(eos)} if isinstance(eos, (int, np.integer)) else set(eos))
    keys = np.array(
        [
            sampling_key(each.seed) if each.seed is not None else sampling_key(seed, i)
            for i, each in enumerate(params)
        ],
        dtype=np.uint64,
    )
    generated: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * count
    stats = GenerationStats()
    started = time.perf_counter()

    active = list(range(count))
    while active:
        logits = model.forward_naive([prompts[i] + generated[i] for i in active])
        rows = [params[i] for i in active]
        uniforms = None
        if any(not each.greedy for each in rows):
            token_index = np.array([len(generated[i]) + 1 for i in active])
            uniforms = paddle.to_tensor(sampling_uniforms(keys[active], token_index))
        tokens = sample_tokens(
            logits,
            # float32, as the engine stores them, so both scale the logits identically.
            paddle.to_tensor([each.temperature for each in rows], dtype="float32"),
            paddle.to_tensor([each.top_p for each in rows], dtype="float32"),
            uniforms,
        ).numpy()

        still_active = []
        for i, token in zip(active, tokens.tolist()):
            generated[i].append(token)
            limit = max(params[i].max_tokens, 1)
            if token in eos_ids[i]:
                reasons[i] = FINISH_EOS
            elif token in params[i].stop_token_ids:
                reasons[i] = FINISH_STOP
            elif len(generated[i]) >= limit or (
                max_model_len is not None and len(prompts[i]) + len(generated[i]) >= max_model_len
            ):
                reasons[i] = FINISH_LENGTH
            else:
                still_active.append(i)
        stats.steps += 1
        stats.generated_tokens += len(active)
        if on_finished is not None and len(still_active) < len(active):
            on_finished(len(active) - len(still_active))
        active = still_active

    stats.elapsed = time.perf_counter() - started
    results = []
    for i in range(count):
        kept = generated[i][: params[i].max_tokens]
        reason = reasons[i] if params[i].max_tokens else FINISH_LENGTH
        results.append(GenerationResult(i, prompts[i], [SampleOutput(0, kept, reason)]))
    return results, stats
