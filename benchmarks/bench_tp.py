#!/usr/bin/env python
"""Decode throughput with tensor parallelism: one engine per rank on its model shard.

A random-weight Llama of SmolLM-135M's shape (30 layers, hidden 576, intermediate 1536,
vocab 49152; heads and KV heads from the flags, default 9 and 3) runs ``--num-requests``
greedy requests of ``--prompt-len`` random tokens for ``--max-new-tokens`` tokens each (eos
disabled), after one short warm-up request. Rank 0 prints one JSON line: the shape, the
ranks and the generated tokens per second (prefills included).

    python benchmarks/bench_tp.py                                   # TP=1
    python -m paddle.distributed.launch --nproc_per_node 3 \\
        benchmarks/bench_tp.py --tp 3                               # 9 heads / 3 KV heads
    python -m paddle.distributed.launch --nproc_per_node 2 \\
        benchmarks/bench_tp.py --tp 2 --heads 8 --kv-heads 4        # TP=2 needs even heads
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.distributed.tensor_parallel import init_tensor_parallel, shard_model
from paddle_step.engine.llm_engine import Engine
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    group = init_tensor_parallel(args.tp)
    config = ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=1536,
    )
    model = LlamaForCausalLM(config)
    if group is not None:
        model = shard_model(model, group)
    max_model_len = args.prompt_len + args.max_new_tokens + 8
    engine_config = EngineConfig(
        max_batch=args.num_requests,
        max_model_len=max_model_len,
        block_size=8,
        num_kv_blocks=2 * args.num_requests * max_model_len // 8 + 2,
    )
    engine = Engine(model, engine_config, eos_token_ids=[])
    prompts = np.random.default_rng(0).integers(0, 49152, (args.num_requests, args.prompt_len))
    engine.generate(prompts[:1].tolist(), SamplingParams(max_tokens=2))  # warm-up
    started = time.perf_counter()
    results = engine.generate(prompts.tolist(), SamplingParams(max_tokens=args.max_new_tokens))
    elapsed = time.perf_counter() - started
    if group is None or group.rank == 0:
        tokens = sum(len(result.token_ids) for result in results)
        report = {
            "tp": args.tp,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "generated_tokens": tokens,
            "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 1),
        }
        print(json.dumps(report))


if __name__ == "__main__":
    main()
