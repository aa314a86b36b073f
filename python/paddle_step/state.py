"""Engine configuration and the slot-indexed device state the two ops work on.

The layout follows FastDeploy's model runner: every request lives in one of ``max_batch``
slots, and all per-slot state sits in fixed tensors ("share inputs") that
``step_paddle`` and ``advance_step`` update in place. KV blocks are split in two regions:

- the lower ids ``[0, num_encoder_blocks)`` hold prompts; the host hands them out at
  admission (``EncoderBlockAllocator``);
- the upper ids ``[num_encoder_blocks, num_kv_blocks)`` are the decoder pool
  (``free_list``); ``step_paddle`` hands them out one at a time as sequences grow, takes
  them back from finished or preempted sequences, and gives them to recovered ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import paddle

from .check_state import check_state
from .sequence import MAX_EOS_IDS
from .tensor_table import STEP_PADDLE_TENSORS

__all__ = ["EngineConfig", "ShareInputs"]


@dataclass(frozen=True)
class EngineConfig:
    """Batch, length and KV-block budget of an ``Engine``.

    Args:
        max_batch: number of batch slots B (requests running or preempted at once).
        max_model_len: longest sequence, prompt plus generated tokens (L, the width of
            ``input_ids``); a multiple of ``block_size``.
        block_size: tokens per KV block.
        num_kv_blocks: KV blocks in the cache, both regions together.
        decoder_pool_ratio: share of the blocks that form the decoder pool (the rest hold
            prompts). FastDeploy's ``kv_cache_ratio`` is the complementary share; at the
            usual 0.5 the two agree.
        enc_dec_block_num: extra blocks given to each prompt at admission so the first
            decode tokens need nothing from the pool (FastDeploy's
            ``enc_dec_block_num``).
    """

    max_batch: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    decoder_pool_ratio: float = 0.5
    enc_dec_block_num: int = 1

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_model_len", "block_size", "num_kv_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"EngineConfig.{name}: expected a positive int, got {value!r}")
        if not isinstance(self.enc_dec_block_num, int) or self.enc_dec_block_num < 0:
            raise ValueError(
                "EngineConfig.enc_dec_block_num: expected an int >= 0, "
                f"got {self.enc_dec_block_num!r}"
            )
        if not 0.0 < self.decoder_pool_ratio < 1.0:
            raise ValueError(
                "EngineConfig.decoder_pool_ratio: expected a float in (0, 1), "
                f"got {self.decoder_pool_ratio!r}"
            )
        # step_paddle restores at most max_dec_blocks = L // block_size table columns on
        # recovery; a sequence in a partial last block would come back one block short.
        if self.max_model_len % self.block_size:
            raise ValueError(
                f"EngineConfig.max_model_len: expected a multiple of block_size "
                f"({self.block_size}), got {self.max_model_len}"
            )
        # With every other sequence preempted, one sequence may need all its decoder
        # blocks at once; a smaller pool would leave it preempted forever.
        if self.num_decoder_blocks < self.max_dec_blocks:
            raise ValueError(
                f"EngineConfig: the decoder pool holds {self.num_decoder_blocks} blocks "
                f"(num_kv_blocks={self.num_kv_blocks} x decoder_pool_ratio="
                f"{self.decoder_pool_ratio}), expected at least max_model_len // block_size "
                f"= {self.max_dec_blocks} so that one sequence can always be recovered"
            )
        if self.num_encoder_blocks < self.encoder_blocks_for(1):
            raise ValueError(
                f"EngineConfig: the encoder region holds {self.num_encoder_blocks} blocks, "
                f"expected at least {self.encoder_blocks_for(1)} (one block plus "
                f"enc_dec_block_num={self.enc_dec_block_num}) for the shortest prompt"
            )

    @property
    def blocks_per_seq(self) -> int:
        """Columns of ``block_tables`` (M = ceil(L / block_size))."""
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def max_dec_blocks(self) -> int:
        """``step_paddle``'s cap on one sequence's decoder blocks (L // block_size)."""
        return self.max_model_len // self.block_size

    @property
    def num_decoder_blocks(self) -> int:
        """Size of the decoder pool (the top block ids)."""
        return int(self.num_kv_blocks * self.decoder_pool_ratio)

    @property
    def num_encoder_blocks(self) -> int:
        """Blocks below the pool, handed out to prompts by the host."""
        return self.num_kv_blocks - self.num_decoder_blocks

    def encoder_blocks_for(self, prompt_len: int) -> int:
        """Blocks a prompt of ``prompt_len`` tokens takes at admission."""
        return min(
            math.ceil(prompt_len / self.block_size) + self.enc_dec_block_num, self.blocks_per_seq
        )


class ShareInputs:
    """FastDeploy-style per-slot state on one place, in SPEC's dtypes.

    Attributes named like ``step_paddle``'s arguments (see ``STEP_PADDLE_TENSORS``) are its
    tensors; the others are:

    - ``eos_token_ids`` [B, MAX_EOS_IDS] int64 (-1 pads), ``max_new_tokens`` [B] int64,
      ``temperature`` [B] and ``top_p`` [B] float32: each slot's request parameters;
    - ``input_tokens``, ``input_positions``, ``slot_mapping`` [B] int64, ``context_lens``
      [B] int32 and ``decode_active`` [B] bool: ``advance_step``'s outputs, the next
      step's decode inputs (token, its position, its KV slot, context length) and which
      rows decode.

    A fresh state has every slot stopped and empty, and the whole decoder pool in
    ``free_list``: the top block ids, descending, as FastDeploy builds it. The tensors
    live on ``place`` (default: Paddle's current device), kept as the ``place`` attribute.
    """

    def __init__(
        self,
        config: EngineConfig,
        place: paddle.CPUPlace | paddle.CUDAPlace | str | None = None,
    ) -> None:
        batch, width = config.max_batch, config.max_model_len
        total, pool = config.num_kv_blocks, config.num_decoder_blocks

        def tensor(values: np.ndarray) -> paddle.Tensor:
            return paddle.to_tensor(values, place=place)

        def per_slot(value, dtype) -> paddle.Tensor:
            return tensor(np.full([batch], value, dtype=dtype))

        self.config = config
        # --- step_paddle's tensors ---
        self.stop_flags = per_slot(True, np.bool_)
        self.seq_lens_this_time = per_slot(0, np.int32)
        self.ori_seq_lens_encoder = per_slot(0, np.int32)
        self.seq_lens_encoder = per_slot(0, np.int32)
        self.seq_lens_decoder = per_slot(0, np.int32)
        self.block_tables = tensor(np.full([batch, config.blocks_per_seq], -1, np.int32))
        self.encoder_block_lens = per_slot(0, np.int32)
        self.is_block_step = per_slot(False, np.bool_)
        self.step_block_list = per_slot(-1, np.int32)
        self.step_lens = tensor(np.zeros([1], np.int32))
        self.recover_block_list = per_slot(-1, np.int32)
        self.recover_lens = tensor(np.zeros([1], np.int32))
        self.need_block_list = per_slot(-1, np.int32)
        self.need_block_len = tensor(np.zeros([1], np.int32))
        self.used_list_len = per_slot(0, np.int32)
        self.free_list = tensor(np.arange(total - 1, total - pool - 1, -1, dtype=np.int32))
        self.free_list_len = tensor(np.array([pool], np.int32))
        self.input_ids = tensor(np.zeros([batch, width], np.int64))
        # Column k holds the k-th generated token (column 0 is unused, as in FastDeploy).
        self.pre_ids = tensor(np.full([batch, width], -1, np.int64))
        self.step_idx = per_slot(0, np.int64)
        self.next_tokens = per_slot(-1, np.int64)
        self.first_token_ids = per_slot(-1, np.int64)
        # --- request parameters ---
        self.eos_token_ids = tensor(np.full([batch, MAX_EOS_IDS], -1, np.int64))
        self.max_new_tokens = per_slot(0, np.int64)
        self.temperature = per_slot(0.0, np.float32)
        self.top_p = per_slot(1.0, np.float32)
        # --- advance_step's outputs: the next step's decode inputs ---
        self.input_tokens = per_slot(0, np.int64)
        self.input_positions = per_slot(0, np.int64)
        self.context_lens = per_slot(0, np.int32)
        self.slot_mapping = per_slot(-1, np.int64)
        self.decode_active = per_slot(False, np.bool_)
        self.place = self.stop_flags.place

    def step_tensors(self) -> dict[str, paddle.Tensor]:
        """``step_paddle``'s 22 tensors by name, in its argument order."""
        return {name: getattr(self, name) for name in STEP_PADDLE_TENSORS}

    def check(self) -> None:
        """``check_state`` on this state (raises ``StateError`` listing every
        violation), knowing the block-id layout: decoder blocks are the top ids."""
        config = self.config
        check_state(
            self.step_tensors(),
            config.block_size,
            num_blocks=config.num_kv_blocks,
            decoder_blocks=range(config.num_encoder_blocks, config.num_kv_blocks),
        )
