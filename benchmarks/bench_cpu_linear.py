#!/usr/bin/env python
"""The CPU op for decode-row products (``paddle_step.layers.cpu_linear``) against the
machine's own limits and against Paddle's eager ``paddle.matmul``.

The machine, on 1 thread and on every core the process may run on:

- read bandwidth: the sum of a float32 array far larger than the last-level cache
  (``cpu_read_sum``: vector loads on the op's threads), median of the repeats;
- matmul peak: float32 multiply-adds on registers only (``cpu_fma_rate``: 12 independent
  chains on the op's widest vectors), the best of 40 short samples; a multiply-add
  counts 2.

The products ``y = x @ W`` for M = 1, 8, 32 rows, at Qwen2.5-0.5B's dimensions (weight
bytes in float32; half in bfloat16, a quarter in int8):

- ``mlp_up``: [M, 896] x [896, 4864] (17.4 MB of weights), cycling through enough copies
  that every call reads its weights from memory, not from the last-level cache;
- ``layer``: one decoder layer's four products in sequence (fused q/k/v [896, 1152], output
  [896, 896], fused gate/up [896, 9728], down [4864, 896]: 59.6 MB), cycling through copies;
- ``lm_head``: the tied LM head [M, 896] x [896, 151936] (545 MB).

Each is timed as our op (weights packed once, in ``--format``: float32, bfloat16 or int8),
as a baseline on the same threads (float32: ``paddle.matmul``; bfloat16 and int8 on a CPU
with AVX512-BF16 and VNNI: the op with the weights widened to float32, the AVX-512 path,
against its default dot products on x in bfloat16 or 8 bits), and as a plain read of the
same packed weights (``cpu_read_sum``), the three interleaved call by call (a machine shared
with other jobs changes its bandwidth from one second to the next): the median of the
repeats, in ms. Weight GB/s = weight bytes / time; % bandwidth = the read's time over the
op's (the share of the bandwidth the op got from the same bytes at the same moments);
GFLOP/s = 2 M K N / time; % peak = that over the float32 matmul peak of the same thread
count (the dot products of bfloat16 and int8 do 2 and 4 multiply-adds a lane, so they can
pass 100%). The targets: M <= 8 at >= 80% of the bandwidth, M = 32 at >= 50% of the peak.

Usage: bench_cpu_linear.py [--quick] [--json] [--threads 1,2] [--repeats N]
                           [--format float32|bfloat16|int8]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import warnings

import zlib  # noqa: F401,E402  isort: skip  (see tests/conftest.py)

import numpy as np  # noqa: E402

warnings.filterwarnings("ignore", message=".*ccache.*")
import paddle  # noqa: E402
from bench_common import emit_report  # noqa: E402
from paddle.base import core  # noqa: E402

import paddle_step_ops as _library  # noqa: E402
from paddle_step.engine.cpu_threads import available_cores  # noqa: E402
from paddle_step.layers import cpu_linear  # noqa: E402
from paddle_step.layers.dense_blocks import WIDENED_ISA  # noqa: E402
from paddle_step.layers.prefetch_distance import choose, describe, last_level_cache_bytes  # noqa: E402

ROWS = (1, 8, 32)
HIDDEN, INTERMEDIATE, QKV, VOCAB = 896, 4864, 1152, 151936
BANDWIDTH_TARGET = 0.80  # M <= 8: share of the read bandwidth
PEAK_TARGET = 0.50  # M = 32: share of the matmul peak
# A peak sample: ~5 ms of multiply-adds per thread at 100 GFLOP/s; the best of many short
# samples is the one least disturbed by other jobs on the machine.
FMA_ITERATIONS = 1_000_000
FMA_SAMPLES = 40


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def set_threads(threads: int) -> None:
    core.set_num_threads(threads)
    cpu_linear.set_num_threads(threads)


def median_seconds(call, repeats: int) -> float:
    return interleaved_medians({"call": call}, repeats)["call"]


def interleaved_medians(calls: dict, repeats: int) -> dict:
    """The median time of each call, the calls taking turns (after one warm-up each)."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def machine_limits(threads: int, read_mib: int, repeats: int, layer: Product) -> dict:
    """The read bandwidth and matmul peak on ``threads`` threads, and the prefetch distances
    the engine would choose there, timed as it does on a decode step's products: the
    ``layer`` product's copies in sequence (the op's products then use them)."""
    set_threads(threads)
    prefetch = choose([packed for copy in layer.packed for packed in copy])
    data = paddle.ones([read_mib << 18], dtype="float32")
    seconds = median_seconds(lambda: _library.cpu_read_sum(data), repeats)
    samples = FMA_SAMPLES if repeats > 3 else 10
    peak = max(_library.cpu_fma_rate(FMA_ITERATIONS) for _ in range(samples))
    return {
        "read_gb_s": (read_mib << 20) / seconds / 1e9,
        "peak_gflop_s": peak / 1e9,
        "prefetch": {
            "one_row": describe(prefetch.one_row),
            "several_rows": describe(prefetch.several_rows),
        },  # fmt: skip
    }


