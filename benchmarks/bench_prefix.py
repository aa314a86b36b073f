"""Prefix caching and chunked prefill, measured on the engine (no HTTP), each setting
against its "off" twin in the same run, alternating, the median of ``--repeats``.

- shared prefix: N requests, a common prefix as long as the context allows (512 tokens
  at most) + 16 to 32 distinct tokens, 32 tokens out, at most C in flight (a finished
  request is replaced at once): time to first token p50 / p99 and output tokens/s, with
  and without prefix caching.
- long prompt: 16 streams decoding, then one prompt near the context length arrives:
  the streams' inter-token latency p99 from its arrival until it has its first token
  plus 8 steps, and that prompt's time to first token, with and without
  ``--max-num-batched-tokens``.

    python benchmarks/bench_prefix.py                 # the shipped model (256-token context)
    python benchmarks/bench_prefix.py --shape pydoc-tiny-2k --max-model-len 1024
    python benchmarks/bench_prefix.py --quick --json
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import tempfile
import time

import numpy as np
import paddle
from bench_common import emit_report, whole_context_config
from bench_decode import COMPARE_SHAPES, write_random_checkpoint

from paddle_step.engine.arg_utils import DEFAULT_MODEL
from paddle_step.engine.llm_engine import Engine
from paddle_step.model_loader.loader import load_checkpoint
from paddle_step.sampling_params import SamplingParams

OUT_TOKENS = 32
# bench_decode's shapes, and the shipped model's shape with a 2048-token context (its own
# is 256): long prompts at a cost a loaded 2-core machine runs in minutes.
SHAPES = {
    **COMPARE_SHAPES,
    "pydoc-tiny-2k": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 384,
        "vocab_size": 2048,
        "tie_word_embeddings": True,
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a checkpoint directory")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="instead of --model: a random-weight Llama of bench_decode's shape (2048 context)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="default: the model's context"
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--streams", type=int, default=16, help="long-prompt case")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--chunk-budget",
        type=int,
        default=48,
        help="--max-num-batched-tokens of the chunked side of the long-prompt case",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting (median kept)")
    parser.add_argument("--quick", action="store_true", help="few requests, one run each")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.concurrency, args.streams, args.repeats = 8, 4, 4, 1
    return args


def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


def engine_for(loaded, context: int, max_batch: int, block_size: int, **features) -> Engine:
    """An engine whose regions each hold every slot's whole sequence (no preemption)."""
    config = whole_context_config(max_batch, context, block_size, **features)
    return Engine(loaded.model, config, eos_token_ids=[])


def shared_prefix_prompts(count: int, context: int, vocab: int) -> tuple[list[list[int]], int]:
    """Prompts of a common prefix plus 16..32 distinct tokens, all fitting with 32 out."""
    rng = np.random.default_rng(0)
    prefix_len = min(512, context - OUT_TOKENS - 32)
    prefix = rng.integers(2, vocab, prefix_len).tolist()
    tails = [rng.integers(2, vocab, int(rng.integers(16, 33))).tolist() for _ in range(count)]
    return [prefix + tail for tail in tails], prefix_len


def run_shared_prefix(loaded, prompts, args, caching: bool) -> dict:
    """Closed loop: at most ``concurrency`` requests in the engine."""
    engine = engine_for(
        loaded, args.context, args.concurrency, args.block_size, enable_prefix_caching=caching
    )
    pending = list(prompts)
    added: dict[int, float] = {}
    first: dict[int, float] = {}
    in_flight = 0
    started = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < args.concurrency:
            added[engine.add_request(pending.pop(0), SamplingParams(max_tokens=OUT_TOKENS))] = (
                time.perf_counter()
            )
            in_flight += 1
        finished = engine.step()
        now = time.perf_counter()
        for token in engine.last_step_outputs:
            first.setdefault(token.request_id, now)
        in_flight -= len(finished)
    elapsed = time.perf_counter() - started
    ttft = [first[request_id] - added[request_id] for request_id in added]
    return {
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "output_tokens_per_s": len(prompts) * OUT_TOKENS / elapsed,
        "prompt_tokens_hit": engine.stats.prompt_tokens_hit,
        "prompt_tokens_queried": engine.stats.prompt_tokens_queried,
        "elapsed_s": elapsed,
    }


def run_long_prompt(loaded, args, budget: int | None) -> dict:
    """``--streams`` streams decode; one prompt near the context length arrives at step 4."""
    rng = np.random.default_rng(1)
    vocab = loaded.model.config.vocab_size
    block_size = args.block_size
    engine = engine_for(
        loaded, args.context, args.streams + 1, block_size, max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    )  # fmt: skip
    context = engine.config.max_model_len
    long_prompt = rng.integers(2, vocab, context - 2 * block_size).tolist()
    streams = [
        engine.add_request(
            rng.integers(2, vocab, 8).tolist(), SamplingParams(max_tokens=context - 8)
        )
        for _ in range(args.streams)
    ]
    last_token: dict[int, float] = {}
    gaps: list[float] = []
    long_id = arrived = ttft = None
    steps_after_first = 0
    while steps_after_first < 8:
        if engine.stats.steps == 4:
            long_id = engine.add_request(long_prompt, SamplingParams(max_tokens=16))
            arrived = time.perf_counter()
        engine.step()
        now = time.perf_counter()
        tokens = {token.request_id: token.token_id for token in engine.last_step_outputs}
        for request_id in streams:
            if request_id in tokens:
                if arrived is not None and request_id in last_token:
                    gaps.append(now - last_token[request_id])
                last_token[request_id] = now
        if long_id in tokens and ttft is None:
            ttft = now - arrived
        if ttft is not None:
            steps_after_first += 1
    return {
        "itl_p50_ms": 1e3 * percentile(gaps, 50),
        "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "long_prompt_tokens": len(long_prompt),
        "long_prompt_ttft_ms": 1e3 * ttft,
    }


