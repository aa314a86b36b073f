// CUDA launcher of advance_step: a grid-stride loop over the rows, each row
// running the same AdvanceStepRow as the CPU kernel.
#include "gpu_launchers.h"

namespace paddle_step {
namespace {

constexpr int kAdvanceStepThreads = 256;
constexpr int64_t kAdvanceStepMaxBlocks = 4096;

template <typename SeqLenT, typename BlockT>
__global__ void AdvanceStepKernel(AdvanceStepParams<SeqLenT, BlockT> params) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t row =
           static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       row < params.num_seqs; row += stride) {
    AdvanceStepRow(params, row);
  }
}

}  // namespace

template <typename SeqLenT, typename BlockT>
cudaError_t LaunchAdvanceStep(const AdvanceStepParams<SeqLenT, BlockT>& params,
                              cudaStream_t stream) {
  if (params.num_seqs <= 0) return cudaSuccess;
  int64_t blocks =
      (params.num_seqs + kAdvanceStepThreads - 1) / kAdvanceStepThreads;
  if (blocks > kAdvanceStepMaxBlocks) blocks = kAdvanceStepMaxBlocks;
  AdvanceStepKernel<<<static_cast<unsigned int>(blocks), kAdvanceStepThreads, 0,
                      stream>>>(params);
  return cudaGetLastError();
}

template cudaError_t LaunchAdvanceStep<int32_t, int32_t>(
    const AdvanceStepParams<int32_t, int32_t>&, cudaStream_t);
template cudaError_t LaunchAdvanceStep<int32_t, int64_t>(
    const AdvanceStepParams<int32_t, int64_t>&, cudaStream_t);
template cudaError_t LaunchAdvanceStep<int64_t, int32_t>(
    const AdvanceStepParams<int64_t, int32_t>&, cudaStream_t);
template cudaError_t LaunchAdvanceStep<int64_t, int64_t>(
    const AdvanceStepParams<int64_t, int64_t>&, cudaStream_t);

}  // namespace paddle_step
