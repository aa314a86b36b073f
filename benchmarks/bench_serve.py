"""Serving benchmark: streaming completions against a server at several concurrencies.

In the spirit of vLLM's benchmark_serving.py: N prompts, each sent as a streaming
``/v1/completions`` request (greedy, ``ignore_eos`` so every request makes
``--max-tokens`` tokens), at most C in flight. Reports request throughput, output
tokens/s, time to first token and inter-token latency (p50, p99), and the ratio to
offline ``Engine.generate`` throughput on the same prompts with the same engine flags,
measured in the same run.

    python benchmarks/bench_serve.py                       # starts its own server
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --model DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

import httpx
import numpy as np

from paddle_step.engine.arg_utils import add_engine_arguments, build_engine, check_engine_arguments
from paddle_step.sampling_params import SamplingParams
from paddle_step.testing.server_process import metric, server_process

PROMPT_STARTS = [
    "The for statement",
    "A list is",
    "The import statement",
    "When an exception is raised,",
    "A function definition",
    "The while statement",
    "Names refer to objects",
    "A class definition",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_engine_arguments(parser)
    parser.set_defaults(max_batch=32)
    args = parser.parse_args(argv)
    check_engine_arguments(parser, args)
    return args


def make_prompts(count: int) -> list[str]:
    """``count`` prompts: the starts above, each with 0 to 7 filler words (seeded)."""
    rng = np.random.default_rng(0)
    fillers = ["and", "or", "the", "a"]
    prompts = []
    for index in range(count):
        words = rng.choice(fillers, int(rng.integers(0, 8))).tolist()
        prompts.append(" ".join([PROMPT_STARTS[index % len(PROMPT_STARTS)], *words]))
    return prompts


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as a command line, for the server process."""
    flags = [
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        *(["--quantization", args.quantization] if args.quantization else []),
        "--max-batch",
        str(args.max_batch),
        "--block-size",
        str(args.block_size),
        "--decoder-pool-ratio",
        str(args.decoder_pool_ratio),
        "--seed",
        str(args.seed),
    ]
    for name in ("max_model_len", "kv_blocks"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> dict:
    """Times one streaming completion: first-token time, token gaps, tokens."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    arrivals, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return {
        "ttft": arrivals[0] - started if arrivals else float("nan"),
        "gaps": np.diff(arrivals).tolist(),
        "tokens": tokens,
        "latency": time.perf_counter() - started,
    }


# The server's time inside engine steps, read before and after a run (outside its timing).
STEP_SECONDS = "paddle_step_engine_step_seconds_total"


async def run_at(
    url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int
) -> dict:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def gated(prompt: str) -> dict:
            async with gate:
                return await one_request(client, url, model, prompt, max_tokens)

        busy_before = metric(url, STEP_SECONDS)
        started = time.perf_counter()
        results = await asyncio.gather(*(gated(prompt) for prompt in prompts))
        elapsed = time.perf_counter() - started
        busy = metric(url, STEP_SECONDS) - busy_before
    ttft = np.array([r["ttft"] for r in results]) * 1e3
    gaps = np.array([gap for r in results for gap in r["gaps"]]) * 1e3
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "engine_busy": busy / elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "tokens": tokens,
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "itl_ms_p50": float(np.percentile(gaps, 50)) if gaps.size else float("nan"),
        "itl_ms_p99": float(np.percentile(gaps, 99)) if gaps.size else float("nan"),
    }


def offline_tokens_per_s(args: argparse.Namespace, prompts: list[str]) -> tuple[float, str]:
    """``Engine.generate`` throughput on the same prompts, flags and lengths; the model name."""
    engine, loaded = build_engine(args)
    ids = [loaded.tokenizer.encode(prompt) for prompt in prompts]
    engine.generate(
        ids[:2], SamplingParams(max_tokens=2, eos_token_id=[])
    )  # warm-up, as the server has had one
    started = time.perf_counter()
    results = engine.generate(ids, SamplingParams(max_tokens=args.max_tokens, eos_token_id=[]))
    elapsed = time.perf_counter() - started
    return sum(len(r.token_ids) for r in results) / elapsed, loaded.name


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    prompts = make_prompts(args.num_prompts)
    offline, model_name = offline_tokens_per_s(args, prompts)
    levels = [int(level) for level in args.concurrency.split(",")]
    rows = []
    if args.url:
        model_name = httpx.get(f"{args.url}/v1/models", timeout=10).json()["data"][0]["id"]
        rows = [
            asyncio.run(run_at(args.url, model_name, prompts, args.max_tokens, c)) for c in levels
        ]
    else:
        with server_process(engine_flags(args)) as url:
            asyncio.run(run_at(url, model_name, prompts[:2], 2, 1))  # warm-up
            rows = [
                asyncio.run(run_at(url, model_name, prompts, args.max_tokens, c)) for c in levels
            ]
    for row in rows:
        row["ratio_to_offline"] = row["output_tokens_per_s"] / offline
    if args.json:
        print(json.dumps({"offline_tokens_per_s": offline, "rows": rows}))
        return
    print(
        f"model {model_name}, {args.num_prompts} prompts x {args.max_tokens} tokens, "
        f"max_batch {args.max_batch}; offline Engine.generate: {offline:.0f} tokens/s"
    )
    print(
        "| concurrency | req/s | output tok/s | vs offline | TTFT p50 / p99 (ms) "
        "| ITL p50 / p99 (ms) | engine busy |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['concurrency']} | {row['requests_per_s']:.2f} | "
            f"{row['output_tokens_per_s']:.0f} | {row['ratio_to_offline']:.2f} | "
            f"{row['ttft_ms_p50']:.0f} / {row['ttft_ms_p99']:.0f} | "
            f"{row['itl_ms_p50']:.1f} / {row['itl_ms_p99']:.1f} | {row['engine_busy']:.0%} |"
        )


if __name__ == "__main__":
    main()
