"""Reference decoding without any cache: every step recomputes each whole sequence.

Slow and simple on purpose: it shares only the model and the sampler with ``Engine``, so
greedy outputs of the two must match token for token (in float64 at least).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import paddle

from ..layers.sampler import sample_tokens, sampling_key, sampling_uniforms
from ..models.llama import LlamaForCausalLM
from .outputs import FINISH_EOS, FINISH_LENGTH, GenerationResult, GenerationStats

__all__ = ["generate_naive"]


def generate_naive(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    eos_token_id: int | Sequence[int] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    max_model_len: int | None = None,
    on_finished: Callable[[int], object] | None = None,
) -> tuple[list[GenerationResult], GenerationStats]:
    """Decodes ``prompts`` with ``model.forward_naive``, one token per request per step.

    Stops like ``Engine``: on ``eos_token_id`` (an id or a list of ids; None: no eos
    stop), after
    ``max_new_tokens`` (one value or one per prompt), or when a sequence reaches
    ``max_model_len`` tokens. Request ``i`` draws its random numbers as the engine's
    request ``i`` does, so sampled outputs agree too. ``on_finished(n)`` is called after
    each step that finished ``n > 0`` requests. Returns the results in prompt order and
    the stats (no cache: preemptions, recoveries and blocks are 0).
    """
    count = len(prompts)
    limits = (
        [int(max_new_tokens)] * count
        if isinstance(max_new_tokens, (int, np.integer))
        else [int(limit) for limit in max_new_tokens]
    )
    if len(limits) != count:
        raise ValueError(
            f"generate_naive: argument 'max_new_tokens': expected one int or {count} "
            f"(one per prompt), got {len(limits)}"
        )
    prompts = [[int(token) for token in prompt] for prompt in prompts]
    if eos_token_id is None:
        stop_ids: set[int] = set()
    elif isinstance(eos_token_id, (int, np.integer)):
        stop_ids = {int(eos_token_id)}
    else:
        stop_ids = {int(token) for token in eos_token_id}
    generated: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * count
    stats = GenerationStats()
    started = time.perf_counter()

    active = list(range(count))
    while active:
        logits = model.forward_naive([prompts[i] + generated[i] for i in active])
        uniforms = None
        if temperature > 0:
            token_index = np.array([len(generated[i]) + 1 for i in active])
            keys = np.array([sampling_key(seed, i) for i in active], dtype=np.uint64)
            uniforms = paddle.to_tensor(sampling_uniforms(keys, token_index))
        tokens = sample_tokens(
            logits,
            # float32, as the engine stores them, so both scale the logits identically.
            paddle.full([len(active)], temperature, dtype="float32"),
            paddle.full([len(active)], top_p, dtype="float32"),
            uniforms,
        ).numpy()

        still_active = []
        for i, token in zip(active, tokens.tolist()):
            generated[i].append(token)
            if token in stop_ids:
                reasons[i] = FINISH_EOS
            elif len(generated[i]) >= limits[i] or (
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
    results = [GenerationResult(i, prompts[i], generated[i], reasons[i]) for i in range(count)]
    return results, stats
