"""Tensor parallelism over ``paddle.distributed``: Megatron-style shards of a ``LlamaForCausalLM``,
the process group they reduce over, and a per-step check that every rank holds the same
schedule.

Each rank runs the whole engine (scheduler, both ops, sampling) on its own replica of the
slot state; nothing about the schedule is broadcast. That works because every input of a
step is the same on every rank: the requests, the ops (deterministic), and the logits,
which come from a replicated LM head applied to an all-reduced hidden state. The sampler's
draws are keyed per request, so sampled tokens agree too. ``RankChecker`` verifies it.

Sharding (rank r of N; matrices are [in, out]):

- ``wq``/``wk``/``wv`` (and Qwen2's q/k/v biases) are column-parallel by head: rank r
  keeps heads ``r*H/N .. (r+1)*H/N`` and their KV heads. With fewer KV heads than ranks
  (``N % KVH == 0``) each KV head is replicated on the ``N/KVH`` ranks whose query heads
  read it, as vLLM does; each rank's paged KV cache holds only its own KV heads.
- ``wo`` is row-parallel (the rows of the rank's query heads), ``w_gate``/``w_up``
  column-parallel and ``w_down`` row-parallel over the intermediate size; the products of
  ``wo`` and ``w_down`` are summed with ``all_reduce``, ``o_bias`` added once after it.
- Weights kept in bfloat16 or int8 (``ModelConfig.weight_format``) are sharded as floats and
  then packed by each rank: int8 scales are per output column, so a column-parallel shard
  gets exactly the full weight's scales; a row-parallel one (``wo``, ``w_down``) gets, per
  column, the largest magnitude over its own rows.
- The embedding, norms and LM head are replicated: a vocab-parallel head would need a
  second collective per step (an all_gather of the logits, or a distributed argmax and
  sampler) to give every rank the same logits, and replicating costs only memory.

The collectives are ``paddle.distributed``'s (``all_reduce``, ``all_gather``) after
``init_parallel_env()``: gloo on a CPU build, NCCL on a GPU build. fleet's tensor-parallel
layers are not used: they need fleet's hybrid-parallel setup and shard nn.Linear layers,
while ``LlamaForCausalLM`` holds plain [in, out] parameters; two reductions per layer are all the
model needs.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import paddle

from ..config import ModelConfig
from ..models.llama import LlamaForCausalLM
from ..spec.tensor_table import STEP_PADDLE_TENSORS

__all__ = [
    "RankChecker",
    "RankDivergenceError",
    "TensorParallel",
    "init_tensor_parallel",
    "shard_config",
    "shard_model",
    "shard_weights",
]

# Where the sampled tokens appear among the digests ``RankChecker`` compares.
SAMPLED_TOKENS = "sampled_tokens"


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group: ``rank`` of ``world_size``."""

    rank: int
    world_size: int

    def all_reduce(self, partial: paddle.Tensor) -> paddle.Tensor:
        """The sum of ``partial`` over the ranks (in place; the same on every rank)."""
        paddle.distributed.all_reduce(partial)
        return partial


def init_tensor_parallel(tp: int) -> TensorParallel | None:
    """Joins the process group of ``paddle.distributed.launch`` for ``--tp tp``.

    ``tp`` 1 without a launcher returns None and initializes nothing. Raises
    ``ValueError`` when ``tp`` is not the launcher's world size.
    """
    # The launcher exports the world size; without it this is a single process.
    world_size = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if tp != world_size:
        raise ValueError(
            f"--tp: expected the launcher's world size ({world_size}; run "
            f"'python -m paddle.distributed.launch --nproc_per_node {tp} ...' for --tp {tp}), "
            f"got {tp}"
        )
    if tp == 1:
        return None
    paddle.distributed.init_parallel_env()
    return TensorParallel(paddle.distributed.get_rank(), paddle.distributed.get_world_size())


