#!/usr/bin/env python
"""Where a decode step's time goes in the example engine (``paddle_step.engine.llm_engine.Engine``).

For each batch size B the engine runs a small ``LlamaForCausalLM`` (the default ModelConfig:
hidden 64, 2 layers, byte vocabulary, random weights) on B slots kept full of greedy
requests (prompts of 8..32 tokens, 256 new tokens max, eos disabled, so no slot finishes
during the measurement: steady-state decode). The first steps (admission, the prefill of
every slot, a few decodes) are warm-up; then ``--steps`` steps are timed.

Each timed step is split by wrapping, in this process only, the engine's phases with
``time.perf_counter_ns`` timers (nothing in the engine is changed):

- ``forward``: ``ModelRunner.forward`` (flat batch, paged-attention forward, logits);
- ``sampling``: ``ModelRunner.sample`` (controls, logprobs, the draw) + ``Engine._uniforms``;
- ``post_process``: ``ModelRunner.update_inputs`` (FastDeploy's update_inputs, in Paddle ops);
- ``step_paddle``: the op call itself;
- ``advance_step``: ``ModelRunner.advance_decode_inputs`` (two assigns + the op), and
  ``advance_step_op``: the op call alone;
- ``host``: ``ModelRunner.sync_host`` (the one copy back), ``Scheduler.record`` (host
  mirrors), ``Engine._count`` (stats), ``Scheduler.retire`` + ``ModelRunner.clear_slots``;
- ``admit``: ``Scheduler.schedule`` (admission, prefill chunks) +
  ``ModelRunner.write_admitted`` and ``write_prefill_chunks``; ``other``: the rest of
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

With ``--paddleformers``: greedy generation throughput of the engine against
PaddleFormers' ``LlamaForCausalLM.generate`` on the same random Llama-shaped checkpoint
(written to a temporary folder as safetensors + config.json, loaded by each side's own
loader) and the same prompts: the issue's earlier shape (hidden 512, 8 layers, 8 heads,
4 KV heads) and SmolLM2-135M's (30 layers, hidden 576, 9 heads, 3 KV heads, tied
embeddings), B in 1, 8, 32, 32-token prompts. Reports tokens/s (prefill included), the
share of a decode step spent outside the model forward, and whether both sides produced
the same greedy ids. Without paddleformers installed (``make bench-paddleformers``
installs it) the PaddleFormers column is skipped with a note.

Usage: bench_decode.py [--quick] [--json] [--batches 1,8,64,256] [--steps N]
       bench_decode.py --paddleformers [--shapes issue-512x8,smollm2-135m] [--repeats N]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings

import zlib  # noqa: F401,E402  isort: skip  (see tests/conftest.py)

import numpy as np  # noqa: E402

warnings.filterwarnings("ignore", message=".*ccache.*")
import paddle  # noqa: E402
from bench_common import (  # noqa: E402
    emit_report,
    layer_projections,
    parse_batches,
    whole_batch_config,
    whole_context_config,
)  # noqa: E402
from paddle.base import core  # noqa: E402

import paddle_step.engine.model_runner as runner_module  # noqa: E402
from paddle_step.config import ModelConfig  # noqa: E402
from paddle_step.engine.cpu_threads import default_threads, set_compute_threads  # noqa: E402
from paddle_step.engine.llm_engine import Engine  # noqa: E402
from paddle_step.layers.dense_blocks import onednn_available  # noqa: E402
from paddle_step.model_loader.loader import load_checkpoint  # noqa: E402
from paddle_step.models.llama import LlamaForCausalLM  # noqa: E402
from paddle_step.sampling_params import SamplingParams  # noqa: E402
from paddle_step.spec.tensor_table import STEP_PADDLE_OUTPUTS, STEP_PADDLE_TENSORS  # noqa: E402

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

    def _methods(self):
        """(phase, part of the engine, method name) of each timed method: the disjoint
        parts of Engine.step, by phase."""
        engine, runner, scheduler = self.engine, self.engine.runner, self.engine.scheduler
        phases = {
            "admit": (
                (scheduler, "schedule"),
                (runner, "write_admitted"),
                (runner, "write_prefill_chunks"),
            ),
            "forward": ((runner, "forward"),),
            "sampling": ((engine, "_uniforms"), (runner, "sample")),
            "post_process": ((runner, "update_inputs"),),
            "advance_step": ((runner, "advance_decode_inputs"),),
            "host": (
                (runner, "sync_host"),
                (scheduler, "record"),
                (engine, "_count"),
                (scheduler, "retire"),
                (runner, "clear_slots"),
            ),
        }
        for phase, methods in phases.items():
            for owner, attr in methods:
                yield phase, owner, attr

    def install(self) -> None:
        for phase, owner, attr in self._methods():
            setattr(owner, attr, self._timed(phase, getattr(owner, attr)))
        self._saved = {
            name: getattr(runner_module, name) for name in ("step_paddle", "advance_step")
        }
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
    model = LlamaForCausalLM(ModelConfig(seed=seed))
    config = whole_context_config(
        batch, MAX_MODEL_LEN, BLOCK_SIZE, decoder_pool_ratio=0.5, threads=THREADS[0]
    )
    engine = Engine(model, config, seed=seed)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    for _ in range(batch):
        length = int(rng.integers(PROMPT_LEN_RANGE[0], PROMPT_LEN_RANGE[1] + 1))
        # No tokenizer was given, so no eos stop: every slot decodes MAX_NEW_TOKENS.
        engine.add_request(
            rng.integers(1, vocab, length).tolist(), SamplingParams(max_tokens=MAX_NEW_TOKENS)
        )
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
    env, model = report["env"], report["model"]
    print(
        f"Engine decode steps, LlamaForCausalLM (hidden {model['hidden_size']}, "
        f"{model['num_layers']} layers), CPU, paddle {env['paddle']}, "
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


# ---------------------------------------------------------------- against PaddleFormers

# Llama shapes of the comparison (HF config.json fields): the issue's earlier figures'
# shape, and SmolLM2-135M's. Random weights; nothing is downloaded.
COMPARE_SHAPES = {
    "issue-512x8": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
}
COMPARE_BATCHES = (1, 8, 32)
# CPU threads of the engine and of PaddleFormers (--threads), set by main().
THREADS = [None]
COMPARE_PROMPT_LEN = 32
COMPARE_NEW_TOKENS = {"issue-512x8": 64, "smollm2-135m": 32}
# Any tokenizer.json serves: the benchmark feeds token ids, the loader just needs one.
TOKENIZER_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "hf-tiny", "llama-tiny"
)


def write_random_checkpoint(path: str, shape: dict, seed: int = 0) -> None:
    """A Hugging Face Llama checkpoint directory with random float32 weights."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    hidden, head_dim = shape["hidden_size"], shape["head_dim"]
    q_width = shape["num_attention_heads"] * head_dim
    kv_width = shape["num_key_value_heads"] * head_dim
    inter, vocab = shape["intermediate_size"], shape["vocab_size"]

    def linear(fan_out, fan_in):  # HF layout [out, in]; 1/sqrt(fan_in) keeps O(1) activations
        return (rng.standard_normal((fan_out, fan_in), dtype=np.float32) / np.sqrt(fan_in)).astype(
            np.float32
        )

    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32),
        "model.norm.weight": np.ones(hidden, np.float32),
    }
    if not shape["tie_word_embeddings"]:
        tensors["lm_head.weight"] = linear(vocab, hidden)
    for layer in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = np.ones(hidden, np.float32)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        for name, out_width, in_width in layer_projections(hidden, q_width, kv_width, inter):
            tensors[f"{prefix}.{name}.weight"] = linear(out_width, in_width)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": None,  # no stop: every request generates max_new_tokens
        "pad_token_id": None,
        "dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as file:
        json.dump(config, file, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), path)


