"""Smoke tests: the benchmark scripts run (``--quick --json``) and report sane numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_json(script: str, *extra: str, timeout: float = 120) -> dict:
    env = dict(os.environ)
    paths = [str(ROOT / "tests"), str(ROOT / "python")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--json", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = [line for line in completed.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one JSON line on stdout, got:\n{completed.stdout[-2000:]}"
    return json.loads(lines[0])


def test_bench_ops_quick_json(tmp_path):
    plot = tmp_path / "ops.png"
    report = run_json("bench_ops.py", "--plot", str(plot))
    assert {"env", "config", "floors", "results", "targets"} <= set(report)
    assert report["results"]
    seen = set()
    for row in report["results"]:
        seen.add((row["op"], row["B"]))
        impls = row["impls"]
        expected = {"op", "binding", "generated", "reference"}
        if row["op"] == "advance_step":
            expected.add("vectorized")
        assert expected <= set(impls), row["op"]
        for result in impls.values():
            assert result["median_us"] > 0 and result["p90_us"] >= result["median_us"]
        assert row["ratios"]["op_over_floor"] > 0
        assert row["ratios"]["reference_over_op"] > 0
        assert row["floor"]["floor"]["median_us"] > 0
    batches = set(report["config"]["batches"])
    assert seen == {(op, b) for op in ("advance_step", "step_paddle") for b in batches}
    # B=256 is in --quick: the four targets at that size are checked, each against the
    # results it names.
    assert {(t["op"], t["B"], t["baseline"]) for t in report["targets"]} >= {
        ("advance_step", 256, "vectorized"),
        ("advance_step", 256, "floor"),
        ("step_paddle", 256, "reference"),
        ("step_paddle", 256, "floor"),
    }
    for target in report["targets"]:
        rows = [r for r in report["results"] if (r["op"], r["B"]) == (target["op"], target["B"])]
        assert set(target["scenarios"]) == {row["scenario"] for row in rows}, target["target"]
        for row in rows:
            op_us = row["impls"]["op"]["median_us"]
            if target["baseline"] == "floor":
                base_us = row["floor"]["floor"]["median_us"]
            else:
                base_us = row["impls"][target["baseline"]]["median_us"]
            value = base_us / op_us if target["kind"] == "speedup" else op_us / base_us
            scenario = target["scenarios"][row["scenario"]]
            assert scenario["value"] == round(value, 2), target["target"]
            bound_met = (
                value >= target["bound"]
                if target["kind"] == "speedup"
                else (value <= target["bound"])
            )
            assert scenario["met"] is bound_met, target["target"]
        assert target["met"] is all(s["met"] for s in target["scenarios"].values())
    assert plot.stat().st_size > 1000


def test_bench_decode_quick_json():
    report = run_json("bench_decode.py")
    assert {"env", "config", "results", "targets"} <= set(report)
    assert report["results"]
    for row in report["results"]:
        mean = row["mean_us"]
        for key in ("step", "forward", "step_paddle", "advance_step_op", "post_process", "host"):
            assert mean[key] > 0, key
        assert mean["forward"] < mean["step"]
        assert 0 < row["fraction_of_step"]["bookkeeping"] < 1
        assert row["tokens_per_s"] > 0 and row["generated_tokens"] > 0
        for name in ("step_paddle", "advance_step"):
            alloc = row["op_allocations"][name]
            assert alloc["calls"] == row["steps"]
            # The ops work in place: no new buffers for the tensors they write.
            assert alloc["data_pointer_changes"] == 0
            assert alloc["allocated_bytes_per_call_max"] == 0


def test_bench_cpu_linear_quick_json():
    report = run_json("bench_cpu_linear.py", "--threads", "1,2")
    assert {"env", "config", "machine", "results"} <= set(report)
    for limits in report["machine"].values():
        assert limits["read_gb_s"] > 0 and limits["peak_gflop_s"] > 0
    seen = set()
    for row in report["results"]:
        seen.add((row["threads"], row["product"], row["M"]))
        assert row["read_ms"] > 0
        for way in ("op", "eager"):
            assert row[way]["ms"] > 0 and row[way]["gflop_s"] > 0
        assert isinstance(row["met"], bool) and row["target"]
    assert seen == {
        (threads, product, rows)
        for threads in (1, 2)
        for product in ("mlp_up", "layer", "lm_head")
        for rows in (1, 8, 32)
    }


@pytest.mark.parametrize("weight_format", ["bfloat16", "int8"])
def test_bench_cpu_linear_packed_formats(weight_format):
    """Packed weights are compared with their widened path where the op's default is a
    dot-product path (avx512_bf16), with nothing elsewhere; bytes are the format's."""
    report = run_json("bench_cpu_linear.py", "--threads", "1", "--format", weight_format)
    assert report["env"]["format"] == weight_format
    expected = "widened" if report["env"]["isa"] == "avx512_bf16" else None
    for row in report["results"]:
        assert row["baseline"] == expected and row["op"]["ms"] > 0 and row["read_ms"] > 0
        if expected:
            assert row["widened"]["ms"] > 0
    megabytes = report["config"]["products"]["mlp_up"]["weight_mb"]
    per_weight = {"bfloat16": 2, "int8": 1}[weight_format]
    assert per_weight * 896 * 1024 / 1e6 <= megabytes < (per_weight + 0.1) * 896 * 1024 / 1e6


