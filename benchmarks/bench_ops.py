#!/usr/bin/env python
"""Per-call latency of ``step_paddle`` and ``advance_step`` against their baselines.

States are captured from ``paddle_step.testing.fake_decode_loop.FakeDecodeLoop`` (the op
drives the loop until the captured call), in two scenarios:

- ``preempt``: a decoder pool of max(B, 32) blocks; the captured step_paddle call is the
  first one that preempts (the pool ran dry), so it frees, preempts and dispatches;
- ``calm``: a pool that never runs short; the captured call frees and dispatches only.

advance_step runs on the state step_paddle leaves (as an engine calls it): seq_lens =
seq_lens_decoder, sampled = next_tokens, active = running decode rows, num_queries =
num_seqs = B.

Each op mutates its inputs, so before *every* timed call the tensors it writes are restored
from a saved copy (``paddle.assign(saved, output=t)``) outside the timed region: each
timed call does exactly the captured call's work. Timed with ``time.perf_counter_ns``
around one call, gc disabled, after warm-up; R rounds with the implementations
interleaved; reported: the best (lowest) per-round median and p90 ("best-of-R").

Implementations, beside each op (``op``: ``paddle_step.<op>``, the pybind11 fast path):

- ``binding``: ``paddle_step_ops.<op>`` called directly (the op minus the Python wrapper);
- ``generated``: Paddle's generated custom-op API ``paddle_step_ops.static_op_<op>`` in
  dynamic mode (the registered op through Paddle's custom-op dispatch);
- ``to_static``: the op inside a ``paddle.jit.to_static`` function (a whole program run);
- ``reference``: the NumPy reference (paddle_step.testing.ref_*) on NumPy copies of the state;
- ``vectorized`` (advance_step only): the same step in built-in Paddle ops (take_along_axis,
  where, assign), what a user would write without the op;
- ``floor``: one built-in in-place Paddle op on a [B] int64 tensor, the cheapest of
  ``x.zero_()``, ``x.fill_(0)``, ``x.add_(one)``, ``paddle.assign(x, output=y)``
  (``raw_floor``: ``_C_ops.assign_out_``, the same op without the public API's Python).

Usage: bench_ops.py [--quick] [--json] [--plot PATH] [--batches 1,8,...] [--rounds R]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import zlib  # noqa: F401,E402  isort: skip  (see tests/conftest.py)

import numpy as np  # noqa: E402

warnings.filterwarnings("ignore", message=".*ccache.*")
import paddle  # noqa: E402
from bench_common import emit_report, parse_batches  # noqa: E402
from paddle import _C_ops  # noqa: E402

import paddle_step  # noqa: E402
import paddle_step_ops  # noqa: E402
from paddle_step.spec.tensor_table import STEP_PADDLE_OUTPUTS, STEP_PADDLE_TENSORS  # noqa: E402
from paddle_step.testing.fake_decode_loop import FakeDecodeLoop  # noqa: E402
from paddle_step.testing.ref_advance_step import ref_advance_step  # noqa: E402
from paddle_step.testing.ref_step_paddle import ref_step_paddle  # noqa: E402

FULL_BATCHES = (1, 8, 64, 256, 1024, 4096)
QUICK_BATCHES = (8, 256)
SCENARIOS = ("preempt", "calm")

# Loop geometry: L = 256 tokens, 8-token blocks, 32 table columns.
MAX_MODEL_LEN = 256
BLOCK_SIZE = 8
BLOCKS_PER_SEQ = 32
ENC_DEC_BLOCK_NUM = 1

# Targets of the brief (CPU).
TARGETS = (
    # (op, B, baseline, kind, bound): kind "speedup" = baseline / op >= bound;
    # "within" = op / baseline <= bound.
    ("advance_step", 256, "vectorized", "speedup", 20.0),
    ("advance_step", 256, "floor", "within", 1.5),
    ("step_paddle", 256, "reference", "speedup", 30.0),
    ("step_paddle", 256, "floor", "within", 3.0),
    ("step_paddle", 4096, "floor", "within", 8.0),
)


# ---------------------------------------------------------------- states


def _paddle_step(state: dict) -> dict:
    """The compiled op on a NumPy state (drives the fake loop)."""
    tensors = [paddle.to_tensor(state[name]) for name in STEP_PADDLE_TENSORS]
    paddle_step.step_paddle(*tensors, BLOCK_SIZE, ENC_DEC_BLOCK_NUM)
    return {name: tensor.numpy() for name, tensor in zip(STEP_PADDLE_TENSORS, tensors)}


def capture_state(batch: int, scenario: str, seed: int = 0, max_steps: int = 120) -> dict:
    """Runs the fake decode loop with the op and returns the captured step_paddle input
    (NumPy), the op's output on it, and what the call did."""
    pool = max(BLOCKS_PER_SEQ, batch) if scenario == "preempt" else batch * BLOCKS_PER_SEQ
    loop = FakeDecodeLoop(
        batch,
        MAX_MODEL_LEN,
        BLOCK_SIZE,
        BLOCKS_PER_SEQ,
        num_decoder_blocks=pool,
        num_encoder_blocks=3 * batch,
        seed=seed,
        enc_dec_block_num=ENC_DEC_BLOCK_NUM,
        arrival_prob=0.3,
        stop_prob=0.02,
        prompt_len_range=(1, 16),
        output_len_range=(32, 200),
        num_requests=100 * batch,
    )
    calm_step = 24
    for step in range(max_steps):
        loop.host_update()
        state = loop.state()
        preempted, recovered = loop.preemptions, loop.recoveries
        after = _paddle_step(state)
        loop.load(after)
        preempted, recovered = loop.preemptions - preempted, loop.recoveries - recovered
        if scenario == "preempt" and (preempted or recovered or step == max_steps - 1):
            break
        if scenario == "calm" and step == calm_step:
            break
    return {
        "state": state,
        "after": after,
        "step": step + 1,
        "preempted": preempted,
        "recovered": recovered,
        "running": int((~state["stop_flags"].reshape(-1)).sum()),
        "pool": int(state["free_list_len"][0]),
        "needy": int(
            sum(  # slots whose next column has no block
                1
                for b in range(batch)
                if not state["stop_flags"].reshape(-1)[b]
                and state["seq_lens_this_time"].reshape(-1)[b] != 0
                and state["block_tables"][b, state["seq_lens_decoder"].reshape(-1)[b] // BLOCK_SIZE]
                == -1
            )
        ),
    }


def advance_inputs(after: dict) -> dict:
    """advance_step's inputs as an engine builds them from step_paddle's output."""
    stop = after["stop_flags"].reshape(-1)
    batch = stop.size
    return {
        "input_tokens": np.zeros(batch, np.int64),
        "sampled_token_ids": after["next_tokens"].reshape(-1).astype(np.int64),
        "input_positions": np.zeros(batch, np.int64),
        "seq_lens": after["seq_lens_decoder"].reshape(-1).astype(np.int32),
        "slot_mapping": np.full(batch, -1, np.int64),
        "block_tables": np.ascontiguousarray(after["block_tables"]),
        "active": (~stop) & (after["seq_lens_encoder"].reshape(-1) == 0),
    }


ADVANCE_NAMES = (
    "input_tokens",
    "sampled_token_ids",
    "input_positions",
    "seq_lens",
    "slot_mapping",
    "block_tables",
)
ADVANCE_WRITTEN = ("input_tokens", "input_positions", "seq_lens", "slot_mapping")


# ---------------------------------------------------------------- implementations


# The ops' argument lists stay packed (fmt: off), as in paddle_step.ops.
# fmt: off
def advance_step_vectorized(input_tokens, sampled_token_ids, input_positions, seq_lens,
                            slot_mapping, block_tables, num_seqs, num_queries, block_size,
                            active=None):
    # fmt: on
    """advance_step in built-in Paddle ops (what one writes without the custom op)."""
    is_query = paddle.arange(num_seqs) < num_queries
    if active is not None:
        is_query = paddle.logical_and(is_query, active)
    sampled = sampled_token_ids.reshape([-1])
    if num_queries < num_seqs:
        sampled = paddle.concat([sampled, paddle.zeros([num_seqs - num_queries], sampled.dtype)])
    position = seq_lens.astype("int64")
    column = position // block_size
    width = block_tables.shape[1]
    in_table = paddle.logical_and(position >= 0, column < width)
    block = (
        paddle.take_along_axis(block_tables, paddle.clip(column, 0, width - 1).unsqueeze(1), axis=1)
        .squeeze(1)
        .astype("int64")
    )
    slot = block * block_size + position % block_size
    valid = paddle.logical_and(paddle.logical_and(in_table, block >= 0), is_query)
    zeros = paddle.zeros_like(position)
    paddle.assign(paddle.where(is_query, sampled, zeros), output=input_tokens)
    paddle.assign(paddle.where(is_query, position, zeros), output=input_positions)
    paddle.assign(paddle.where(is_query, seq_lens + 1, seq_lens), output=seq_lens)
    paddle.assign(paddle.where(valid, slot, paddle.full_like(slot, -1)), output=slot_mapping)


# A to_static function takes the tensors as one list: it refuses a ``*tensors`` parameter.
def _make_to_static_advance(num_seqs, block_size):
    def run(tensors, active):
        paddle_step.advance_step(*tensors, num_seqs, num_seqs, block_size, active=active)

    return paddle.jit.to_static(run, full_graph=True)


def _make_to_static_step(block_size, enc_dec):
    def run(tensors):
        paddle_step.step_paddle(*tensors, block_size, enc_dec)

    return paddle.jit.to_static(run, full_graph=True)


# ---------------------------------------------------------------- timing


def _time_calls(fn, restore, n: int) -> np.ndarray:
    out = np.empty(n, np.int64)
    clock = time.perf_counter_ns
    if restore is None:
        for i in range(n):
            start = clock()
            fn()
            out[i] = clock() - start
    else:
        for i in range(n):
            restore()
            start = clock()
            fn()
            out[i] = clock() - start
    return out


class Candidate:
    """One implementation: ``fn`` (one call), ``restore`` (outside the timer) and how
    many calls a round takes (sized from a probe so each round lasts ~``budget_s``)."""

    def __init__(self, name, fn, restore=None):
        self.name, self.fn, self.restore = name, fn, restore
        self.medians, self.p90s, self.n = [], [], 0

    def size(self, budget_s: float, max_calls: int, min_calls: int) -> None:
        probe = 3
        start = time.perf_counter()
        for _ in range(probe):  # also warms up
            if self.restore is not None:
                self.restore()
            self.fn()
        per_call = (time.perf_counter() - start) / probe
        self.n = int(min(max_calls, max(min_calls, budget_s / max(per_call, 1e-7))))
        self.warmup = min(self.n // 4 + 1, 200)

    def round(self) -> None:
        _time_calls(self.fn, self.restore, self.warmup)
        times = _time_calls(self.fn, self.restore, self.n)
        self.medians.append(float(np.median(times)) / 1e3)
        self.p90s.append(float(np.percentile(times, 90)) / 1e3)

    def result(self) -> dict:
        return {
            "median_us": min(self.medians),
            "p90_us": min(self.p90s),
            "calls_per_round": self.n,
            "rounds": len(self.medians),
            "round_medians_us": [round(m, 3) for m in self.medians],
        }


def run_candidates(candidates, rounds, budget_s, max_calls, min_calls) -> dict:
    for candidate in candidates:
        candidate.size(budget_s, max_calls, min_calls)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):  # interleaved, so load bursts hit every candidate
            for candidate in candidates:
                candidate.round()
    finally:
        if gc_was_enabled:
            gc.enable()
    return {candidate.name: candidate.result() for candidate in candidates}


def _restorer(pairs):
    """Copies each saved tensor into its live tensor (one in-place assign each)."""
    assign_out = _C_ops.assign_out_

    def restore():
        for saved, live in pairs:
            assign_out(saved, live)

    return restore


def floor_candidates(batch: int) -> list[Candidate]:
    x = paddle.zeros([batch], "int64")
    y = paddle.zeros([batch], "int64")
    one = paddle.ones([1], "int64")
    return [
        Candidate("floor:x.zero_()", lambda: x.zero_()),
        Candidate("floor:x.fill_(0)", lambda: x.fill_(0)),
        Candidate("floor:x.add_(one)", lambda: x.add_(one)),
        Candidate("floor:paddle.assign(x,output=y)", lambda: paddle.assign(x, output=y)),
        Candidate("raw_floor:_C_ops.assign_out_", lambda: _C_ops.assign_out_(x, y)),
    ]


def summarize_floor(results: dict) -> dict:
    public = {k.split(":", 1)[1]: v for k, v in results.items() if k.startswith("floor:")}
    best = min(public, key=lambda k: public[k]["median_us"])
    raw = next(v for k, v in results.items() if k.startswith("raw_floor:"))
    return {
        "floor": {**public[best], "op": best},
        "raw_floor": {**raw, "op": "_C_ops.assign_out_"},
        "candidates": {k: v["median_us"] for k, v in results.items()},
    }


# ---------------------------------------------------------------- per-op benches


def bench_step_paddle(captured, floor, args, with_static) -> dict:
    state = captured["state"]
    live = [paddle.to_tensor(state[name]) for name in STEP_PADDLE_TENSORS]
    saved = [paddle.to_tensor(state[name]) for name in STEP_PADDLE_TENSORS]
    written = set(STEP_PADDLE_OUTPUTS)
    restore = _restorer(
        [(s, t) for name, s, t in zip(STEP_PADDLE_TENSORS, saved, live) if name in written]
    )
    bs, enc = BLOCK_SIZE, ENC_DEC_BLOCK_NUM

    # Correctness sanity check: op == reference on this state.
    reference_out = ref_step_paddle(state, bs, enc)
    restore()
    paddle_step.step_paddle(*live, bs, enc)
    for name, tensor in zip(STEP_PADDLE_TENSORS, live):
        if not np.array_equal(tensor.numpy(), reference_out[name]):
            raise AssertionError(f"step_paddle differs from the reference in {name}")
    restore()

    step = paddle_step.step_paddle
    binding = paddle_step_ops.step_paddle
    generated = paddle_step_ops.static_op_step_paddle
    candidates = [
        Candidate("op", lambda: step(*live, bs, enc), restore),
        Candidate("binding", lambda: binding(*live, bs, enc), restore),
        Candidate("generated", lambda: generated(*live, bs, enc), restore),
        Candidate("reference", lambda: ref_step_paddle(state, bs, enc)),
    ]
    if with_static:
        static_fn = _make_to_static_step(bs, enc)
        static_fn(live)
        restore()
        candidates.append(Candidate("to_static", lambda: static_fn(live), restore))
    return run_candidates(candidates, args.rounds, args.budget, args.max_calls, args.min_calls)


def bench_advance_step(captured, floor, args, with_static) -> dict:
    inputs = advance_inputs(captured["after"])
    batch = inputs["seq_lens"].size
    live = {name: paddle.to_tensor(value) for name, value in inputs.items()}
    saved = {name: paddle.to_tensor(inputs[name]) for name in ADVANCE_WRITTEN}
    restore = _restorer([(saved[name], live[name]) for name in ADVANCE_WRITTEN])
    tensors = [live[name] for name in ADVANCE_NAMES]
    active = live["active"]
    bs = BLOCK_SIZE

    expected = ref_advance_step(
        *[inputs[name] for name in ADVANCE_NAMES], batch, batch, bs, active=inputs["active"]
    )
    for impl in ("op", "vectorized"):
        restore()
        if impl == "op":
            paddle_step.advance_step(*tensors, batch, batch, bs, active=active)
        else:
            advance_step_vectorized(*tensors, batch, batch, bs, active=active)
        for name, want in zip(ADVANCE_WRITTEN, expected):
            if not np.array_equal(live[name].numpy(), want):
                raise AssertionError(f"advance_step ({impl}) differs from the reference in {name}")
    restore()

    advance = paddle_step.advance_step
    binding = paddle_step_ops.advance_step
    generated = paddle_step_ops.static_op_advance_step
    numpy_args = [inputs[name] for name in ADVANCE_NAMES]
    numpy_active = inputs["active"]
    candidates = [
        Candidate("op", lambda: advance(*tensors, batch, batch, bs, active=active), restore),
        Candidate("binding", lambda: binding(*tensors, active, batch, batch, bs), restore),
        Candidate("generated", lambda: generated(*tensors, active, batch, batch, bs), restore),
        Candidate(
            "vectorized",
            lambda: advance_step_vectorized(*tensors, batch, batch, bs, active=active),
            restore,
        ),
        Candidate(
            "reference",
            lambda: ref_advance_step(*numpy_args, batch, batch, bs, active=numpy_active),
        ),
    ]
    if with_static:
        static_fn = _make_to_static_advance(batch, bs)
        static_fn(tensors, active)
        restore()
        candidates.append(Candidate("to_static", lambda: static_fn(tensors, active), restore))
    return run_candidates(candidates, args.rounds, args.budget, args.max_calls, args.min_calls)


def ratios(impls: dict, floor: dict) -> dict:
    op = impls["op"]["median_us"]
    out = {
        "op_over_floor": op / floor["floor"]["median_us"],
        "op_over_raw_floor": op / floor["raw_floor"]["median_us"],
    }
    for name in ("reference", "vectorized", "generated", "to_static"):
        if name in impls:
            out[f"{name}_over_op"] = impls[name]["median_us"] / op
    return out


def check_targets(results: list[dict]) -> list[dict]:
    checks = []
    for op, batch, baseline, kind, bound in TARGETS:
        rows = [r for r in results if r["op"] == op and r["B"] == batch]
        if not rows:
            continue
        per_scenario = {}
        for row in rows:
            op_us = row["impls"]["op"]["median_us"]
            base_us = (
                row["floor"]["floor"]["median_us"]
                if baseline == "floor"
                else row["impls"][baseline]["median_us"]
            )
            value = base_us / op_us if kind == "speedup" else op_us / base_us
            met = value >= bound if kind == "speedup" else value <= bound
            per_scenario[row["scenario"]] = {"value": round(value, 2), "met": bool(met)}
        text = (
            f"{op} B={batch}: {baseline}/op >= {bound:g}x"
            if kind == "speedup"
            else f"{op} B={batch}: op/{baseline} <= {bound:g}x"
        )
        checks.append(
            {
                "target": text,
                "op": op,
                "B": batch,
                "baseline": baseline,
                "kind": kind,
                "bound": bound,
                "scenarios": per_scenario,
                "met": all(v["met"] for v in per_scenario.values()),
            }
        )
    return checks


# ---------------------------------------------------------------- output


def _fmt_us(value: float) -> str:
    return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def print_table(report: dict) -> None:
    print(
        f"paddle {report['env']['paddle']} on {report['env']['cpu_count']} CPU core(s), "
        f"{report['env']['platform']}; best-of-{report['config']['rounds']} medians "
        f"(us per call, p90 in brackets); shared, noisy machine."
    )
    for op in ("advance_step", "step_paddle"):
        print(f"\n== {op} ==")
        cols = ["op", "binding", "generated", "to_static", "vectorized", "reference"]
        cols = [c for c in cols if any(c in r["impls"] for r in report["results"] if r["op"] == op)]
        header = (
            f"{'scen':8s} {'B':>5s} "
            + " ".join(f"{c:>17s}" for c in cols)
            + f" {'floor':>7s}  {'op/floor':>8s} {'ref/op':>8s}"
            + ("  vec/op" if op == "advance_step" else "")
            + "  event"
        )
        print(header)
        for row in report["results"]:
            if row["op"] != op:
                continue
            cells = []
            for c in cols:
                if c in row["impls"]:
                    v = row["impls"][c]
                    cells.append(f"{_fmt_us(v['median_us']):>8s} [{_fmt_us(v['p90_us']):>6s}]")
                else:
                    cells.append(f"{'-':>17s}")
            r = row["ratios"]
            line = (
                f"{row['scenario']:8s} {row['B']:>5d} "
                + " ".join(cells)
                + f" {row['floor']['floor']['median_us']:>7.2f}  {r['op_over_floor']:>7.2f}x"
                f" {r['reference_over_op']:>7.0f}x"
            )
            if op == "advance_step":
                line += f" {r['vectorized_over_op']:>6.1f}x"
            cap = row["state"]
            line += (
                f"  running={cap['running']} needy={cap['needy']} pool={cap['pool']} "
                f"preempted={cap['preempted']}"
            )
            print(line)
    print("\nfloor = cheapest public in-place builtin on a [B] int64 tensor:")
    for batch, floor in report["floors"].items():
        print(
            f"  B={batch:>5}: {floor['floor']['op']} {floor['floor']['median_us']:.2f} us "
            f"(raw _C_ops.assign_out_ {floor['raw_floor']['median_us']:.2f} us; all: "
            + ", ".join(f"{k.split(':', 1)[1]}={v:.2f}" for k, v in floor["candidates"].items())
            + ")"
        )
    print("\ntargets:")
    for check in report["targets"]:
        per = ", ".join(f"{s}={v['value']}x" for s, v in check["scenarios"].items())
        print(f"  [{'MET ' if check['met'] else 'MISS'}] {check['target']}  ({per})")


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    styles = {
        "op": ("C0", "o"),
        "binding": ("C9", "."),
        "generated": ("C1", "s"),
        "to_static": ("C4", "v"),
        "vectorized": ("C2", "^"),
        "reference": ("C3", "x"),
    }
    for ax, op in zip(axes, ("advance_step", "step_paddle")):
        for scenario, dash in (("preempt", "-"), ("calm", ":")):
            rows = sorted(
                (r for r in report["results"] if r["op"] == op and r["scenario"] == scenario),
                key=lambda r: r["B"],
            )
            if not rows:
                continue
            batches = [r["B"] for r in rows]
            for impl, (color, marker) in styles.items():
                if impl == "binding" or not all(impl in r["impls"] for r in rows):
                    continue
                ax.plot(
                    batches,
                    [r["impls"][impl]["median_us"] for r in rows],
                    dash,
                    color=color,
                    marker=marker,
                    label=f"{impl} ({scenario})",
                )
        floors = sorted(report["floors"].items(), key=lambda kv: int(kv[0]))
        ax.plot(
            [int(b) for b, _ in floors],
            [f["floor"]["median_us"] for _, f in floors],
            "--",
            color="k",
            label="floor: 1 built-in in-place op",
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch slots B")
        ax.set_ylabel("median latency per call (us)")
        ax.set_title(f"{op} (CPU)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(
        f"paddle_step op latency vs B, paddle {report['env']['paddle']}, "
        f"{report['env']['cpu_count']} cores (shared machine, best-of-"
        f"{report['config']['rounds']} medians)",
        fontsize=10,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"B in {QUICK_BATCHES}, preempt scenario only, few calls",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="PATH", help="write a log-log PNG of latency vs B")
    parser.add_argument("--batches", help="comma-separated B values (default: all)")
    parser.add_argument("--scenarios", help=f"comma-separated, of {SCENARIOS}")
    parser.add_argument("--rounds", type=int, help="timing rounds (best-of)")
    parser.add_argument("--no-static", action="store_true", help="skip the to_static column")
    args = parser.parse_args(argv)
    args.batches = parse_batches(args.batches, QUICK_BATCHES if args.quick else FULL_BATCHES)
    args.scenarios = (
        tuple(args.scenarios.split(","))
        if args.scenarios
        else ("preempt",)
        if args.quick
        else SCENARIOS
    )
    if args.quick:
        args.rounds = args.rounds or 2
        args.budget, args.max_calls, args.min_calls = 0.04, 300, 3
        args.with_static = False
    else:
        args.rounds = args.rounds or 5
        args.budget, args.max_calls, args.min_calls = 0.25, 3000, 5
        args.with_static = not args.no_static
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    paddle.set_device("cpu")
    started = time.time()
    results, floors = [], {}
    for batch in args.batches:
        floors[batch] = summarize_floor(
            run_candidates(
                floor_candidates(batch), args.rounds, args.budget, args.max_calls, args.min_calls
            )
        )
        for scenario in args.scenarios:
            captured = capture_state(batch, scenario)
            info = {
                k: captured[k]
                for k in ("step", "preempted", "recovered", "running", "pool", "needy")
            }
            for op, bench in (
                ("step_paddle", bench_step_paddle),
                ("advance_step", bench_advance_step),
            ):
                impls = bench(captured, floors[batch], args, args.with_static)
                results.append(
                    {
                        "op": op,
                        "scenario": scenario,
                        "B": batch,
                        "state": info,
                        "impls": impls,
                        "floor": floors[batch],
                        "ratios": ratios(impls, floors[batch]),
                    }
                )
            if not args.json:
                print(
                    f"  B={batch} {scenario} done ({time.time() - started:.0f} s)", file=sys.stderr
                )
    report = {
        "benchmark": "bench_ops",
        "env": {
            "paddle": paddle.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "device": "cpu",
            "note": "shared machine, other jobs running: best-of-rounds medians",
        },
        "config": {
            "quick": args.quick,
            "batches": list(args.batches),
            "scenarios": list(args.scenarios),
            "rounds": args.rounds,
            "round_budget_s": args.budget,
            "max_calls_per_round": args.max_calls,
            "max_model_len": MAX_MODEL_LEN,
            "block_size": BLOCK_SIZE,
            "blocks_per_seq": BLOCKS_PER_SEQ,
            "timed": "one call per sample; written tensors restored before each "
            "call, outside the timer; gc disabled",
        },
        "floors": {str(b): f for b, f in floors.items()},
        "results": results,
        "targets": check_targets(results),
        "elapsed_s": round(time.time() - started, 1),
    }
    if args.plot:
        plot(report, args.plot)
        report["plot"] = args.plot
    return emit_report(report, args.json, print_table)


if __name__ == "__main__":
    main()
