"""Invalid calls of both ops, for test_fuzz_ops.py (run in a child interpreter, so that a
crash is seen as one): each mutates one argument of a valid call (dtype, rank, shape or
scalar). Prints a JSON list of [op, argument, error message or "no error"].

    python tests/ops/fuzz_invalid_calls.py SEED
"""

import json
import sys

import numpy as np
import paddle

import paddle_step
from paddle_step.spec.tensor_table import STEP_PADDLE_DTYPES, STEP_PADDLE_TENSORS
from paddle_step.testing.fake_decode_loop import make_state

rng = np.random.default_rng(int(sys.argv[1]))
outcomes = []
DTYPES = ["bool", "int8", "int16", "int32", "int64", "float32", "float64"]


def mutate(array, accepted_dtypes, first_dim_fixed=True):
    # Always invalid: a dtype the argument does not accept, one more
    # dimension, or (where it is fixed) another first dimension.
    kind = rng.integers(0, 3 if first_dim_fixed else 2)
    if kind == 0:
        return array.astype(rng.choice([d for d in DTYPES if d not in accepted_dtypes]))
    if kind == 1:
        return np.zeros(array.shape + (2,), array.dtype)
    return np.zeros((array.shape[0] + int(rng.integers(1, 3)),) + array.shape[1:], array.dtype)


for _ in range(40):
    state = make_state(3, 4, 16, free_list=[9, 8, 7])
    name = STEP_PADDLE_TENSORS[rng.integers(0, len(STEP_PADDLE_TENSORS))]
    block_size = 4
    if rng.random() < 0.15:
        name, block_size = "block_size", int(rng.integers(-3, 1))
    else:
        state[name] = mutate(
            state[name], [STEP_PADDLE_DTYPES[name].name], first_dim_fixed=name != "free_list"
        )
    tensors = [paddle.to_tensor(state[key]) for key in STEP_PADDLE_TENSORS]
    try:
        paddle_step.step_paddle(*tensors, block_size, 0)
        outcomes.append(["step_paddle", name, "no error"])
    except ValueError as error:
        outcomes.append(["step_paddle", name, str(error)])

ADVANCE = {
    "input_tokens": ["int64"],
    "sampled_token_ids": ["int64"],
    "input_positions": ["int64"],
    "seq_lens": ["int32", "int64"],
    "slot_mapping": ["int64"],
    "block_tables": ["int32", "int64"],
}
for _ in range(40):
    arrays = {
        "input_tokens": np.zeros(4, np.int64),
        "sampled_token_ids": np.zeros((3, 1), np.int64),
        "input_positions": np.zeros(4, np.int64),
        "seq_lens": np.zeros(4, np.int32),
        "slot_mapping": np.zeros(4, np.int64),
        "block_tables": np.zeros((4, 2), np.int32),
    }
    scalars = {"num_seqs": 4, "num_queries": 3, "block_size": 16}
    if rng.random() < 0.3:
        name = str(rng.choice(list(scalars)))
        wrong = {
            "num_seqs": [-1, 0, 2, 3, 5],
            "num_queries": [-1, 0, 1, 2, 4, 5],
            "block_size": [-2, -1, 0],
        }[name]
        scalars[name] = int(rng.choice(wrong))
    else:
        name = str(rng.choice(list(ADVANCE)))
        arrays[name] = mutate(arrays[name], ADVANCE[name])
    try:
        paddle_step.advance_step(
            *(paddle.to_tensor(arrays[key]) for key in ADVANCE), *scalars.values()
        )
        outcomes.append(["advance_step", name, "no error"])
    except ValueError as error:
        outcomes.append(["advance_step", name, str(error)])
print(json.dumps(outcomes))
