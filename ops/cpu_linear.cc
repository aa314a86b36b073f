// cpu_linear: validation, packing, the thread pool and instruction-set state of
// the CPU decode-row product. The kernels are ops/include/cpu_linear_kernel.h;
// Python reaches these through the pybind11 fast path (bindings.cc).
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sched.h>
#include <sys/mman.h>
#endif

#include "cpu_fma_peak.h"
#include "cpu_isa.h"
#include "cpu_linear_kernel.h"
#include "cpu_linear_ops.h"
#include "cpu_read_sum.h"
#include "cpu_runtime.h"
#include "cpu_thread_pool.h"
#include "input_checks.h"

namespace paddle_step {
namespace {

constexpr InputChecker kCheck("cpu_linear");
constexpr const char* kIsaVariable = "PADDLE_STEP_CPU_ISA";

// The cores this process may run on.
int AvailableCores() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// `name` as a path no more capable than `best`, which `limit` describes.
cpu::Isa ParseIsa(const char* argument, const std::string& name, cpu::Isa best,
                  const char* limit = "a path this CPU supports") {
  if (name == "auto") return best;
  cpu::Isa isa;
  if (!cpu::IsaFromName(name, &isa)) {
    kCheck.Fail(argument, "one of auto, scalar, avx2, avx512, avx512_bf16",
                "'" + name + "'");
  }
  if (isa > best) {
    kCheck.Fail(argument,
                std::string(limit) + " (up to " +
                    cpu::IsaName(best) + ")",
                "'" + name + "'");
  }
  return isa;
}

// Process-wide settings of the products: their path and their pool. A bad
// PADDLE_STEP_CPU_ISA is reported by every product until set_isa replaces it.
struct CpuLinearState {
  cpu::Isa best = cpu::DetectIsa();
  cpu::Isa isa = best;
  std::string isa_error;
  int64_t prefetch_one_row = cpu::kDefaultPrefetchBytes;
  int64_t prefetch_several_rows = cpu::kDefaultPrefetchBytes;
  int64_t prefetch_l2_one_row = 0;
  int64_t prefetch_l2_several_rows = 0;
  cpu::ThreadPool pool;

