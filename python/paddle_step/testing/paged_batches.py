"""Inputs for paged-attention tests: block tables that scatter each sequence over the
cache, and FastDeploy-style per-slot tensors for the rows of one step (needs paddle)."""

from __future__ import annotations

import numpy as np
import paddle

__all__ = ["scrambled_block_tables", "slot_state"]


def scrambled_block_tables(num_rows: int, blocks_per_row: int) -> np.ndarray:
    """Gives out blocks from the highest id down, column by column across rows, so every
    sequence's blocks are descending and interleaved with the other sequences' blocks."""
    descending = iter(range(num_rows * blocks_per_row - 1, -1, -1))
    tables = np.empty((num_rows, blocks_per_row), dtype=np.int32)
    for col in range(blocks_per_row):
        for row in range(num_rows):
            tables[row, col] = next(descending)
    return tables


def slot_state(
    rows: list[list[int]], starts: list[int], width: int
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """FastDeploy-style (input_ids [B, width], seq_lens_this_time [B, 1], seq_lens_decoder [B])
    for rows carrying these tokens this step, starting at these positions."""
    input_ids = np.zeros((len(rows), width), dtype=np.int64)
    for b, tokens in enumerate(rows):
        input_ids[b, : len(tokens)] = tokens
    lens = np.array([[len(tokens)] for tokens in rows], dtype=np.int32)
    return (
        paddle.to_tensor(input_ids),
        paddle.to_tensor(lens),
        paddle.to_tensor(np.array(starts, dtype=np.int32)),
    )
