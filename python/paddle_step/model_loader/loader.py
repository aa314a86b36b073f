"""Load a Hugging Face checkpoint directory (as ``save_pretrained`` writes it) into a
``LlamaForCausalLM`` and an ``HFTokenizer``.

Reads ``config.json`` (see ``hf_config`` for what is supported), the weights from
``model.safetensors`` or the shards ``model.safetensors.index.json`` lists (bf16, fp16, fp32
or fp64 on disk, cast to the requested dtype or packed in the requested format),
``tokenizer.json`` (+ ``tokenizer_config.json``) and the stop ids from
``generation_config.json`` (else ``config.json``). Anything it cannot load raises
``CheckpointError``.

    loaded = load_checkpoint("path/to/Llama-3.2-1B")  # bfloat16 weights, as stored
    loaded = load_checkpoint("path/to/Llama-3.2-1B", quantization="int8")
    ids = loaded.tokenizer.encode("Hello")
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..distributed.tensor_parallel import TensorParallel, shard_config, shard_weights
from ..errors import CheckpointError
from ..host_memory import return_freed_memory
from ..layers.dense_blocks import check_packed_weights_run
from ..models.llama import LlamaForCausalLM
from ..tokenizer.hf import HFTokenizer
from .hf_config import model_config_from_hf, read_json
from .weights import load_weights, stored_dtypes

__all__ = ["DTYPES", "QUANTIZATIONS", "LoadedCheckpoint", "load_checkpoint"]


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


DTYPES = ("auto", "float32", "bfloat16", "float64")
QUANTIZATIONS = (None, "int8")


def _weight_format(path: Path, dtype: str, quantization: str | None) -> tuple[str, str | None]:
    """``(dtype the model computes in, weight_format)`` for ``load_checkpoint``'s
    arguments."""
    if dtype not in DTYPES:
        raise CheckpointError(
            f"load_checkpoint: argument 'dtype': expected one of {DTYPES}, got {dtype!r}"
        )
    if quantization not in QUANTIZATIONS:
        raise CheckpointError(
            f"load_checkpoint: argument 'quantization': expected one of {QUANTIZATIONS}, "
            f"got {quantization!r}"
        )
    if dtype == "auto":
        # The checkpoint's own dtype, as vLLM's --dtype auto; the op has no float16 format
        # and float32 holds float16 exactly.
        dtype = "bfloat16" if stored_dtypes(path) == {"BF16"} else "float32"
    if quantization == "int8":
        if dtype == "float64":
            raise CheckpointError(
                "load_checkpoint: argument 'quantization': int8 weights compute in float32, "
                "expected dtype 'auto', 'float32' or 'bfloat16', got 'float64'"
            )
        return "float32", "int8"
    if dtype == "bfloat16":
        return "float32", "bfloat16"
    return dtype, None


def load_checkpoint(
    path: str | Path,
    dtype: str = "auto",
    quantization: str | None = None,
    *,
    tensor_parallel: TensorParallel | None = None,
) -> LoadedCheckpoint:
    """Load the checkpoint directory ``path``. Raises ``CheckpointError`` naming what it
    cannot load.

    ``dtype``: 'float32' or 'float64' (weights and computation in it), 'bfloat16' (weights
    kept in bfloat16, computation in float32) or 'auto' (the checkpoint's own: bfloat16 for
    a bfloat16 checkpoint, else float32). ``quantization`` 'int8': weight-only int8,
    quantized here from the checkpoint's values. bfloat16 and int8 weights run on the CPU
    op only (``layers.cpu_linear``): elsewhere, or on a CPU without AVX2, this raises.
    ``tensor_parallel``: keep only that rank's shard (``distributed.tensor_parallel``).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"load_checkpoint: argument 'path': expected a str or os.PathLike, "
            f"got {type(path).__name__}"
        )
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"load_checkpoint: argument 'path': expected a directory, got {str(path)!r}"
        )
    compute_dtype, weight_format = _weight_format(path, dtype, quantization)
    if weight_format is not None:
        try:  # before reading any weights
            check_packed_weights_run(weight_format)
        except ValueError as error:
            raise CheckpointError(f"{path}: {error}") from None
    hf_config = read_json(path / "config.json")
    config = replace(model_config_from_hf(hf_config, compute_dtype), weight_format=weight_format)
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
    weights = load_weights(path, config)
    all_reduce = None
    if tensor_parallel is not None:
        world_size = tensor_parallel.world_size
        weights = shard_weights(weights, config, tensor_parallel.rank, world_size)
        config, all_reduce = shard_config(config, world_size), tensor_parallel.all_reduce
    try:
        model = LlamaForCausalLM(config, weights=weights, all_reduce=all_reduce)
    except ValueError as error:  # a tensor of the wrong shape, a format this CPU cannot run
        raise CheckpointError(f"{path}: {error}") from None
    del weights
    return_freed_memory()  # the load's freed arrays leave holes in the heap
    return LoadedCheckpoint(
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        max_model_len=config.max_position_embeddings,
        name=path.resolve().name,
    )
