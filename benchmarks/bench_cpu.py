#!/usr/bin/env python
"""CPU decode throughput of paddle_step beside vLLM's CPU build and llama.cpp, same
weights, same prompts, one run (``make bench-cpu``).

The shapes (``make_random_llama.py`` writes them with random weights, nothing is
downloaded): ``h512`` (hidden 512, 8 layers, 8/4 heads, intermediate 1408, vocab 2048;
B = 1, 8, 32; 64 new tokens) and ``qwen2.5-0.5b`` (Qwen2.5-0.5B's dimensions as a Llama:
hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab 151936, tied; B = 1, 8; 32 new
tokens). Every batch is B prompts of 64 random token ids, greedy, no eos; tokens/s =
B x new tokens / wall time of the whole generation, prefill included, the median of
``--repeats`` timed generations (3) after an untimed warm-up generation of the same
prompts. Each engine is given room for the whole batch.

Each (engine, weight format, threads) runs in its own process (a worker script in this
folder, in that engine's virtual environment), one thread and then every core this process
may run on:

- paddle_step (``bench_cpu_ours.py``, the project's .venv): float32; bfloat16 and int8
  when ``load_checkpoint`` offers them (else the row says why it was skipped);
- vLLM (``bench_cpu_vllm.py``, .venv-vllm): float32 and bfloat16 (``dtype``), prefix
  caching off, ``VLLM_CPU_OMP_THREADS_BIND`` = the cores used;
- llama.cpp (``bench_cpu_llamacpp.py``, .venv-llamacpp): GGUFs converted from the same
  checkpoint by the converter of the llama-cpp-python sdist (``bench_cpu_convert.py``
  says how its unknown-tokenizer check is handled): f32, bf16 and Q8_0.

The formats other than float32 run on the 0.5B shape. An engine whose interpreter is
missing is skipped with a note. Printed: the CPU, the machine's read bandwidth (a NumPy sum
over 512 MiB, 1 thread and all), tokens/s per engine and format, the ratios, the share of
the read bandwidth a B=1 step reaches (weight bytes x tokens/s), and how many rows' greedy
ids equal vLLM's (same dtype), with the first position where the others differ.

Usage: bench_cpu.py [--quick] [--json] [--shapes h512,qwen2.5-0.5b] [--engines ...]
                    [--formats ...] [--threads 1,2] [--repeats 3] [--work-dir .bench-cpu]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from bench_common import emit_report  # noqa: E402
from make_random_llama import SHAPES, write_checkpoint  # noqa: E402

PROMPT_LEN = 64
RUNS = {
    "h512": {"batches": (1, 8, 32), "new_tokens": 64},
    "qwen2.5-0.5b": {"batches": (1, 8), "new_tokens": 32},
}
WARMUP_TOKENS = 2
SEED = 0
# (engine, format): the float32 comparison on every shape, the other formats on FORMAT_SHAPES.
FLOAT32 = (("paddle_step", "float32"), ("vllm", "float32"), ("llama.cpp", "f32"))
OTHER_FORMATS = (
    ("paddle_step", "bfloat16"),
    ("paddle_step", "int8"),
    ("vllm", "bfloat16"),
    ("llama.cpp", "bf16"),
    ("llama.cpp", "q8_0"),
)
FORMAT_SHAPES = ("qwen2.5-0.5b",)
# One precision under each engine's name: --formats float32 runs llama.cpp's f32 too.
SAME_PRECISION = ({"float32", "f32"}, {"bfloat16", "bf16"})
WORKERS = {
    "paddle_step": "bench_cpu_ours.py",
    "vllm": "bench_cpu_vllm.py",
    "llama.cpp": "bench_cpu_llamacpp.py",
}
# Bytes a decode step reads per weight element, by format (Q8_0: 32 int8 + one f16 scale).
WEIGHT_BYTES = {"float32": 4, "f32": 4, "bfloat16": 2, "bf16": 2, "int8": 1, "q8_0": 34 / 32}
# The dtype of vLLM's row the ids of a format are compared with.
VLLM_REFERENCE = {
    "float32": "float32",
    "f32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
WORKER_TIMEOUT_S = 3600
LLAMA_CPP_SDIST = "llama_cpp_python-0.3.36"


def log(message: str) -> None:
    print(f"[bench-cpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the machine


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_flags() -> list[str]:
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return [f for f in wanted if f in flags]


def read_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """GB/s of a sum over ``mib`` MiB of float32 split across ``threads`` threads (NumPy
    releases the GIL in the reduction), best of ``repeats``."""
    data = np.ones(mib * 2**20 // 4, np.float32)
    parts = np.array_split(data, threads)
    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best / 1e9


def weight_elements_per_step(shape: dict) -> int:
    """Weight elements one decode step reads: every linear layer and the LM head (the
    embedding lookup reads B rows only)."""
    hidden, head_dim = shape["hidden_size"], shape["head_dim"]
    q = shape["num_attention_heads"] * head_dim
    kv = shape["num_key_value_heads"] * head_dim
    layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * shape["intermediate_size"]
    return shape["num_hidden_layers"] * layer + shape["vocab_size"] * hidden


# ---------------------------------------------------------------- models and jobs


def checkpoint(work: Path, shape: str) -> Path:
    path = work / "checkpoints" / f"{shape}-seed{SEED}"
    if not (path / "config.json").is_file():
        log(f"writing the random checkpoint {path}")
        write_checkpoint(str(path), shape=shape, seed=SEED)
    return path


def gguf(work: Path, shape: str, outtype: str, args) -> Path | str:
    """The GGUF of ``shape`` in ``outtype``, converted once; or why it cannot be."""
    out = work / "gguf" / f"{shape}-seed{SEED}-{outtype}.gguf"
    if out.is_file():
        return out
    converter_dir = Path(args.llama_cpp_dir)
    if not (converter_dir / "convert_hf_to_gguf.py").is_file():
        return f"no convert_hf_to_gguf.py under {converter_dir}"
    if not Path(args.vllm_python).is_file():
        return f"the converter needs torch: no {args.vllm_python}"
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"converting {shape} to {out.name}")
    partial = out.with_suffix(".partial")
    completed = subprocess.run(
        [
            args.vllm_python,
            str(HERE / "bench_cpu_convert.py"),
            str(converter_dir),
            str(checkpoint(work, shape)),
            str(partial),
            outtype,
        ],
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT_S,
    )
    if completed.returncode != 0:
        return f"convert_hf_to_gguf.py failed: {completed.stderr[-1500:]}"
    partial.rename(out)
    return out


def prompts_for(shape: str, batch: int) -> list[list[int]]:
    """B prompts of PROMPT_LEN random ids (not the special ids 0 and 1), the same for every
    engine; they depend only on the shape's vocabulary and B."""
    rng = np.random.default_rng([SEED, batch])
    return rng.integers(2, SHAPES[shape]["vocab_size"], (batch, PROMPT_LEN)).tolist()


