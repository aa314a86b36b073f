"""The slot-indexed device state the two ops work on (``ShareInputs``); its sizes come
from ``paddle_step.config.EngineConfig``.

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

import numpy as np
import paddle

from ..config import EngineConfig
from ..host_memory import refuse_past_available_memory
from ..spec.check_state import check_state
from ..spec.tensor_table import STEP_PADDLE_TENSORS
from .request import MAX_LOGIT_BIAS, MAX_STOP_IDS

__all__ = ["ShareInputs", "host_array"]


class ShareInputs:
    """FastDeploy-style per-slot state on one place, in SPEC's dtypes.

    Attributes named like ``step_paddle``'s arguments (see ``STEP_PADDLE_TENSORS``) are its
    tensors; the others are:

    - ``eos_token_ids`` [B, MAX_STOP_IDS] int64 (-1 pads): the ids that stop the slot
      (its eos ids, then its stop_token_ids); ``max_new_tokens`` [B] int64,
      ``temperature``, ``top_p``, ``min_p`` and the three penalties [B] float32,
      ``top_k`` and ``min_tokens`` [B] int64, ``logit_bias_ids`` [B, MAX_LOGIT_BIAS] int64
      (-1 pads) and ``logit_bias_values`` float32, ``prompt_ids`` [B, max_model_len] int64
      (-1 pads, for repetition_penalty): each slot's request parameters;
    - ``input_tokens``, ``input_positions``, ``slot_mapping`` [B] int64, ``context_lens``
      [B] int32 and ``decode_active`` [B] bool: ``advance_step``'s outputs, the next
      step's decode inputs (token, its position, its KV slot, context length) and which
      rows decode.

    A fresh state has every slot stopped and empty, and the whole decoder pool in
    ``free_list``: the top block ids, descending, as FastDeploy builds it. The tensors
    live on ``place`` (default: Paddle's current device), kept as the ``place`` attribute.
    ``on_host``: they are CPU tensors that ``host_array`` can read and write in place
    (paddle exports DLPack and NumPy imports it writable: NumPy 1.26 imports it read-only).
    """

    def __init__(
        self,
        config: EngineConfig,
        place: paddle.CPUPlace | paddle.CUDAPlace | str | None = None,
    ) -> None:
        batch, width = config.max_batch, config.max_model_len
        total, pool = config.num_kv_blocks, config.num_decoder_blocks
        in_host_memory = paddle.get_device() == "cpu" if place is None else "cpu" in str(place)
        if in_host_memory:
            _check_fits_in_memory(config)

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
        self.eos_token_ids = tensor(np.full([batch, MAX_STOP_IDS], -1, np.int64))
        self.max_new_tokens = per_slot(0, np.int64)
        self.temperature = per_slot(0.0, np.float32)
        self.top_p = per_slot(1.0, np.float32)
        self.top_k = per_slot(0, np.int64)
        self.min_p = per_slot(0.0, np.float32)
        self.presence_penalty = per_slot(0.0, np.float32)
        self.frequency_penalty = per_slot(0.0, np.float32)
        self.repetition_penalty = per_slot(1.0, np.float32)
        self.min_tokens = per_slot(0, np.int64)
        self.logit_bias_ids = tensor(np.full([batch, MAX_LOGIT_BIAS], -1, np.int64))
        self.logit_bias_values = tensor(np.zeros([batch, MAX_LOGIT_BIAS], np.float32))
        # The prompt (-1 pads): input_ids holds only each step's chunk.
        self.prompt_ids = tensor(np.full([batch, width], -1, np.int64))
        # --- advance_step's outputs: the next step's decode inputs ---
        self.input_tokens = per_slot(0, np.int64)
        self.input_positions = per_slot(0, np.int64)
        self.context_lens = per_slot(0, np.int32)
        self.slot_mapping = per_slot(-1, np.int64)
        self.decode_active = per_slot(False, np.bool_)
        self.place = self.stop_flags.place
        self.on_host = self.place.is_cpu_place() and _writes_through_dlpack(self.stop_flags)

    def step_tensors(self) -> dict[str, paddle.Tensor]:
        """``step_paddle``'s 22 tensors by name, in its argument order."""
        return {name: getattr(self, name) for name in STEP_PADDLE_TENSORS}

    def check(self) -> None:
        """``check_state`` on this state (raises ``StateError`` listing every
        violation), knowing the block-id layout: decoder blocks are the top ids, and the
        prompt blocks below them may be shared by several slots (prefix caching; the
        engine checks their reference counts itself)."""
        config = self.config
        check_state(
            self.step_tensors(),
            config.block_size,
            num_blocks=config.num_kv_blocks,
            decoder_blocks=range(config.num_encoder_blocks, config.num_kv_blocks),
            shared_prompt_blocks=range(config.num_encoder_blocks),
        )


def _check_fits_in_memory(config: EngineConfig) -> None:
    """Refuses a slot state past the available memory, naming the sizes."""
    per_slot = (
        3 * 8 * config.max_model_len  # input, generated and prompt ids
        + 4 * config.blocks_per_seq
        + 8 * MAX_STOP_IDS
        + 12 * MAX_LOGIT_BIAS
        + 128  # the scalars
    )
    refuse_past_available_memory(
        config.max_batch * per_slot,
        "the slot state",
        f"max_batch {config.max_batch} slots x max_model_len {config.max_model_len} token "
        "ids of 3 kinds in int64",
        "a smaller --max-batch or --max-model-len",
    )


def _writes_through_dlpack(tensor: paddle.Tensor) -> bool:
    """Whether ``host_array(tensor)`` gives a writable view: paddle 2.6 exports no DLPack,
    and NumPy 1.26 (which PaddleFormers installs) imports DLPack arrays read-only."""
    return hasattr(tensor, "__dlpack__") and np.from_dlpack(tensor).flags.writeable


def host_array(tensor: paddle.Tensor) -> np.ndarray:
    """``tensor``'s own memory as a NumPy array, read and written in place: a CPU tensor of
    a paddle that exports DLPack, under a NumPy that imports it writable
    (``ShareInputs.on_host``). The step's updates of its [B] vectors run as NumPy
    operations on these instead of eager Paddle ops, each of which runs cold (~27 us) right
    after the weights have streamed through the caches (docs/performance-cpu.md)."""
    return np.from_dlpack(tensor)
