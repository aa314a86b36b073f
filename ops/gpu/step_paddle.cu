// CUDA launcher of step_paddle: one thread block walks the batch in chunks.
//
// List positions (where freed blocks land in free_list, a slot's place in the
// needy list, which pool block a needy slot gets, where a recovered slot's
// blocks come from) are exclusive prefix sums over ascending slots or
// recovery order, never atomics, so the result is the CPU kernel's, byte for
// byte. The few inherently sequential decisions (which victim, which
// sequence to recover) are made by thread 0 with the shared helpers; the
// victim search is a block-wide max reduction.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "gpu_launchers.h"

namespace paddle_step {
namespace {

constexpr int kStepThreads = 512;

struct MaxKey {
  __device__ __forceinline__ uint64_t operator()(uint64_t a, uint64_t b) const {
    return a > b ? a : b;
  }
};

__global__ void __launch_bounds__(kStepThreads)
    StepPaddleKernel(StepPaddleParams p) {
  using Scan = cub::BlockScan<int64_t, kStepThreads>;
  using Reduce = cub::BlockReduce<uint64_t, kStepThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ int64_t pool_len;
  __shared__ int64_t step_len;
  __shared__ int64_t needy_total;
  __shared__ int64_t needy_count;
  __shared__ int64_t victim;
  __shared__ int64_t recovered_count;
  __shared__ bool include_full_holders;

  const int tid = threadIdx.x;
  const int64_t batch = p.batch_size;
  if (tid == 0) {
    pool_len = ClampIndex(*p.free_list_len, p.free_list_capacity);
    step_len = ClampIndex(*p.step_lens, batch);
    include_full_holders = false;
  }
  __syncthreads();

  // Phase 1: free and find the needy, chunk by chunk.
  int64_t pool_position = pool_len;
  int64_t needy_position = 0;
  for (int64_t chunk = 0; chunk < batch; chunk += kStepThreads) {
    const int64_t slot = chunk + tid;
    FreePhaseDecision decision{false, false};
    if (slot < batch) decision = DecideFreeOrNeed(p, slot);
    const int64_t freed = decision.frees ? FreedBlockCount(p, slot) : 0;
    int64_t freed_before, freed_in_chunk;
    Scan(temp.scan).ExclusiveSum(freed, freed_before, freed_in_chunk);
    __syncthreads();
    int64_t needy_before, needy_in_chunk;
    Scan(temp.scan).ExclusiveSum(decision.needy ? int64_t{1} : int64_t{0},
                                 needy_before, needy_in_chunk);
    __syncthreads();
    if (decision.frees) FreeSlot(p, slot, pool_position + freed_before);
    if (decision.needy) {
      p.need_block_list[needy_position + needy_before] =
          static_cast<int32_t>(slot);
    }
    pool_position += freed_in_chunk;
    needy_position += needy_in_chunk;
  }
  if (tid == 0) {
    pool_len = pool_position < p.free_list_capacity ? pool_position
                                                    : p.free_list_capacity;
    needy_total = needy_position;
    needy_count = needy_position;
  }

  // Phase 2: preempt until the pool covers the needy.
  for (;;) {
    __syncthreads();
    if (needy_count <= pool_len) break;
    uint64_t best_key = 0;
    for (int64_t slot = tid; slot < batch; slot += kStepThreads) {
      const uint64_t key = VictimKey(p, slot, include_full_holders);
      if (key > best_key) best_key = key;
    }
    const uint64_t block_best = Reduce(temp.reduce).Reduce(best_key, MaxKey());
    if (tid == 0) {
      victim = -1;
      if (block_best != 0) {
        victim = SlotOfVictimKey(block_best);
      } else if (!include_full_holders) {
        include_full_holders = true;
      } else {  // shortfall: nobody holds a block, the highest needy slot
        int64_t index = needy_total - 1;
        while (p.need_block_list[index] < 0) --index;
        victim = p.need_block_list[index];
      }
    }
    __syncthreads();
    if (victim < 0) continue;
    for (int64_t index = tid; index < needy_total; index += kStepThreads) {
      if (p.need_block_list[index] == victim) {  // a slot is listed once
        p.need_block_list[index] = -1;
        needy_count -= 1;
      }
    }
    __syncthreads();
    if (tid == 0) pool_len = PreemptSlot(p, victim, pool_len, &step_len);
  }

  // Phase 3: the r-th remaining needy slot gets the block r below the top.
  int64_t rank_base = 0;
  for (int64_t chunk = 0; chunk < needy_total; chunk += kStepThreads) {
    const int64_t index = chunk + tid;
    const int64_t slot = index < needy_total ? p.need_block_list[index] : -1;
    int64_t rank, ranked_in_chunk;
    Scan(temp.scan).ExclusiveSum(slot >= 0 ? int64_t{1} : int64_t{0}, rank,
                                 ranked_in_chunk);
    __syncthreads();
    if (slot >= 0) DispatchBlock(p, slot, pool_len, rank_base + rank);
    rank_base += ranked_in_chunk;
  }
  __syncthreads();
  for (int64_t slot = tid; slot < batch; slot += kStepThreads) {
    p.need_block_list[slot] = -1;
  }
  if (tid == 0) {
    pool_len -= needy_count;
    *p.need_block_len = 0;
    // Phase 4, choice: LIFO from the top of step_block_list.
    int64_t pool_left = pool_len;
    recovered_count = 0;
    for (;;) {
      const int64_t budget =
          TryRecoverTop(p, &step_len, pool_left, recovered_count);
      if (budget == 0) break;
      pool_left -= budget;
      ++recovered_count;
    }
  }
  __syncthreads();

  // Phase 4, rebuild: recovered sequence k pops its blocks after those of
  // sequences 0 .. k-1.
  int64_t popped_base = 0;
  for (int64_t chunk = 0; chunk < recovered_count; chunk += kStepThreads) {
    const int64_t k = chunk + tid;
    const int64_t slot = k < recovered_count ? p.recover_block_list[k] : -1;
    const int64_t budget = slot >= 0 ? p.used_list_len[slot] : 0;
    int64_t popped_before, popped_in_chunk;
    Scan(temp.scan).ExclusiveSum(budget, popped_before, popped_in_chunk);
    __syncthreads();
    if (slot >= 0) {
      RebuildRecovered(p, slot, pool_len - popped_base - popped_before);
    }
    popped_base += popped_in_chunk;
  }
  if (tid == 0) {
    *p.recover_lens = 0;
    *p.step_lens = static_cast<int32_t>(step_len);
    *p.free_list_len = static_cast<int32_t>(pool_len - popped_base);
  }
}

}  // namespace

cudaError_t LaunchStepPaddle(const StepPaddleParams& params,
                             cudaStream_t stream) {
  StepPaddleKernel<<<1, kStepThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace paddle_step