def test_bench_sampler_quick_json():
    report = run_json("bench_sampler.py")
    assert [row["mode"] for row in report["results"]] == ["greedy", "all", "all+constraint"]
    for row in report["results"]:
        assert row["step_us"] > row["sampling_us"] > 0
        assert 0 < row["sampling_share"] < 1


def test_soak_serve_quick_json():
    """200 streaming requests from 32 clients, 20% closed mid-stream: none fails, and no
    request or KV block is held once every client has left."""
    report = run_json("soak_serve.py", timeout=300)
    outcomes = report["outcomes"]
    assert outcomes.get("errors", 0) == 0, outcomes
    assert outcomes["done"] + outcomes["cancelled"] == report["config"]["requests"] == 200
    assert 20 <= outcomes["cancelled"] <= 80  # 20% of 200, drawn
    assert report["pools_full"], report["held_at_end"]
    samples = report["rss_mib"]
    assert [s["requests"] for s in samples] == list(range(50, 201, 15))
    assert all(s["server"] > 0 and s["engine"] > 0 for s in samples)


def test_bench_prefix_quick_json():
    report = run_json("bench_prefix.py")
    shared, long_case = report["shared_prefix"], report["long_prompt"]
    assert shared["on"]["prompt_tokens_hit"] > 0 and shared["off"]["prompt_tokens_hit"] == 0
    for run in (shared["on"], shared["off"]):
        assert 0 < run["ttft_p50_ms"] <= run["ttft_p99_ms"] and run["output_tokens_per_s"] > 0
    for run in (long_case["whole"], long_case["chunked"]):
        assert 0 < run["itl_p50_ms"] <= run["itl_p99_ms"] and run["long_prompt_ttft_ms"] > 0
    assert shared["ttft_p50_ratio"] > 0 and long_case["itl_p99_ratio"] > 0


def test_bench_weight_formats_quick_json():
    # Three fresh processes, one per format: a longer bound than one script's.
    report = run_json("bench_weight_formats.py", timeout=600)
    assert [row["format"] for row in report["results"]] == ["float32", "bfloat16", "int8"]
    weights = {row["format"]: row["weight_mb"] for row in report["results"]}
    # The tiny shape's packed formats keep 2 and about 1 byte per weight, float32 more.
    assert weights["int8"] < weights["bfloat16"] < weights["float32"]
    for row in report["results"]:
        # The loader hands freed heap back: a tiny model may leave the resident set lower.
        assert row["rss_after_load_mb"] > 0 and row["rss_before_load_mb"] > 0
        assert set(row["batches"]) == {"1", "2"}
        assert all(run["tokens_per_s"] > 0 for run in row["batches"].values())
