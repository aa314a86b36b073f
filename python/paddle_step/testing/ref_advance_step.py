"""Plain NumPy reference of ``advance_step`` (docs/SPEC.md), one row at a time."""

import numpy as np


# The op's argument list, packed as in paddle_step.ops.
# fmt: off
def ref_advance_step(input_tokens, sampled_token_ids, input_positions, seq_lens, slot_mapping,
                     block_tables, num_seqs, num_queries, block_size, active=None):
    # fmt: on
    """Returns new (input_tokens, input_positions, seq_lens, slot_mapping)."""
    input_tokens = np.array(input_tokens, copy=True)
    input_positions = np.array(input_positions, copy=True)
    seq_lens = np.array(seq_lens, copy=True)
    slot_mapping = np.array(slot_mapping, copy=True)
    sampled = np.asarray(sampled_token_ids).reshape(-1)
    blocks_per_seq = block_tables.shape[1]
    for row in range(num_seqs):
        is_query = row < num_queries and (active is None or bool(active[row]))
        if not is_query:  # padding row
            input_tokens[row] = 0
            input_positions[row] = 0
            slot_mapping[row] = -1
            continue
        position = int(seq_lens[row])
        input_tokens[row] = sampled[row]
        input_positions[row] = position
        seq_lens[row] = position + 1
        slot = -1
        if position >= 0 and position // block_size < blocks_per_seq:
            block_id = int(block_tables[row, position // block_size])
            if block_id >= 0:
                slot = block_id * block_size + position % block_size
        slot_mapping[row] = slot
    return input_tokens, input_positions, seq_lens, slot_mapping