def python_for(engine: str, args) -> str:
    return {
        "paddle_step": args.ours_python,
        "vllm": args.vllm_python,
        "llama.cpp": args.llamacpp_python,
    }[engine]


def run_in_own_group(command: list, env: dict, log_base: Path):
    """Runs ``command`` in a new process group with its output in files, waits for it,
    then ends what is left of the group: vLLM's engine processes can outlive the worker.
    Returns (exit status or None on timeout, stdout, stderr)."""
    out_path, err_path = Path(f"{log_base}.out"), Path(f"{log_base}.err")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        process = subprocess.Popen(
            command, stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(2)
        process.wait()
    return returncode, out_path.read_text(), err_path.read_text()


def run_worker(
    engine: str, fmt: str, threads: int, shape: str, batches, new_tokens: int, work: Path, args
) -> dict:
    base = {"engine": engine, "format": fmt, "threads": threads, "shape": shape, "rows": []}
    python = python_for(engine, args)
    if not Path(python).is_file():
        return {**base, "skipped": f"no interpreter {python} (make bench-cpu creates it)"}
    model = gguf(work, shape, fmt, args) if engine == "llama.cpp" else checkpoint(work, shape)
    if isinstance(model, str):
        return {**base, "skipped": model}
    job = {
        "model": str(model),
        "format": fmt,
        "threads": threads,
        "warmup_tokens": WARMUP_TOKENS,
        "repeats": args.repeats,
        "runs": [{"prompts": prompts_for(shape, b), "new_tokens": new_tokens} for b in batches],
    }
    job_file = work / "jobs" / f"{shape}-{engine}-{fmt}-t{threads}.json"
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(json.dumps(job))
    env = dict(os.environ)
    if engine == "paddle_step":
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")])
        )
    started = time.time()
    returncode, stdout, stderr = run_in_own_group(
        [python, str(HERE / WORKERS[engine]), str(job_file)], env, job_file.parent / job_file.stem
    )
    if returncode is None:
        return {**base, "skipped": f"worker timed out after {WORKER_TIMEOUT_S} s"}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if returncode != 0 or not lines:
        status = (
            f"ended by {signal.Signals(-returncode).name}"
            if returncode < 0
            else f"exit {returncode}"
        )
        # The status last: the printed table shows the last line.
        return {**base, "skipped": f"{stderr[-1500:]}\nworker failed ({status})"}
    report = json.loads(lines[-1])
    for row in report["rows"]:
        row["tokens_per_s"] = row["B"] * row["new_tokens"] / row["seconds"]
    log(
        f"{shape} {engine} {fmt} threads={threads}: "
        + (
            ", ".join(f"B={r['B']} {r['tokens_per_s']:.1f} tok/s" for r in report["rows"])
            or f"skipped: {report['skipped']}"
        )
        + f" ({time.time() - started:.0f} s)"
    )
    return {**base, **report, "shape": shape}


