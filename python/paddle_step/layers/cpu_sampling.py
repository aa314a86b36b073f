"""The sampler's CPU float32 path: one call of the op library's fused kernel
(ops/include/cpu_sampling_kernel.h) per step for the whole batch, on the CPU kernels'
instruction-set path (``cpu_linear.set_isa``) and threads (``cpu_linear.set_num_threads``),
instead of the few dozen paddle ops of
``sampler.apply_controls``, ``sample_tokens`` and ``token_logprobs``. Same semantics as
those (sampler.py documents them); other places and dtypes stay on the paddle path
(``supports`` tells which).
"""

from __future__ import annotations

import paddle

import paddle_step_ops as _library

__all__ = ["sample", "supports", "token_logprobs_and_ranks"]


def supports(logits: paddle.Tensor) -> bool:
    """Whether ``sample`` takes ``logits``: float32 on the CPU."""
    return logits.place.is_cpu_place() and logits.dtype == paddle.float32


# The op's optional tensors, in its argument order: ``sample``'s ``uniforms`` and its
# controls (keyword arguments).
_OPTIONAL_TENSORS = (
    "top_k", "min_p", "uniforms", "allowed_bits", "stop_ids", "min_tokens", "step_idx",
    "output_ids", "bias_ids", "bias_values", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "prompt_ids",
)  # fmt: skip


def sample(
    logits: paddle.Tensor,
    temperature: paddle.Tensor,
    top_p: paddle.Tensor,
    uniforms: paddle.Tensor | None,
    *,
    logprobs_top: int | None = None,
    **controls: paddle.Tensor | None,
) -> tuple[paddle.Tensor, tuple | None]:
    """Next token of each row of ``logits`` float32 [R, V], and (when ``logprobs_top`` is
    not None) ``token_logprobs``' triple of the raw logits (ids and values None for 0).

    ``temperature``, ``top_p``, ``min_p``, the penalties float32 [R]; ``top_k``,
    ``min_tokens``, ``step_idx`` int64 [R]; ``uniforms`` float64 [R] (None: every row
    greedy); ``allowed_bits`` int32 [R, ceil(V / 32)], the allowed tokens packed as
    ``sampling_params.pack_token_mask`` packs them. The id tables are the slot state's, -1 pads:
    ``stop_ids`` [R, S] (masked while ``step_idx < min_tokens``), ``output_ids`` [R, L]
    whose columns 1..``step_idx`` are the generated tokens (column 0 is scratch),
    ``prompt_ids`` [R, P] (``repetition_penalty`` only; a row's prompt ends at its first
    pad), ``bias_ids``/``bias_values`` [R, K]. A control left None is off for every row."""
    unknown = sorted(set(controls) - set(_OPTIONAL_TENSORS))
    if unknown:
        expected = [name for name in _OPTIONAL_TENSORS if name != "uniforms"]
        raise TypeError(
            f"cpu_sampling.sample: unknown controls {unknown}, expected some of {expected}"
        )
    optional = {**controls, "uniforms": uniforms}
    top = -1 if logprobs_top is None else logprobs_top
    outputs = _library.cpu_sample(
        logits, temperature, top_p, *(optional.get(name) for name in _OPTIONAL_TENSORS), top
    )
    if logprobs_top is None:
        return outputs[0], None
    tokens, chosen, ids, values = outputs
    if logprobs_top == 0:
        return tokens, (chosen, None, None)
    return tokens, (chosen, ids, values)


def token_logprobs_and_ranks(
    logits: paddle.Tensor, tokens: paddle.Tensor, top: int
) -> tuple[paddle.Tensor, paddle.Tensor | None, paddle.Tensor | None, paddle.Tensor]:
    """``sampler.token_logprobs_and_ranks`` of ``logits`` float32 [R, V] (``supports``)
    in one call: per row one pass for the log-softmax's sum, one for the top ``top`` and
    one for the rank, on the CPU kernels' threads (the paddle ops' passes over [R, V] took
    ~4 ms a row on a 151,936-token vocabulary)."""
    chosen, ids, values, ranks = _library.cpu_token_logprobs(logits, tokens, top)
    return (chosen, None, None, ranks) if top == 0 else (chosen, ids, values, ranks)
