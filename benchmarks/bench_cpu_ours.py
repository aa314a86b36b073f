#!/usr/bin/env python
"""bench_cpu.py's worker for paddle_step (runs in the project's .venv).

Reads the job (``bench_cpu.py`` writes it: checkpoint, weight format, threads, timed
repeats, and per batch size the prompts' token ids and the number of new tokens) from the
JSON file named by the only argument, and prints one JSON line: per batch size the median
wall time of the repeats of a greedy generation of every prompt at once (prefill included)
and the generated ids.
A weight format that ``load_checkpoint`` does not offer yet is reported as skipped, with
the reason, instead of falling back to another format.
"""

from __future__ import annotations

import inspect
import json
import sys
import time

import zlib  # noqa: F401  isort: skip  (loaded before paddle, see tests/conftest.py)

import paddle  # noqa: E402
from bench_common import whole_batch_config  # noqa: E402
from bench_repeats import median_of_repeats  # noqa: E402

from paddle_step.engine.llm_engine import Engine  # noqa: E402
from paddle_step.errors import CheckpointError  # noqa: E402
from paddle_step.model_loader.loader import load_checkpoint  # noqa: E402
from paddle_step.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
# Weight formats this worker knows, as load_checkpoint's keyword arguments.
FORMATS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
}


def load(path: str, fmt: str):
    """The model in format ``fmt``, or a string saying why this build cannot give it."""
    if fmt not in FORMATS:
        return f"unknown format {fmt!r}, expected one of {list(FORMATS)}"
    kwargs = FORMATS[fmt]
    missing = set(kwargs) - set(inspect.signature(load_checkpoint).parameters)
    if missing:
        return f"load_checkpoint has no argument {sorted(missing)} yet"
    try:
        return load_checkpoint(path, **kwargs).model
    except (CheckpointError, ValueError, TypeError, NotImplementedError) as error:
        return f"load_checkpoint({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}): {error}"


def engine_for(model, prompts: list, new_tokens: int, threads: int) -> Engine:
    """An engine for one batch size, kept for its warm-up and timed generations as vLLM's
    worker keeps its LLM: every prompt in its own slot, all admitted in the first step (the
    KV cache has room for the whole batch in both block regions), and prefix caching off,
    as for vLLM, so a repeat of the same prompts computes them again."""
    config = whole_batch_config(
        len(prompts),
        max(map(len, prompts)) + new_tokens,
        BLOCK_SIZE,
        decoder_pool_ratio=0.5,
        threads=threads,
        enable_prefix_caching=False,
    )
    return Engine(model, config)


def generate(engine: Engine, prompts: list, new_tokens: int) -> dict:
    """A greedy generation of every prompt at once, timed from the first request added."""
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, eos_token_id=[]))
    results = {}
    while engine.has_unfinished():
        results.update((r.request_id, r.token_ids) for r in engine.step())
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "token_ids": [list(results[i]) for i in sorted(results)]}


def main() -> None:
    with open(sys.argv[1]) as file:
        job = json.load(file)
    paddle.set_device("cpu")
    report = {
        "engine": "paddle_step",
        "version": f"paddle {paddle.__version__}",
        "format": job["format"],
        "threads": job["threads"],
        "rows": [],
        "skipped": None,
    }
    start = time.perf_counter()
    model = load(job["model"], job["format"])
    report["load_s"] = time.perf_counter() - start
    if isinstance(model, str):
        report["skipped"] = model
    else:
        for run in job["runs"]:
            engine = engine_for(model, run["prompts"], run["new_tokens"], job["threads"])
            generate(engine, run["prompts"], job["warmup_tokens"])  # warm-up
            result = median_of_repeats(
                lambda: generate(engine, run["prompts"], run["new_tokens"]),
                job.get("repeats", 1),
            )
            report["rows"].append(
                {"B": len(run["prompts"]), "new_tokens": run["new_tokens"], **result}
            )
            print(
                f"  paddle_step {job['format']} B={len(run['prompts'])}: {result['seconds']:.1f} s",
                file=sys.stderr,
            )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
