// The run-time settings every CPU kernel shares (ops/cpu_linear.cc owns them):
// the thread pool the engine sizes and the instruction-set path in use.
#pragma once

#include "cpu_isa.h"
#include "cpu_thread_pool.h"

namespace paddle_step {

cpu::ThreadPool& CpuThreadPool();

// The path the CPU kernels run on; throws the error of a PADDLE_STEP_CPU_ISA
// that names no path this CPU has.
cpu::Isa CpuActiveIsa();

}  // namespace paddle_step
