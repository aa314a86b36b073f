// advance_step on raw pointers: no Paddle types, so the CPU op, the CUDA op
// and the Paddle-free GPU test harness all run this exact code.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace paddle_step {

template <typename SeqLenT, typename BlockT>
struct AdvanceStepParams {
  int64_t* input_tokens;             // [num_seqs], written
  const int64_t* sampled_token_ids;  // [num_queries] (or [num_queries, 1])
  int64_t* input_positions;          // [num_seqs], written
  SeqLenT* seq_lens;                 // [num_seqs], incremented for queries
  int64_t* slot_mapping;             // [num_seqs], written
  const BlockT* block_tables;        // [num_seqs, blocks_per_seq]
  const bool* active;                // [num_seqs] or nullptr (all active)
  int64_t num_seqs;
  int64_t num_queries;
  int64_t blocks_per_seq;
  int64_t block_size;
};

// One row of SPEC's advance_step. Rows past num_queries, and rows whose
// `active` flag is false, are padding: they get token 0, position 0 and no
// slot, and keep their seq_len.
template <typename SeqLenT, typename BlockT>
PADDLE_STEP_HOST_DEVICE void AdvanceStepRow(
    const AdvanceStepParams<SeqLenT, BlockT>& params, int64_t row) {
  const bool is_query = row < params.num_queries &&
                        (params.active == nullptr || params.active[row]);
  if (!is_query) {
    params.input_tokens[row] = 0;
    params.input_positions[row] = 0;
    params.slot_mapping[row] = -1;
    return;
  }
  const int64_t position = static_cast<int64_t>(params.seq_lens[row]);
  params.input_tokens[row] = params.sampled_token_ids[row];
  params.input_positions[row] = position;
  params.seq_lens[row] = static_cast<SeqLenT>(position + 1);

  // A position before the start or past the table has no slot (-1) rather
  // than a read outside this row of the block table.
  int64_t slot = -1;
  if (position >= 0) {
    const int64_t column = position / params.block_size;
    if (column < params.blocks_per_seq) {
      const int64_t block_id = static_cast<int64_t>(
          params.block_tables[row * params.blocks_per_seq + column]);
      if (block_id >= 0) {
        slot = block_id * params.block_size + position % params.block_size;
      }
    }
  }
  params.slot_mapping[row] = slot;
}

template <typename SeqLenT, typename BlockT>
inline void AdvanceStepCpu(const AdvanceStepParams<SeqLenT, BlockT>& params) {
  for (int64_t row = 0; row < params.num_seqs; ++row) {
    AdvanceStepRow(params, row);
  }
}

}  // namespace paddle_step
