// Entry points of the CUDA kernels: raw pointers and a stream in, no Paddle
// types, so the op glue and the Paddle-free GPU test harness share them.
#pragma once

#include <cuda_runtime_api.h>

#include "advance_step_kernel.h"
#include "step_paddle_kernel.h"

namespace paddle_step {

// Instantiated for SeqLenT, BlockT in {int32_t, int64_t}.
template <typename SeqLenT, typename BlockT>
cudaError_t LaunchAdvanceStep(const AdvanceStepParams<SeqLenT, BlockT>& params,
                              cudaStream_t stream);

// One thread block, after a many-block pass over the slots when the batch is
// large; both on `stream`, no host synchronisation, so it can be
// graph-captured.
cudaError_t LaunchStepPaddle(const StepPaddleParams& params,
                             cudaStream_t stream);

}  // namespace paddle_step
