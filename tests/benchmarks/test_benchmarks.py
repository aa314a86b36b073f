"""Smoke tests: the benchmark scripts run (``--quick --json``) and report sane numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_bench_weight_formats_quick_json():
    # Three fresh processes, one per format: a longer bound than one script's.
    report = run_json("bench_weight_formats.py", timeout=600)
    assert [row["format"] for row in report["results"]] == ["float32", "bfloat16", "int8"]
    weights = {row["format"]: row["weight_mb"] for row in report["results"]}
    # The tiny shape's packed formats keep 2 and about 1 byte per weight, float32 more.
    assert weights["int8"] < weights["bfloat16"] < weights["float32"]
    for row in report["results"]:
        assert row["rss_after_load_mb"] >= row["rss_before_load_mb"] > 0
        assert set(row["batches"]) == {"1", "2"}
        assert all(run["tokens_per_s"] > 0 for run in row["batches"].values())
