"""A Hugging Face ``config.json`` read into a ``ModelConfig``, or refused with one clear error.

Supported: ``LlamaForCausalLM`` (Llama 2 and 3.x, ``rope_scaling`` of type ``llama3``),
``MistralForCausalLM`` without a sliding window shorter than the context, and
``Qwen2ForCausalLM`` without sliding-window attention. Rotary settings are read from either
layout: ``rope_theta`` + ``rope_scaling`` at the top level, or transformers 5's
``rope_parameters``. Anything else raises ``CheckpointError`` naming the field, what was
found and what is supported.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import Llama3RopeScaling, ModelConfig
from ..errors import CheckpointError

__all__ = ["SUPPORTED_ARCHITECTURES", "model_config_from_hf", "read_json"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Config keys that mean a mixture-of-experts MLP, which LlamaForCausalLM does not have.
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: no {path.name}")
    try:
        parsed = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(parsed).__name__}")
    return parsed


def _require(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise CheckpointError(f"config.json: field {key!r} is missing")
    return config[key]


def _positive_int(config: Mapping[str, Any], key: str) -> int:
    value = _require(config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"config.json: field {key!r}: expected a positive int, got {value!r}")
    return value


def _positive_float(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise CheckpointError(
            f"config.json: field {key!r}: expected a positive number, got {value!r}"
        )
    return float(value)


def _rope_settings(config: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """``(rope_theta, scaling)`` from either layout (transformers 5 nests both in
    ``rope_parameters``; older configs keep ``rope_theta`` and ``rope_scaling`` on top)."""
    if config.get("rope_parameters") is not None:
        where, params = "rope_parameters", dict(config["rope_parameters"])
        theta = params.get("rope_theta", config.get("rope_theta"))
    else:
        where, params = "rope_scaling", dict(config.get("rope_scaling") or {})
        theta = config.get("rope_theta")
    if theta is None:
        raise CheckpointError(f"config.json: no 'rope_theta' (top level or in {where!r})")
    # Older configs name the type "type"; transformers keeps reading both.
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"config.json: {where}.rope_type: expected one of {list(SUPPORTED_ROPE_TYPES)}, "
            f"got {rope_type!r}"
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(
            f"config.json: partial_rotary_factor: expected 1.0 (rotary over the whole head), "
            f"got {partial!r}"
        )
    if rope_type == "default":
        return float(theta), None
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [key for key in fields if params.get(key) is None]
    if missing:
        raise CheckpointError(f"config.json: {where} of type 'llama3' lacks {missing}")
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except ValueError as error:
        raise CheckpointError(f"config.json: {where}: {error}") from None
    return float(theta), scaling


def _check_full_attention(config: Mapping[str, Any], architecture: str, context: int) -> None:
    """Refuse any sliding-window attention that could hide keys within the context."""
    if architecture == "Qwen2ForCausalLM" and config.get("use_sliding_window"):
        raise CheckpointError(
            "config.json: field 'use_sliding_window': expected false (sliding-window "
            "attention is not supported), got true"
        )
    if architecture == "MistralForCausalLM":
        window = config.get("sliding_window")
        if window is not None and window < context:
            raise CheckpointError(
                f"config.json: field 'sliding_window': expected null or >= "
                f"max_position_embeddings ({context}), got {window!r} (sliding-window attention "
                "is not supported)"
            )
    layer_types = config.get("layer_types")
    if layer_types is not None and set(layer_types) - {"full_attention"}:
        raise CheckpointError(
            "config.json: field 'layer_types': expected only 'full_attention', got "
            f"{sorted(set(layer_types))}"
        )


def model_config_from_hf(config: Mapping[str, Any], dtype: str = "float32") -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face ``config.json`` (parsed), computing in ``dtype``.

    Raises ``CheckpointError`` for an architecture or feature ``LlamaForCausalLM`` does not have.
    """
    if dtype not in ("float32", "float64"):
        raise ValueError(
            "model_config_from_hf: argument 'dtype': expected 'float32' or 'float64', "
            f"got {dtype!r}"
        )
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"config.json: field 'architectures': expected one of "
            f"{list(SUPPORTED_ARCHITECTURES)}, got {architectures!r}"
        )
    architecture = architectures[0]
    moe = {key: config[key] for key in MOE_KEYS if config.get(key)}
    if moe:
        raise CheckpointError(
            f"config.json: mixture-of-experts fields {moe}: expected a dense MLP (MoE is not "
            "supported)"
        )
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise CheckpointError(
            f"config.json: field 'hidden_act': expected 'silu', got {activation!r}"
        )
    if config.get("mlp_bias"):
        raise CheckpointError("config.json: field 'mlp_bias': expected false, got true")

    context = _positive_int(config, "max_position_embeddings")
    _check_full_attention(config, architecture, context)
    rope_theta, rope_scaling = _rope_settings(config)
    hidden = _positive_int(config, "hidden_size")
    num_heads = _positive_int(config, "num_attention_heads")
    num_kv_heads = (
        _positive_int(config, "num_key_value_heads")
        if config.get("num_key_value_heads") is not None
        else num_heads  # transformers' default: multi-head attention
    )
    head_dim = config.get("head_dim")
    if head_dim is None and hidden % num_heads:
        raise CheckpointError(
            f"config.json: no 'head_dim' and hidden_size ({hidden}) is not a multiple of "
            f"num_attention_heads ({num_heads})"
        )
    # Qwen2 always has q/k/v biases; Llama's attention_bias puts one on o_proj too.
    attention_bias = bool(config.get("attention_bias", False))
    try:
        return ModelConfig(
            vocab_size=_positive_int(config, "vocab_size"),
            hidden_size=hidden,
            num_layers=_positive_int(config, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            intermediate_size=_positive_int(config, "intermediate_size"),
            rope_theta=rope_theta,
            rms_eps=_positive_float(config, "rms_norm_eps", 1e-6),
            dtype=dtype,
            explicit_head_dim=None if head_dim is None else int(head_dim),
            qkv_bias=architecture == "Qwen2ForCausalLM" or attention_bias,
            o_proj_bias=architecture != "Qwen2ForCausalLM" and attention_bias,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            max_position_embeddings=context,
        )
    except CheckpointError:  # names its field already
        raise
    except ValueError as error:  # ModelConfig's own checks (heads, dims)
        raise CheckpointError(f"config.json: {error}") from None
