"""Runs lm-evaluation-harness against ``python -m paddle_step.serve`` on the shipped model:
the tiny local tasks in evals/pydoc_tiny (loglikelihood and generate_until, from JSONL
files in the repository), through lm-eval's ``local-completions`` model, which sends
``logprobs`` + ``echo`` for every loglikelihood request. Prints lm-eval's score table.

    .venv/bin/python evals/run_lm_eval.py --lm-eval .venv-eval/bin/lm_eval

lm-eval lives in its own virtual environment (``make eval`` creates it); this script runs
in the project's, which starts and stops the server.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from paddle_step.engine.arg_utils import DEFAULT_MODEL
from paddle_step.testing.server_process import server_process

REPO = Path(__file__).resolve().parents[1]
TASKS = "pydoc_tiny_choice,pydoc_tiny_generate"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", required=True, help="the lm_eval executable")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for lm-eval")
    args = parser.parse_args()
    # No network: the tasks read local files, the tokenizer is the shipped model's.
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}  # fmt: skip
    with server_process(["--seed", "0"]) as url:
        model_args = ",".join([
            "model=pydoc-tiny",
            f"base_url={url}/v1/completions",
            f"tokenizer={DEFAULT_MODEL}",
            "tokenizer_backend=huggingface",
            "num_concurrent=4",
            "max_retries=1",
        ])  # fmt: skip
        command = [
            args.lm_eval,
            "--model", "local-completions",
            "--model_args", model_args,
            "--tasks", TASKS,
            "--include_path", str(REPO / "evals" / "pydoc_tiny"),
            "--batch_size", "1",
        ]  # fmt: skip
        completed = subprocess.run(command, cwd=REPO, env=env, timeout=args.timeout)
    sys.exit(completed.returncode)


if __name__ == "__main__":
    main()
