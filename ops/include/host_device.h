// Lets one function body serve the CPU kernel and the CUDA kernel, so both
// builds run the same arithmetic and give the same bytes.
#pragma once

#if defined(__CUDACC__)
#define PADDLE_STEP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PADDLE_STEP_HOST_DEVICE inline
#endif