def run_engine(model, prompts: list, new_tokens: int) -> dict:
    """Greedy generation of ``prompts`` by our engine, every prompt in its own slot at
    once; the step time split into the model forward and the rest."""
    batch = len(prompts)
    config = whole_batch_config(
        batch,
        COMPARE_PROMPT_LEN + new_tokens,
        BLOCK_SIZE,
        decoder_pool_ratio=0.5,
        threads=THREADS[0],
    )
    engine = Engine(model, config)
    probe = StepProbe(engine)
    probe.install()
    steps = []  # (step ns, forward ns)
    try:
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, eos_token_id=[]))
        results = {}
        start = time.perf_counter()
        while engine.has_unfinished():
            probe.reset()
            step_start = time.perf_counter_ns()
            finished = engine.step()
            steps.append((time.perf_counter_ns() - step_start, probe.current["forward"]))
            results.update((r.request_id, r.token_ids) for r in finished)
        elapsed = time.perf_counter() - start
    finally:
        probe.uninstall()
    decode = steps[1:]  # the first step is every prompt's prefill
    decode_step = sum(s for s, _ in decode)
    return {
        "seconds": elapsed,
        "tokens_per_s": batch * new_tokens / elapsed,
        "token_ids": [results[i] for i in sorted(results)],
        "decode_steps": len(decode),
        "decode_step_ms": decode_step / len(decode) / 1e6,
        "outside_forward_share": 1 - sum(f for _, f in decode) / decode_step,
    }