class Product:
    """Copies of one product's weights (a list of [K, N] shapes run in sequence), as
    paddle tensors and packed for the op."""

    def __init__(
        self,
        name: str,
        shapes: list[tuple[int, int]],
        copies: int,
        seed: int,
        weight_format: str = "float32",
    ):
        rng = np.random.default_rng(seed)
        self.name, self.shapes = name, shapes
        self.tensors = [
            [
                paddle.to_tensor(rng.standard_normal((k, n), dtype=np.float32) / np.float32(k**0.5))
                for k, n in shapes
            ]
            for _ in range(copies)
        ]
        self.packed = [[cpu_linear.pack(w, weight_format) for w in ws] for ws in self.tensors]
        if weight_format != "float32":
            self.tensors = None  # only eager reads them
        self.weight_bytes = sum(w.nbytes for w in self.packed[0])
        # What the plain read sums: the packed float32 weights themselves, or for the other
        # formats float32 ones of the same bytes (their bits read as float32 include
        # denormals, which slow the sum down).
        self.raw = [
            [w.weights for w in ws]
            if weight_format == "float32"
            else [paddle.ones([self.weight_bytes // 4], dtype="float32")]
            for ws in self.packed
        ]
        self.flops_per_row = 2 * sum(k * n for k, n in shapes)

    def timer(self, way: str, rows: int):
        """A call that runs the products (``op``, ``eager``) or reads the packed weights
        (``read``) of the next copy."""
        inputs = {k: paddle.rand([rows, k], dtype="float32") for k, _ in self.shapes}
        state = {"copy": 0}

        def next_copy(weights):
            state["copy"] += 1
            return weights[state["copy"] % len(weights)]

        def op():
            for (k, _), w in zip(self.shapes, next_copy(self.packed)):
                cpu_linear.linear(inputs[k], w)

        def eager():
            for (k, _), w in zip(self.shapes, next_copy(self.tensors)):
                paddle.matmul(inputs[k], w)

        def widened():
            for (k, _), w in zip(self.shapes, next_copy(self.packed)):
                cpu_linear.linear(inputs[k], w, isa=WIDENED_ISA)

        def read():
            for array in next_copy(self.raw):
                _library.cpu_read_sum(array)

        return {"op": op, "eager": eager, "widened": widened, "read": read}[way]


def baseline_way(weight_format: str) -> str | None:
    """What the op is compared with: eager for float32, the widened path for packed
    formats where the op's default is a dot-product path (None: nothing to compare)."""
    if weight_format == "float32":
        return "eager"
    return "widened" if cpu_linear.isa() == "avx512_bf16" else None


def copies_beyond(cache_bytes: int, weight_bytes: int) -> int:
    """Copies whose weights together are at least twice the last-level cache."""
    return max(2, -(-2 * cache_bytes // weight_bytes) + 1)


# The smoke run (--quick) sizes its copies past a cache of at most this much: on a CPU with
# a last-level cache of hundreds of MB, sizing them past it took a minute per format.
QUICK_CACHE_BYTES = 32 << 20


def measure(args) -> dict:
    llc = last_level_cache_bytes()
    sized_past = min(llc, QUICK_CACHE_BYTES) if args.quick else llc
    vocab = 16384 if args.quick else VOCAB
    intermediate = 1024 if args.quick else INTERMEDIATE
    read_mib = 64 if args.quick else 512
    mlp = [(HIDDEN, intermediate)]
    layer = [(HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * intermediate), (intermediate, HIDDEN)]
    products = []
    for seed, (name, shapes) in enumerate(
        (("mlp_up", mlp), ("layer", layer), ("lm_head", [(HIDDEN, vocab)]))
    ):
        element = cpu_linear.BYTES_PER_WEIGHT[args.format]
        bytes_ = element * sum(k * n for k, n in shapes)
        copies = 1 if name == "lm_head" and not args.quick else copies_beyond(sized_past, bytes_)
        products.append(Product(name, shapes, copies, seed, args.format))

    limits, results = {}, []
    for threads in args.threads:
        layer = next(p for p in products if p.name == "layer")
        limits[threads] = machine_limits(threads, read_mib, args.repeats, layer)
        for product in products:
            for rows in args.rows:
                repeats = max(3, args.repeats // 2) if product.name == "lm_head" else args.repeats
                row = {"threads": threads, "product": product.name, "M": rows}
                baseline = baseline_way(args.format)
                timed = ("op", baseline) if baseline else ("op",)
                medians = interleaved_medians(
                    {way: product.timer(way, rows) for way in (*timed, "read")}, repeats
                )
                row["read_ms"] = medians["read"] * 1e3
                row["baseline"] = baseline
                for way in timed:
                    seconds = medians[way]
                    gflop_s = rows * product.flops_per_row / seconds / 1e9
                    row[way] = {
                        "ms": seconds * 1e3,
                        "weight_gb_s": product.weight_bytes / seconds / 1e9,
                        "bandwidth_share": medians["read"] / seconds,
                        "gflop_s": gflop_s,
                        "peak_share": gflop_s / limits[threads]["peak_gflop_s"],
                    }
                if baseline:
                    row["baseline_over_op"] = row[baseline]["ms"] / row["op"]["ms"]
                if rows <= 8:
                    row["target"] = f">= {BANDWIDTH_TARGET:.0%} of bandwidth"
                    row["met"] = row["op"]["bandwidth_share"] >= BANDWIDTH_TARGET
                elif rows == 32:
                    row["target"] = f">= {PEAK_TARGET:.0%} of peak"
                    row["met"] = row["op"]["peak_share"] >= PEAK_TARGET
                results.append(row)
    return {
        "env": {
            "cpu": cpu_model(),
            "isa": cpu_linear.isa(),
            "format": args.format,
            "cores": available_cores(),
            "last_level_cache_mib": llc / (1 << 20),
            "paddle": paddle.__version__,
            "python": sys.version.split()[0],
        },
        "config": {
            "threads": args.threads,
            "rows": args.rows,
            "repeats": args.repeats,
            "quick": args.quick,
            "products": {
                p.name: {
                    "shapes": p.shapes,
                    "copies": len(p.packed),
                    "weight_mb": p.weight_bytes / 1e6,
                }
                for p in products
            },
        },  # fmt: skip
        "machine": {str(t): v for t, v in limits.items()},
        "results": results,
    }


def print_report(report: dict) -> None:
    env = report["env"]
    llc = env["last_level_cache_mib"]
    print(f"CPU: {env['cpu']} ({env['cores']} cores, path {env['isa']}, "
          f"last-level cache {llc:.0f} MiB), paddle {env['paddle']}; weights in "
          f"{env['format']}")  # fmt: skip
    for threads, limits in report["machine"].items():
        prefetch = limits["prefetch"]
        print(f"{threads} thread(s): read bandwidth {limits['read_gb_s']:.1f} GB/s, "
              f"matmul peak {limits['peak_gflop_s']:.1f} GFLOP/s; the op prefetches "
              f"{prefetch['one_row']} ahead for one row, {prefetch['several_rows']} for "
              "several")  # fmt: skip
    for name, product in report["config"]["products"].items():
        print(f"{name}: {product['shapes']}, {product['weight_mb']:.1f} MB, "
              f"{product['copies']} copies")  # fmt: skip
    print()
    name = report["results"][0]["baseline"] if report["results"] else None
    print(f"| threads | product | M | op ms | {name} ms | {name}/op | read ms | op GB/s "
          "| % bandwidth | op GFLOP/s | % peak | target |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in report["results"]:
        op = row["op"]
        target = ""
        if "target" in row:
            target = f"{row['target']}: {'met' if row['met'] else 'SHORT'}"
        baseline, ratio = "-", "-"
        if row["baseline"]:
            baseline = f"{row[row['baseline']]['ms']:.3f}"
            ratio = f"{row['baseline_over_op']:.2f}x"
        print(f"| {row['threads']} | {row['product']} | {row['M']} | {op['ms']:.3f} | "
              f"{baseline} | {ratio} | {row['read_ms']:.3f} | "
              f"{op['weight_gb_s']:.1f} | {op['bandwidth_share']:.0%} | {op['gflop_s']:.1f} | "
              f"{op['peak_share']:.0%} | {target} |")  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small products, few repeats")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--threads", default=None, help="thread counts, e.g. 1,2 "
                        "(default: 1 and every core)")  # fmt: skip
    parser.add_argument("--rows", default=None, help="row counts (default 1,8,32)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per figure")
    parser.add_argument("--format", default="float32", choices=cpu_linear.FORMATS,
                        help="the weights' format (default float32)")  # fmt: skip
    args = parser.parse_args(argv)
    cores = available_cores()
    args.threads = (
        sorted({1, cores}) if args.threads is None else [int(t) for t in args.threads.split(",")]
    )
    args.rows = list(ROWS) if args.rows is None else [int(r) for r in args.rows.split(",")]
    if args.repeats is None:
        args.repeats = 3 if args.quick else 15
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = measure(args)
    return emit_report(report, args.json, print_report)


if __name__ == "__main__":
    main()
