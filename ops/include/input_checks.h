// Input validation shared by the ops. Every failure throws
// std::invalid_argument (a ValueError in Python) whose message names the op,
// the argument, what was expected and what came, before any tensor is
// written.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "paddle/extension.h"

namespace paddle_step {

// What validation sees of a tensor: enough to check a real tensor and a
// static-mode variable while its program is built, where a dimension may
// still be unknown (-1).
struct TensorSpec {
  std::string name;
  paddle::DataType dtype;
  std::vector<int64_t> shape;
};

inline TensorSpec SpecOf(const char* name, const paddle::Tensor& tensor) {
  return {name, tensor.dtype(), tensor.shape()};
}

// The dtype named as Python prints it ("int32", "paddle.int32"); UNDEFINED
// for a name not listed, which every dtype check then rejects.
inline paddle::DataType DataTypeFromName(std::string name) {
  const std::string prefix = "paddle.";
  if (name.compare(0, prefix.size(), prefix) == 0) name = name.substr(prefix.size());
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

using NamedTensor = std::pair<const char*, const paddle::Tensor*>;

inline std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream text;
  text << "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    text << (i ? ", " : "") << shape[i];
  }
  text << "]";
  return text.str();
}

inline std::string PlaceString(const paddle::Tensor& tensor) {
  if (tensor.is_cpu()) return "CPU";
  if (tensor.is_gpu()) return "GPU";
  return tensor.place().DebugString();
}

// Paddle's op runner only converts its own exception type; anything else
// thrown through a registered op aborts the process. The registered ops run
// their body through this, so a bad input raises there too.
template <typename Body>
void RethrowForPaddle(Body&& body) {
  try {
    body();
  } catch (const std::exception& error) {
    PD_THROW(error.what());
  }
}

class InputChecker {
 public:
  explicit InputChecker(const char* op_name) : op_name_(op_name) {}

  [[noreturn]] void Fail(const std::string& argument,
                         const std::string& expected,
                         const std::string& received) const {
    throw std::invalid_argument("paddle_step." + op_name_ + ": argument '" +
                                argument + "': expected " + expected +
                                ", got " + received);
  }

  void Dtype(const TensorSpec& tensor,
             std::initializer_list<paddle::DataType> allowed) const {
    const paddle::DataType dtype = tensor.dtype;
    std::string expected;
    for (paddle::DataType candidate : allowed) {
      if (candidate == dtype) return;
      expected += (expected.empty() ? "dtype " : " or ") +
                  phi::DataTypeToString(candidate);
    }
    Fail(tensor.name, expected, "dtype " + phi::DataTypeToString(dtype));
  }

  // Exact shape; -1 in `expected` accepts any size in that dimension, and a
  // dimension not known yet (-1, at program-build time) is accepted.
  void Shape(const TensorSpec& tensor,
             const std::vector<int64_t>& expected) const {
    if (!Matches(tensor.shape, expected)) {
      Fail(tensor.name, "shape " + ShapeString(expected),
           "shape " + ShapeString(tensor.shape));
    }
  }

  // A per-sequence vector: [batch] or [batch, 1].
  void BatchVector(const TensorSpec& tensor, int64_t batch) const {
    if (!Matches(tensor.shape, {batch}) && !Matches(tensor.shape, {batch, 1})) {
      Fail(tensor.name,
           "shape [" + std::to_string(batch) + "] or [" +
               std::to_string(batch) + ", 1]",
           "shape " + ShapeString(tensor.shape));
    }
  }

  // All tensors on the place of the first one, and that place is CPU or
  // (in a CUDA build) GPU.
  void SamePlace(const std::vector<NamedTensor>& tensors) const {
    const paddle::Tensor& first = *tensors.front().second;
#ifdef PADDLE_STEP_WITH_CUDA
    const bool supported = first.is_cpu() || first.is_gpu();
    const char* supported_places = "a CPU or GPU tensor";
#else
    const bool supported = first.is_cpu();
    const char* supported_places =
        "a CPU tensor (this build has no CUDA kernels)";
#endif
    if (!supported) {
      Fail(tensors.front().first, supported_places,
           "a tensor on " + PlaceString(first));
    }
    for (const NamedTensor& tensor : tensors) {
      if (tensor.second->place() != first.place()) {
        Fail(tensor.first,
             std::string("a tensor on ") + PlaceString(first) + " (like '" +
                 tensors.front().first + "')",
             "a tensor on " + PlaceString(*tensor.second));
      }
    }
  }

  void Positive(const char* argument, int64_t value) const {
    if (value <= 0) {
      Fail(argument, "a positive integer", std::to_string(value));
    }
  }

 private:
  static bool Matches(const std::vector<int64_t>& shape,
                      const std::vector<int64_t>& expected) {
    if (shape.size() != expected.size()) return false;
    for (size_t i = 0; i < shape.size(); ++i) {
      if (expected[i] >= 0 && shape[i] >= 0 && expected[i] != shape[i]) {
        return false;
      }
    }
    return true;
  }

  std::string op_name_;
};

}  // namespace paddle_step
