"""What the benchmark scripts share: engine configs sized so that no step preempts, the
projections of a random checkpoint's decoder layer, the ``--batches`` list, and the report
ending (one JSON line or the script's own table)."""

from __future__ import annotations

import json
from collections.abc import Callable

from paddle_step.config import EngineConfig

__all__ = [
    "emit_report",
    "layer_projections",
    "parse_batches",
    "whole_batch_config",
    "whole_context_config",
]


def whole_batch_config(batch: int, tokens_per_seq: int, block_size: int, **fields) -> EngineConfig:
    """Every sequence of ``tokens_per_seq`` tokens in its own slot, all admitted in the first
    step: each block region has room for the whole batch plus a spare block a slot, so no
    step preempts. ``fields`` are the other EngineConfig fields (threads, pool ratio)."""
    per_seq = -(-tokens_per_seq // block_size)
    return EngineConfig(
        max_batch=batch,
        max_model_len=per_seq * block_size,
        block_size=block_size,
        num_kv_blocks=2 * batch * (per_seq + 1),
        **fields,
    )


def whole_context_config(batch: int, context: int, block_size: int, **fields) -> EngineConfig:
    """Each block region holds every slot's whole sequence of ``context`` tokens (rounded
    down to whole blocks), so no step preempts."""
    max_model_len = context // block_size * block_size
    return EngineConfig(
        max_batch=batch,
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=2 * batch * (max_model_len // block_size),
        **fields,
    )


def parse_batches(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    """``--batches 1,8,64`` as a tuple of ints; ``default`` when the flag is not given."""
    return tuple(int(b) for b in text.split(",")) if text else default


def emit_report(report: dict, as_json: bool, print_table: Callable[[dict], None]) -> dict:
    """Prints ``report`` as one JSON line (``--json``) or as the script's table; returns it."""
    if as_json:
        print(json.dumps(report))
    else:
        print_table(report)
    return report


def layer_projections(
    hidden: int, q_width: int, kv_width: int, inter: int
) -> tuple[tuple[str, int, int], ...]:
    """A Llama/Qwen2 decoder layer's projections as (HF name, out width, in width)."""
    return (
        ("self_attn.q_proj", q_width, hidden),
        ("self_attn.k_proj", kv_width, hidden),
        ("self_attn.v_proj", kv_width, hidden),
        ("self_attn.o_proj", hidden, q_width),
        ("mlp.gate_proj", inter, hidden),
        ("mlp.up_proj", inter, hidden),
        ("mlp.down_proj", hidden, inter),
    )
