"""The 22 tensors of ``step_paddle``: the one table the Python side reads them from.

One row per tensor, in FastDeploy's argument order (docs/SPEC.md): its name, dtype, shape
kind and whether the op writes it. Adding or retyping a tensor is a one-line change here.
NumPy only, so it imports without paddle.

Shape kinds: B = batch slots, M = block-table columns, N = free-list capacity,
L = ``input_ids`` width, P = ``pre_ids`` width.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = [
    "SHAPE_KINDS",
    "STEP_PADDLE_DTYPES",
    "STEP_PADDLE_OUTPUTS",
    "STEP_PADDLE_TABLE",
    "STEP_PADDLE_TENSORS",
    "TensorSpec",
    "names_of_kind",
]

SHAPE_KINDS = ("[B]", "[B or B,1]", "[B,M]", "[N]", "[1]", "[B,L]", "[B,P]")

_BOOL, _I32, _I64 = np.dtype(np.bool_), np.dtype(np.int32), np.dtype(np.int64)


class TensorSpec(NamedTuple):
    """One ``step_paddle`` tensor: ``shape`` is one of ``SHAPE_KINDS``; ``written`` is
    whether the op may change it (it is then in the op's in-place outputs)."""

    name: str
    dtype: np.dtype
    shape: str
    written: bool


STEP_PADDLE_TABLE = (
    TensorSpec("stop_flags", _BOOL, "[B or B,1]", True),
    TensorSpec("seq_lens_this_time", _I32, "[B or B,1]", True),
    TensorSpec("ori_seq_lens_encoder", _I32, "[B or B,1]", False),
    TensorSpec("seq_lens_encoder", _I32, "[B or B,1]", True),
    TensorSpec("seq_lens_decoder", _I32, "[B or B,1]", True),
    TensorSpec("block_tables", _I32, "[B,M]", True),
    TensorSpec("encoder_block_lens", _I32, "[B or B,1]", True),
    TensorSpec("is_block_step", _BOOL, "[B]", True),
    TensorSpec("step_block_list", _I32, "[B or B,1]", True),
    TensorSpec("step_lens", _I32, "[1]", True),
    TensorSpec("recover_block_list", _I32, "[B or B,1]", True),
    TensorSpec("recover_lens", _I32, "[1]", True),
    TensorSpec("need_block_list", _I32, "[B or B,1]", True),
    TensorSpec("need_block_len", _I32, "[1]", True),
    TensorSpec("used_list_len", _I32, "[B or B,1]", True),
    TensorSpec("free_list", _I32, "[N]", True),
    TensorSpec("free_list_len", _I32, "[1]", True),
    TensorSpec("input_ids", _I64, "[B,L]", True),
    TensorSpec("pre_ids", _I64, "[B,P]", False),
    TensorSpec("step_idx", _I64, "[B or B,1]", False),
    TensorSpec("next_tokens", _I64, "[B or B,1]", False),
    TensorSpec("first_token_ids", _I64, "[B or B,1]", True),
)

STEP_PADDLE_TENSORS = tuple(spec.name for spec in STEP_PADDLE_TABLE)
STEP_PADDLE_DTYPES = {spec.name: spec.dtype for spec in STEP_PADDLE_TABLE}
# The op's in-place outputs, in argument order.
STEP_PADDLE_OUTPUTS = tuple(spec.name for spec in STEP_PADDLE_TABLE if spec.written)


def names_of_kind(*shapes: str) -> tuple[str, ...]:
    """The tensors whose shape kind is one of ``shapes``, in argument order."""
    unknown = [shape for shape in shapes if shape not in SHAPE_KINDS]
    if unknown:
        raise ValueError(f"names_of_kind: expected shape kinds from {SHAPE_KINDS}, got {unknown}")
    return tuple(spec.name for spec in STEP_PADDLE_TABLE if spec.shape in shapes)
