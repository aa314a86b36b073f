#!/usr/bin/env python
"""bench_cpu.py's worker for llama.cpp, through llama-cpp-python's C API bindings (runs in
.venv-llamacpp).

Same job file and JSON line as ``bench_cpu_ours.py``; the job's ``model`` is a GGUF file.
llama-cpp-python's ``Llama`` class decodes one sequence at a time, so batches go through
the C API as llama.cpp's own batched examples do: one context per batch size with a
sequence per prompt (``n_seq_max`` = B) and room for all of them, the B prompts decoded in
one ``llama_decode`` (``n_batch`` holds them all), then one ``llama_decode`` of B tokens per
step; greedy = the argmax of each row's logits, in NumPy. ``n_threads`` and
``n_threads_batch`` are the job's threads. The KV cache is float32 for the f32 GGUF (the
precision of the float32 rows of ours and vLLM's) and llama.cpp's default (f16) otherwise.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import llama_cpp as lib
import numpy as np
from bench_repeats import median_of_repeats

GGML_TYPE_F32 = 0


class BatchedGreedy:
    """A llama.cpp context for ``batch`` sequences of up to ``max_len`` tokens."""

    def __init__(
        self,
        model,
        vocab_size: int,
        batch: int,
        max_len: int,
        prompt_len: int,
        threads: int,
        f32_cache: bool,
    ) -> None:
        params = lib.llama_context_default_params()
        params.n_ctx = batch * max_len
        params.n_batch = batch * prompt_len
        params.n_ubatch = batch * prompt_len
        params.n_seq_max = batch
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        if f32_cache:
            params.type_k = params.type_v = GGML_TYPE_F32
        self.ctx = lib.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed for B={batch}, n_ctx={params.n_ctx}")
        self.vocab_size = vocab_size
        self.llama_batch = lib.llama_batch_init(batch * prompt_len, 0, 1)

    def close(self) -> None:
        lib.llama_batch_free(self.llama_batch)
        lib.llama_free(self.ctx)

    def _decode(
        self, tokens: list[int], positions: list[int], seqs: list[int], outputs: list[bool]
    ) -> None:
        batch = self.llama_batch
        for i, (token, pos, seq, out) in enumerate(zip(tokens, positions, seqs, outputs)):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = out
        batch.n_tokens = len(tokens)
        status = lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} for {len(tokens)} tokens")

    def _argmax(self, index: int) -> int:
        pointer = lib.llama_get_logits_ith(self.ctx, index)
        logits = np.ctypeslib.as_array(
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), (self.vocab_size,)
        )
        return int(logits.argmax())

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        tokens, positions, seqs, outputs, last = [], [], [], [], []
        for seq, prompt in enumerate(prompts):
            tokens += prompt
            positions += range(len(prompt))
            seqs += [seq] * len(prompt)
            outputs += [False] * (len(prompt) - 1) + [True]
            last.append(len(tokens) - 1)
        self._decode(tokens, positions, seqs, outputs)
        generated = [[self._argmax(i)] for i in last]
        lengths = [len(p) for p in prompts]
        for step in range(1, new_tokens):
            rows = range(len(prompts))
            self._decode(
                [g[-1] for g in generated],
                [lengths[s] + step - 1 for s in rows],
                list(rows),
                [True] * len(prompts),
            )
            for s in rows:
                generated[s].append(self._argmax(s))
        return generated


def main() -> None:
    with open(sys.argv[1]) as file:
        job = json.load(file)
    lib.llama_backend_init()
    start = time.perf_counter()
    model_params = lib.llama_model_default_params()
    model = lib.llama_model_load_from_file(job["model"].encode(), model_params)
    if not model:
        raise RuntimeError(f"llama_model_load_from_file failed for {job['model']}")
    vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    report = {
        "engine": "llama.cpp",
        "version": f"llama-cpp-python {lib.__version__}",
        "format": job["format"],
        "threads": job["threads"],
        "load_s": time.perf_counter() - start,
        "system_info": lib.llama_print_system_info().decode(errors="replace"),
        "rows": [],
        "skipped": None,
    }
    for run in job["runs"]:
        prompts = run["prompts"]
        max_len = max(map(len, prompts)) + run["new_tokens"]
        runner = BatchedGreedy(
            model,
            vocab_size,
            len(prompts),
            max_len,
            max(map(len, prompts)),
            job["threads"],
            f32_cache=job["format"] == "f32",
        )

        def timed() -> dict:
            start = time.perf_counter()
            token_ids = runner.generate(prompts, run["new_tokens"])
            return {"seconds": time.perf_counter() - start, "token_ids": token_ids}

        try:
            runner.generate(prompts, job["warmup_tokens"])  # warm-up
            result = median_of_repeats(timed, job.get("repeats", 1))
        finally:
            runner.close()
        report["rows"].append({"B": len(prompts), "new_tokens": run["new_tokens"], **result})
        print(
            f"  llama.cpp {job['format']} B={len(prompts)}: {result['seconds']:.1f} s",
            file=sys.stderr,
        )
    lib.llama_model_free(model)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
