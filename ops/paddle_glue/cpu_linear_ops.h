// The CPU decode-row product's entry points on Paddle tensors (ops/cpu_linear.cc),
// bound by the pybind11 fast path (bindings.cc). The kernels are
// ops/include/cpu_linear_kernel.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "paddle/extension.h"

namespace paddle_step {

// The packers take W [K, N] (as `x @ W` multiplies it), or with `transposed`
// W stored as its transpose [N, K] (a tied LM head's embedding).

// W float32 packed into float32 panels [ceil(N/32), K, 32].
paddle::Tensor CpuLinearPackFloat32(const paddle::Tensor& w, bool transposed);

// W float32 or bfloat16 packed into bfloat16 panels
// [ceil(N/32), ceil(K/2), 32, 2] (float32 rounds to nearest even).
paddle::Tensor CpuLinearPackBFloat16(const paddle::Tensor& w, bool transposed);

// W float32 or bfloat16 quantized to symmetric int8 with a float32 scale per
// column and group of `group_size` rows of K: {int8 panels [ceil(N/32), K, 32],
// float32 scales [ceil(N/32), ceil(K/group_size), 32]}.
std::vector<paddle::Tensor> CpuLinearPackInt8(const paddle::Tensor& w,
                                              int64_t group_size,
                                              bool transposed);

// x float32 [M, K] @ the packed weights of N columns (+ bias float32 [N]):
// float32 [M, N]. The weights' dtype says their format; `scales` and
// `group_size` belong to int8 weights (pass none and 0 otherwise). `isa`:
// the path of this product, at most the process's (CpuLinearSetIsa), or ""
// for the process's path.
paddle::Tensor CpuLinear(const paddle::Tensor& x, const paddle::Tensor& weights,
                         const paddle::optional<paddle::Tensor>& scales,
                         const paddle::optional<paddle::Tensor>& bias,
                         int64_t n, int64_t group_size,
                         const std::string& isa = "");

// Threads a product runs on (the caller's included); at least 1.
void CpuLinearSetNumThreads(int64_t threads);
int64_t CpuLinearNumThreads();

// The instruction-set path products run on: "auto" (the best this CPU has) or
// one of "scalar", "avx2", "avx512", "avx512_bf16" that the CPU supports.
// PADDLE_STEP_CPU_ISA sets it before the first product.
void CpuLinearSetIsa(const std::string& name);
std::string CpuLinearIsa();
// The best path this CPU supports.
std::string CpuLinearBestIsa();

// How far ahead of their loads the products ask for weights, in bytes, for
// products of one row of x and of several: into the first-level cache (0: the
// hardware prefetcher alone) and, besides, into the second-level cache (l2_;
// 0: not at all); multiples of 64 up to kMaxPrefetchBytes. The best distances
// depend on the CPU, its memory and how much a tile computes per byte, so
// they are chosen by timing (layers/prefetch_distance.py); they never change
// a result.
constexpr int64_t kMaxPrefetchBytes = 65536;
void CpuLinearSetPrefetchBytes(int64_t one_row, int64_t several_rows,
                               int64_t l2_one_row, int64_t l2_several_rows);
// {one row, several rows, l2 one row, l2 several rows}.
std::vector<int64_t> CpuLinearPrefetchBytes();

// Sum of a contiguous float32 CPU tensor, read on all the product's threads
// with its instruction set: the benchmark's read bandwidth.
double CpuReadSum(const paddle::Tensor& data);

// Float32 operations per second (a multiply-add counts two) of `iterations`
// rounds of register-only multiply-adds on each of the product's threads, with
// its instruction set: the benchmark's matmul peak.
double CpuFmaRate(int64_t iterations);

}  // namespace paddle_step
