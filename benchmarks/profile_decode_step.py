#!/usr/bin/env python
"""Where each millisecond of a decode step goes, on a Hugging Face checkpoint (for example
the Qwen2.5-0.5B shape that ``make_random_llama.py`` writes).

B requests with 64-token prompts (``--prompt-len``; token ids drawn from a seeded
generator) run greedy in B slots; after the prefill and a few decode steps, ``--steps``
decode steps are timed, each split by timers wrapped, in this process only, around the
engine's parts:

- in the forward: ``attention_inputs`` (RMSNorm, fused q/k/v, rotary), ``kv_write`` (the
  KV cache writes), ``kv_gather`` (reading the keys and values through the block tables),
  ``attention`` (scores, softmax, weighted sum), ``output_and_mlp`` (output projection,
  RMSNorm, fused gate/up, SwiGLU, down, residuals), ``logits`` (final RMSNorm, LM head of
  the sampled rows), ``fused_layers`` (all layers as one CPU call, where the
  layers fuse: those steps have no attention_inputs, KV or output_and_mlp parts),
  ``forward_other`` (embedding, rotary tables, the flat batch, masks);
- outside it: ``sampling``, ``update_inputs``, ``step_paddle`` and ``advance_step`` (the
  ops and their assigns), ``host`` (the one copy back and the scheduler's bookkeeping).

Each part: the median over the timed steps, in ms. ``--dense eager`` runs every dense
block with ``paddle.matmul`` (as before the CPU op), ``--dense auto`` as shipped (each block
runs the fastest way measured: our op, eager or compiled).

``--dtype`` and ``--quantization`` load the weights as ``load_checkpoint`` does (float32,
bfloat16, int8); ``--kv-cache-dtype`` stores the KV cache as ``EngineConfig.kv_cache_dtype``
does (auto, bfloat16).

Usage: profile_decode_step.py CHECKPOINT [--batches 1,8] [--steps N] [--threads N]
                              [--dense auto|eager|op|op_widened|compiled]
                              [--dtype auto|float32|bfloat16] [--quantization int8]
                              [--kv-cache-dtype auto|bfloat16] [--prompt-len N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import zlib  # noqa: F401  isort: skip  (loaded before paddle, see tests/conftest.py)

import numpy as np  # noqa: E402

PROMPT_TOKENS = 64
BLOCK_SIZE = 16
WARMUP_STEPS = 3
FORWARD_PARTS = ("attention_inputs", "kv_write", "kv_gather", "attention", "output_and_mlp",
                 "fused_layers", "logits")  # fmt: skip
STEP_PARTS = ("sampling", "update_inputs", "step_paddle", "advance_step", "host")


class PartTimer:
    """Accumulates wall time per part name over one step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, owner, attribute: str, part: str) -> None:
        """Times ``owner.attribute`` (an instance's method or a plain function) as ``part``."""
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - started

        setattr(owner, attribute, timed)


def instrument(engine, timer: PartTimer) -> None:
    runner, model = engine.runner, engine.runner.model
    for name in ("attention_inputs", "output_and_mlp", "logits"):
        timer.wrap(getattr(model.blocks, name), "run", name)
    timer.wrap(runner.kv_cache, "write_kept", "kv_write")
    timer.wrap(runner.kv_cache, "gather_head_major", "kv_gather")
    timer.wrap(model, "_attention", "attention")
    timer.wrap(runner.kv_cache, "decode_attention", "attention")  # our CPU op's
    timer.wrap(model, "_fused_layers", "fused_layers")
    timer.wrap(runner, "forward", "forward")
    timer.wrap(runner, "sample", "sampling")
    timer.wrap(runner, "update_inputs", "update_inputs")
    timer.wrap(runner, "schedule_blocks", "step_paddle")
    timer.wrap(runner, "advance_decode_inputs", "advance_step")
    timer.wrap(runner, "sync_host", "host_sync")
    timer.wrap(engine.scheduler, "record", "host_record")