# ---------------------------------------------------------------- report


def index_rows(results: list) -> dict:
    """(shape, engine, format, threads, B) -> row."""
    table = {}
    for result in results:
        for row in result["rows"]:
            key = (result["shape"], result["engine"], result["format"], result["threads"], row["B"])
            table[key] = row
    return table


def ids_against_vllm(table: dict, shape, engine, fmt, threads, batch):
    """(rows equal, rows, first divergence over the differing rows) or None."""
    reference_fmt = VLLM_REFERENCE.get(fmt)
    mine = table.get((shape, engine, fmt, threads, batch))
    theirs = table.get((shape, "vllm", reference_fmt, threads, batch))
    if mine is None or theirs is None:
        return None
    equal, first = 0, None
    for a, b in zip(mine["token_ids"], theirs["token_ids"]):
        if a == b:
            equal += 1
            continue
        diverge = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first = diverge if first is None else min(first, diverge)
    return {"equal": equal, "rows": len(mine["token_ids"]), "first_divergence": first}


def summarize(results: list, bandwidth: dict, runs: dict, thread_counts) -> list:
    table = index_rows(results)
    lines = []
    for shape, run in runs.items():
        elements = weight_elements_per_step(SHAPES[shape])
        for batch in run["batches"]:
            for threads in thread_counts:
                line = {"shape": shape, "B": batch, "threads": threads, "engines": {}}
                for result in results:
                    if result["shape"] != shape or result["threads"] != threads:
                        continue
                    row = table.get((shape, result["engine"], result["format"], threads, batch))
                    if row is None:
                        continue
                    entry = {"tokens_per_s": row["tokens_per_s"]}
                    if batch == 1 and str(threads) in bandwidth:
                        read = elements * WEIGHT_BYTES[result["format"]] * row["tokens_per_s"]
                        entry["bandwidth_share"] = read / 1e9 / bandwidth[str(threads)]
                    if result["engine"] != "vllm":
                        entry["ids_vs_vllm"] = ids_against_vllm(
                            table, shape, result["engine"], result["format"], threads, batch
                        )
                    line["engines"][f"{result['engine']} {result['format']}"] = entry
                if line["engines"]:
                    lines.append(line)
    return lines


def ratio(lines_entry: dict, a: str, b: str) -> str:
    if a not in lines_entry or b not in lines_entry:
        return "-"
    return f"{lines_entry[a]['tokens_per_s'] / lines_entry[b]['tokens_per_s']:.2f}x"


def ids_text(entry: dict | None) -> str:
    ids = entry and entry.get("ids_vs_vllm")
    if not ids:
        return "-"
    text = f"{ids['equal']}/{ids['rows']}"
    return text + (
        f" (from {ids['first_divergence']})" if ids["first_divergence"] is not None else ""
    )