  CpuLinearState() {
    pool.Resize(AvailableCores());
    const char* forced = std::getenv(kIsaVariable);
    if (forced == nullptr || *forced == '\0') return;
    try {
      isa = ParseIsa(kIsaVariable, forced, best);
    } catch (const std::invalid_argument& error) {
      isa_error = error.what();
    }
  }
};

CpuLinearState& State() {
  static CpuLinearState state;
  return state;
}

void CheckMatrix(const char* name, const paddle::Tensor& w,
                 std::initializer_list<paddle::DataType> dtypes) {
  const TensorView view = ViewOf(w);
  kCheck.Dtype(name, view, dtypes);
  kCheck.Shape(name, view, {-1, -1});
  kCheck.DenseCpu(name, w);
  if (view.dims[0] < 1 || view.dims[1] < 1) {
    kCheck.Fail(name, "a matrix [K, N] with K, N >= 1",
                "shape " + ShapeString(view.dims, view.rank));
  }
}

cpu::WeightFormat FormatOf(const paddle::Tensor& weights) {
  const TensorView view = ViewOf(weights);
  kCheck.Dtype("weights", view,
               {paddle::DataType::FLOAT32, paddle::DataType::BFLOAT16,
                paddle::DataType::INT8});
  switch (view.dtype) {
    case paddle::DataType::BFLOAT16:
      return cpu::WeightFormat::kBFloat16;
    case paddle::DataType::INT8:
      return cpu::WeightFormat::kInt8;
    default:
      return cpu::WeightFormat::kFloat32;
  }
}

// Tasks per thread of a product: threads claim them one at a time, so a thread
// that gets its core late leaves its share to the others (cpu_thread_pool.h).
constexpr int kTasksPerThread = 4;

// Panel ranges, one per task: contiguous, as even as whole panels allow.
int64_t TaskBoundary(int64_t panels, int tasks, int task) {
  return panels * task / tasks;
}

// K and N of the product: w's dims, or their reverse for a w stored as its
// transpose.
std::pair<int64_t, int64_t> KAndN(const paddle::Tensor& w, bool transposed) {
  return transposed ? std::pair{w.dims()[1], w.dims()[0]}
                    : std::pair{w.dims()[0], w.dims()[1]};
}

// w (its elements at data) as the packers read it.
template <typename T>
cpu::SourceMatrix<T> SourceOf(const paddle::Tensor& w, const T* data,
                              bool transposed) {
  const auto [k, n] = KAndN(w, transposed);
  return cpu::SourceMatrix<T>{data, k, n, transposed};
}

// pack(source) with w's elements as they are: float32, or bfloat16 bits.
template <typename Pack>
void WithSourceOf(const paddle::Tensor& w, bool transposed, const Pack& pack) {
  if (w.dtype() == paddle::DataType::FLOAT32) {
    pack(SourceOf(w, w.data<float>(), transposed));
  } else {
    const auto* bits =
        reinterpret_cast<const uint16_t*>(w.data<phi::dtype::bfloat16>());
    pack(SourceOf(w, bits, transposed));
  }
}

// body(begin, end) over ranges of `panels` panels on the pool (products, and
// packing: it writes memory the process touches for the first time, whose
// page faults take most of its time, and they scale with the threads).
template <typename Body>
void ForPanelRanges(int64_t panels, const Body& body) {
  cpu::ThreadPool& pool = State().pool;
  const int tasks = static_cast<int>(std::min<int64_t>(
      {int64_t{pool.size()} * kTasksPerThread, panels,
       cpu::ThreadPool::kMaxTasks}));
  pool.Run(tasks, [&](int task) {
    body(TaskBoundary(panels, tasks, task),
         TaskBoundary(panels, tasks, task + 1));
  });
}

// An uninitialized tensor for packs. They are written once, at load, into
// memory the process has not touched, where each 4 KB page costs a fault (9 us
// each in a KVM guest). Asked for transparent huge pages (which a kernel whose
// setting is "madvise" or "always" hands out), the pages fault once per 2 MB.
paddle::Tensor EmptyPacks(const std::vector<int64_t>& shape,
                          paddle::DataType dtype) {
  auto packs = paddle::empty(shape, dtype, paddle::CPUPlace());
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const auto first = reinterpret_cast<uintptr_t>(packs.data());
  const uintptr_t begin = (first + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end =
      (first + packs.numel() * phi::SizeOf(dtype)) & ~(kHugePage - 1);
  if (end > begin) {  // a hint: where refused, the pages stay small
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
#endif
  return packs;
}

}  // namespace

paddle::Tensor CpuLinearPackFloat32(const paddle::Tensor& w, bool transposed) {
  CheckMatrix("w", w, {paddle::DataType::FLOAT32});
  const auto source = SourceOf(w, w.data<float>(), transposed);
  const int64_t panels = cpu::PanelCount(source.n);
  auto packed = EmptyPacks({panels, source.k, cpu::kPanelWidth},
                           paddle::DataType::FLOAT32);
  ForPanelRanges(panels, [&](int64_t begin, int64_t end) {
    cpu::PackFloat32(source, packed.data<float>(), begin, end);
  });
  return packed;
}

paddle::Tensor CpuLinearPackBFloat16(const paddle::Tensor& w, bool transposed) {
  CheckMatrix("w", w, {paddle::DataType::FLOAT32, paddle::DataType::BFLOAT16});
  const auto [k, n] = KAndN(w, transposed);
  const int64_t panels = cpu::PanelCount(n);
  auto packed =
      EmptyPacks({panels, cpu::PanelRows(cpu::WeightFormat::kBFloat16, k),
                  cpu::kPanelWidth, 2},
                 paddle::DataType::BFLOAT16);
  auto* out = reinterpret_cast<uint16_t*>(packed.data<phi::dtype::bfloat16>());
  ForPanelRanges(panels, [&](int64_t begin, int64_t end) {
    WithSourceOf(w, transposed, [&](const auto& source) {
      cpu::PackBFloat16(source, out, begin, end);
    });
  });
  return packed;
}

std::vector<paddle::Tensor> CpuLinearPackInt8(const paddle::Tensor& w,
                                              int64_t group_size,
                                              bool transposed) {
  CheckMatrix("w", w, {paddle::DataType::FLOAT32, paddle::DataType::BFLOAT16});
  kCheck.Positive("group_size", group_size);
  const auto [k, n] = KAndN(w, transposed);
  const int64_t panels = cpu::PanelCount(n);
  auto packed =
      EmptyPacks({panels, k, cpu::kPanelWidth}, paddle::DataType::INT8);
  auto scales = paddle::empty(
      {panels, cpu::GroupCount(k, group_size), cpu::kPanelWidth},
      paddle::DataType::FLOAT32, paddle::CPUPlace());
  ForPanelRanges(panels, [&](int64_t begin, int64_t end) {
    WithSourceOf(w, transposed, [&](const auto& source) {
      cpu::PackInt8(source, group_size, packed.data<int8_t>(),
                    scales.data<float>(), begin, end);
    });
  });
  return {packed, scales};
}

paddle::Tensor CpuLinear(const paddle::Tensor& x, const paddle::Tensor& weights,
                         const paddle::optional<paddle::Tensor>& scales,
                         const paddle::optional<paddle::Tensor>& bias,
                         int64_t n, int64_t group_size,
                         const std::string& isa_name) {
  CpuLinearState& state = State();
  if (!state.isa_error.empty()) throw std::invalid_argument(state.isa_error);
  const cpu::Isa isa =
      isa_name.empty() ? state.isa : ParseIsa("isa", isa_name, state.isa,
                                       "a path products may run on now");
  const TensorView x_view = ViewOf(x);
  kCheck.Dtype("x", x_view, {paddle::DataType::FLOAT32});
  kCheck.Shape("x", x_view, {-1, -1});
  const int64_t m = x_view.dims[0];
  const int64_t k = x_view.dims[1];
  const int64_t x_stride = kCheck.RowStride("x", x);
  if (k < 1) kCheck.Fail("x", "shape [M, K] with K >= 1", "shape " + ShapeString({m, k}));
  kCheck.Positive("n", n);

  const cpu::WeightFormat format = FormatOf(weights);
  const int64_t panels = cpu::PanelCount(n);
  const int64_t panel_rows = cpu::PanelRows(format, k);
  if (format == cpu::WeightFormat::kBFloat16) {
    kCheck.Shape("weights", ViewOf(weights),
                 {panels, panel_rows, cpu::kPanelWidth, 2});
  } else {
    kCheck.Shape("weights", ViewOf(weights),
                 {panels, panel_rows, cpu::kPanelWidth});
  }
  kCheck.DenseCpu("weights", weights);

  cpu::LinearProblem problem;
  if (format == cpu::WeightFormat::kInt8) {
    if (!scales) {
      kCheck.Fail("scales", "the float32 scales of the int8 weights", "none");
    }
    kCheck.Positive("group_size", group_size);
    const TensorView scales_view = ViewOf(*scales);
    kCheck.Dtype("scales", scales_view, {paddle::DataType::FLOAT32});
    kCheck.Shape("scales", scales_view,
                 {panels, cpu::GroupCount(k, group_size), cpu::kPanelWidth});
    kCheck.DenseCpu("scales", *scales);
    problem.w.scales = scales->data<float>();
    problem.w.group_size = group_size;
  } else if (scales) {
    kCheck.Fail("scales", std::string("none for ") +
                              cpu::WeightFormatName(format) + " weights",
                "a tensor");
  }
  if (bias) {
    const TensorView bias_view = ViewOf(*bias);
    kCheck.Dtype("bias", bias_view, {paddle::DataType::FLOAT32});
    kCheck.Shape("bias", bias_view, {n});
    kCheck.DenseCpu("bias", *bias);
    problem.bias = bias->data<float>();
  }

  auto y = paddle::empty({m, n}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  if (m == 0) return y;
  problem.x = x.data<float>();
  problem.m = m;
  problem.x_stride = x_stride;
  problem.w.format = format;
  problem.w.k = k;
  problem.w.n = n;
  problem.w.data = weights.data();
  problem.y = y.data<float>();
  problem.y_stride = n;
  problem.prefetch_bytes =
      m == 1 ? state.prefetch_one_row : state.prefetch_several_rows;
  problem.prefetch_l2_bytes =
      m == 1 ? state.prefetch_l2_one_row : state.prefetch_l2_several_rows;
  // The caller's thread prepares x, the pool's threads read it.
  thread_local std::vector<uint32_t> scratch;
  scratch.resize(cpu::ActivationBytes(isa, problem.w, m) / sizeof(uint32_t));
  cpu::PrepareActivations(isa, &problem, scratch.data());

  ForPanelRanges(panels, [&](int64_t begin, int64_t end) {
    cpu::LinearPanels(isa, problem, begin, end);
  });
  return y;
}

void CpuLinearSetNumThreads(int64_t threads) {
  kCheck.Positive("threads", threads);
  State().pool.Resize(static_cast<int>(threads));
}

int64_t CpuLinearNumThreads() { return State().pool.size(); }

void CpuLinearSetIsa(const std::string& name) {
  CpuLinearState& state = State();
  state.isa = ParseIsa("isa", name, state.best);
  state.isa_error.clear();
}

std::string CpuLinearIsa() { return cpu::IsaName(State().isa); }

std::string CpuLinearBestIsa() { return cpu::IsaName(State().best); }

void CpuLinearSetPrefetchBytes(int64_t one_row, int64_t several_rows,
                               int64_t l2_one_row, int64_t l2_several_rows) {
  const std::string expected =
      "a multiple of 64 from 0 to " + std::to_string(kMaxPrefetchBytes);
  for (const auto& [name, bytes] :
       {std::pair{"one_row", one_row}, std::pair{"several_rows", several_rows},
        std::pair{"l2_one_row", l2_one_row},
        std::pair{"l2_several_rows", l2_several_rows}}) {
    if (bytes < 0 || bytes > kMaxPrefetchBytes || bytes % 64 != 0) {
      kCheck.Fail(name, expected, std::to_string(bytes));
    }
  }
  CpuLinearState& state = State();
  state.prefetch_one_row = one_row;
  state.prefetch_several_rows = several_rows;
  state.prefetch_l2_one_row = l2_one_row;
  state.prefetch_l2_several_rows = l2_several_rows;
}

std::vector<int64_t> CpuLinearPrefetchBytes() {
  const CpuLinearState& state = State();
  return {state.prefetch_one_row, state.prefetch_several_rows,
          state.prefetch_l2_one_row, state.prefetch_l2_several_rows};
}

double CpuReadSum(const paddle::Tensor& data) {
  CpuLinearState& state = State();
  const TensorView view = ViewOf(data);
  kCheck.Dtype("data", view, {paddle::DataType::FLOAT32});
  kCheck.DenseCpu("data", data);
  const float* values = data.data<float>();
  const int64_t count = data.numel();
  // Chunks of whole cache lines, one per thread.
  const int tasks = state.pool.size();
  std::vector<double> sums(tasks, 0.0);
  state.pool.Run(tasks, [&](int task) {
    const int64_t begin = count * task / tasks / 16 * 16;
    const int64_t end = task + 1 == tasks ? count : count * (task + 1) / tasks / 16 * 16;
    sums[task] = cpu::ReadSum(state.isa, values + begin, end - begin);
  });
  double total = 0.0;
  for (double sum : sums) total += sum;
  return total;
}

double CpuFmaRate(int64_t iterations) {
  kCheck.Positive("iterations", iterations);
  CpuLinearState& state = State();
  const int tasks = state.pool.size();
  std::vector<double> operations(tasks, 0.0);
  std::vector<float> results(tasks, 0.0f);
  const auto start = std::chrono::steady_clock::now();
  state.pool.Run(tasks, [&](int task) {
    operations[task] = cpu::FmaLoop(state.isa, iterations, &results[task]);
  });
  const std::chrono::duration<double> elapsed =
      std::chrono::steady_clock::now() - start;
  double total = 0.0;
  for (int task = 0; task < tasks; ++task) {
    total += operations[task];
    if (results[task] != results[task]) return 0.0;  // uses the results
  }
  return total / elapsed.count();
}

cpu::ThreadPool& CpuThreadPool() { return State().pool; }

cpu::Isa CpuActiveIsa() {
  const CpuLinearState& state = State();
  if (!state.isa_error.empty()) throw std::invalid_argument(state.isa_error);
  return state.isa;
}

}  // namespace paddle_step
