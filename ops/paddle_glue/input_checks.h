// Input validation and error reporting shared by the ops. Every input failure
// throws std::invalid_argument (a ValueError in Python) whose message names
// the op, the argument, what was expected and what came, before any tensor is
// written. Nothing here allocates unless a check fails: it runs on every call.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>

#ifdef PADDLE_STEP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "paddle/common/ddim.h"  // Tensor::dims(); paddle 2.6 only declares it
#include "paddle/extension.h"

namespace paddle_step {

// What validation sees of a tensor: its dtype and a view of its dims. Enough
// to check a real tensor and a static-mode variable while its program is
// built, where a dimension may still be unknown (-1).
struct TensorView {
  paddle::DataType dtype;
  const int64_t* dims;
  int64_t rank;
};

inline TensorView ViewOf(const paddle::Tensor& tensor) {
  const auto& dims = tensor.dims();
  return {tensor.dtype(), dims.Get(), dims.size()};
}

// The dtype named as Python prints it ("int32", "paddle.int32"); UNDEFINED
// for a name not listed, which every dtype check then rejects.
inline paddle::DataType DataTypeFromName(std::string name) {
  const std::string prefix = "paddle.";
  if (name.compare(0, prefix.size(), prefix) == 0) {
    name = name.substr(prefix.size());
  }
  for (paddle::DataType dtype :
       {paddle::DataType::BOOL, paddle::DataType::INT8, paddle::DataType::UINT8,
        paddle::DataType::INT16, paddle::DataType::INT32,
        paddle::DataType::INT64, paddle::DataType::FLOAT16,
        paddle::DataType::BFLOAT16, paddle::DataType::FLOAT32,
        paddle::DataType::FLOAT64}) {
    if (phi::DataTypeToString(dtype) == name) return dtype;
  }
  return paddle::DataType::UNDEFINED;
}

inline std::string ShapeString(const int64_t* dims, int64_t rank) {
  std::ostringstream text;
  text << "[";
  for (int64_t i = 0; i < rank; ++i) text << (i ? ", " : "") << dims[i];
  text << "]";
  return text.str();
}

inline std::string ShapeString(std::initializer_list<int64_t> dims) {
  return ShapeString(dims.begin(), static_cast<int64_t>(dims.size()));
}

inline std::string PlaceString(const paddle::Tensor& tensor) {
  if (tensor.is_cpu()) return "CPU";
  if (tensor.is_gpu()) return "GPU";
  return tensor.place().DebugString();
}

#ifdef PADDLE_STEP_WITH_CUDA
// A failed kernel launch as an exception naming the op.
inline void ThrowIfLaunchFailed(const char* op_name, cudaError_t status) {
  if (status != cudaSuccess) {
    throw std::runtime_error(
        std::string("paddle_step.") + op_name +
        ": CUDA launch failed: " + cudaGetErrorString(status));
  }
}
#endif

class InputChecker {
 public:
  explicit constexpr InputChecker(const char* op_name) : op_name_(op_name) {}

  [[noreturn]] void Fail(const std::string& argument,
                         const std::string& expected,
                         const std::string& received) const {
    throw std::invalid_argument(std::string("paddle_step.") + op_name_ +
                                ": argument '" + argument + "': expected " +
                                expected + ", got " + received);
  }

  void Dtype(const char* name, const TensorView& tensor,
             std::initializer_list<paddle::DataType> allowed) const {
    for (paddle::DataType candidate : allowed) {
      if (candidate == tensor.dtype) return;
    }
    std::string expected;
    for (paddle::DataType candidate : allowed) {
      expected += (expected.empty() ? "dtype " : " or ") +
                  phi::DataTypeToString(candidate);
    }
    Fail(name, expected, "dtype " + phi::DataTypeToString(tensor.dtype));
  }

  // Exact shape; -1 in `expected` accepts any size in that dimension, and a
  // dimension not known yet (-1, at program-build time) is accepted.
  void Shape(const char* name, const TensorView& tensor,
             std::initializer_list<int64_t> expected) const {
    if (!Matches(tensor, expected)) {
      Fail(name, "shape " + ShapeString(expected),
           "shape " + ShapeString(tensor.dims, tensor.rank));
    }
  }