def median_run(runs: list[dict], key: str) -> dict:
    """The run whose ``key`` is the median (the lower middle one of an even count)."""
    return sorted(runs, key=lambda run: run[key])[(len(runs) - 1) // 2]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # The dense blocks log each first-use timing; this script reports its own figures.
    logging.getLogger("paddle_step.layers.dense_blocks").setLevel(logging.WARNING)
    if args.shape is not None:
        folder = tempfile.mkdtemp(prefix="bench-prefix-")
        write_random_checkpoint(folder, SHAPES[args.shape])
        args.model = folder
    loaded = load_checkpoint(args.model)
    args.context = min(loaded.max_model_len, args.max_model_len or loaded.max_model_len)
    prompts, prefix_len = shared_prefix_prompts(
        args.num_requests, args.context, loaded.model.config.vocab_size
    )
    # One warm-up of each shape, so no run pays the dense blocks' first-use timing.
    run_shared_prefix(loaded, prompts[: args.concurrency], args, caching=False)
    shared: dict[str, list] = {"off": [], "on": []}
    long_case: dict[str, list] = {"whole": [], "chunked": []}
    for _ in range(args.repeats):
        for name, caching in (("off", False), ("on", True)):
            shared[name].append(run_shared_prefix(loaded, prompts, args, caching))
        for name, budget in (("whole", None), ("chunked", args.chunk_budget)):
            long_case[name].append(run_long_prompt(loaded, args, budget))
    off, on = (median_run(shared[name], "elapsed_s") for name in ("off", "on"))
    whole, chunked = (median_run(long_case[name], "itl_p99_ms") for name in ("whole", "chunked"))
    report = {
        "env": {
            "paddle": paddle.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "model": args.shape or loaded.name,
            "context": args.context,
        },
        "config": {
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "prefix_tokens": prefix_len,
            "out_tokens": OUT_TOKENS,
            "block_size": args.block_size,
            "chunk_budget": args.chunk_budget,
            "streams": args.streams,
            "repeats": args.repeats,
        },
        "shared_prefix": {
            "off": off,
            "on": on,
            "ttft_p50_ratio": off["ttft_p50_ms"] / on["ttft_p50_ms"],
            "throughput_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        },
        "long_prompt": {
            "whole": whole,
            "chunked": chunked,
            "itl_p99_ratio": whole["itl_p99_ms"] / chunked["itl_p99_ms"],
            "ttft_cost": chunked["long_prompt_ttft_ms"] / whole["long_prompt_ttft_ms"],
        },
    }
    return emit_report(report, args.json, print_report)


def print_report(report: dict) -> None:
    config, shared, long_case = report["config"], report["shared_prefix"], report["long_prompt"]
    print(
        f"shared prefix: {config['num_requests']} requests, {config['prefix_tokens']}-token "
        f"prefix + 16..32, {config['out_tokens']} out, concurrency {config['concurrency']}"
    )
    for name in ("off", "on"):
        run = shared[name]
        print(
            f"  caching {name:3}: TTFT p50 {run['ttft_p50_ms']:8.1f} ms  p99 "
            f"{run['ttft_p99_ms']:8.1f} ms  {run['output_tokens_per_s']:8.1f} output tok/s  "
            f"(hit {run['prompt_tokens_hit']} of {run['prompt_tokens_queried']} prompt tokens)"
        )
    print(
        f"  TTFT p50 {shared['ttft_p50_ratio']:.2f}x lower, throughput "
        f"{shared['throughput_ratio']:.2f}x higher with caching"
    )
    print(
        f"long prompt ({long_case['whole']['long_prompt_tokens']} tokens) among "
        f"{config['streams']} streams, chunks of --max-num-batched-tokens {config['chunk_budget']}:"
    )
    for name in ("whole", "chunked"):
        run = long_case[name]
        print(
            f"  {name:7}: streams' ITL p50 {run['itl_p50_ms']:7.1f} ms  p99 "
            f"{run['itl_p99_ms']:7.1f} ms; the prompt's TTFT {run['long_prompt_ttft_ms']:7.1f} ms"
        )
    print(
        f"  ITL p99 {long_case['itl_p99_ratio']:.2f}x lower chunked; the prompt's TTFT "
        f"x{long_case['ttft_cost']:.2f}"
    )


if __name__ == "__main__":
    main()
