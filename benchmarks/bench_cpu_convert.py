#!/usr/bin/env python
"""Run llama.cpp's ``convert_hf_to_gguf.py`` (from the llama-cpp-python sdist) on a
checkpoint of ``make_random_llama.py``, accepting its unknown BPE pre-tokenizer.

The converter identifies a BPE tokenizer's pre-tokenizer (how text is split before BPE)
by hashing the ids of a test string, and refuses a hash it does not list. The random
checkpoints carry a plain byte-level BPE of our own, so the hash is unknown. The benchmark
feeds token ids, never text, so the pre-tokenizer is never used: when the hash is unknown,
this wrapper records llama.cpp's 'default' pre-tokenizer and converts everything else
(weights, vocabulary padded to the embedding's rows, special tokens) with the converter's
own code, unchanged.

Needs torch, transformers and numpy (run it with .venv-vllm's interpreter).

Usage: bench_cpu_convert.py LLAMA_CPP_DIR CHECKPOINT_DIR OUT.gguf OUTTYPE(f32|bf16|q8_0)
"""

from __future__ import annotations

import logging
import runpy
import sys
from pathlib import Path


def main() -> None:
    llama_cpp_dir, checkpoint, out_file, outtype = sys.argv[1:5]
    converter = Path(llama_cpp_dir) / "convert_hf_to_gguf.py"
    sys.path[:0] = [str(converter.parent), str(converter.parent / "gguf-py")]
    import conversion.base as base

    recognized = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return recognized(self, tokenizer)
        except NotImplementedError:
            logging.getLogger(__name__).warning(
                "bench_cpu_convert: unknown BPE pre-tokenizer written as 'default' "
                "(the benchmark's prompts are token ids)"
            )
            return "default"

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = [str(converter), checkpoint, "--outfile", out_file, "--outtype", outtype]
    runpy.run_path(str(converter), run_name="__main__")


if __name__ == "__main__":
    main()
