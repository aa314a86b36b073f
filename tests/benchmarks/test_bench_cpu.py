"""benchmarks/bench_cpu.py: its bookkeeping, and a --quick run of our engine alone (the
anchors' virtual environments are not needed: their rows say they were skipped)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors import deserialize

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


BENCH = load_script("bench_cpu")


def test_weight_elements_per_step_counts_the_checkpoints_matrices(tmp_path):
    for shape in ("h512",):
        path = BENCH.write_checkpoint(str(tmp_path / shape), shape=shape)
        tensors = deserialize((Path(path) / "model.safetensors").read_bytes())
        read = sum(
            int(np.prod(info["shape"]))
            for name, info in tensors
            if name.endswith("proj.weight") or name == "lm_head.weight"
        )
        assert BENCH.weight_elements_per_step(BENCH.SHAPES[shape]) == read
    # Tied: the LM head is the embedding.
    qwen = BENCH.SHAPES["qwen2.5-0.5b"]
    untied = dict(qwen, tie_word_embeddings=False)
    assert BENCH.weight_elements_per_step(qwen) == BENCH.weight_elements_per_step(untied)
    # Qwen2.5-0.5B has 494,032,768 parameters: these, its norms and its q/k/v biases.
    norms = 24 * 2 * 896 + 896
    biases = 24 * (896 + 128 + 128)
    assert BENCH.weight_elements_per_step(qwen) == 494_032_768 - norms - biases


def test_prompts_are_deterministic_ids_outside_the_special_ones():
    a = BENCH.prompts_for("qwen2.5-0.5b", 8)
    assert a == BENCH.prompts_for("qwen2.5-0.5b", 8)
    assert np.array(a).shape == (8, BENCH.PROMPT_LEN)
    assert 2 <= np.min(a) and np.max(a) < 151936
    assert BENCH.prompts_for("qwen2.5-0.5b", 1)[0] != a[0]  # each B its own draw


def test_ids_against_vllm_counts_equal_rows_and_the_first_divergence():
    table = {
        ("h512", "vllm", "float32", 1, 3): {"token_ids": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]},
        ("h512", "paddle_step", "float32", 1, 3): {"token_ids": [[1, 2, 3], [4, 0, 6], [7, 8, 0]]},
        ("h512", "llama.cpp", "f32", 1, 3): {"token_ids": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]},
    }
    ours = BENCH.ids_against_vllm(table, "h512", "paddle_step", "float32", 1, 3)
    assert ours == {"equal": 1, "rows": 3, "first_divergence": 1}
    theirs = BENCH.ids_against_vllm(table, "h512", "llama.cpp", "f32", 1, 3)
    assert theirs == {"equal": 3, "rows": 3, "first_divergence": None}
    # No vLLM row of that dtype (int8 has none): nothing to compare.
    assert BENCH.ids_against_vllm(table, "h512", "paddle_step", "int8", 1, 3) is None


def test_quick_run_of_our_engine(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    missing = str(tmp_path / "no-such-venv" / "python")
    completed = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_cpu.py"),
            "--quick",
            "--json",
            "--formats",
            "float32,f32",
            "--work-dir",
            str(tmp_path / "work"),
            "--vllm-python",
            missing,
            "--llamacpp-python",
            missing,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["read_bandwidth_gbs"]["1"] > 0
    by_engine = {r["engine"]: r for r in report["results"]}
    assert set(by_engine) == {"paddle_step", "vllm", "llama.cpp"}
    for anchor in ("vllm", "llama.cpp"):
        assert "no interpreter" in by_engine[anchor]["skipped"]
    ours = by_engine["paddle_step"]
    assert ours["skipped"] is None
    assert [row["B"] for row in ours["rows"]] == [1, 2]
    for row in ours["rows"]:
        ids = np.array(row["token_ids"])
        assert ids.shape == (row["B"], 4)
        assert ids.min() >= 0 and ids.max() < BENCH.SHAPES["h512"]["vocab_size"]
        assert row["tokens_per_s"] > 0
    assert [ln["B"] for ln in report["table"]] == [1, 2]
    assert json.loads((tmp_path / "work" / "bench_cpu.json").read_text())["results"]


def test_a_row_is_the_median_of_its_timed_generations():
    repeats = load_script("bench_repeats")
    runs = iter([{"seconds": 3.0, "token_ids": [[1]]}, {"seconds": 1.0, "token_ids": [[2]]},
                 {"seconds": 2.0, "token_ids": [[3]]}])  # fmt: skip
    row = repeats.median_of_repeats(lambda: next(runs), 3)
    assert row == {"seconds": 2.0, "seconds_each": [3.0, 1.0, 2.0], "token_ids": [[1]]}
    once = repeats.median_of_repeats(lambda: {"seconds": 5.0, "token_ids": []}, 0)
    assert once["seconds_each"] == [5.0]


def test_a_precision_selects_every_engines_name_for_it():
    """--formats float32 left llama.cpp (whose name for it is f32) out without a word."""
    assert BENCH.parse_args(["--formats", "float32"]).formats == {"float32", "f32"}
    assert BENCH.parse_args(["--formats", "bf16,int8"]).formats == {"bfloat16", "bf16", "int8"}
    assert BENCH.parse_args(["--formats", "q8_0"]).formats == {"q8_0"}
