"""Generate text with the paddle_step engine: continuous batching over a paged KV cache.

By default it runs the small model shipped with the package (a Llama trained on Python's
documentation, see python/paddle_step/assets/README.md); ``--model DIR`` runs a Hugging
Face checkpoint (Llama, Mistral, Qwen2), ``--model random`` a random-weight LlamaForCausalLM.

    python examples/generate.py                     # built-in prompts, CPU, greedy
    python examples/generate.py --model path/to/Qwen2.5-0.5B-Instruct --chat \
        --prompt "What is a paged KV cache?"
    python examples/generate.py --num-requests 16 --max-batch 8 \
        --kv-blocks 60 --decoder-pool-ratio 0.2     # tight pool: preemption and recovery
    python examples/generate.py --num-requests 16 --naive   # no cache, full recompute
    python examples/generate.py --json              # one JSON object on stdout
    python -m paddle.distributed.launch --nproc_per_node 2 \
        examples/generate.py --tp 2 --check-ranks   # tensor parallel, 2 processes

With ``--tp`` > 1 every rank runs the same engine on its shard of the model; rank 0 alone
prints (the launcher shows rank 0's output and keeps each rank's in its --log_dir).
"""

from __future__ import annotations

import argparse
import json
import os
import string
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# Paddle's C++ log (glog) prints its own INFO and WARNING lines about its internals ("New
# Executor is Running", the PIR notices of compiled programs) amid the output; errors
# still show. GLOG_minloglevel set in the environment wins. Before paddle loads.
os.environ.setdefault("GLOG_minloglevel", "2")

import numpy as np

from paddle_step.distributed.tensor_parallel import RankDivergenceError
from paddle_step.engine.arg_utils import (
    LoadedModel,
    add_engine_arguments,
    build_engine,
    check_engine_arguments,
    engine_config,
    load_model,
)
from paddle_step.engine.cpu_threads import default_threads, set_compute_threads
from paddle_step.engine.naive import generate_naive
from paddle_step.engine.outputs import GenerationResult, GenerationStats
from paddle_step.sampling_params import SamplingParams
from paddle_step.spec.check_state import StateError

try:  # optional: only the progress bar needs it
    from tqdm import tqdm
except ImportError:
    tqdm = None

# The shipped model learned from Python's documentation: prompts in its language.
BUILT_IN_PROMPTS = [
    "The for statement",
    "A list is",
    "The import statement",
    "When an exception is raised,",
    "A function definition",
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
        help="N random prompts of varied length (seeded by --seed), after any --prompt; "
        "the built-in prompts run only when neither is given",
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the checkpoint's chat template",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="generate past the model's end-of-sequence"
    )
    parser.add_argument(
        "--naive",
        action="store_true",
        help="decode without a cache by full recompute (the reference); the engine's "
        "cache and scheduling flags do not apply",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print exactly one JSON object (requests and stats) on stdout",
    )
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    check_engine_arguments(parser, args)
    if args.num_requests < 0:
        parser.error(f"--num-requests: expected >= 0, got {args.num_requests}")
    if args.max_new_tokens <= 0:
        parser.error(f"--max-new-tokens: expected > 0, got {args.max_new_tokens}")
    if args.naive and args.tp != 1:
        parser.error(f"--naive: runs in one process, expected --tp 1, got --tp {args.tp}")
    if args.naive:  # flags that change only what the engine does: refused, not ignored
        engine_only = [flag for flag, given in [
            ("--check-state", args.check_state),
            ("--kv-cache-dtype", args.kv_cache_dtype != "auto"),
            ("--max-num-batched-tokens", args.max_num_batched_tokens is not None),
        ] if given]  # fmt: skip
        if engine_only:
            parser.error(f"--naive: decodes without the engine, got {', '.join(engine_only)}")
    for prompt in args.prompt:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:  # bytes the shell passed that are not UTF-8
            parser.error(f"--prompt: expected UTF-8 text, got {prompt!r} ({error.reason})")
    return args


def random_prompts(count: int, seed: int) -> list[str]:
    """``count`` lowercase word salads of 4 to 48 characters."""
    rng = np.random.default_rng(seed)
    letters = np.array(list(string.ascii_lowercase + "     "))
    return ["".join(rng.choice(letters, size=int(rng.integers(4, 49)))) for _ in range(count)]


