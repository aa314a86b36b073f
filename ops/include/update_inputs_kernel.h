// FastDeploy's update_inputs with its stop checks, for one slot of the
// engine's per-slot state (engine/model_runner.py, ModelRunner.update_inputs):
// framework-free, on raw pointers. One call per slot; slots are independent.
#pragma once

#include <cstdint>

namespace paddle_step {
namespace cpu {

// The slot state a step's sampled tokens update, all [batch] unless noted;
// the [batch, width] tables are dense, rows `*_width` elements apart.
struct UpdateInputsProblem {
  int64_t batch = 0;
  const bool* running = nullptr;  // not stopped before the step
  const bool* ran = nullptr;      // sampled a token this step
  const int64_t* tokens = nullptr;
  int64_t* step_idx = nullptr;
  const int64_t* stop_ids = nullptr;  // [batch, stop_width], -1 pads
  int64_t stop_width = 0;
  const int64_t* max_new_tokens = nullptr;
  int64_t* pre_ids = nullptr;  // [batch, pre_ids_width]
  int64_t pre_ids_width = 0;
  int64_t* next_tokens = nullptr;
  int64_t* input_ids = nullptr;  // [batch, input_ids_width]
  int64_t input_ids_width = 0;
  int32_t* seq_lens_this_time = nullptr;
  int32_t* seq_lens_encoder = nullptr;
  int32_t* seq_lens_decoder = nullptr;
  bool* stop_flags = nullptr;
};

// The pre_ids column slot b writes: its new step_idx if it ran (column k holds
// the k-th generated token), else the unread column 0.
inline int64_t PreIdsColumn(const UpdateInputsProblem& p, int64_t b) {
  return p.ran[b] ? p.step_idx[b] + 1 : 0;
}

// Slot b after its step: a slot that ran counts its token, stops on a stop id
// or at max_new_tokens, records the token in pre_ids and next_tokens; every
// slot takes the token as input_ids[b, 0]; a slot still running advances its
// decoder length by the tokens it ran and runs one token next; a stopped one
// ends at 0. The prompt phase is over for every slot (seq_lens_encoder 0).
inline void UpdateInputsRow(const UpdateInputsProblem& p, int64_t b) {
  const int64_t token = p.tokens[b];
  const bool ran = p.ran[b];
  const int64_t column = PreIdsColumn(p, b);
  bool finished = false;
  if (ran) {
    p.step_idx[b] += 1;
    finished = p.step_idx[b] >= p.max_new_tokens[b];
    const int64_t* stops = p.stop_ids + b * p.stop_width;
    for (int64_t s = 0; s < p.stop_width; ++s) finished |= stops[s] == token;
    p.next_tokens[b] = token;
  }
  p.pre_ids[b * p.pre_ids_width + column] = token;
  p.input_ids[b * p.input_ids_width] = token;
  const int32_t still_running = p.running[b] && !finished ? 1 : 0;
  p.seq_lens_decoder[b] =
      (p.seq_lens_decoder[b] + p.seq_lens_this_time[b]) * still_running;
  p.seq_lens_this_time[b] = still_running;
  p.seq_lens_encoder[b] = 0;
  p.stop_flags[b] = p.stop_flags[b] || finished;
}

}  // namespace cpu
}  // namespace paddle_step
