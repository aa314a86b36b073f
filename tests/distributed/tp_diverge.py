"""Test helper (not a test): examples/generate.py with a planted divergence between ranks.

Run under ``paddle.distributed.launch`` with generate.py's flags (``--tp 2 --check-ranks``).
After step ``DIVERGE_AFTER_STEP``, rank 1 bumps the first entry of its ``free_list`` before
the rank check runs, as a scheduling bug on one rank would; test_tensor_parallel expects
``--check-ranks`` to stop the run naming ``free_list``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import paddle

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import generate  # noqa: E402

DIVERGE_AFTER_STEP = 3
build_engine = generate.build_engine


def build_engine_with_divergence(args, loaded):
    engine, loaded = build_engine(args, loaded)
    check_ranks = engine.after_step

    def diverge_then_check(engine) -> None:
        if loaded.tensor_parallel.rank == 1 and engine.stats.steps == DIVERGE_AFTER_STEP:
            free_list = engine.state.free_list
            altered = free_list.numpy()
            altered[0] += 1
            paddle.assign(paddle.to_tensor(altered.astype(np.int32)), output=free_list)
        check_ranks(engine)

    engine.after_step = diverge_then_check
    return engine, loaded


generate.build_engine = build_engine_with_divergence

if __name__ == "__main__":
    generate.main()
