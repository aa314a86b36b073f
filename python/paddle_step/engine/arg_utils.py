"""The engine's command-line flags, shared by ``examples/generate.py`` and
``python -m paddle_step.serve``, and how they become a model and an ``Engine``.

``--model`` names a Hugging Face checkpoint directory (default: the small model shipped
in the package), or ``random`` for a random-weight ``LlamaForCausalLM`` with the byte tokenizer.
``--max-model-len`` defaults to the model's context; when the KV budget cannot hold one
sequence that long, it is reduced to what fits and a line on stderr says so.
``--tp N`` shards the model over the N processes of ``paddle.distributed.launch`` (see
``paddle_step.distributed.tensor_parallel``); each builds the same engine.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import KV_CACHE_DTYPES, EngineConfig
from .cpu_threads import default_threads

__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "add_engine_arguments",
    "build_engine",
    "engine_config",
    "load_model",
    "load_tokenizer",
]

DEFAULT_MODEL = Path(__file__).parents[1] / "assets" / "pydoc-tiny"
RANDOM_MODEL = "random"
# The random LlamaForCausalLM has no context of its own; this one keeps its demo quick.
RANDOM_MODEL_CONTEXT = 256


@dataclass(frozen=True)
class LoadedModel:
    """A model with what serving it needs: its tokenizer, stop ids, context and name, and
    with ``--tp`` > 1 this process's place in the tensor-parallel group."""

    model: object  # LlamaForCausalLM (this rank's shard with --tp > 1)
    tokenizer: object  # HFTokenizer or ByteTokenizer
    eos_token_ids: list[int]
    context_len: int
    name: str
    tensor_parallel: object = None  # TensorParallel, or None for one process


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the model and engine flags to ``parser``."""
    group = parser.add_argument_group("model and engine")
    group.add_argument(
        "--model",
        default=str(DEFAULT_MODEL),
        help="a Hugging Face checkpoint directory (Llama, Mistral, Qwen2), or 'random' for "
        "a random-weight LlamaForCausalLM with a byte tokenizer (default: the shipped model)",
    )
    group.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float64"),
        default="auto",
        help="weights: 'auto' keeps the checkpoint's (bfloat16 for a bfloat16 checkpoint, "
        "else float32); bfloat16 weights compute in float32 on the CPU op (default: auto)",
    )
    group.add_argument(
        "--quantization",
        choices=("int8",),
        default=None,
        help="int8: weight-only int8 quantized at load, one scale per output channel, "
        "computing in float32 on the CPU op (default: none)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache storage: 'auto' in the model's dtype; 'bfloat16' rounds keys and "
        "values to bfloat16 (half the memory and the bytes attention reads; a float32 model "
        "on the CPU; attention still computes in float32) (default: auto)",
    )
    group.add_argument("--max-batch", type=int, default=4, help="batch slots")
    group.add_argument("--block-size", type=int, default=8, help="tokens per KV block")
    group.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence, prompt plus generated tokens (default: the model's "
        "context, reduced to what the KV budget holds)",
    )
    group.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="total KV blocks (default: enough for every slot to hold a full-length "
        "sequence, so nothing is preempted; fewer forces preemption)",
    )
    group.add_argument(
        "--decoder-pool-ratio",
        type=float,
        default=0.5,
        help="share of the KV blocks that form the decoder pool; the rest hold prompts",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the K/V of full prompt blocks that an earlier prompt with the same "
        "leading tokens computed (default: on)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the most tokens one step runs: decode rows first, the rest to prompts, a long "
        "one continuing over several steps (chunked prefill); at least --max-batch "
        "(default: no limit, a prompt runs whole)",
    )
    group.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the model's math (default: the cores this process may run "
        "on, divided among the --tp ranks)",
    )
    group.add_argument(
        "--explain-dense",
        action="store_true",
        help="print on stderr how each dense block runs for each row count (eager, the CPU "
        "op or compiled: the fastest, timed the first time the row count appears), and "
        "where whole layers as one CPU call were timed against the blocks, and the distance "
        "the CPU op's products prefetch their weights at (timed at start)",
    )
    group.add_argument("--seed", type=int, default=0, help="sampling (and random weights)")
    group.add_argument(
        "--check-state",
        action="store_true",
        help="debug: validate the engine state after every step",
    )
    group.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: the launcher's world size, e.g. 'python -m "
        "paddle.distributed.launch --nproc_per_node 2 ... --tp 2' (default 1: one process)",
    )
    group.add_argument(
        "--check-ranks",
        action="store_true",
        help="debug (--tp > 1): compare every rank's scheduling state and sampled tokens "
        "after every step, stop at the first difference",
    )


def check_engine_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` for flag values no engine can take."""
    if not args.model or (args.model != RANDOM_MODEL and not Path(args.model).is_dir()):
        parser.error(
            f"--model: expected a checkpoint directory or '{RANDOM_MODEL}', got {args.model!r}"
        )
    if not 0 < args.decoder_pool_ratio < 1:
        parser.error(f"--decoder-pool-ratio: expected in (0, 1), got {args.decoder_pool_ratio}")
    if args.quantization is not None and args.dtype == "float64":
        parser.error(
            f"--quantization {args.quantization}: computes in float32, got --dtype float64"
        )
    if args.kv_cache_dtype == "bfloat16" and args.dtype == "float64":
        parser.error("--kv-cache-dtype bfloat16: expected a float32 model, got --dtype float64")
    if args.check_ranks and args.tp == 1:
        parser.error("--check-ranks: expected --tp > 1, got --tp 1")
    for name in ("max_batch", "block_size", "max_model_len", "kv_blocks", "tp", "threads"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')}: expected > 0, got {value}")
    if not 0 <= args.seed < 2**63:
        parser.error(f"--seed: expected an integer in [0, 2**63), got {args.seed}")
    budget = args.max_num_batched_tokens
    if budget is not None and budget < args.max_batch:
        parser.error(
            f"--max-num-batched-tokens: expected at least --max-batch ({args.max_batch}, one "
            f"token per decoding slot), got {budget}"
        )


def load_model(args: argparse.Namespace) -> LoadedModel:
    """The model ``--model`` names, in ``--dtype`` and ``--quantization``; with ``--tp`` > 1,
    joins the process group and keeps this rank's shard. Raises ``CheckpointError`` (a
    ``ValueError``) for a checkpoint it cannot load, ``ValueError`` for a ``--tp`` that does
    not fit or a weight format this machine cannot run."""
    from ..distributed.tensor_parallel import init_tensor_parallel, shard_model

    if args.explain_dense:
        explain_dense()
    group = init_tensor_parallel(args.tp)
    if args.model == RANDOM_MODEL:
        from ..config import ModelConfig
        from ..models.llama import LlamaForCausalLM
        from ..tokenizer.byte import ByteTokenizer

        tokenizer = ByteTokenizer()
        weight_format = args.quantization or ("bfloat16" if args.dtype == "bfloat16" else None)
        dtype = "float64" if args.dtype == "float64" else "float32"
        config = ModelConfig(dtype=dtype, seed=args.seed)
        if group is not None:  # drawn whole in float, then sharded and packed
            model = shard_model(LlamaForCausalLM(config), group, weight_format)
        else:
            model = LlamaForCausalLM(replace(config, weight_format=weight_format))
        eos_token_ids, context_len, name = [tokenizer.eos_id], RANDOM_MODEL_CONTEXT, "random"
    else:
        from ..model_loader.loader import load_checkpoint

        checkpoint = load_checkpoint(
            args.model, args.dtype, args.quantization, tensor_parallel=group
        )
        model, tokenizer = checkpoint.model, checkpoint.tokenizer
        eos_token_ids, context_len = list(checkpoint.eos_token_ids), checkpoint.max_model_len
        name = checkpoint.name
    return LoadedModel(model, tokenizer, eos_token_ids, context_len, name, group)


def load_tokenizer(args: argparse.Namespace):
    """The tokenizer of ``--model`` alone (no weights), for a process that only encodes
    and decodes."""
    if args.model == RANDOM_MODEL:
        from ..tokenizer.byte import ByteTokenizer

        return ByteTokenizer()
    from ..tokenizer.hf import HFTokenizer

    return HFTokenizer.from_dir(args.model)


def engine_config(args: argparse.Namespace, context_len: int) -> EngineConfig:
    """The ``EngineConfig`` of the flags for a model of ``context_len`` tokens.

    Raises ``ValueError`` when ``--max-model-len`` exceeds the context, or when the KV
    budget cannot hold even the shortest sequence.
    """
    block_size = args.block_size
    wanted = args.max_model_len if args.max_model_len is not None else context_len
    if wanted > context_len:
        raise ValueError(
            f"--max-model-len: expected at most the model's context ({context_len}), got {wanted}"
        )
    # step_paddle restores whole blocks on recovery: the length is a multiple of them.
    max_model_len = wanted // block_size * block_size
    named = "--max-model-len" if args.max_model_len is not None else "the model's context"
    if max_model_len == 0:
        raise ValueError(f"--block-size: expected at most {named} ({wanted}), got {block_size}")
    if max_model_len != wanted:
        print(
            f"max_model_len reduced from {wanted} to {max_model_len}, a multiple of "
            f"--block-size {block_size}",
            file=sys.stderr,
        )
    ratio = args.decoder_pool_ratio
    kv_blocks = args.kv_blocks
    if kv_blocks is None:
        per_region = args.max_batch * (max_model_len // block_size)
        kv_blocks = math.ceil(per_region / min(ratio, 1 - ratio))
        while min(int(kv_blocks * ratio), kv_blocks - int(kv_blocks * ratio)) < per_region:
            kv_blocks += 1  # the pool size is rounded down
    else:
        # One sequence must fit the decoder pool (its recovery takes all its blocks at
        # once) and its prompt the encoder region.
        pool = int(kv_blocks * ratio)
        fits = min(pool, kv_blocks - pool) * block_size
        if fits < max_model_len:
            if fits < block_size:
                raise ValueError(
                    f"--kv-blocks {kv_blocks} with --decoder-pool-ratio {ratio}: the pool "
                    f"({pool}) or the prompt region ({kv_blocks - pool}) cannot hold one "
                    "block of a sequence"
                )
            print(
                f"max_model_len reduced from {max_model_len} to {fits}: {kv_blocks} KV blocks "
                f"of {block_size} tokens (decoder pool {pool}) hold no longer sequence",
                file=sys.stderr,
            )
            max_model_len = fits
    return EngineConfig(
        max_batch=args.max_batch,
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=kv_blocks,
        decoder_pool_ratio=ratio,
        threads=args.threads or default_threads(args.tp),
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def explain_dense() -> None:
    """Shows the dense blocks', the layers' and the prefetch distance's choices on stderr
    (``layers.dense_blocks`` and ``layers.prefetch_distance`` log them at DEBUG, below
    the INFO that ``import paddle.distributed`` sets on the root logger)."""
    logger = logging.getLogger("paddle_step.layers")
    if not any(getattr(h, "explains_dense", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("dense: %(message)s"))
        handler.explains_dense = True
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # once, not again through a handler paddle put on the root


def build_engine(args: argparse.Namespace, loaded: LoadedModel | None = None):
    """``(engine, loaded)`` for the flags (``loaded`` defaults to ``load_model(args)``)."""
    from ..distributed.tensor_parallel import RankChecker
    from .llm_engine import Engine

    loaded = loaded if loaded is not None else load_model(args)
    config = engine_config(args, loaded.context_len)
    engine = Engine(
        loaded.model,
        config,
        eos_token_ids=loaded.eos_token_ids,
        seed=args.seed,
        check_state=args.check_state,
        after_step=RankChecker(loaded.tensor_parallel) if args.check_ranks else None,
    )
    return engine, loaded
