"""NumPy references of the weight formats (what the CPU op multiplies by), and a bfloat16
copy of a float checkpoint, for the tests of bfloat16 and int8 weights."""

from __future__ import annotations

import shutil
from collections.abc import Collection
from pathlib import Path

import numpy as np
import safetensors

from ..model_loader.weights import read_safetensors


def bfloat16_bits(w: np.ndarray) -> np.ndarray:
    """float32 ``w`` rounded to the nearest bfloat16 (ties to even), as uint16 bits."""
    bits = w.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bfloat16_values(w: np.ndarray) -> np.ndarray:
    """float32 ``w`` rounded to the nearest bfloat16, as float32."""
    return (bfloat16_bits(w).astype(np.uint32) << 16).view(np.float32)


def int8_values(w: np.ndarray, group_size: int | None = None) -> np.ndarray:
    """float32 ``w`` [K, N] quantized to symmetric int8 and back, as float32: per column and
    group of ``group_size`` rows of K (None: the whole column), scale = max |w| / 127,
    q = w / scale rounded to nearest even."""
    w = w.astype(np.float32)
    k = w.shape[0]
    group = k if group_size is None else group_size
    out = np.zeros_like(w)
    for start in range(0, k, group):
        rows = w[start : start + group]
        scale = np.abs(rows).max(axis=0) / np.float32(127)
        safe = np.where(scale == 0, np.float32(1), scale)
        q = np.clip(np.rint(rows / safe), -127, 127)
        out[start : start + group] = q.astype(np.float32) * scale
    return out


def write_bfloat16_copy(source: Path, target: Path, keep_float32: Collection[str] = ()) -> Path:
    """``source``'s checkpoint directory copied to ``target`` with its weights rounded to
    bfloat16 and stored as BF16 (as published checkpoints are), but for the tensors named
    in ``keep_float32``: stored as F32, with the same rounded values (a mixed checkpoint)."""
    shutil.copytree(source, target)
    for golden in target.glob("golden_*"):
        golden.unlink()
    weights_file = target / "model.safetensors"
    stored = {}
    for name, values in read_safetensors(weights_file).items():
        if name in keep_float32:
            stored[name] = ("float32", bfloat16_values(values))
        else:
            stored[name] = ("bfloat16", np.ascontiguousarray(bfloat16_bits(values)))
    specs = {
        name: safetensors.TensorSpec(
            dtype=dtype, shape=list(v.shape), data_ptr=v.ctypes.data, data_len=v.nbytes
        )
        for name, (dtype, v) in stored.items()
    }
    safetensors.serialize_file(specs, str(weights_file))
    return target
