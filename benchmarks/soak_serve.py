"""Soak: a server under C concurrent streaming clients for N requests, a share of them
closed mid-stream. Reports the resident memory (RSS) of the server process and of its
engine process after a warm-up and then every tenth of the run, and checks that when
every client has left no request is held and both KV pools are full again.

    python benchmarks/soak_serve.py                     # 10,000 requests, 32 clients, 20% cancelled
    python benchmarks/soak_serve.py --quick --json      # 200 requests (the test suite's run)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import sys
import time

import httpx
from bench_serve import engine_flags, make_prompts

from paddle_step.engine.arg_utils import add_engine_arguments, check_engine_arguments
from paddle_step.testing.server_process import metrics, spawn_server


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=1_000, help="requests before the first RSS")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--cancel", type=float, default=0.2, help="share closed mid-stream")
    parser.add_argument("--max-tokens", type=int, default=24, help="each asks 4 to this many")
    parser.add_argument(
        "--quick", action="store_true", help="200 requests of 4 to 12 tokens, 50 of warm-up"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_engine_arguments(parser)
    parser.set_defaults(max_batch=32)
    args = parser.parse_args(argv)
    check_engine_arguments(parser, args)
    if args.quick:
        args.requests, args.warmup, args.max_tokens = 200, 50, 12
    if not 0 < args.warmup < args.requests:
        parser.error(f"--warmup: expected 0 < warmup < requests, got {args.warmup}")
    return args


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        [kib] = re.findall(r"^VmRSS:\s+(\d+) kB", status.read(), re.MULTILINE)
    return int(kib) / 1024


async def one_request(client: httpx.AsyncClient, url: str, body: dict, cancel_after: int | None):
    """``"done"`` (finish reason and ``[DONE]`` seen), ``"cancelled"``, or an error text."""
    chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return f"status {response.status_code}: {(await response.aread())[:200]!r}"
        finished = False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "done" if finished else "no finish_reason before [DONE]"
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return f"error event: {chunk['error']['message']}"
            finished = finished or chunk["choices"][0]["finish_reason"] is not None
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return "cancelled"  # leaving the block closes the stream mid-way
    return "stream ended without [DONE]"


async def run(url: str, args: argparse.Namespace, model: str, pids: dict[str, int]) -> dict:
    rng = random.Random(0)
    prompts = make_prompts(64)
    outcomes: dict[str, int] = {}
    samples: list[dict] = []
    every = max((args.requests - args.warmup) // 10, 1)
    gate = asyncio.Semaphore(args.concurrency)
    done = 0
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def gated(body: dict, cancel_after: int | None) -> None:
            nonlocal done
            async with gate:
                outcome = await one_request(client, url, body, cancel_after)
            kind = outcome if outcome in ("done", "cancelled") else "errors"
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if kind == "errors":
                print(f"soak: {outcome}", file=sys.stderr)
            done += 1
            if done >= args.warmup and (done - args.warmup) % every == 0:
                samples.append(
                    {"requests": done, **{name: rss_mib(pid) for name, pid in pids.items()}}
                )

        started = time.perf_counter()
        tasks = []
        for _ in range(args.requests):
            body = {
                "model": model,
                "prompt": rng.choice(prompts),
                "max_tokens": rng.randint(4, args.max_tokens),
                "temperature": rng.choice([0, 0.8]),
                "stream": True,
                "ignore_eos": True,
            }
            cancel_after = rng.randint(1, 3) if rng.random() < args.cancel else None
            tasks.append(gated(body, cancel_after))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    return {"outcomes": outcomes, "seconds": elapsed, "rss_mib": samples}


def settled_pools(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """The metrics once no request is running or waiting (raises after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = metrics(url)
        idle = not values["paddle_step_requests_running"] + values["paddle_step_requests_waiting"]
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    with spawn_server(engine_flags(args)) as server:
        engine_pid = int(re.search(r"engine process (\d+)", server.log()).group(1))
        pids = {"server": server.process.pid, "engine": engine_pid}
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        result = asyncio.run(run(server.url, args, model, pids))
        values = settled_pools(server.url)
    result["held_at_end"] = {
        "requests_running": values["paddle_step_requests_running"],
        "requests_waiting": values["paddle_step_requests_waiting"],
        "kv_blocks_in_use": values["paddle_step_kv_total_blocks"]
        - values["paddle_step_kv_free_blocks"],
        "kv_encoder_blocks_in_use": values["paddle_step_kv_encoder_total_blocks"]
        - values["paddle_step_kv_encoder_free_blocks"],
    }
    result["pools_full"] = not any(result["held_at_end"].values())
    result["config"] = {
        "requests": args.requests,
        "warmup": args.warmup,
        "concurrency": args.concurrency,
        "cancel": args.cancel,
        "max_tokens": args.max_tokens,
        "max_batch": args.max_batch,
    }
    if args.json:
        print(json.dumps(result))
        return
    samples = result["rss_mib"]
    print(
        f"{args.requests} requests ({result['outcomes']}) from {args.concurrency} clients "
        f"in {result['seconds']:.0f} s; pools full at the end: {result['pools_full']}"
    )
    for name in ("server", "engine"):
        series = ", ".join(f"{sample[name]:.0f}" for sample in samples)
        print(f"RSS {name} (MiB) after warm-up, then every tenth: {series}")


if __name__ == "__main__":
    main()