def print_report(report: dict) -> None:
    machine = report["machine"]
    print(
        f"CPU: {machine['cpu_model']}, {machine['cores']} cores this process may use, "
        f"flags {' '.join(machine['flags'])}; load average {machine['loadavg_start']} at "
        f"start, {machine['loadavg_end']} at end (shared machine: figures move between "
        "runs, compare engines within one run)"
    )
    print(
        "Read bandwidth (NumPy sum over 512 MiB): "
        + ", ".join(
            f"{t} thread(s) {gbs:.1f} GB/s" for t, gbs in report["read_bandwidth_gbs"].items()
        )
    )
    print(
        f"Prompts of {PROMPT_LEN} token ids, greedy, tokens/s = B x new tokens / wall time "
        f"(prefill included; median of {report['config'].get('repeats', 1)} generations). "
        "ids = vLLM: rows whose greedy ids equal vLLM's of the same "
        "dtype (first differing position)."
    )
    for name, engines in (("float32", FLOAT32), ("other weight formats", OTHER_FORMATS)):
        keys = [f"{e} {f}" for e, f in engines]
        lines = [ln for ln in report["table"] if any(k in ln["engines"] for k in keys)]
        if not lines:
            continue
        print(f"\n{name}:")
        head = ["shape", "B", "thr", *keys]
        if name == "float32":
            head += [
                "ours/vLLM",
                "ours/llama.cpp",
                "B=1 ours %BW",
                "B=1 llama %BW",
                "ids=vLLM ours",
                "ids=vLLM llama",
            ]
        else:
            head += [
                "bf16 ours/llama",
                "bf16 ours/vLLM",
                "int8 ours/Q8_0",
                "ids=vLLM ours bf16",
                "ids=vLLM llama bf16",
            ]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for ln in lines:
            e = ln["engines"]
            cells = [ln["shape"], str(ln["B"]), str(ln["threads"])]
            cells += [f"{e[k]['tokens_per_s']:.1f}" if k in e else "-" for k in keys]
            if name == "float32":
                cells += [
                    ratio(e, "paddle_step float32", "vllm float32"),
                    ratio(e, "paddle_step float32", "llama.cpp f32"),
                    *(
                        f"{100 * e[k]['bandwidth_share']:.0f}%"
                        if "bandwidth_share" in e.get(k, {})
                        else "-"
                        for k in ("paddle_step float32", "llama.cpp f32")
                    ),
                    ids_text(e.get("paddle_step float32")),
                    ids_text(e.get("llama.cpp f32")),
                ]
            else:
                cells += [
                    ratio(e, "paddle_step bfloat16", "llama.cpp bf16"),
                    ratio(e, "paddle_step bfloat16", "vllm bfloat16"),
                    ratio(e, "paddle_step int8", "llama.cpp q8_0"),
                    ids_text(e.get("paddle_step bfloat16")),
                    ids_text(e.get("llama.cpp bf16")),
                ]
            print("| " + " | ".join(cells) + " |")
    skipped = [r for r in report["results"] if r.get("skipped")]
    if skipped:
        print("\nskipped:")
        for r in skipped:
            print(
                f"  {r['shape']} {r['engine']} {r['format']} threads={r['threads']}: "
                f"{r['skipped'].strip().splitlines()[-1][:300]}"
            )
    if report.get("runs_merged", 1) > 1:
        print(
            f"\n(rows of {report['runs_merged']} runs, one after the other; machine figures of "
            "the first)"
        )
    versions = sorted({r["version"] for r in report["results"] if r.get("version")})
    print("\nversions: " + "; ".join(versions))