  // A per-sequence vector: [batch] or [batch, 1].
  void BatchVector(const char* name, const TensorView& tensor,
                   int64_t batch) const {
    if (!Matches(tensor, {batch}) && !Matches(tensor, {batch, 1})) {
      Fail(name,
           "shape [" + std::to_string(batch) + "] or [" +
               std::to_string(batch) + ", 1]",
           "shape " + ShapeString(tensor.dims, tensor.rank));
    }
  }

  // All `count` tensors on the place of the first, and that place is CPU or
  // (in a CUDA build) GPU.
  void SamePlace(const char* const* names, const paddle::Tensor* const* tensors,
                 int count) const {
    const paddle::Tensor& first = *tensors[0];
#ifdef PADDLE_STEP_WITH_CUDA
    const bool supported = first.is_cpu() || first.is_gpu();
    const char* supported_places = "a CPU or GPU tensor";
#else
    const bool supported = first.is_cpu();
    const char* supported_places =
        "a CPU tensor (this build has no CUDA kernels)";
#endif
    if (!supported) {
      Fail(names[0], supported_places, "a tensor on " + PlaceString(first));
    }
    const phi::Place place = first.place();
    for (int i = 1; i < count; ++i) {
      if (tensors[i]->place() != place) {
        Fail(names[i],
             "a tensor on " + PlaceString(first) + " (like '" + names[0] + "')",
             "a tensor on " + PlaceString(*tensors[i]));
      }
    }
  }

  // A CPU tensor in plain row-major order: what the CPU kernels index.
  // Strides are checked where the tensor has them (a strided view); a tensor
  // without them is dense.
  void DenseCpu(const char* name, const paddle::Tensor& tensor) const {
    if (!tensor.is_cpu()) {
      Fail(name, "a CPU tensor", "a tensor on " + PlaceString(tensor));
    }
    const auto& dims = tensor.dims();
    const auto& strides = tensor.strides();
    if (strides.size() != dims.size()) return;
    int64_t expected = 1;
    for (int i = dims.size() - 1; i >= 0; --i) {
      if (dims[i] != 1 && strides[i] != expected) {
        Fail(name, "a contiguous tensor",
             "strides " + ShapeString(strides.Get(), strides.size()) +
                 " for shape " + ShapeString(dims.Get(), dims.size()));
      }
      expected *= dims[i];
    }
  }

  void Positive(const char* argument, int64_t value) const {
    if (value <= 0) {
      Fail(argument, "a positive integer", std::to_string(value));
    }
  }

  // The distance between the rows of a CPU matrix whose rows are contiguous
  // (a column slice of a wider one is fine: no copy).
  int64_t RowStride(const char* name, const paddle::Tensor& matrix) const {
    if (!matrix.is_cpu()) {
      Fail(name, "a CPU tensor", "a tensor on " + PlaceString(matrix));
    }
    const auto& dims = matrix.dims();
    const auto& strides = matrix.strides();
    if (strides.size() != dims.size()) return dims[1];
    const bool rows_contiguous = dims[1] == 1 || strides[1] == 1;
    const bool rows_apart = dims[0] == 1 || strides[0] >= dims[1];
    if (!rows_contiguous || !rows_apart) {
      Fail(name, "a matrix whose rows are contiguous",
           "strides " + ShapeString(strides.Get(), strides.size()) +
               " for shape " + ShapeString(dims.Get(), dims.size()));
    }
    return dims[0] == 1 ? dims[1] : strides[0];
  }

 private:
  static bool Matches(const TensorView& tensor,
                      std::initializer_list<int64_t> expected) {
    if (tensor.rank != static_cast<int64_t>(expected.size())) return false;
    const int64_t* dim = tensor.dims;
    for (int64_t want : expected) {
      if (want >= 0 && *dim >= 0 && want != *dim) return false;
      ++dim;
    }
    return true;
  }

  const char* op_name_;
};

}  // namespace paddle_step
