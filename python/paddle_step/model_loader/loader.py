"""Load a Hugging Face checkpoint directory (as ``save_pretrained`` writes it) into a
``LlamaForCausalLM`` and an ``HFTokenizer``.

Reads ``config.json`` (see ``hf_config`` for what is supported), the weights from
``model.safetensors`` or the shards ``model.safetensors.index.json`` lists (bf16, fp16, fp32
or fp64 on disk, cast to the requested dtype), ``tokenizer.json`` (+ ``tokenizer_config.json``)
and the stop ids from ``generation_config.json`` (else ``config.json``). Anything it cannot
load raises ``CheckpointError``.

    loaded = load_checkpoint("path/to/Llama-3.2-1B", dtype="float32")
    ids = loaded.tokenizer.encode("Hello")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..models.llama import LlamaForCausalLM
from ..tokenizer.hf import HFTokenizer
from .hf_config import model_config_from_hf, read_json
from .weights import load_weights

__all__ = ["LoadedCheckpoint", "load_checkpoint"]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What ``load_checkpoint`` returns.

    ``eos_token_ids``: every id that ends a generation (Llama 3 instruct models have several);
    ``max_model_len``: the context length (``max_position_embeddings``); ``name``: the
    directory name.
    """

    model: LlamaForCausalLM
    tokenizer: HFTokenizer
    eos_token_ids: list[int]
    max_model_len: int
    name: str


def _eos_token_ids(path: Path, config: dict[str, Any]) -> list[int]:
    generation_file = path / "generation_config.json"
    source = "config.json"
    value = config.get("eos_token_id")
    if generation_file.is_file():
        generation = read_json(generation_file)
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
    hf_config = read_json(path / "config.json")
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
        model = LlamaForCausalLM(config, weights=load_weights(path, config))
    except ValueError as error:  # a tensor of the wrong shape
        raise CheckpointError(f"{path}: {error}") from None
    return LoadedCheckpoint(
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        max_model_len=config.max_position_embeddings,
        name=path.resolve().name,
    )
