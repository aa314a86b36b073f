#!/usr/bin/env python
"""The sampler's share of a decode step on the shipped model (pydoc-tiny), at batch B
(default 64) in steady decode, with

- ``greedy``: every slot greedy (the sampler's fast path: one argmax);
- ``all``: every slot uses every control at once: temperature, top_p, top_k, min_p,
  presence/frequency/repetition penalties, a 16-entry logit_bias, min_tokens (eos and two
  stop ids masked all along), logprobs with 5 alternatives, its own seed;
- ``all+constraint``: the same plus a structured-output constraint per slot (a NumPy mask
  built on the host every step, as a grammar library gives one).

``sampling`` is ``ModelRunner.sample`` plus the draws (``Engine._uniforms``); host-side
constraint work (mask building, ``accept_token``) is in ``constraint``. Prompts are
random ids of 8..32 tokens; eos is ignored so that no slot finishes while measured.

Usage: bench_sampler.py [--batch 64] [--steps 20] [--warmup 4] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings

import numpy as np

warnings.filterwarnings("ignore", message=".*ccache.*")
import paddle  # noqa: E402

from paddle_step.config import EngineConfig  # noqa: E402
from paddle_step.engine.arg_utils import DEFAULT_MODEL  # noqa: E402
from paddle_step.engine.llm_engine import Engine  # noqa: E402
from paddle_step.model_loader.loader import load_checkpoint  # noqa: E402
from paddle_step.sampling_params import SamplingParams  # noqa: E402
from paddle_step.testing.constraints import CyclingConstraint  # noqa: E402

MODES = ("greedy", "all", "all+constraint")
MAX_TOKENS = 200


def params_for(mode: str, slot: int, vocab: int) -> SamplingParams:
    if mode == "greedy":
        return SamplingParams(max_tokens=MAX_TOKENS, eos_token_id=[])
    rng = np.random.default_rng(slot)
    bias = {int(t): float(b) for t, b in zip(rng.choice(vocab, 16, replace=False),
                                              rng.normal(0, 2, 16))}  # fmt: skip
    constraint = None
    if mode == "all+constraint":
        constraint = CyclingConstraint([list(range(2, vocab))], length=10**9)
    return SamplingParams(
        max_tokens=MAX_TOKENS, eos_token_id=[1], temperature=0.8, top_p=0.9, top_k=40,
        min_p=0.02, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
        logit_bias=bias, min_tokens=MAX_TOKENS, stop_token_ids=[2, 3], logprobs=5,
        seed=1000 + slot, constraint=constraint,
    )  # fmt: skip


def bench(loaded, mode: str, batch: int, steps: int, warmup: int) -> dict:
    config = EngineConfig(max_batch=batch, max_model_len=256, block_size=16,
                          num_kv_blocks=2 * batch * 16, decoder_pool_ratio=0.5)  # fmt: skip
    engine = Engine(loaded.model, config)
    vocab = loaded.model.config.vocab_size
    rng = np.random.default_rng(0)
    for slot in range(batch):
        prompt = rng.integers(4, vocab, int(rng.integers(8, 33))).tolist()
        engine.add_request(prompt, params_for(mode, slot, vocab))
    timers = {"sampling": 0, "constraint": 0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[name] += time.perf_counter_ns() - start

        return wrapper

    engine.runner.sample = timed("sampling", engine.runner.sample)
    engine._uniforms = timed("sampling", engine._uniforms)
    scheduler = engine.scheduler
    scheduler.advance_constraints = timed("constraint", scheduler.advance_constraints)
    scheduler.sampling_plan = timed("constraint", scheduler.sampling_plan)
    for _ in range(warmup):
        engine.step()
    for name in timers:
        timers[name] = 0
    start = time.perf_counter_ns()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter_ns() - start
    assert int(scheduler.running.sum()) == batch, "a slot finished while measured"
    step_us = total / steps / 1e3
    sampling_us = timers["sampling"] / steps / 1e3
    constraint_us = timers["constraint"] / steps / 1e3
    return {
        "mode": mode,
        "B": batch,
        "step_us": step_us,
        "sampling_us": sampling_us,
        "sampling_share": sampling_us / step_us,
        "plan_and_constraint_us": constraint_us,
        "plan_and_constraint_share": constraint_us / step_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="B 8, few steps")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    batch = 8 if args.quick else args.batch
    steps = args.steps or (3 if args.quick else 20)
    warmup = args.warmup or (2 if args.quick else 4)
    loaded = load_checkpoint(DEFAULT_MODEL)
    results = [bench(loaded, mode, batch, steps, warmup) for mode in MODES]
    report = {
        "env": {
            "paddle": paddle.__version__,
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
        },  # fmt: skip
        "model": DEFAULT_MODEL.name,
        "results": results,
    }
    if args.json:
        print(json.dumps(report))
        return
    print(f"Sampler share of a decode step, {DEFAULT_MODEL.name}, B = {batch}, {steps} steps, "
          f"paddle {paddle.__version__}, {os.cpu_count()} cores (shared machine)")  # fmt: skip
    print(f"{'mode':>16s} {'step us':>9s} {'sampling us':>12s} {'share':>7s} "
          f"{'plan+constraint us':>19s} {'share':>7s}")  # fmt: skip
    for row in results:
        print(f"{row['mode']:>16s} {row['step_us']:9.0f} {row['sampling_us']:12.0f} "
              f"{row['sampling_share']:7.1%} {row['plan_and_constraint_us']:19.0f} "
              f"{row['plan_and_constraint_share']:7.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
