#!/usr/bin/env python
"""bench_cpu.py's worker for vLLM's CPU build (runs in .venv-vllm).

Same job file and JSON line as ``bench_cpu_ours.py``. The format is vLLM's ``dtype``
('float32' or 'bfloat16', the weights cast at load). vLLM computes on the cores
``VLLM_CPU_OMP_THREADS_BIND`` names: the first ``threads`` cores this process may run on.
Prefix caching is off (every run repeats the same prompts); ``max_num_seqs`` and
``max_num_batched_tokens`` take the largest batch's prompts in one step, as ours does.
Prompts are token ids (``skip_tokenizer_init``), greedy, ``ignore_eos``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from bench_repeats import median_of_repeats


def cpu_list(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def main() -> None:
    with open(sys.argv[1]) as file:
        job = json.load(file)
    cpus = sorted(os.sched_getaffinity(0))[: job["threads"]]
    # Read when vLLM starts its engine: set before the import.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cpus)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the runs need < 0.1
    import vllm
    from vllm import LLM, SamplingParams

    runs = job["runs"]
    max_batch = max(len(r["prompts"]) for r in runs)
    longest = max(len(p) + r["new_tokens"] for r in runs for p in r["prompts"])
    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["format"],
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_num_seqs=max_batch,
        max_model_len=longest,
        max_num_batched_tokens=max(max_batch * longest, 2048),
        seed=0,
    )
    report = {
        "engine": "vllm",
        "version": f"vllm {vllm.__version__}",
        "format": job["format"],
        "threads": job["threads"],
        "bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "load_s": time.perf_counter() - start,
        "rows": [],
        "skipped": None,
    }

    def generate(prompts, new_tokens):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=new_tokens,
            min_tokens=new_tokens,
            ignore_eos=True,
            detokenize=False,
        )
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}

    for run in runs:
        generate(run["prompts"], job["warmup_tokens"])  # warm-up
        result = median_of_repeats(
            lambda: generate(run["prompts"], run["new_tokens"]), job.get("repeats", 1)
        )
        report["rows"].append({"B": len(run["prompts"]), "new_tokens": run["new_tokens"], **result})
        print(
            f"  vllm {job['format']} B={len(run['prompts'])}: {result['seconds']:.1f} s",
            file=sys.stderr,
        )
    print(json.dumps(report), flush=True)
    # vLLM's engine process can keep the interpreter alive past main: leave at once.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