def _local_kv_heads(config: ModelConfig, world_size: int) -> int:
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % world_size:
        raise ValueError(f"--tp: expected a divisor of num_heads ({heads}), got {world_size}")
    if config.intermediate_size % world_size:
        raise ValueError(
            f"--tp: expected a divisor of intermediate_size ({config.intermediate_size}), "
            f"got {world_size}"
        )
    if kv_heads % world_size == 0:
        return kv_heads // world_size
    if world_size % kv_heads == 0:
        return 1  # replicated: N / KVH ranks share each KV head
    raise ValueError(
        f"--tp: expected a divisor or a multiple of num_kv_heads ({kv_heads}), got {world_size}"
    )


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's shard: its head counts and intermediate size.

    Raises ``ValueError`` when ``world_size`` does not divide the heads or the intermediate
    size, or is neither a divisor nor a multiple of the KV heads.
    """
    return replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=_local_kv_heads(config, world_size),
        intermediate_size=config.intermediate_size // world_size,
        explicit_head_dim=config.head_dim,  # hidden_size // local heads would be wrong
    )


def shard_weights(
    weights: Mapping[str, np.ndarray], config: ModelConfig, rank: int, world_size: int
) -> dict[str, np.ndarray]:
    """Rank ``rank``'s slices of the full ``weights`` (``LlamaForCausalLM`` names, [in, out]) of a
    model of ``config``, for ``LlamaForCausalLM(shard_config(config, world_size), ...)``."""
    if not 0 <= rank < world_size:
        raise ValueError(
            f"shard_weights: argument 'rank': expected 0 <= rank < {world_size}, got {rank}"
        )
    local = shard_config(config, world_size)
    head_dim = config.head_dim
    q = slice(rank * local.num_heads * head_dim, (rank + 1) * local.num_heads * head_dim)
    # The KV heads the rank's query heads read (head h reads KV head h // group).
    first_kv = rank * local.num_heads // (config.num_heads // config.num_kv_heads)
    kv = slice(first_kv * head_dim, (first_kv + local.num_kv_heads) * head_dim)
    width = local.intermediate_size
    mlp = slice(rank * width, (rank + 1) * width)
    columns = {
        "wq": q,
        "q_bias": q,
        "wk": kv,
        "k_bias": kv,
        "wv": kv,
        "v_bias": kv,
        "w_gate": mlp,
        "w_up": mlp,
    }
    rows = {"wo": q, "w_down": mlp}
    shards = {}
    for name, array in weights.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in columns:
            shards[name] = array[..., columns[leaf]]
        elif leaf in rows:
            shards[name] = array[rows[leaf]]
        else:  # embedding, norms, o_bias, lm_head: replicated
            shards[name] = array
    return shards


def shard_model(
    model: LlamaForCausalLM, group: TensorParallel, weight_format: str | None = None
) -> LlamaForCausalLM:
    """``group.rank``'s shard of ``model`` (weights in its dtype), reducing over ``group``,
    its weights kept in ``weight_format`` (``ModelConfig.weight_format``). A model whose
    weights are packed only is sharded at load instead (``load_checkpoint``'s
    ``tensor_parallel``)."""
    config = model.config
    if config.weight_format is not None:
        raise ValueError(
            f"shard_model: argument 'model': expected weights in {config.dtype}, got a model "
            f"packed in {config.weight_format} (shard at load: load_checkpoint(..., "
            "tensor_parallel=group))"
        )
    full = {name: param.numpy() for name, param in model.named_parameters()}
    return LlamaForCausalLM(
        replace(shard_config(config, group.world_size), weight_format=weight_format),
        shard_weights(full, config, group.rank, group.world_size),
        all_reduce=group.all_reduce,
    )


class RankDivergenceError(RuntimeError):
    """The ranks' schedules (or sampled tokens) differ: a bug, never expected."""


def _digest(array: np.ndarray) -> int:
    hasher = hashlib.blake2b(digest_size=8)
    hasher.update(f"{array.dtype.str}{array.shape}".encode())
    hasher.update(np.ascontiguousarray(array).tobytes())
    return int(np.frombuffer(hasher.digest(), dtype="<i8")[0])


class RankChecker:
    """``--check-ranks``: the engine's ``after_step`` hook that all_gathers a digest of
    ``step_paddle``'s 22 tensors and of the step's sampled tokens from every rank, and
    raises ``RankDivergenceError`` naming the first tensor that differs. Every rank
    receives the same digests, so every rank raises together (none is left waiting)."""

    names = (*STEP_PADDLE_TENSORS, SAMPLED_TOKENS)

    def __init__(self, group: TensorParallel) -> None:
        self.group = group

    def __call__(self, engine) -> None:
        arrays = [tensor.numpy() for tensor in engine.state.step_tensors().values()]
        arrays.append(
            np.array(
                [(t.request_id, t.index, t.token_id) for t in engine.last_step_outputs],
                dtype=np.int64,
            )
        )
        local = paddle.to_tensor(np.array([_digest(a) for a in arrays], dtype=np.int64))
        gathered: list[paddle.Tensor] = []
        paddle.distributed.all_gather(gathered, local)
        digests = np.stack([tensor.numpy() for tensor in gathered])  # [ranks, tensors]
        differs = (digests != digests[0]).any(axis=0)
        if differs.any():
            column = int(np.flatnonzero(differs)[0])
            ranks = np.flatnonzero(digests[:, column] != digests[0, column]).tolist()
            raise RankDivergenceError(
                f"--check-ranks: after step {engine.stats.steps}: tensor "
                f"{self.names[column]!r} differs between rank 0 and rank(s) {ranks} "
                f"(of {self.group.world_size}); this rank is {self.group.rank}"
            )
