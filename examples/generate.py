"""Generate text with the paddle_step engine: continuous batching over a paged KV cache.

The model is a tiny Llama with random weights, so the continuations are gibberish; what
the run shows is the serving loop (admission, mixed prefill/decode steps, step_paddle's
block scheduling with preemption and recovery, advance_step) and its statistics.

    python examples/generate.py                     # built-in prompts, CPU, greedy
    python examples/generate.py --num-requests 16 --max-batch 8 \
        --kv-blocks 60 --decoder-pool-ratio 0.2     # tight pool: preemption and recovery
    python examples/generate.py --num-requests 16 --naive   # no cache, full recompute
    python examples/generate.py --json              # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import math
import string
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from paddle_step.check_state import StateError
from paddle_step.engine import Engine
from paddle_step.model import ModelConfig, TinyLlama
from paddle_step.naive import generate_naive
from paddle_step.sequence import GenerationResult, GenerationStats
from paddle_step.state import EngineConfig
from paddle_step.tokenizer import ByteTokenizer

try:  # optional: only the progress bar needs it
    from tqdm import tqdm
except ImportError:
    tqdm = None

BUILT_IN_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Paged attention splits the KV cache into",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "Le café est prêt ✓",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a prompt (repeatable); default: a few built-in ones",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=0,
        help="add N random prompts of varied length (seeded by --seed)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=4, help="batch slots")
    parser.add_argument("--block-size", type=int, default=8, help="tokens per KV block")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="total KV blocks (default: enough that no request is ever "
        "preempted; fewer forces preemption)",
    )
    parser.add_argument(
        "--decoder-pool-ratio",
        type=float,
        default=0.5,
        help="share of the KV blocks that form the decoder pool; the rest "
        "hold prompts (lower: more requests admitted, more preemption)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="model weights, prompts, sampling")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument(
        "--naive",
        action="store_true",
        help="decode without a cache by full recompute (the reference)",
    )
    parser.add_argument(
        "--check-state",
        action="store_true",
        help="debug: validate the engine state after every step",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print exactly one JSON object (requests and stats) on stdout",
    )
    args = parser.parse_args(argv)
    if not 0 < args.decoder_pool_ratio < 1:
        parser.error(f"--decoder-pool-ratio: expected in (0, 1), got {args.decoder_pool_ratio}")
    if args.num_requests < 0:
        parser.error(f"--num-requests: expected >= 0, got {args.num_requests}")
    for name in ("max_new_tokens", "max_batch", "block_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}: expected > 0, got {getattr(args, name)}")
    return args


def random_prompts(count: int, seed: int) -> list[str]:
    """``count`` lowercase word salads of 4 to 48 characters."""
    rng = np.random.default_rng(seed)
    letters = np.array(list(string.ascii_lowercase + "     "))
    return ["".join(rng.choice(letters, size=int(rng.integers(4, 49)))) for _ in range(count)]


def engine_config(args: argparse.Namespace, prompts: list[list[int]]) -> EngineConfig:
    """Model length fitted to the longest request; by default enough blocks for every slot
    to hold a full-length sequence in each region."""
    longest = max(len(prompt) for prompt in prompts) + args.max_new_tokens
    max_model_len = math.ceil(longest / args.block_size) * args.block_size
    kv_blocks = args.kv_blocks
    if kv_blocks is None:
        per_region = args.max_batch * (max_model_len // args.block_size)
        ratio = args.decoder_pool_ratio
        kv_blocks = math.ceil(per_region / min(ratio, 1 - ratio))
        while min(int(kv_blocks * ratio), kv_blocks - int(kv_blocks * ratio)) < per_region:
            kv_blocks += 1  # the pool size is rounded down
    return EngineConfig(
        max_batch=args.max_batch,
        max_model_len=max_model_len,
        block_size=args.block_size,
        num_kv_blocks=kv_blocks,
        decoder_pool_ratio=args.decoder_pool_ratio,
    )


@contextmanager
def progress_bar(total: int) -> Iterator[Callable[[int], object]]:
    """Yields ``update(finished_count)`` of a progress bar on stderr; without tqdm, says
    so in one line and yields a no-op."""
    if tqdm is None:
        print(
            "generate.py: no progress bar (optional package 'tqdm' not installed)", file=sys.stderr
        )
        yield lambda count: None
        return
    with tqdm(total=total, unit="req", file=sys.stderr, desc="generating") as bar:
        yield bar.update


def run(args: argparse.Namespace) -> tuple[list[GenerationResult], GenerationStats]:
    """Decodes the requested prompts with the engine (or the naive reference)."""
    tokenizer = ByteTokenizer()
    texts = list(args.prompt) + random_prompts(args.num_requests, args.seed)
    prompts = [tokenizer.encode(text) for text in texts or BUILT_IN_PROMPTS]
    model = TinyLlama(ModelConfig(dtype=args.dtype, seed=args.seed))
    try:
        config = engine_config(args, prompts)
        engine = (
            None
            if args.naive
            else Engine(
                model, config, tokenizer=tokenizer, seed=args.seed, check_state=args.check_state
            )
        )
    except ValueError as error:  # a budget the engine cannot run
        raise SystemExit(f"generate.py: {error}") from None

    with progress_bar(len(prompts)) as update:
        if engine is None:
            return generate_naive(
                model,
                prompts,
                args.max_new_tokens,
                eos_token_id=tokenizer.eos_id,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                max_model_len=config.max_model_len,
                on_finished=update,
            )
        try:
            results = engine.generate(
                prompts,
                args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                on_finished=update,
            )
        except StateError:  # --check-state found a broken state: a bug, keep the trace
            raise
        except ValueError as error:  # a request the engine cannot run (before any step)
            raise SystemExit(f"generate.py: {error}") from None
        return results, engine.stats


def print_report(
    args: argparse.Namespace, results: list[GenerationResult], stats: GenerationStats
) -> None:
    tokenizer = ByteTokenizer()
    mode = "naive full recompute (no KV cache)" if args.naive else "paged KV cache engine"
    print(f"TinyLlama, random weights (seed {args.seed}), {args.dtype}, {mode}.")
    print("The model is untrained: the continuations are gibberish by design.\n")
    for index, result in enumerate(results):
        print(f"[{index}] prompt: {tokenizer.decode(result.prompt_ids)!r}")
        print(
            f"    -> {tokenizer.decode(result.token_ids)!r}"
            f"  ({len(result.token_ids)} tokens, {result.finish_reason})"
        )
    print(
        f"\nsteps {stats.steps}, generated tokens {stats.generated_tokens}, "
        f"{stats.tokens_per_s:.1f} tokens/s ({stats.elapsed:.2f} s)"
    )
    print(
        f"preemptions {stats.preemptions}, recoveries {stats.recoveries}, "
        f"peak blocks in use {stats.peak_blocks_in_use}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results, stats = run(args)
    if args.json:
        print(
            json.dumps(
                {
                    "requests": [result.to_dict() for result in results],
                    "stats": stats.to_dict(),
                }
            )
        )
    else:
        print_report(args, results, stats)


if __name__ == "__main__":
    main()