def merge_reports(reports: list) -> dict:
    """One report of the rows of several runs (the machine and bandwidth of the first)."""
    merged = dict(reports[0])
    merged["results"] = [r for report in reports for r in report["results"]]
    runs, threads = {}, set()
    for report in reports:
        runs.update(report["config"]["runs"])
        threads.update(report["config"]["threads"])
    merged["config"] = {**merged["config"], "runs": runs, "threads": sorted(threads)}
    merged["runs_merged"] = len(reports)
    merged["table"] = summarize(
        merged["results"], merged["read_bandwidth_gbs"], runs, sorted(threads)
    )
    return merged


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: h512 in every format, B 1 and 2, 4 new tokens, one thread",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--shapes", default=",".join(RUNS))
    parser.add_argument("--engines", default=",".join(WORKERS))
    parser.add_argument(
        "--formats",
        default="all",
        help="comma-separated formats, or 'all' (float32 and the others); a precision "
        "selects every engine's name for it (float32 = llama.cpp's f32, bfloat16 = bf16)",
    )
    parser.add_argument(
        "--from-json",
        help="print the tables of earlier runs' JSON reports (comma-separated: "
        "their rows together, the machine figures of the first)",
    )
    parser.add_argument("--threads", help="comma-separated thread counts (default: 1 and all)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed generations per row, the median counts (default 3; --quick: 1)",
    )
    parser.add_argument(
        "--work-dir",
        default=str(ROOT / ".bench-cpu"),
        help="checkpoints, GGUFs, job files and the JSON report",
    )
    parser.add_argument("--ours-python", default=sys.executable)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument(
        "--llamacpp-python", default=str(ROOT / ".venv-llamacpp" / "bin" / "python")
    )
    parser.add_argument(
        "--llama-cpp-dir",
        default=str(ROOT / ".bench-cpu" / "sdist" / LLAMA_CPP_SDIST / "vendor" / "llama.cpp"),
        help="the llama.cpp tree of the llama-cpp-python sdist (its converter)",
    )
    args = parser.parse_args(argv)
    args.shapes = tuple(args.shapes.split(","))
    unknown = set(args.shapes) - set(RUNS)
    if unknown:
        parser.error(f"--shapes: unknown {sorted(unknown)}, expected some of {list(RUNS)}")
    args.engines = tuple(args.engines.split(","))
    unknown = set(args.engines) - set(WORKERS)
    if unknown:
        parser.error(f"--engines: unknown {sorted(unknown)}, expected some of {list(WORKERS)}")
    known_formats = {f for _, f in FLOAT32 + OTHER_FORMATS}
    args.formats = known_formats if args.formats == "all" else set(args.formats.split(","))
    if args.formats - known_formats:
        parser.error(
            f"--formats: unknown {sorted(args.formats - known_formats)}, "
            f"expected some of {sorted(known_formats)}"
        )
    for names in SAME_PRECISION:
        if args.formats & names:
            args.formats |= names
    cores = len(os.sched_getaffinity(0))
    if args.threads:
        args.threads = tuple(int(t) for t in args.threads.split(","))
    else:
        args.threads = (1,) if args.quick else tuple(sorted({1, cores}))
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        parser.error(f"--repeats: expected >= 1, got {args.repeats}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.from_json:
        report = merge_reports([json.loads(Path(p).read_text()) for p in args.from_json.split(",")])
        print(json.dumps(report)) if args.json else print_report(report)
        return report
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs = {s: dict(RUNS[s]) for s in args.shapes}
    if args.quick:
        runs = {"h512": {"batches": (1, 2), "new_tokens": 4}}
    machine = {
        "cpu_model": cpu_model(),
        "flags": cpu_flags(),
        "cores": len(os.sched_getaffinity(0)),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
    }
    bandwidth = {str(t): read_bandwidth(t) for t in args.threads}
    log("read bandwidth: " + ", ".join(f"{t} thr {v:.1f} GB/s" for t, v in bandwidth.items()))
    report = {
        "benchmark": "bench_cpu",
        "machine": machine,
        "read_bandwidth_gbs": bandwidth,
        "config": {
            "prompt_len": PROMPT_LEN,
            "runs": runs,
            "threads": list(args.threads),
            "warmup_tokens": WARMUP_TOKENS,
            "repeats": args.repeats,
            "seed": SEED,
        },
        "results": [],
    }

    def save():
        # After every worker: a run cut short still leaves its rows (--from-json prints them).
        machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        report["table"] = summarize(report["results"], bandwidth, runs, args.threads)
        report["elapsed_s"] = round(time.time() - started, 1)
        (work / "bench_cpu.json").write_text(json.dumps(report))

    for shape, run in runs.items():
        pairs = FLOAT32 + (OTHER_FORMATS if shape in FORMAT_SHAPES or args.quick else ())
        pairs = [(e, f) for e, f in pairs if e in args.engines and f in args.formats]
        for threads in args.threads:
            for engine, fmt in pairs:
                report["results"].append(
                    run_worker(
                        engine, fmt, threads, shape, run["batches"], run["new_tokens"], work, args
                    )
                )
                save()
    return emit_report(report, args.json, print_report)


if __name__ == "__main__":
    main()
