// Registration of this library's ops as Paddle static ops.
#pragma once

#include <cstdint>
#include <exception>
#include <type_traits>

#include "paddle/extension.h"

// FastDeploy registers its ops with PD_BUILD_STATIC_OP(name), which names them
// "static_op_<name>". Paddle ships the macro in some versions only, so we
// define it here when missing; the op names are the same either way.
#ifndef PD_BUILD_STATIC_OP
#define PD_BUILD_STATIC_OP(name) PD_BUILD_OP(static_op_##name)
#endif

namespace paddle_step {

// The kernel function an op registers for its entry point (PD_KERNEL(
// StaticOpKernel<&Entry>::Run)): the entry point's signature with its int64_t
// attributes as int, as the ops declare them ("name: int", as FastDeploy
// does), and every exception rethrown as Paddle's own. Paddle's op runner
// converts only that one; anything else thrown through a registered op aborts
// the process.
template <auto kEntryPoint>
struct StaticOpKernel;

template <typename... Args, void (*kEntryPoint)(Args...)>
struct StaticOpKernel<kEntryPoint> {
  template <typename T>
  using Parameter = std::conditional_t<std::is_same_v<T, int64_t>, int, T>;

  static void Run(Parameter<Args>... args) {
    try {
      kEntryPoint(args...);
    } catch (const std::exception& error) {
      PD_THROW(error.what());
    }
  }
};

}  // namespace paddle_step
