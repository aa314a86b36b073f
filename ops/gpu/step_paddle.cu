// CUDA launcher of step_paddle.
//
// List positions (where freed blocks land in free_list, a slot's place in the
// needy list, which pool block a needy slot gets, where a recovered slot's
// blocks come from) are exclusive prefix sums over ascending slots or
// recovery order, never atomics, so the result is the CPU kernel's, byte for
// byte. The few inherently sequential decisions (which victim, which
// sequence to recover) are made by thread 0 with the shared helpers; the
// victim search is a block-wide max reduction.
//
// Up to kOneLaunchMaxBatch slots, one thread block does everything. Above,
// phase 1's per-slot decisions (several dependent loads per slot: the cost at
// large B) are spread over many blocks by a first kernel, which leaves one
// code per slot in need_block_list (its scratch until phase 3 resets it);
// the one-block kernel then only scans the codes. Both launches go on the
// caller's stream: no host synchronisation, graph-capturable.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "gpu_launchers.h"

namespace paddle_step {
namespace {

constexpr int kStepThreads = 512;
constexpr int kDecideThreads = 256;
constexpr int64_t kOneLaunchMaxBatch = 1024;
// Codes of phase 1's decision for a slot, in need_block_list[slot].
constexpr int32_t kCodeNothing = -1;
constexpr int32_t kCodeNeedy = -2;
constexpr int32_t kCodeFrees = -3;

struct MaxKey {
  __device__ __forceinline__ uint64_t operator()(uint64_t a, uint64_t b) const {
    return a > b ? a : b;
  }
};

// Phase 1's decision for `slot`, its flag stores applied, as a code.
__device__ __forceinline__ int32_t DecideSlotCode(const StepPaddleParams& p,
                                                  int64_t slot) {
  const FreePhaseDecision decision = DecideFreeOrNeed(p, slot);
  if (decision.frees) return kCodeFrees;
  return decision.needy ? kCodeNeedy : kCodeNothing;
}

__global__ void __launch_bounds__(kDecideThreads)
    DecideSlotsKernel(StepPaddleParams p) {
  const int64_t slot = int64_t{blockIdx.x} * kDecideThreads + threadIdx.x;
  if (slot < p.batch_size) p.need_block_list[slot] = DecideSlotCode(p, slot);
}

// Phase 1's two counts of a slot in one int64, so that one scan places both:
// the pool entries its free adds (< 2^31) above, 1 if it is needy below. The
// sums over a tile of kTileSlots (<= 2^12) slots fit: < 2^43 and < 2^16.
constexpr int kNeedyBits = 16;

__device__ __forceinline__ int64_t PackFreedNeedy(int64_t freed, bool needy) {
  return (freed << kNeedyBits) | (needy ? 1 : 0);
}
__device__ __forceinline__ int64_t FreedOf(int64_t packed) {
  return packed >> kNeedyBits;
}
__device__ __forceinline__ int64_t NeedyOf(int64_t packed) {
  return packed & ((int64_t{1} << kNeedyBits) - 1);
}

// kCodesWritten: DecideSlotsKernel ran first, each slot's code is in
// need_block_list. Otherwise the decisions are made here. Thread t holds
// slots t * kSlotsPerThread .. + kSlotsPerThread - 1 of each tile.
template <int kSlotsPerThread, bool kCodesWritten>
__global__ void __launch_bounds__(kStepThreads)
    StepPaddleKernel(StepPaddleParams p) {
  constexpr int64_t kTileSlots = int64_t{kStepThreads} * kSlotsPerThread;
  static_assert(kTileSlots < (1 << kNeedyBits), "needy count overflows");
  using Scan =
      cub::BlockScan<int64_t, kStepThreads, cub::BLOCK_SCAN_WARP_SCANS>;
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
  // Phase 4: a chunk of recovered sequences and where each one's blocks start.
  __shared__ int32_t recovered_slot[kStepThreads];
  __shared__ int64_t recovered_pool_top[kStepThreads];

  const int tid = threadIdx.x;
  const int64_t batch = p.batch_size;
  if (tid == 0) {
    pool_len = ClampIndex(*p.free_list_len, p.free_list_capacity);
    step_len = ClampIndex(*p.step_lens, batch);
    include_full_holders = false;
  }
  __syncthreads();

  // Phase 1: free and find the needy, a tile at a time.
  int64_t pool_position = pool_len;
  int64_t needy_position = 0;
  for (int64_t tile = 0; tile < batch; tile += kTileSlots) {
    const int64_t first_slot = tile + int64_t{tid} * kSlotsPerThread;
    int32_t code[kSlotsPerThread];
    int64_t packed[kSlotsPerThread];
#pragma unroll
    for (int item = 0; item < kSlotsPerThread; ++item) {
      const int64_t slot = first_slot + item;
      code[item] = kCodeNothing;
      if (slot < batch) {
        code[item] =
            kCodesWritten ? p.need_block_list[slot] : DecideSlotCode(p, slot);
      }
    }
#pragma unroll
    for (int item = 0; item < kSlotsPerThread; ++item) {
      const int64_t freed =
          code[item] == kCodeFrees ? FreedBlockCount(p, first_slot + item) : 0;
      packed[item] = PackFreedNeedy(freed, code[item] == kCodeNeedy);
    }
    int64_t before[kSlotsPerThread];
    int64_t in_tile;
    Scan(temp.scan).ExclusiveSum(packed, before, in_tile);
    // Codes are read: the needy list may now overwrite them (a needy slot's
    // list position is at most its slot, so later tiles' codes are intact).
    __syncthreads();
#pragma unroll
    for (int item = 0; item < kSlotsPerThread; ++item) {
      const int64_t slot = first_slot + item;
      if (code[item] == kCodeFrees) {
        FreeSlot(p, slot, pool_position + FreedOf(before[item]));
      } else if (code[item] == kCodeNeedy) {
        p.need_block_list[needy_position + NeedyOf(before[item])] =
            static_cast<int32_t>(slot);
      }
    }
    pool_position += FreedOf(in_tile);
    needy_position += NeedyOf(in_tile);
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
    // Leaving the needy list and the preemption itself touch different
    // tensors, so they overlap; the barrier at the loop's top orders both
    // before the next victim search.
    for (int64_t index = tid; index < needy_total; index += kStepThreads) {
      if (p.need_block_list[index] == victim) {  // a slot is listed once
        p.need_block_list[index] = -1;
        needy_count -= 1;
      }
    }
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
    recovered_count = ChooseRecoveries(p, &step_len, pool_len);
  }
  __syncthreads();

  // Phase 4, rebuild: recovered sequence k pops its blocks after those of
  // sequences 0 .. k-1. A chunk of up to kStepThreads sequences at a time:
  // their pool tops by one scan, then each sequence rebuilt by a group of
  // threads (the whole block for one sequence, one thread each for
  // kStepThreads), since a re-prefill copies thousands of tokens.
  int64_t popped_base = 0;
  for (int64_t chunk = 0; chunk < recovered_count; chunk += kStepThreads) {
    const int64_t k = chunk + tid;
    const int64_t slot = k < recovered_count ? p.recover_block_list[k] : -1;
    const int64_t budget = slot >= 0 ? p.used_list_len[slot] : 0;
    int64_t popped_before, popped_in_chunk;
    Scan(temp.scan).ExclusiveSum(budget, popped_before, popped_in_chunk);
    recovered_slot[tid] = static_cast<int32_t>(slot);
    recovered_pool_top[tid] = pool_len - popped_base - popped_before;
    __syncthreads();
    const int64_t in_chunk = recovered_count - chunk < kStepThreads
                                 ? recovered_count - chunk
                                 : kStepThreads;
    int groups = 1;  // the smallest power of two >= in_chunk
    while (groups < in_chunk) groups *= 2;
    const int lanes = kStepThreads / groups;
    const int group = tid / lanes;
    if (group < in_chunk) {
      RebuildRecovered(p, recovered_slot[group], recovered_pool_top[group],
                       tid % lanes, lanes);
    }
    popped_base += popped_in_chunk;
    __syncthreads();  // recovered_slot is refilled by the next chunk
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
  const int64_t batch = params.batch_size;
  if (batch <= kOneLaunchMaxBatch) {
    StepPaddleKernel<1, false><<<1, kStepThreads, 0, stream>>>(params);
    return cudaGetLastError();
  }
  const int64_t decide_blocks = (batch + kDecideThreads - 1) / kDecideThreads;
  DecideSlotsKernel<<<static_cast<unsigned>(decide_blocks), kDecideThreads, 0,
                      stream>>>(params);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  StepPaddleKernel<8, true><<<1, kStepThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace paddle_step
