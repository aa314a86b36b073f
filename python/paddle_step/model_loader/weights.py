"""Checkpoint weights: safetensors files (one or sharded), checked by the ``safetensors``
package and read through a map of the file, renamed from Hugging Face's parameter names to
the model's and cast."""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np
import safetensors

from ..config import ModelConfig
from ..errors import CheckpointError
from .hf_config import read_json

__all__ = ["load_weights", "read_safetensors", "stored_dtypes"]

# On-disk dtypes (safetensors' names) and how to read them; BF16 separately (no numpy type).
_NUMPY_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


# Rows of an [out, in] matrix transposed at a time (``_in_layout``): a slice stays in the
# cache. On an Intel Xeon, [4864, 896] float32 moved at 2.3 GB/s this way, 0.6 GB/s whole.
TRANSPOSE_ROWS = 256


def _bf16_to_float32(raw) -> np.ndarray:
    # bfloat16 is the upper half of a float32: widen by shifting into the high 16 bits.
    bits = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype="<u2")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _read_header(stream) -> tuple[dict[str, dict], int]:
    """The tensor entries of the safetensors file open as ``stream`` (its header, less
    ``__metadata__``) and the offset of the data after it. ValueError if the header is not
    a JSON object."""
    size = int.from_bytes(stream.read(8), "little")
    header = json.loads(stream.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, expected an object")
    return {name: entry for name, entry in header.items() if name != "__metadata__"}, 8 + size


def stored_dtypes(path: Path) -> set[str]:
    """The dtypes (safetensors' names: BF16, F16, F32, ...) the checkpoint directory ``path``
    stores its tensors in, read from the files' headers alone."""
    found = set()
    for file in _weight_files(path):
        with file.open("rb") as stream:
            try:
                entries, _ = _read_header(stream)
                found.update(entry["dtype"] for entry in entries.values())
            except (ValueError, UnicodeDecodeError, TypeError, KeyError) as error:
                raise CheckpointError(f"{file}: not a readable safetensors file: {error}") from None
    return found


def read_safetensors(path: Path, keep_bfloat16: bool = False) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as a float array (bf16 widened to float32, or
    with ``keep_bfloat16`` kept as its bits: a uint16 view of the map).

    ``safetensors`` checks the file (its header, and that every tensor's bytes lie in it);
    the arrays then read the bytes through a read-only map of the file, not a copy (its
    numpy loader has no bf16): F16/F32/F64 arrays are views of the map, which lasts as long
    as they do. Where the file cannot be mapped, they read a copy of it.
    """
    try:
        with safetensors.safe_open(str(path), framework="numpy"):
            pass
        with path.open("rb") as stream:
            entries, first = _read_header(stream)
            try:
                data = memoryview(mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ))
            except (OSError, ValueError):  # a file system that cannot map it: a copy
                stream.seek(0)
                data = memoryview(stream.read())
    except Exception as error:  # SafetensorError and friends
        raise CheckpointError(f"{path}: not a readable safetensors file: {error}") from None
    arrays = {}
    for name, entry in entries.items():
        dtype = entry["dtype"]
        begin, end = entry["data_offsets"]
        raw = data[first + begin : first + end]
        if dtype == "BF16":
            flat = np.frombuffer(raw, dtype="<u2") if keep_bfloat16 else _bf16_to_float32(raw)
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
    weight_map = read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file}: field 'weight_map': expected a non-empty object")
    files = [path / name for name in sorted(set(weight_map.values()))]
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise CheckpointError(f"{index_file} lists shards that are not there: {missing}")
    return files


def _hf_to_model_names(config: ModelConfig) -> dict[str, tuple[str, bool]]:
    """HF tensor name -> (``LlamaForCausalLM`` parameter name, transpose it): Linear weights are
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


def _in_layout(array: np.ndarray, dtype: str, transpose: bool) -> np.ndarray:
    """``array``, or its transpose, as a C-contiguous array of ``dtype`` of its own, in one
    copy: the source may be a view of the file, which the model must not keep mapped (a
    file rewritten under a running server would end it with SIGBUS). A transpose is copied
    ``TRANSPOSE_ROWS`` rows of the source at a time: numpy's copy of a whole [out, in]
    matrix into [in, out] order strides through memory at every element."""
    if not transpose:
        return np.array(array, dtype=dtype, order="C")
    out = np.empty(array.shape[::-1], dtype)
    for first in range(0, array.shape[0], TRANSPOSE_ROWS):
        out[:, first : first + TRANSPOSE_ROWS] = array[first : first + TRANSPOSE_ROWS].T
    return out


def _bfloat16_matrix(bits: np.ndarray, transpose: bool) -> np.ndarray:
    """A matrix's bfloat16 bits (uint16) for a model packed in bfloat16 or int8: a view of the
    file's map, [in, out] as a view of the stored [out, in] where ``transpose`` (the packer
    reads either order). Not copied: packing copies them once, and the model keeps only
    the packed copy, so the map ends with the load."""
    return bits.T if transpose else bits


def load_weights(path: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """The model's arrays by its parameter names, in ``config.dtype``, matrices [in, out].
    For a model packed in bfloat16 or int8 from a checkpoint stored in bfloat16 alone, the
    matrices stay its bits (``_bfloat16_matrix``), which the packers read: a float32 copy
    was most of such a load."""
    names = _hf_to_model_names(config)
    keep_bits = config.weight_format in ("bfloat16", "int8") and stored_dtypes(path) == {"BF16"}
    weights: dict[str, np.ndarray] = {}
    unexpected = []
    for file in _weight_files(path):
        arrays = read_safetensors(file, keep_bfloat16=keep_bits)
        for hf_name in list(arrays):  # each dropped once cast: one model's worth at a time
            array = arrays.pop(hf_name)
            if hf_name not in names:
                if not _is_ignored(hf_name, config):
                    unexpected.append(hf_name)
                continue
            name, transpose = names[hf_name]
            if array.dtype == np.uint16 and array.ndim == 2:
                weights[name] = _bfloat16_matrix(array, transpose)
                continue
            if array.dtype == np.uint16:  # a norm's or a bias's bits: those stay float
                array = _bf16_to_float32(array)
            weights[name] = _in_layout(array, config.dtype, transpose)
    missing = [hf for hf, (name, _) in names.items() if name not in weights]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: the weights do not match the config: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )
    return weights
