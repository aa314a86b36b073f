"""Smoke tests: the benchmark scripts run (``--quick --json``) and report sane numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_json(script: str, *extra: str) -> dict:
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
        timeout=120,
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
    assert {t["target"].split(":")[0] for t in report["targets"]}  # B=256 is in --quick
    for target in report["targets"]:
        assert isinstance(target["met"], bool)
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
