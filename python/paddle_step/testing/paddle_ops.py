"""The compiled ops as NumPy-in, NumPy-out runners for the shared test cases
(``step_paddle_cases``, ``advance_step_cases``). Needs paddle and the built op
library, unlike the rest of ``paddle_step.testing``."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import paddle

from .. import ops
from ..spec.tensor_table import STEP_PADDLE_TENSORS
from .advance_step_cases import ADVANCE_STEP_OUTPUTS


def run_step_paddle(
    state: Mapping[str, np.ndarray], block_size: int, encoder_decoder_block_num: int = 0
) -> dict[str, np.ndarray]:
    """``step_paddle`` on copies of ``state`` on Paddle's current device."""
    tensors = {name: paddle.to_tensor(state[name]) for name in STEP_PADDLE_TENSORS}
    ops.step_paddle(*tensors.values(), block_size, encoder_decoder_block_num)
    return {name: tensor.numpy() for name, tensor in tensors.items()}


def run_advance_step(
    case: Mapping[str, np.ndarray], active, num_seqs: int, num_queries: int, block_size: int
) -> list[np.ndarray]:
    """``advance_step`` on copies of ``case``; returns its outputs in
    ``ADVANCE_STEP_OUTPUTS`` order."""
    tensors = {name: paddle.to_tensor(value) for name, value in case.items()}
    ops.advance_step(
        tensors["input_tokens"],
        tensors["sampled_token_ids"],
        tensors["input_positions"],
        tensors["seq_lens"],
        tensors["slot_mapping"],
        tensors["block_tables"],
        num_seqs,
        num_queries,
        block_size,
        active=None if active is None else paddle.to_tensor(active),
    )
    return [tensors[name].numpy() for name in ADVANCE_STEP_OUTPUTS]