def profile(
    model,
    batch: int,
    steps: int,
    threads: int,
    prompt_len: int = PROMPT_TOKENS,
    kv_cache_dtype: str = "auto",
) -> dict:
    from bench_common import whole_batch_config

    from paddle_step.engine.llm_engine import Engine
    from paddle_step.sampling_params import SamplingParams

    vocab = model.config.vocab_size
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(3, vocab, prompt_len).tolist() for _ in range(batch)]
    total = WARMUP_STEPS + steps + 1
    config = whole_batch_config(
        batch,
        prompt_len + total,
        BLOCK_SIZE,
        decoder_pool_ratio=0.5,
        threads=threads,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = Engine(model, config)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=total, eos_token_id=[]))
    timer = PartTimer()
    instrument(engine, timer)
    engine.step()  # the prefill
    for _ in range(WARMUP_STEPS):
        engine.step()
    samples = defaultdict(list)
    for _ in range(steps):
        timer.current.clear()
        started = time.perf_counter()
        engine.step()
        step = time.perf_counter() - started
        parts = dict(timer.current)
        parts["forward_other"] = parts["forward"] - sum(parts.get(p, 0.0) for p in FORWARD_PARTS)
        parts["host"] = parts.pop("host_sync", 0.0) + parts.pop("host_record", 0.0)
        parts["step_other"] = step - parts["forward"] - sum(parts.get(p, 0.0) for p in STEP_PARTS)
        parts["step"] = step
        for name, seconds in parts.items():
            samples[name].append(seconds * 1e3)
    dense_ways = {
        name: dict(getattr(model.blocks, name).choice)
        for name in ("attention_inputs", "output_and_mlp", "logits")
    }
    return {
        "B": batch,
        "steps": steps,
        "median_ms": {name: statistics.median(values) for name, values in samples.items()},
        "dense_ways": dense_ways,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a Hugging Face checkpoint folder")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="default: every core")
    parser.add_argument(
        "--dense", default="auto", choices=("auto", "eager", "op", "op_widened", "compiled")
    )
    parser.add_argument("--dtype", default="auto", help="load_checkpoint's dtype")
    parser.add_argument("--quantization", default=None, help="load_checkpoint's quantization")
    parser.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig.kv_cache_dtype")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    os.environ["PADDLE_STEP_DENSE"] = args.dense  # read when the model's blocks are made

    import paddle

    from paddle_step.engine.cpu_threads import default_threads
    from paddle_step.model_loader.loader import load_checkpoint

    paddle.set_device("cpu")
    threads = default_threads() if args.threads is None else args.threads
    model = load_checkpoint(args.checkpoint, args.dtype, args.quantization).model
    rows = [
        profile(model, int(b), args.steps, threads, args.prompt_len, args.kv_cache_dtype)
        for b in args.batches.split(",")
    ]
    report = {"checkpoint": args.checkpoint, "dense": args.dense, "threads": threads,
              "dtype": args.dtype, "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype, "prompt_len": args.prompt_len,
              "results": rows}  # fmt: skip
    if args.json:
        print(json.dumps(report))
        return report
    parts = ("step", "forward", *FORWARD_PARTS, "forward_other", *STEP_PARTS, "step_other")
    weights = args.quantization or args.dtype
    print(f"{args.checkpoint} ({weights}, KV cache {args.kv_cache_dtype}, prompts of "
          f"{args.prompt_len}): dense {args.dense}, {threads} thread(s), median of "
          f"{args.steps} decode steps, ms")  # fmt: skip
    print("| part | " + " | ".join(f"B={row['B']}" for row in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for part in parts:
        cells = " | ".join(f"{row['median_ms'].get(part, 0.0):.2f}" for row in rows)
        print(f"| {part} | {cells} |")
    for row in rows:
        print(f"B={row['B']} dense ways: {row['dense_ways']}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