def load_paddleformers(path: str):
    """PaddleFormers' ``LlamaForCausalLM`` from a copy of ``path`` (loading writes a
    metadata file into the folder), or None when paddleformers is not installed."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from paddleformers.transformers import AutoConfig, LlamaForCausalLM
    except ImportError:
        return None
    copy = path + "-paddleformers"
    shutil.copytree(path, copy)
    with contextlib.redirect_stdout(sys.stderr):
        config = AutoConfig.from_pretrained(copy)
        config.fuse_rms_norm = False  # its fused RMSNorm kernel exists only on GPU
        model = LlamaForCausalLM.from_pretrained(copy, config=config, dtype="float32")
    model.eval()
    return model


def run_paddleformers(model, prompts: list, new_tokens: int) -> dict:
    """Greedy ``generate`` of the same prompts in one padded-free batch (equal lengths)."""
    input_ids = paddle.to_tensor(prompts, dtype="int64")
    with contextlib.redirect_stdout(sys.stderr), paddle.no_grad():
        start = time.perf_counter()
        ids, _ = model.generate(
            input_ids=input_ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            decode_strategy="greedy_search",
            use_cache=True,
        )
        elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "tokens_per_s": len(prompts) * new_tokens / elapsed,
        "token_ids": ids.numpy().tolist(),
    }


def compare_shape(name: str, batches, repeats: int, log) -> list:
    shape = COMPARE_SHAPES[name]
    new_tokens = COMPARE_NEW_TOKENS[name]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        os.mkdir(path)
        write_random_checkpoint(path, shape)
        model = load_checkpoint(path).model
        reference = load_paddleformers(path)
        rng = np.random.default_rng(1)
        for batch in batches:
            prompts = rng.integers(1, shape["vocab_size"], (batch, COMPARE_PROMPT_LEN)).tolist()
            # Warm-up (first kernel calls, allocator) with a short run of each, untimed.
            run_engine(model, prompts, 2)
            if reference is not None:
                run_paddleformers(reference, prompts, 2)
            ours, theirs = [], []
            for _ in range(repeats):  # alternated, so both see the same machine load
                ours.append(run_engine(model, prompts, new_tokens))
                if reference is not None:
                    theirs.append(run_paddleformers(reference, prompts, new_tokens))
            row = {
                "shape": name,
                "B": batch,
                "prompt_len": COMPARE_PROMPT_LEN,
                "new_tokens": new_tokens,
                "repeats": repeats,
                "ours_tokens_per_s": float(np.median([r["tokens_per_s"] for r in ours])),
                "ours_decode_step_ms": float(np.median([r["decode_step_ms"] for r in ours])),
                "ours_outside_forward_share": float(
                    np.median([r["outside_forward_share"] for r in ours])
                ),
                "paddleformers_tokens_per_s": None,
                "speedup": None,
                "same_greedy_ids": None,
            }
            if theirs:
                row["paddleformers_tokens_per_s"] = float(
                    np.median([r["tokens_per_s"] for r in theirs])
                )
                row["speedup"] = row["ours_tokens_per_s"] / row["paddleformers_tokens_per_s"]
                row["same_greedy_ids"] = ours[0]["token_ids"] == theirs[0]["token_ids"]
            rows.append(row)
            log(f"  {name} B={batch} done")
    return rows, reference is not None


def compare_main(args) -> dict:
    started = time.time()

    def log(message):
        if not args.json:
            print(f"{message} ({time.time() - started:.0f} s)", file=sys.stderr)

    results, have_reference = [], False
    for name in args.shapes:
        rows, have_reference = compare_shape(name, args.batches, args.repeats, log)
        results.extend(rows)
    report = {
        "benchmark": "bench_decode --paddleformers",
        "env": environment(),
        "shapes": {name: COMPARE_SHAPES[name] for name in args.shapes},
        "config": {
            "batches": list(args.batches),
            "repeats": args.repeats,
            "prompt_len": COMPARE_PROMPT_LEN,
            "new_tokens": {name: COMPARE_NEW_TOKENS[name] for name in args.shapes},
        },
        "paddleformers": have_reference,
        "results": results,
        "elapsed_s": round(time.time() - started, 1),
    }
    if args.json:
        print(json.dumps(report))
        return report
    env = report["env"]
    print(
        f"Greedy generation, {COMPARE_PROMPT_LEN}-token prompts, random float32 weights, CPU, "
        f"paddle {env['paddle']}, {env['cpu_count']} cores (shared, noisy machine), "
        f"{env['blas_env']}, "
        f"engine's oneDNN blocks {'on' if env['engine_onednn_blocks'] else 'off'}; "
        f"medians of {args.repeats} alternated runs. tokens/s = B * new tokens / wall time "
        "(prefill included)."
    )
    if not have_reference:
        print("paddleformers is not importable: its column is skipped (make bench-paddleformers).")
    print(
        f"{'shape':>14s} {'B':>3s} {'new':>4s} {'ours tok/s':>10s} {'PF tok/s':>9s} "
        f"{'ours/PF':>8s} {'outside fwd':>11s} {'step ms':>8s} {'same ids':>8s}"
    )
    for row in results:
        pf = row["paddleformers_tokens_per_s"]
        print(
            f"{row['shape']:>14s} {row['B']:>3d} {row['new_tokens']:>4d} "
            f"{row['ours_tokens_per_s']:>10.1f} "
            + (f"{pf:>9.1f} {row['speedup']:>7.2f}x " if pf else f"{'-':>9s} {'-':>8s} ")
            + f"{100 * row['ours_outside_forward_share']:>10.1f}% "
            f"{row['ours_decode_step_ms']:>8.1f} {str(row['same_greedy_ids']):>8s}"
        )
    return report


def environment() -> dict:
    return {
        "paddle": paddle.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": "cpu",
        "note": "shared machine, other jobs running; wall time per phase",
        # All change the CPU matmul kernels' speed a lot (MKL_DEBUG_CPU_TYPE=5 makes MKL
        # take its AVX2 path on AMD CPUs; PADDLE_STEP_ONEDNN=0 keeps the engine's dense
        # blocks on eager MKL, see paddle_step.layers.dense_blocks).
        "blas_env": {
            name: os.environ.get(name)
            for name in ("OMP_NUM_THREADS", "MKL_DEBUG_CPU_TYPE", "PADDLE_STEP_ONEDNN")
        },
        "engine_onednn_blocks": onednn_available("float32"),
        "threads": THREADS[0],
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"B in {QUICK_BATCHES}, few steps")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--batches", help="comma-separated B values")
    parser.add_argument("--steps", type=int, help="timed steps per batch size")
    parser.add_argument("--warmup", type=int, help="untimed steps first (prefill included)")
    parser.add_argument(
        "--paddleformers", action="store_true", help="throughput against PaddleFormers' generate"
    )
    parser.add_argument(
        "--shapes",
        default=",".join(COMPARE_SHAPES),
        help=f"--paddleformers: comma-separated, of {list(COMPARE_SHAPES)}",
    )
    parser.add_argument("--repeats", type=int, default=3, help="--paddleformers: runs per B")
    parser.add_argument(
        "--threads",
        type=int,
        default=default_threads(),
        help="CPU threads for both sides (default: the cores this process may run on)",
    )
    args = parser.parse_args(argv)
    args.shapes = tuple(args.shapes.split(","))
    unknown = set(args.shapes) - set(COMPARE_SHAPES)
    if unknown:
        parser.error(
            f"--shapes: unknown {sorted(unknown)}, expected some of {list(COMPARE_SHAPES)}"
        )
    batches = QUICK_BATCHES if args.quick else FULL_BATCHES
    args.batches = parse_batches(args.batches, COMPARE_BATCHES if args.paddleformers else batches)
    args.steps = args.steps or (4 if args.quick else 60)
    args.warmup = args.warmup or (2 if args.quick else 4)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    paddle.set_device("cpu")
    # The engine and PaddleFormers compute on the same number of threads.
    THREADS[0] = args.threads
    set_compute_threads(args.threads)
    if args.paddleformers:
        return compare_main(args)
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
        "env": environment(),
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
    return emit_report(report, args.json, print_table)


if __name__ == "__main__":
    main()
