// step_paddle on raw pointers: no Paddle types.
//
// SPEC's four phases are split into per-sequence pieces plus list positions
// that are prefix sums over ascending slot ids. The CPU kernel below runs the
// pieces in a plain loop with running sums; the CUDA kernel
// (ops/gpu/step_paddle.cu) runs the same pieces in parallel with block-wide
// scans and reductions. Same pieces, same order, hence the same bytes. Only
// the choice of preemption victims is organised differently (a heap on the
// CPU, a block-wide max per victim on the GPU); both yield the same victims in
// the same order (see PreemptCpu).
//
// Bounds rules (SPEC: no read or write outside any tensor), for states that
// are not what a serving loop produces:
//  - a table column is used only when 0 <= column < blocks_per_seq;
//  - a push onto a full list (free_list, step_block_list) is dropped;
//  - the pool length and step_lens are clamped to their lists on entry;
//  - recovery stops at a step_block_list entry that is not a preempted
//    slot (not a slot id, or not is_block_step);
//  - input_ids / pre_ids positions outside their rows are skipped.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "host_device.h"
#include "step_paddle_tensors.h"

namespace paddle_step {

struct StepPaddleParams {
  // The data of each tensor of step_paddle_tensors.h, under its name; const
  // where the op only reads it.
#define PADDLE_STEP_POINTER_FIELD(name, type, shape, access) \
  TensorPointer<type, Access::access> name;
  PADDLE_STEP_STEP_PADDLE_TENSORS(PADDLE_STEP_POINTER_FIELD)
#undef PADDLE_STEP_POINTER_FIELD
  int64_t batch_size;          // B = stop_flags.shape[0]
  int64_t blocks_per_seq;      // block_tables.shape[1]
  int64_t free_list_capacity;  // free_list.shape[0]
  int64_t input_ids_len;       // input_ids.shape[1]
  int64_t pre_ids_len;         // pre_ids.shape[1]
  int64_t block_size;
  int64_t max_dec_blocks;  // input_ids_len / block_size
};

PADDLE_STEP_HOST_DEVICE int64_t ClampIndex(int64_t value, int64_t upper) {
  return value < 0 ? 0 : (value > upper ? upper : value);
}

PADDLE_STEP_HOST_DEVICE bool ColumnInTable(const StepPaddleParams& p,
                                           int64_t column) {
  return column >= 0 && column < p.blocks_per_seq;
}

PADDLE_STEP_HOST_DEVICE int32_t* TableRow(const StepPaddleParams& p,
                                          int64_t slot) {
  return p.block_tables + slot * p.blocks_per_seq;
}

// Table column of the position a sequence writes next. seq_lens_decoder is
// int32, so when block_size fits in int32 a 32-bit division gives the same
// truncated quotient; a 64-bit division is a slow routine on the GPU.
PADDLE_STEP_HOST_DEVICE int64_t NextColumn(const StepPaddleParams& p,
                                           int64_t slot) {
  const int32_t position = p.seq_lens_decoder[slot];
  if (p.block_size > INT32_MAX) {
    return static_cast<int64_t>(position) / p.block_size;  // 0, or -1 at 2^31
  }
  return position / static_cast<int32_t>(p.block_size);
}

// Decoder blocks of `slot` sit in columns enc .. enc+used-1; only those
// inside the table are handled. Returns [first, end) of those columns.
struct ColumnRange {
  int64_t first;
  int64_t end;
};

PADDLE_STEP_HOST_DEVICE ColumnRange DecoderColumns(const StepPaddleParams& p,
                                                   int64_t slot) {
  const int64_t encoder_blocks = p.encoder_block_lens[slot];
  const int64_t used_blocks = p.used_list_len[slot];
  ColumnRange range;
  range.first = encoder_blocks < 0 ? 0 : encoder_blocks;
  range.end = used_blocks > 0 ? encoder_blocks + used_blocks : 0;
  if (range.end > p.blocks_per_seq) range.end = p.blocks_per_seq;
  if (range.end < range.first) range.end = range.first;
  return range;
}

// Moves the decoder blocks of `slot` to free_list[pool_len ..] (dropping
// what does not fit) and clears their table entries. Returns the new length.
PADDLE_STEP_HOST_DEVICE int64_t PushDecoderBlocks(const StepPaddleParams& p,
                                                  int64_t slot,
                                                  int64_t pool_len) {
  const ColumnRange columns = DecoderColumns(p, slot);
  int32_t* row = TableRow(p, slot);
  for (int64_t column = columns.first; column < columns.end; ++column) {
    if (pool_len < p.free_list_capacity) {
      p.free_list[pool_len] = row[column];
      ++pool_len;
    }
    row[column] = -1;
  }
  return pool_len;
}

// ---- Phase 1: free finished sequences, find the needy ones. --------------

struct FreePhaseDecision {
  bool frees;  // stopped and not preempted: its decoder blocks go back
  bool needy;  // running into a column with no block
};

// Decides for one slot and applies the parts that touch only that slot's
// flags (the stop at the end of the table, first_token_ids).
PADDLE_STEP_HOST_DEVICE FreePhaseDecision
DecideFreeOrNeed(const StepPaddleParams& p, int64_t slot) {
  FreePhaseDecision decision{false, false};
  const bool running = !p.stop_flags[slot] && p.seq_lens_this_time[slot] != 0;
  if (running && NextColumn(p, slot) >= p.blocks_per_seq) {
    p.stop_flags[slot] = true;  // no column left for its next token
  }
  if (p.stop_flags[slot] && !p.is_block_step[slot]) {
    p.first_token_ids[slot] = -1;
    decision.frees = p.used_list_len[slot] > 0;
  } else if (!p.stop_flags[slot] && p.seq_lens_this_time[slot] != 0) {
    // A stopped (preempted) slot is never needy: a block given to it would be
    // lost when recovery rebuilds its table over the same columns.
    const int64_t column = NextColumn(p, slot);
    decision.needy =
        ColumnInTable(p, column) && TableRow(p, slot)[column] == -1;
  }
  return decision;
}

// How many pool entries freeing `slot` adds (before the capacity limit).
PADDLE_STEP_HOST_DEVICE int64_t FreedBlockCount(const StepPaddleParams& p,
                                                int64_t slot) {
  const ColumnRange columns = DecoderColumns(p, slot);
  return columns.end - columns.first;
}

// Frees `slot`'s decoder blocks into free_list from `pool_position` on.
PADDLE_STEP_HOST_DEVICE void FreeSlot(const StepPaddleParams& p, int64_t slot,
                                      int64_t pool_position) {
  PushDecoderBlocks(p, slot, pool_position);
  p.encoder_block_lens[slot] = 0;
  p.used_list_len[slot] = 0;
}

// ---- Phase 2: preemption. -------------------------------------------------

// Ordering key of a preemption candidate: more decoder blocks first, then the
// lowest slot. 0 means "not a candidate" (a victim must hold a block).
PADDLE_STEP_HOST_DEVICE uint64_t VictimKey(const StepPaddleParams& p,
                                           int64_t slot,
                                           bool include_full_holders) {
  // All three loads before any test, so that on the GPU they are in flight
  // together (a short-circuit would make each wait for the one before).
  const bool stopped = p.stop_flags[slot];
  const bool block_step = p.is_block_step[slot];
  const int64_t used_blocks = p.used_list_len[slot];
  if (stopped || block_step || used_blocks <= 0) return 0;
  if (!include_full_holders && used_blocks == p.max_dec_blocks) return 0;
  return (static_cast<uint64_t>(used_blocks) << 32) |
         static_cast<uint64_t>(0xFFFFFFFFu - static_cast<uint32_t>(slot));
}

PADDLE_STEP_HOST_DEVICE int64_t SlotOfVictimKey(uint64_t key) {
  return static_cast<int64_t>(0xFFFFFFFFu -
                              static_cast<uint32_t>(key & 0xFFFFFFFFu));
}

// Preempts `victim`: its decoder blocks go to the pool, it goes on
// step_block_list and stops. used_list_len is kept for its recovery.
// Removing it from the needy list is the caller's part. Returns the new
// pool length; *step_len is updated.
PADDLE_STEP_HOST_DEVICE int64_t PreemptSlot(const StepPaddleParams& p,
                                            int64_t victim, int64_t pool_len,
                                            int64_t* step_len) {
  pool_len = PushDecoderBlocks(p, victim, pool_len);
  if (*step_len < p.batch_size) {
    p.step_block_list[*step_len] = static_cast<int32_t>(victim);
    ++*step_len;
  }
  p.stop_flags[victim] = true;
  p.is_block_step[victim] = true;
  p.seq_lens_this_time[victim] = 0;
  p.seq_lens_decoder[victim] = 0;
  return pool_len;
}

// ---- Phase 3: dispatch. ---------------------------------------------------

// Gives needy `slot` the block `pool_rank` places below the pool top.
PADDLE_STEP_HOST_DEVICE void DispatchBlock(const StepPaddleParams& p,
                                           int64_t slot, int64_t pool_len,
                                           int64_t pool_rank) {
  TableRow(p, slot)[NextColumn(p, slot)] =
      p.free_list[pool_len - 1 - pool_rank];
  p.used_list_len[slot] += 1;
}

// ---- Phase 4: recovery. ---------------------------------------------------

// Blocks a preempted sequence gets back: one more than it held, bounded by
// what its own encoder length leaves, and at least one.
PADDLE_STEP_HOST_DEVICE int64_t RecoveryBudget(const StepPaddleParams& p,
                                               int64_t slot) {
  const int64_t encoder_blocks = p.encoder_block_lens[slot];
  int64_t budget = static_cast<int64_t>(p.used_list_len[slot]) + 1;
  const int64_t decoder_room = p.max_dec_blocks - encoder_blocks;
  const int64_t table_room = p.blocks_per_seq - encoder_blocks;
  if (decoder_room < budget) budget = decoder_room;
  if (table_room < budget) budget = table_room;
  return budget < 1 ? 1 : budget;
}

// Marks the top of step_block_list recovered if the pool still holds its
// budget. Returns the budget, or 0 when recovery stops here.
PADDLE_STEP_HOST_DEVICE int64_t TryRecoverTop(const StepPaddleParams& p,
                                              int64_t* step_len,
                                              int64_t pool_left,
                                              int64_t recovered_count) {
  if (*step_len <= 0) return 0;
  const int64_t slot = p.step_block_list[*step_len - 1];
  // An entry that is not a preempted sequence (not a slot id, or a slot
  // listed twice and already recovered) ends recovery.
  if (slot < 0 || slot >= p.batch_size || !p.is_block_step[slot]) return 0;
  const int64_t budget = RecoveryBudget(p, slot);
  if (pool_left < budget) return 0;
  p.is_block_step[slot] = false;
  p.used_list_len[slot] = static_cast<int32_t>(budget);
  p.step_block_list[*step_len - 1] = -1;
  --*step_len;
  // recovered_count < the step_len this phase started with <= batch_size.
  p.recover_block_list[recovered_count] = static_cast<int32_t>(slot);
  return budget;
}

// Phase 4's choice: recovers from the top of step_block_list while the pool
// holds each one's budget. Returns how many (listed in recover_block_list).
PADDLE_STEP_HOST_DEVICE int64_t ChooseRecoveries(const StepPaddleParams& p,
                                                 int64_t* step_len,
                                                 int64_t pool_len) {
  int64_t recovered_count = 0;
  int64_t pool_left = pool_len;
  for (;;) {
    const int64_t budget =
        TryRecoverTop(p, step_len, pool_left, recovered_count);
    if (budget == 0) return recovered_count;
    pool_left -= budget;
    ++recovered_count;
  }
}

// Hands a recovered sequence its blocks, popped from free_list[.. pool_top),
// and rebuilds its inputs for a full re-prefill of prompt + generated tokens.
// The work is strided over `lanes` threads (this one is `lane`): each table
// column and each input_ids position is written by exactly one lane, once, so
// the lanes need no synchronisation and any lane count gives the same bytes.
PADDLE_STEP_HOST_DEVICE void RebuildRecovered(const StepPaddleParams& p,
                                              int64_t slot, int64_t pool_top,
                                              int64_t lane, int64_t lanes) {
  const int64_t encoder_blocks = p.encoder_block_lens[slot];
  const int64_t budget = p.used_list_len[slot];
  int32_t* row = TableRow(p, slot);
  for (int64_t i = lane; i < budget; i += lanes) {
    if (ColumnInTable(p, encoder_blocks + i)) {
      row[encoder_blocks + i] = p.free_list[pool_top - 1 - i];
    }
  }

  const int64_t prompt_len = p.ori_seq_lens_encoder[slot];
  const int64_t steps = p.step_idx[slot];
  if (lane == 0) {
    // Wraps like the int32 store it is, without signed overflow.
    const int32_t prefill_len = static_cast<int32_t>(
        static_cast<uint64_t>(prompt_len) + static_cast<uint64_t>(steps));
    p.seq_lens_this_time[slot] = prefill_len;
    p.seq_lens_encoder[slot] = prefill_len;
    p.stop_flags[slot] = false;
  }

  int64_t* ids = p.input_ids + slot * p.input_ids_len;
  const int64_t* generated = p.pre_ids + slot * p.pre_ids_len;
  // Index arithmetic on a bounded step count cannot overflow; a step_idx
  // beyond the bound addresses nothing inside the rows either way.
  const int64_t kIndexBound = int64_t{1} << 40;
  const int64_t bounded_steps =
      steps < -kIndexBound ? -kIndexBound
                           : (steps > kIndexBound ? kIndexBound : steps);
  // ids[prompt_len + i] = generated[i + 1] for 0 <= i < steps - 1, limited
  // to positions inside both rows.
  const int64_t first = prompt_len < 0 ? -prompt_len : 0;
  int64_t end = bounded_steps - 1;
  if (p.input_ids_len - prompt_len < end) end = p.input_ids_len - prompt_len;
  if (p.pre_ids_len - 1 < end) end = p.pre_ids_len - 1;
  for (int64_t i = first + lane; i < end; i += lanes) {
    ids[prompt_len + i] = generated[i + 1];
  }
  // SPEC writes ids[0] = first_token_ids first and ids[last] = next_tokens
  // after the copy. The copy covers positions prompt_len + first .. last - 1,
  // so only position 0 can be written twice: the later write wins, and the
  // earlier one is skipped.
  const int64_t last = prompt_len + bounded_steps - 1;
  const bool copy_writes_zero = prompt_len + first == 0 && first < end;
  if (lane == 0 && p.input_ids_len > 0 && last != 0 && !copy_writes_zero) {
    ids[0] = p.first_token_ids[slot];
  }
  if (lane == 0 && last >= 0 && last < p.input_ids_len) {
    ids[last] = p.next_tokens[slot];
  }
}

// ---- The CPU kernel: the phases in order, one slot at a time. ------------

// Phase 2 on the CPU. Preempting a sequence changes only that sequence, so
// the victims the CUDA kernel finds one block-wide argmax at a time come in
// an order fixed before the first: holders below max_dec_blocks by most
// blocks, then lowest slot; then the full holders by slot; then (shortfall)
// the needy slots from the highest down. A heap of those keys gives the same
// victims in O(B + victims x log B) instead of O(victims x B).
inline void PreemptCpu(const StepPaddleParams& p, int64_t needy_total,
                       int64_t* needy_count, int64_t* pool_len,
                       int64_t* step_len) {
  constexpr uint64_t kBelowFullBlocks = uint64_t{1} << 63;
  std::vector<uint64_t> victim_keys;
  std::vector<int64_t> needy_index(p.batch_size, -1);
  for (int64_t slot = 0; slot < p.batch_size; ++slot) {
    const uint64_t below_full = VictimKey(p, slot, false);
    const uint64_t any_holder = VictimKey(p, slot, true);
    if (below_full != 0) {
      victim_keys.push_back(below_full | kBelowFullBlocks);
    } else if (any_holder != 0) {
      victim_keys.push_back(any_holder);
    }
  }
  std::make_heap(victim_keys.begin(), victim_keys.end());
  for (int64_t index = 0; index < needy_total; ++index) {
    needy_index[p.need_block_list[index]] = index;
  }

  int64_t highest_needy = needy_total - 1;
  while (*needy_count > *pool_len) {
    int64_t victim;
    if (!victim_keys.empty()) {
      std::pop_heap(victim_keys.begin(), victim_keys.end());
      victim = SlotOfVictimKey(victim_keys.back() & ~kBelowFullBlocks);
      victim_keys.pop_back();
    } else {  // shortfall: nobody holds a block, the highest needy slot goes
      while (p.need_block_list[highest_needy] < 0) --highest_needy;
      victim = p.need_block_list[highest_needy];
    }
    const int64_t index = needy_index[victim];
    if (index >= 0) {
      p.need_block_list[index] = -1;
      needy_index[victim] = -1;
      --*needy_count;
    }
    *pool_len = PreemptSlot(p, victim, *pool_len, step_len);
  }
}

inline void StepPaddleCpu(const StepPaddleParams& p) {
  const int64_t batch = p.batch_size;
  int64_t pool_len = ClampIndex(*p.free_list_len, p.free_list_capacity);
  int64_t step_len = ClampIndex(*p.step_lens, batch);

  // Phase 1. Freed blocks are appended in slot order; the needy list is
  // kept in need_block_list[0 .. needy_total), ascending.
  int64_t needy_total = 0;
  for (int64_t slot = 0; slot < batch; ++slot) {
    const FreePhaseDecision decision = DecideFreeOrNeed(p, slot);
    if (decision.frees) {
      const int64_t position = pool_len;
      pool_len += FreedBlockCount(p, slot);
      FreeSlot(p, slot, position);
      if (pool_len > p.free_list_capacity) pool_len = p.free_list_capacity;
    } else if (decision.needy) {
      p.need_block_list[needy_total++] = static_cast<int32_t>(slot);
    }
  }

  // Phase 2. Preempted entries of the needy list become -1.
  int64_t needy_count = needy_total;
  if (needy_count > pool_len) {
    PreemptCpu(p, needy_total, &needy_count, &pool_len, &step_len);
  }

  // Phase 3.
  int64_t pool_rank = 0;
  for (int64_t index = 0; index < needy_total; ++index) {
    const int64_t slot = p.need_block_list[index];
    if (slot >= 0) DispatchBlock(p, slot, pool_len, pool_rank++);
  }
  pool_len -= needy_count;
  for (int64_t slot = 0; slot < batch; ++slot) p.need_block_list[slot] = -1;
  *p.need_block_len = 0;

  // Phase 4. Choose (LIFO) first, then hand out blocks in recovery order.
  const int64_t recovered_count = ChooseRecoveries(p, &step_len, pool_len);
  for (int64_t k = 0; k < recovered_count; ++k) {
    const int64_t slot = p.recover_block_list[k];
    RebuildRecovered(p, slot, pool_len, /*lane=*/0, /*lanes=*/1);
    pool_len -= p.used_list_len[slot];
  }
  *p.recover_lens = 0;
  *p.step_lens = static_cast<int32_t>(step_len);
  *p.free_list_len = static_cast<int32_t>(pool_len);
}

}  // namespace paddle_step