@contextmanager
def progress_bar(total: int, shown: bool = True) -> Iterator[Callable[[int], object]]:
    """Yields ``update(finished_count)`` of a progress bar on stderr (a no-op when not
    ``shown``); without tqdm, says so in one line and yields a no-op."""
    if not shown:
        yield lambda count: None
        return
    if tqdm is None:
        print(
            "generate.py: no progress bar (optional package 'tqdm' not installed)", file=sys.stderr
        )
        yield lambda count: None
        return
    with tqdm(total=total, unit="req", file=sys.stderr, desc="generating") as bar:
        yield bar.update


def encode_prompts(args: argparse.Namespace, loaded: LoadedModel) -> list[list[int]]:
    """The prompts' ids; with ``--chat`` each is one user message in the chat template."""
    texts = list(args.prompt) + random_prompts(args.num_requests, args.seed) or BUILT_IN_PROMPTS
    tokenizer = loaded.tokenizer
    if args.chat:
        return [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in texts]
    return [tokenizer.encode(text) for text in texts]


def run(
    args: argparse.Namespace,
) -> tuple[LoadedModel, list[GenerationResult], GenerationStats]:
    """Decodes the requested prompts with the engine (or the naive reference)."""
    try:
        loaded = load_model(args)
        prompts = encode_prompts(args, loaded)
        eos = [] if args.ignore_eos else loaded.eos_token_ids
        params = SamplingParams(
            max_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            eos_token_id=eos,
        )
        if args.naive:
            engine, config = None, engine_config(args, loaded.context_len)
        else:
            engine, _ = build_engine(args, loaded)
            config = engine.config
    except ValueError as error:  # a checkpoint, budget or prompt the engine cannot run
        raise SystemExit(f"generate.py: {error}") from None
    except MemoryError as error:  # --max-batch or --kv-blocks past this machine's memory
        raise SystemExit(f"generate.py: out of memory building the engine: {error}") from None

    with progress_bar(len(prompts), shown=is_rank_zero(loaded)) as update:
        if engine is None:
            set_compute_threads(config.threads)
            results, stats = generate_naive(
                loaded.model,
                prompts,
                params,
                seed=args.seed,
                max_model_len=config.max_model_len,
                on_finished=update,
            )
            return loaded, results, stats
        try:
            results = engine.generate(prompts, params, on_finished=update)
        except StateError:  # --check-state found a broken state: a bug, keep the trace
            raise
        except RankDivergenceError as error:  # --check-ranks: the message names the tensor
            raise SystemExit(f"generate.py: {error}") from None
        except ValueError as error:  # a request the engine cannot run (before any step)
            raise SystemExit(f"generate.py: {error}") from None
        return loaded, results, engine.stats


def is_rank_zero(loaded: LoadedModel) -> bool:
    """Whether this process prints: the only one, or rank 0 of the tensor-parallel group."""
    return loaded.tensor_parallel is None or loaded.tensor_parallel.rank == 0


def continuation(loaded: LoadedModel, result: GenerationResult) -> str:
    """The generated text, special tokens (an eos) left out."""
    return loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def print_report(
    args: argparse.Namespace,
    loaded: LoadedModel,
    results: list[GenerationResult],
    stats: GenerationStats,
) -> None:
    mode = "naive full recompute (no KV cache)" if args.naive else "paged KV cache engine"
    threads = args.threads or default_threads(args.tp)
    config = loaded.model.config
    numerics = config.dtype
    if config.weight_format is not None:
        numerics = f"{config.weight_format} weights, {config.dtype} compute"
    print(f"model {loaded.name}, {numerics}, {mode}, {threads} CPU threads.\n")
    for index, result in enumerate(results):
        prompt = loaded.tokenizer.decode(result.prompt_ids, skip_special_tokens=True)
        print(f"[{index}] prompt: {prompt!r}")
        print(
            f"    -> {continuation(loaded, result)!r}"
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
    loaded, results, stats = run(args)
    if not is_rank_zero(loaded):
        return
    if args.json:
        requests = [
            {**result.to_dict(), "text": continuation(loaded, result)} for result in results
        ]
        print(json.dumps({"requests": requests, "stats": stats.to_dict()}))
    else:
        print_report(args, loaded, results, stats)


if __name__ == "__main__":
    main()
