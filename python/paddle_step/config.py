"""Configurations: the engine's batch and KV budget, the model's shape and numerics, and
Llama 3's rotary scaling. Plain dataclasses, no paddle."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .tokenizer.byte import ByteTokenizer

__all__ = ["KV_CACHE_DTYPES", "WEIGHT_FORMATS", "EngineConfig", "Llama3RopeScaling", "ModelConfig"]

# Weight formats a float32 model can keep its weights in, packed for the CPU op.
WEIGHT_FORMATS = ("bfloat16", "int8")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x's frequency-dependent rotary scaling (``rope_type: llama3``).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    stretched by ``factor``, shorter than ``.. / high_freq_factor`` kept, and the band
    between interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.high_freq_factor > self.low_freq_factor > 0 or self.factor <= 0:
            raise ValueError(
                "Llama3RopeScaling: expected factor > 0 and high_freq_factor > low_freq_factor "
                f"> 0, got factor={self.factor}, low_freq_factor={self.low_freq_factor}, "
                f"high_freq_factor={self.high_freq_factor}"
            )

    def scale(self, inv_freq: np.ndarray) -> np.ndarray:
        """The scaled inverse frequencies (float64, same shape as ``inv_freq``)."""
        context = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        smooth = (context / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        interpolated = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        long_waves = np.where(
            wavelen > context / self.low_freq_factor, inv_freq / self.factor, interpolated
        )
        return np.where(wavelen < context / self.high_freq_factor, inv_freq, long_waves)


@dataclass(frozen=True)
class ModelConfig:
    """Shape, numerics and seed of a ``LlamaForCausalLM``.

    The defaults are the random test model; ``paddle_step.model_loader.hf_config`` fills the
    rest from a Hugging Face checkpoint (``explicit_head_dim``, biases, tied embeddings, rope
    scaling, context length).

    ``dtype`` is what the model computes in (activations, norms, rotary embedding, softmax,
    logits). ``weight_format`` None keeps the weights as ``dtype`` parameters; ``"bfloat16"``
    or ``"int8"`` (``WEIGHT_FORMATS``, with ``dtype`` float32) keeps the embedding and every
    product's weights only packed in that format for the CPU op (``layers.cpu_linear``),
    which widens them to float32 in registers.
    """

    vocab_size: int = ByteTokenizer().vocab_size
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: str = "float32"
    seed: int = 0
    explicit_head_dim: int | None = None  # None: hidden_size // num_heads
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    o_proj_bias: bool = False  # a bias on the attention output projection
    tie_word_embeddings: bool = False  # the lm head is the embedding matrix, transposed
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int | None = None  # context length; None: unbounded
    weight_format: str | None = None  # None: weights in dtype; else one of WEIGHT_FORMATS

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        if self.weight_format is not None:
            if self.weight_format not in WEIGHT_FORMATS:
                raise ValueError(
                    f"weight_format must be None or one of {WEIGHT_FORMATS}, "
                    f"got {self.weight_format!r}"
                )
            if self.dtype != "float32":
                raise ValueError(
                    f"weight_format {self.weight_format!r} computes in float32, got dtype "
                    f"{self.dtype!r}"
                )
        if self.explicit_head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                f"({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(
                f"head_dim ({self.head_dim}) must be positive and even for rotary embedding"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        if self.explicit_head_dim is not None:
            return self.explicit_head_dim
        return self.hidden_size // self.num_heads


# EngineConfig.kv_cache_dtype's values: the model's own dtype, or bfloat16.
KV_CACHE_DTYPES = ("auto", "bfloat16")


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
        threads: CPU threads for the model's math; None: the cores this process may run
            on, divided among the tensor-parallel ranks.
        enable_prefix_caching: reuse the K/V of full prompt blocks an earlier prompt with
            the same leading tokens computed (``engine.prefix_cache``); a request then
            prefills only the rest of its prompt.
        max_num_batched_tokens: the most tokens one step runs (None: no limit). Decode
            rows come first, one token each; the rest of the budget goes to prompts, a
            long one continuing over several steps (chunked prefill). At least
            ``max_batch``, so every decoding slot runs every step.
        kv_cache_dtype: how the KV cache stores keys and values (``KV_CACHE_DTYPES``):
            ``"auto"`` in the model's dtype; ``"bfloat16"`` rounded to bfloat16 (half the
            memory, and half the bytes a decode token's attention reads) for a float32
            model on the CPU ops: the step's keys and values are rounded as they are
            written and widened as attention reads them, which computes in float32.

    Prompts and decoding draw on separate block regions: a prompt is admitted only when
    the prompt region (``1 - decoder_pool_ratio`` of the blocks) has room for it, so a
    budget sized for the whole batch at the default 0.5 split may admit only part of a
    batch of long prompts at once and run it in waves (the engine logs this once).
    """

    max_batch: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    decoder_pool_ratio: float = 0.5
    enc_dec_block_num: int = 1
    threads: int | None = None
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_model_len", "block_size", "num_kv_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"EngineConfig.{name}: expected a positive int, got {value!r}")
        if self.threads is not None and (
            not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1
        ):
            raise ValueError(
                f"EngineConfig.threads: expected None or an int >= 1, got {self.threads!r}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                "EngineConfig.enable_prefix_caching: expected a bool, "
                f"got {self.enable_prefix_caching!r}"
            )
        budget = self.max_num_batched_tokens
        if budget is not None and (
            not isinstance(budget, int) or isinstance(budget, bool) or budget < self.max_batch
        ):
            raise ValueError(
                "EngineConfig.max_num_batched_tokens: expected None or an int >= max_batch "
                f"({self.max_batch}, one token per decoding slot), got {budget!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineConfig.kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if (
            not isinstance(self.enc_dec_block_num, int)
            or isinstance(self.enc_dec_block_num, bool)
            or self.enc_dec_block_num < 0
        ):
            raise ValueError(
                "EngineConfig.enc_dec_block_num: expected an int >= 0, "
                f"got {self.enc_dec_block_num!r}"
            )
        ratio = self.decoder_pool_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio < 1.0:
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
