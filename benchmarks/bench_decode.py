#!/usr/bin/env python
"""Where a decode step's time goes in the example engine (``paddle_step.engine.Engine``).

For each batch size B the engine runs a small ``TinyLlama`` (the default ModelConfig:
hidden 64, 2 layers, byte vocabulary, random weights) on B slots kept full of greedy
requests (prompts of 8..32 tokens, 256 new tokens max, eos disabled, so no slot finishes
during the measurement: steady-state decode). The first steps (admission, the prefill of
every slot, a few decodes) are warm-up; then ``--steps`` steps are timed.

Each timed step is split by wrapping, in this process only, the engine's phases with
``time.perf_counter_ns`` timers (nothing in the engine is changed):

- ``forward``: ``ModelRunner.forward`` (flat batch, paged-attention forward, logits);
- ``sampling``: ``sample_tokens`` (+ ``Engine._uniforms``);
- ``post_process``: ``ModelRunner.update_inputs`` (FastDeploy's update_inputs, in Paddle ops);
- ``step_paddle``: the op call itself;
- ``advance_step``: ``ModelRunner.advance_decode_inputs`` (two assigns + the op), and
  ``advance_step_op``: the op call alone;
- ``host``: ``ModelRunner.sync_host`` (the one copy back), ``Scheduler.record`` (host
  mirrors), ``Engine._count`` (stats), ``Scheduler.retire`` + ``ModelRunner.clear_slots``;
- ``admit``: ``Scheduler.admit`` + ``ModelRunner.write_admitted``; ``other``: the rest of
  ``Engine.step``.

``bookkeeping`` = step - forward (everything but the model forward, sampling included);
``bookkeeping_ex_sampling`` = step - forward - sampling; ``ops`` = step_paddle +
advance_step_op. On CPU everything is synchronous, so wall time per phase is its cost.

Allocation by the ops: Paddle's host allocator statistics
(``core.host_memory_stat_current_value / _peak_value("Allocated", 0)``) are read around
every op call (peak reset before it): ``allocated`` = bytes still held after the call,
``transient_peak`` = peak above the level before it. Also, the data pointers of all the
tensors the ops write are compared before and after each call (same buffers = in place,
no new tensors). The same stats for the whole step are reported for comparison.

Usage: bench_decode.py [--quick] [--json] [--batches 1,8,64,256] [--steps N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import warnings

import zlib  # noqa: F401,E402  isort: skip  (see tests/conftest.py)

import numpy as np  # noqa: E402

warnings.filterwarnings("ignore", message=".*ccache.*")
import paddle  # noqa: E402
from paddle.base import core  # noqa: E402

import paddle_step.model_runner as runner_module  # noqa: E402
from paddle_step.engine import Engine  # noqa: E402
from paddle_step.model import ModelConfig, TinyLlama  # noqa: E402
from paddle_step.state import EngineConfig  # noqa: E402
from paddle_step.tensor_table import STEP_PADDLE_OUTPUTS, STEP_PADDLE_TENSORS  # noqa: E402

FULL_BATCHES = (1, 8, 64, 256)
QUICK_BATCHES = (1, 8)
BLOCK_SIZE = 16
MAX_MODEL_LEN = 320  # 32-token prompts + 256 new tokens fit
MAX_NEW_TOKENS = 256
PROMPT_LEN_RANGE = (8, 32)
# The inputs step_paddle writes, by argument index.
STEP_PADDLE_WRITTEN = tuple(STEP_PADDLE_TENSORS.index(name) for name in STEP_PADDLE_OUTPUTS)
PHASES = ("admit", "forward", "sampling", "post_process", "step_paddle", "advance_step",
          "advance_step_op", "host")  # fmt: skip
# Phases that are disjoint parts of Engine.step (advance_step_op is inside advance_step).
DISJOINT = ("admit", "forward", "sampling", "post_process", "step_paddle", "advance_step", "host")


def _host_allocated() -> int:
    return int(core.host_memory_stat_current_value("Allocated", 0))


def _host_peak() -> int:
    return int(core.host_memory_stat_peak_value("Allocated", 0))


# paddle 2.6 cannot reset the peak: there only the bytes held are measured and
# the transient peak is reported as None.
_CAN_RESET_PEAK = hasattr(core, "host_memory_stat_reset_peak_value")


class StepProbe:
    """Timers (and allocation probes on the two ops) around one engine's phases."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.current = dict.fromkeys(PHASES, 0)
        self.op_alloc = {"step_paddle": [], "advance_step": []}  # (allocated, peak) per call
        self.pointer_changes = {"step_paddle": 0, "advance_step": 0}
        self.op_calls = {"step_paddle": 0, "advance_step": 0}
        self._saved = {}

    def _timed(self, phase, fn):
        current, clock = self.current, time.perf_counter_ns

        def wrapper(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                current[phase] += clock() - start

        return wrapper

    def _op_probe(self, name, fn, written):
        """Times the op and checks it allocates nothing (allocator stats, pointers).
        The probing happens outside the timer."""
        current, clock = self.current, time.perf_counter_ns
        phase = "step_paddle" if name == "step_paddle" else "advance_step_op"

        def wrapper(*args, **kwargs):
            tensors = written(args)
            pointers = [t.data_ptr() for t in tensors]
            before = _host_allocated()
            if _CAN_RESET_PEAK:
                core.host_memory_stat_reset_peak_value("Allocated", 0)
            start = clock()
            result = fn(*args, **kwargs)
            current[phase] += clock() - start
            peak = _host_peak() - before if _CAN_RESET_PEAK else None
            self.op_alloc[name].append((_host_allocated() - before, peak))
            self.pointer_changes[name] += sum(p != t.data_ptr() for p, t in zip(pointers, tensors))
            self.op_calls[name] += 1
            return result

        return wrapper

    # (phase, part of the engine, method): the disjoint parts of Engine.step.
    def _methods(self):
        engine = self.engine
        return (
            ("admit", engine.scheduler, "admit"),
            ("admit", engine.runner, "write_admitted"),
            ("forward", engine.runner, "forward"),
            ("sampling", engine, "_uniforms"),
            ("post_process", engine.runner, "update_inputs"),
            ("advance_step", engine.runner, "advance_decode_inputs"),
            ("host", engine.runner, "sync_host"),
            ("host", engine.scheduler, "record"),
            ("host", engine, "_count"),
            ("host", engine.scheduler, "retire"),
            ("host", engine.runner, "clear_slots"),
        )

    def install(self) -> None:
        for phase, owner, attr in self._methods():
            setattr(owner, attr, self._timed(phase, getattr(owner, attr)))
        self._saved = {
            name: getattr(runner_module, name)
            for name in ("sample_tokens", "step_paddle", "advance_step")
        }
        runner_module.sample_tokens = self._timed("sampling", self._saved["sample_tokens"])
        runner_module.step_paddle = self._op_probe(
            "step_paddle",
            self._saved["step_paddle"],
            lambda args: [args[i] for i in STEP_PADDLE_WRITTEN],
        )
        runner_module.advance_step = self._op_probe(
            "advance_step",
            self._saved["advance_step"],
            lambda args: [args[0], args[2], args[3], args[4]],
        )

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(runner_module, name, fn)
        for _, owner, attr in self._methods():
            owner.__dict__.pop(attr, None)

    def reset(self) -> None:
        for phase in self.current:
            self.current[phase] = 0


def make_engine(batch: int, seed: int) -> tuple[Engine, list]:
    model = TinyLlama(ModelConfig(seed=seed))
    per_region = batch * (MAX_MODEL_LEN // BLOCK_SIZE)
    config = EngineConfig(
        max_batch=batch,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_kv_blocks=2 * per_region,
        decoder_pool_ratio=0.5,
    )
    engine = Engine(model, config, seed=seed)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    for _ in range(batch):
        length = int(rng.integers(PROMPT_LEN_RANGE[0], PROMPT_LEN_RANGE[1] + 1))
        # No tokenizer was given, so no eos stop: every slot decodes MAX_NEW_TOKENS.
        engine.add_request(rng.integers(1, vocab, length).tolist(), MAX_NEW_TOKENS)
    return engine, config


def bench_batch(batch: int, steps: int, warmup: int, seed: int = 0) -> dict:
    engine, config = make_engine(batch, seed)
    probe = StepProbe(engine)
    probe.install()
    try:
        for _ in range(warmup):
            engine.step()
        probe.reset()
        for name in probe.op_alloc:
            probe.op_alloc[name].clear()
            probe.op_calls[name] = 0
            probe.pointer_changes[name] = 0
        per_step = []
        step_alloc = []
        tokens_before = engine.stats.generated_tokens
        gc.collect()
        gc.disable()
        try:
            for _ in range(steps):
                probe.reset()
                before = _host_allocated()
                start = time.perf_counter_ns()
                engine.step()
                total = time.perf_counter_ns() - start
                step_alloc.append(_host_allocated() - before)
                per_step.append({"step": total, **probe.current})
        finally:
            gc.enable()
        tokens = engine.stats.generated_tokens - tokens_before
        running = int(engine.scheduler.running.sum())
    finally:
        probe.uninstall()

    def mean_us(key):
        return float(np.mean([s[key] for s in per_step])) / 1e3

    def median_us(key):
        return float(np.median([s[key] for s in per_step])) / 1e3

    mean = {key: mean_us(key) for key in ("step", *PHASES)}
    mean["other"] = mean["step"] - sum(mean[p] for p in DISJOINT)
    mean["bookkeeping"] = mean["step"] - mean["forward"]
    mean["bookkeeping_ex_sampling"] = mean["bookkeeping"] - mean["sampling"]
    mean["ops"] = mean["step_paddle"] + mean["advance_step_op"]
    total_s = sum(s["step"] for s in per_step) / 1e9
    allocs = {}
    for name, records in probe.op_alloc.items():
        held = [r[0] for r in records]
        peak = [r[1] for r in records if r[1] is not None]
        allocs[name] = {
            "calls": probe.op_calls[name],
            "allocated_bytes_per_call_max": int(max(held, default=0)),
            "transient_peak_bytes_per_call_max": int(max(peak, default=0))
            if _CAN_RESET_PEAK
            else None,
            "data_pointer_changes": probe.pointer_changes[name],
        }
    return {
        "B": batch,
        "steps": steps,
        "running_slots": running,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / total_s if total_s > 0 else 0.0,
        "mean_us": mean,
        "median_us": {key: median_us(key) for key in ("step", *PHASES)},
        "fraction_of_step": {
            key: mean[key] / mean["step"]
            for key in (
                "forward",
                "bookkeeping",
                "bookkeeping_ex_sampling",
                "ops",
                "sampling",
                "post_process",
                "step_paddle",
                "advance_step",
                "host",
                "admit",
                "other",
            )
        },
        "op_allocations": allocs,
        "step_host_bytes_held_after_max": int(max(step_alloc, default=0)),
        "config": {
            "max_model_len": config.max_model_len,
            "block_size": config.block_size,
            "num_kv_blocks": config.num_kv_blocks,
            "warmup_steps": warmup,
        },
    }


def print_table(report: dict) -> None:
    env = report["env"]
    print(
        f"Engine decode steps, TinyLlama (hidden {report['model']['hidden_size']}, "
        f"{report['model']['num_layers']} layers), CPU, paddle {env['paddle']}, "
        f"{env['cpu_count']} cores (shared, noisy machine). Mean us per step."
    )
    cols = ("step", "forward", "sampling", "post_process", "step_paddle", "advance_step",
            "advance_step_op", "host", "admit", "other")  # fmt: skip
    print(
        f"{'B':>4s} "
        + " ".join(f"{c[:12]:>12s}" for c in cols)
        + f" {'bookkeep%':>9s} {'ex-samp%':>8s} {'ops%':>6s} {'tok/s':>9s}"
    )
    for row in report["results"]:
        m, f = row["mean_us"], row["fraction_of_step"]
        print(
            f"{row['B']:>4d} "
            + " ".join(f"{m[c]:>12.1f}" for c in cols)
            + f" {100 * f['bookkeeping']:>8.1f}% {100 * f['bookkeeping_ex_sampling']:>7.1f}%"
            f" {100 * f['ops']:>5.2f}% {row['tokens_per_s']:>9.0f}"
        )
    print("\nallocation by the ops (host allocator stats around each call; data pointers):")
    for row in report["results"]:
        parts = []
        for name, a in row["op_allocations"].items():
            parts.append(
                f"{name}: {a['calls']} calls, held {a['allocated_bytes_per_call_max']} B, "
                f"transient peak {a['transient_peak_bytes_per_call_max']} B, "
                f"pointer changes {a['data_pointer_changes']}"
            )
        print(f"  B={row['B']:>4d}: " + "; ".join(parts))
    print("\ntargets:")
    for check in report["targets"]:
        print(
            f"  [{'MET ' if check['met'] else 'MISS'}] {check['target']}: "
            f"{100 * check['value']:.1f}%"
        )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"B in {QUICK_BATCHES}, few steps")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--batches", help="comma-separated B values")
    parser.add_argument("--steps", type=int, help="timed steps per batch size")
    parser.add_argument("--warmup", type=int, help="untimed steps first (prefill included)")
    args = parser.parse_args(argv)
    args.batches = (
        tuple(int(b) for b in args.batches.split(","))
        if args.batches
        else QUICK_BATCHES
        if args.quick
        else FULL_BATCHES
    )
    args.steps = args.steps or (4 if args.quick else 60)
    args.warmup = args.warmup or (2 if args.quick else 4)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    paddle.set_device("cpu")
    started = time.time()
    bench_batch(2, 3, 3)  # process warm-up (first kernel calls, allocator), not reported
    results = []
    for batch in args.batches:
        results.append(bench_batch(batch, args.steps, args.warmup))
        if not args.json:
            print(f"  B={batch} done ({time.time() - started:.0f} s)", file=sys.stderr)
    targets = []
    for row in results:
        if row["B"] == 64:
            value = row["fraction_of_step"]["bookkeeping"]
            targets.append(
                {
                    "target": "bookkeeping (step - forward) < 10% of step at B=64",
                    "value": value,
                    "met": bool(value < 0.10),
                    "bookkeeping_ex_sampling": row["fraction_of_step"]["bookkeeping_ex_sampling"],
                    "ops": row["fraction_of_step"]["ops"],
                }
            )
    model = ModelConfig()
    report = {
        "benchmark": "bench_decode",
        "env": {
            "paddle": paddle.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "device": "cpu",
            "note": "shared machine, other jobs running; wall time per phase",
        },
        "model": {
            "hidden_size": model.hidden_size,
            "num_layers": model.num_layers,
            "vocab_size": model.vocab_size,
        },
        "config": {
            "quick": args.quick,
            "batches": list(args.batches),
            "steps": args.steps,
            "warmup": args.warmup,
            "max_new_tokens": MAX_NEW_TOKENS,
            "prompt_len_range": list(PROMPT_LEN_RANGE),
        },
        "results": results,
        "targets": targets,
        "elapsed_s": round(time.time() - started, 1),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return report


if __name__ == "__main__":
    main()
