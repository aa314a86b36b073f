// cpu_paged_attention: validation and threading of the CPU decode attention
// and KV-cache write. The kernels are ops/include/cpu_paged_attention_kernel.h;
// Python reaches these through the pybind11 fast path (bindings.cc).
//
// A cache is float32 or float64, with k, v and q of its dtype, or bfloat16
// for float32 k, v and q: stored rounded to nearest even, read widened, the
// attention computed in float32 (half the bytes a long context's attention
// reads, and half the memory).
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_attention_ops.h"
#include "cpu_paged_attention_kernel.h"
#include "cpu_runtime.h"
#include "input_checks.h"

namespace paddle_step {
namespace {

constexpr InputChecker kCheck("cpu_paged_attention");

// Tasks per thread of an attention call, claimed one at a time (see
// cpu_thread_pool.h: a thread that gets its core late leaves its share).
constexpr int kTasksPerThread = 4;

// Dims of a [layers, num_slots, kv_heads, head_dim] cache pair, checked.
struct CacheShape {
  int64_t layers, num_slots, kv_heads, head_dim;
};

CacheShape CheckCaches(const paddle::Tensor& key_cache,
                       const paddle::Tensor& value_cache, int64_t layer) {
  const TensorView key = ViewOf(key_cache);
  kCheck.Dtype("key_cache", key,
               {paddle::DataType::FLOAT32, paddle::DataType::FLOAT64,
                paddle::DataType::BFLOAT16});
  kCheck.Shape("key_cache", key, {-1, -1, -1, -1});
  kCheck.DenseCpu("key_cache", key_cache);
  const CacheShape shape{key.dims[0], key.dims[1], key.dims[2], key.dims[3]};
  kCheck.Dtype("value_cache", ViewOf(value_cache), {key.dtype});
  kCheck.Shape("value_cache", ViewOf(value_cache),
               {shape.layers, shape.num_slots, shape.kv_heads, shape.head_dim});
  kCheck.DenseCpu("value_cache", value_cache);
  if (layer < 0 || layer >= shape.layers) {
    kCheck.Fail("layer", "a layer in [0, " + std::to_string(shape.layers) + ")",
                std::to_string(layer));
  }
  return shape;
}

// The dtype of the k, v and q that go with a cache of `cache_dtype`: its own,
// float32 for bfloat16 (stored rounded, computed in float32).
paddle::DataType ComputeDtype(paddle::DataType cache_dtype) {
  return cache_dtype == paddle::DataType::BFLOAT16 ? paddle::DataType::FLOAT32
                                                   : cache_dtype;
}

// A cache's elements as the kernels take them: bfloat16 as uint16_t bits
// (const where the tensor is).
template <typename Cache, typename Tensor>
auto* CacheData(Tensor& cache) {
  if constexpr (std::is_same_v<Cache, uint16_t>) {
    using Bits =
        std::conditional_t<std::is_const_v<Tensor>, const uint16_t, uint16_t>;
    return reinterpret_cast<Bits*>(cache.template data<phi::dtype::bfloat16>());
  } else {
    return cache.template data<Cache>();
  }
}

// An int64 vector [count], dense, on the CPU.
void CheckIndexVector(const char* name, const paddle::Tensor& tensor,
                      int64_t count) {
  kCheck.Dtype(name, ViewOf(tensor), {paddle::DataType::INT64});
  kCheck.Shape(name, ViewOf(tensor), {count});
  kCheck.DenseCpu(name, tensor);
}

template <typename T, typename Table, typename Cache>
paddle::Tensor AttendTyped(cpu::DecodeAttentionProblem<T, Table, Cache> problem,
                           const CacheShape& shape, int64_t layer,
                           int64_t tokens, paddle::DataType dtype) {
  auto out = paddle::empty({tokens, problem.heads * shape.head_dim}, dtype,
                           paddle::CPUPlace());
  if (tokens == 0) return out;
  const int64_t layer_offset =
      layer * shape.num_slots * shape.kv_heads * shape.head_dim;
  problem.key += layer_offset;
  problem.value += layer_offset;
  problem.out = out.template data<T>();
  const cpu::Isa isa = CpuActiveIsa();
  cpu::ThreadPool& pool = CpuThreadPool();
  // An item is a token and a run of its KV heads: all of them (a slot's keys
  // read as one row) where the tokens alone give every thread its tasks, one
  // (a quarter of a row, strided) where they are too few.
  const int64_t wanted_tasks = int64_t{pool.size()} * kTasksPerThread;
  const int64_t span = tokens >= wanted_tasks ? shape.kv_heads : 1;
  const int64_t runs = shape.kv_heads / span;
  const int64_t items = tokens * runs;
  const int tasks = static_cast<int>(
      std::min<int64_t>({wanted_tasks, items, cpu::ThreadPool::kMaxTasks}));
  pool.Run(tasks, [&](int task) {
    thread_local cpu::AttentionScratch<T> scratch;
    int64_t last_token = -1;
    for (int64_t item = items * task / tasks;
         item < items * (task + 1) / tasks; ++item) {
      const int64_t t = item / runs;
      if (t != last_token) {
        cpu::VisibleSlots(problem, t, &scratch.slots);
        last_token = t;
      }
      cpu::AttendGroup(isa, problem, t, item % runs * span, span, &scratch);
    }
  });
  return out;
}

// Every block id a token can reach names a block of the cache. A prompt's
// tokens share their row: its table is read once per run of them.
template <typename Table>
void CheckTableBlocks(const Table* tables, int64_t width, const int64_t* rows,
                      int64_t tokens, int64_t table_rows, int64_t num_blocks) {
  for (int64_t t = 0; t < tokens; ++t) {
    if (rows[t] < 0 || rows[t] >= table_rows) {
      kCheck.Fail("rows", "entries in [0, " + std::to_string(table_rows) + ")",
                  std::to_string(rows[t]) + " at index " + std::to_string(t));
    }
    if (t > 0 && rows[t] == rows[t - 1]) continue;
    for (int64_t c = 0; c < width; ++c) {
      const int64_t block = static_cast<int64_t>(tables[rows[t] * width + c]);
      if (block >= num_blocks) {
        kCheck.Fail("block_tables",
                    "block ids < " + std::to_string(num_blocks) +
                        " (the cache's blocks) or negative (unused)",
                    std::to_string(block) + " in row " +
                        std::to_string(rows[t]));
      }
    }
  }
}

}  // namespace

void CpuWriteKv(paddle::Tensor& key_cache, paddle::Tensor& value_cache,
                int64_t layer, const paddle::Tensor& slots,
                const paddle::Tensor& k, const paddle::Tensor& v) {
  const CacheShape shape = CheckCaches(key_cache, value_cache, layer);
  const int64_t count = ViewOf(k).rank == 3 ? ViewOf(k).dims[0] : -1;
  for (const auto& [name, tensor] : {std::pair{"k", &k}, std::pair{"v", &v}}) {
    kCheck.Dtype(name, ViewOf(*tensor), {ComputeDtype(key_cache.dtype())});
    kCheck.Shape(name, ViewOf(*tensor), {count, shape.kv_heads, shape.head_dim});
    kCheck.DenseCpu(name, *tensor);
  }
  CheckIndexVector("slots", slots, count);
  const int64_t* slot = slots.data<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    if (slot[i] < -1 || slot[i] >= shape.num_slots) {
      kCheck.Fail("slots",
                  "entries in [-1, " + std::to_string(shape.num_slots) + ")",
                  std::to_string(slot[i]) + " at index " + std::to_string(i));
    }
  }
  const int64_t row = shape.kv_heads * shape.head_dim;
  const int64_t offset = layer * shape.num_slots * row;
  if (key_cache.dtype() == paddle::DataType::FLOAT32) {
    cpu::WriteKv(k.data<float>(), v.data<float>(), slot, count, row,
                 key_cache.data<float>() + offset,
                 value_cache.data<float>() + offset);
  } else if (key_cache.dtype() == paddle::DataType::BFLOAT16) {
    cpu::WriteKv(k.data<float>(), v.data<float>(), slot, count, row,
                 CacheData<uint16_t>(key_cache) + offset,
                 CacheData<uint16_t>(value_cache) + offset);
  } else {
    cpu::WriteKv(k.data<double>(), v.data<double>(), slot, count, row,
                 key_cache.data<double>() + offset,
                 value_cache.data<double>() + offset);
  }
}

