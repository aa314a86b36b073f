"""Load a Hugging Face checkpoint directory (as ``save_pretrained`` writes it) into a
``TinyLlama`` and an ``HFTokenizer``.

Reads ``config.json`` (see ``hf_config`` for what is supported), the weights from
``model.safetensors`` or the shards ``model.safetensors.index.json`` lists (bf16, fp16, fp32
or fp64 on disk, cast to the requested dtype), ``tokenizer.json`` (+ ``tokenizer_config.json``)
and the stop ids from ``generation_config.json`` (else ``config.json``). Anything it cannot
load raises ``CheckpointError``.

    loaded = load_checkpoint("path/to/Llama-3.2-1B", dtype="float32")
    ids = loaded.tokenizer.encode("Hello")
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors

from .hf_config import CheckpointError, model_config_from_hf
from .hf_tokenizer import HFTokenizer
from .model import ModelConfig, TinyLlama

__all__ = ["CheckpointError", "LoadedCheckpoint", "load_checkpoint", "read_safetensors"]

# On-disk dtypes (safetensors' names) and how to read them; BF16 separately (no numpy type).
_NUMPY_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What ``load_checkpoint`` returns.

    ``eos_token_ids``: every id that ends a generation (Llama 3 instruct models have several);
    ``max_model_len``: the context length (``max_position_embeddings``); ``name``: the
    directory name.
    """

    model: TinyLlama
    tokenizer: HFTokenizer
    eos_token_ids: list[int]
    max_model_len: int
    name: str


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: no {path.name}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON: {error}") from None


def _bf16_to_float32(raw: bytes | bytearray) -> np.ndarray:
    # bfloat16 is the upper half of a float32: widen by shifting into the high 16 bits.
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as a float array (bf16 widened to float32).

    Reads raw bytes through ``safetensors.deserialize``, since its numpy loader has no bf16.
    """
    try:
        entries = safetensors.deserialize(path.read_bytes())
    except Exception as error:  # SafetensorError and friends
        raise CheckpointError(f"{path}: not a readable safetensors file: {error}") from None
    arrays = {}
    for name, entry in entries:
        dtype, raw = entry["dtype"], entry["data"]
        if dtype == "BF16":
            flat = _bf16_to_float32(raw)
        elif dtype in _NUMPY_DTYPES:
            flat = np.frombuffer(raw, dtype=np.dtype(_NUMPY_DTYPES[dtype]).newbyteorder("<"))
        else:
            raise CheckpointError(
                f"{path}: tensor {name!r}: dtype {dtype}: expected one of "
                f"{['BF16', *_NUMPY_DTYPES]}"
            )
        arrays[name] = flat.reshape(entry["shape"])
    return arrays


def _weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index_file = path / "model.safetensors.index.json"
    if not index_file.is_file():
        raise CheckpointError(
            f"{path}: no model.safetensors and no model.safetensors.index.json (only "
            "safetensors weights are supported)"
        )
    weight_map = _read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file}: field 'weight_map': expected a non-empty object")
    files = [path / name for name in sorted(set(weight_map.values()))]
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise CheckpointError(f"{index_file} lists shards that are not there: {missing}")
    return files


def _hf_to_model_names(config: ModelConfig) -> dict[str, tuple[str, bool]]:
    """HF tensor name -> (``TinyLlama`` parameter name, transpose it): Linear weights are
    [out, in] in HF and [in, out] here."""
    names = {
        "model.embed_tokens.weight": ("embed", False),
        "model.norm.weight": ("final_norm.weight", False),
    }
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = ("lm_head", True)
    projections = {
        "self_attn.q_proj": "wq",
        "self_attn.k_proj": "wk",
        "self_attn.v_proj": "wv",
        "self_attn.o_proj": "wo",
        "mlp.gate_proj": "w_gate",
        "mlp.up_proj": "w_up",
        "mlp.down_proj": "w_down",
    }
    biases = {}
    if config.qkv_bias:
        biases.update(
            {
                "self_attn.q_proj": "q_bias",
                "self_attn.k_proj": "k_bias",
                "self_attn.v_proj": "v_bias",
            }
        )
    if config.o_proj_bias:
        biases["self_attn.o_proj"] = "o_bias"
    for layer in range(config.num_layers):
        hf, ours = f"model.layers.{layer}", f"layers.{layer}"
        names[f"{hf}.input_layernorm.weight"] = (f"{ours}.attn_norm.weight", False)
        names[f"{hf}.post_attention_layernorm.weight"] = (f"{ours}.mlp_norm.weight", False)
        for hf_name, name in projections.items():
            names[f"{hf}.{hf_name}.weight"] = (f"{ours}.{name}", True)
        for hf_name, name in biases.items():
            names[f"{hf}.{hf_name}.bias"] = (f"{ours}.{name}", False)
    return names


def _is_ignored(name: str, config: ModelConfig) -> bool:
    # Old checkpoints store the rotary table (recomputed here); tied ones may keep a copy
    # of the embedding as lm_head, which transformers ignores too.
    return name.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and name == "lm_head.weight"
    )


def _load_weights(path: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    names = _hf_to_model_names(config)
    weights: dict[str, np.ndarray] = {}
    unexpected = []
    for file in _weight_files(path):
        for hf_name, array in read_safetensors(file).items():
            if hf_name not in names:
                if not _is_ignored(hf_name, config):
                    unexpected.append(hf_name)
                continue
            name, transpose = names[hf_name]
            weights[name] = (array.T if transpose else array).astype(config.dtype)
    missing = [hf for hf, (name, _) in names.items() if name not in weights]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: the weights do not match the config: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )
    return weights


def _eos_token_ids(path: Path, config: dict[str, Any]) -> list[int]:
    generation_file = path / "generation_config.json"
    source = "config.json"
    value = config.get("eos_token_id")
    if generation_file.is_file():
        generation = _read_json(generation_file)
        if generation.get("eos_token_id") is not None:
            source, value = "generation_config.json", generation["eos_token_id"]
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(
            f"{source}: field 'eos_token_id': expected an id or a list of ids, got {value!r}"
        )
    return list(ids)


def load_checkpoint(path: str | Path, dtype: str = "float32") -> LoadedCheckpoint:
    """Load the checkpoint directory ``path`` with the weights cast to ``dtype``
    ('float32' or 'float64'). Raises ``CheckpointError`` naming what it cannot load."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"load_checkpoint: argument 'path': expected a directory, got {str(path)!r}"
        )
    hf_config = _read_json(path / "config.json")
    config = model_config_from_hf(hf_config, dtype)
    tokenizer = HFTokenizer.from_dir(path)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} ids, expected at most the "
            f"embedding's {config.vocab_size} rows (config.json vocab_size)"
        )
    eos_token_ids = _eos_token_ids(path, hf_config)
    outside = [i for i in eos_token_ids if i >= config.vocab_size]
    if outside:
        raise CheckpointError(
            f"{path}: eos_token_id {outside}: expected ids below vocab_size ({config.vocab_size})"
        )
    try:
        model = TinyLlama(config, weights=_load_weights(path, config))
    except ValueError as error:  # a tensor of the wrong shape
        raise CheckpointError(f"{path}: {error}") from None
    return LoadedCheckpoint(
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        max_model_len=config.max_position_embeddings,
        name=path.resolve().name,
    )