paddle::Tensor CpuDecodeAttention(const paddle::Tensor& q,
                                  const PagedKvView& cache, double scale) {
  const paddle::Tensor& key_cache = cache.key_cache;
  const paddle::Tensor& value_cache = cache.value_cache;
  const paddle::Tensor& block_tables = cache.block_tables;
  const paddle::Tensor& rows = cache.rows;
  const paddle::Tensor& positions = cache.positions;
  const int64_t layer = cache.layer;
  const int64_t block_size = cache.block_size;
  const CacheShape shape = CheckCaches(key_cache, value_cache, layer);
  const TensorView q_view = ViewOf(q);
  kCheck.Dtype("q", q_view, {ComputeDtype(key_cache.dtype())});
  kCheck.Shape("q", q_view, {-1, -1, shape.head_dim});
  kCheck.DenseCpu("q", q);
  const int64_t tokens = q_view.dims[0];
  const int64_t heads = q_view.dims[1];
  if (heads < shape.kv_heads || heads % shape.kv_heads != 0) {
    kCheck.Fail("q", "a multiple of the cache's " +
                         std::to_string(shape.kv_heads) + " KV heads",
                std::to_string(heads) + " heads");
  }
  kCheck.Positive("block_size", block_size);
  if (shape.num_slots % block_size != 0) {
    kCheck.Fail("block_size",
                "a divisor of the cache's " + std::to_string(shape.num_slots) +
                    " slots",
                std::to_string(block_size));
  }
  const TensorView table_view = ViewOf(block_tables);
  kCheck.Dtype("block_tables", table_view,
               {paddle::DataType::INT32, paddle::DataType::INT64});
  kCheck.Shape("block_tables", table_view, {-1, -1});
  kCheck.DenseCpu("block_tables", block_tables);
  CheckIndexVector("rows", rows, tokens);
  CheckIndexVector("positions", positions, tokens);
  const int64_t* position = positions.data<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    if (position[t] < 0) {
      kCheck.Fail("positions", "entries >= 0",
                  std::to_string(position[t]) + " at index " + std::to_string(t));
    }
  }
  const int64_t table_rows = table_view.dims[0];
  const int64_t width = table_view.dims[1];
  const int64_t num_blocks = shape.num_slots / block_size;

  // T computes, Cache stores.
  auto run = [&](auto typed_zero, auto cache_zero, const auto* tables) {
    using T = decltype(typed_zero);
    using Cache = decltype(cache_zero);
    using Table = std::remove_cv_t<std::remove_pointer_t<decltype(tables)>>;
    CheckTableBlocks(tables, width, rows.data<int64_t>(), tokens, table_rows,
                     num_blocks);
    cpu::DecodeAttentionProblem<T, Table, Cache> problem;
    problem.q = q.data<T>();
    problem.key = CacheData<Cache>(key_cache);
    problem.value = CacheData<Cache>(value_cache);
    problem.tables = tables;
    problem.rows = rows.data<int64_t>();
    problem.positions = position;
    problem.heads = heads;
    problem.kv_heads = shape.kv_heads;
    problem.head_dim = shape.head_dim;
    problem.table_width = width;
    problem.block_size = block_size;
    problem.scale = static_cast<T>(scale);
    return AttendTyped(problem, shape, layer, tokens, q.dtype());
  };
  const bool wide_table = block_tables.dtype() == paddle::DataType::INT64;
  if (key_cache.dtype() == paddle::DataType::FLOAT32) {
    return wide_table ? run(0.0f, 0.0f, block_tables.data<int64_t>())
                      : run(0.0f, 0.0f, block_tables.data<int32_t>());
  }
  if (key_cache.dtype() == paddle::DataType::BFLOAT16) {
    return wide_table ? run(0.0f, uint16_t{0}, block_tables.data<int64_t>())
                      : run(0.0f, uint16_t{0}, block_tables.data<int32_t>());
  }
  return wide_table ? run(0.0, 0.0, block_tables.data<int64_t>())
                    : run(0.0, 0.0, block_tables.data<int32_t>());
}

}  // namespace paddle_step
