// C entry points for the Paddle-free GPU test harness (tests/gpu): raw device
// pointers, sizes and a stream in, the op's launchers called exactly as the
// Paddle glue (ops/step_paddle.cc, ops/advance_step.cc) calls them. No op
// kernel code here; the one kernel below (x += 1) is the timing floor. Every
// function returns a cudaError_t as int (0 = success).
// Streams, events and graphs are opaque handles passed as void*.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>

#include "gpu_launchers.h"

namespace {

template <typename SeqLenT, typename BlockT>
cudaError_t AdvanceStep(void* input_tokens, const void* sampled_token_ids,
                        void* input_positions, void* seq_lens,
                        void* slot_mapping, const void* block_tables,
                        const void* active, int64_t num_seqs,
                        int64_t num_queries, int64_t blocks_per_seq,
                        int64_t block_size, cudaStream_t stream) {
  paddle_step::AdvanceStepParams<SeqLenT, BlockT> params;
  params.input_tokens = static_cast<int64_t*>(input_tokens);
  params.sampled_token_ids = static_cast<const int64_t*>(sampled_token_ids);
  params.input_positions = static_cast<int64_t*>(input_positions);
  params.seq_lens = static_cast<SeqLenT*>(seq_lens);
  params.slot_mapping = static_cast<int64_t*>(slot_mapping);
  params.block_tables = static_cast<const BlockT*>(block_tables);
  params.active = static_cast<const bool*>(active);
  params.num_seqs = num_seqs;
  params.num_queries = num_queries;
  params.blocks_per_seq = blocks_per_seq;
  params.block_size = block_size;
  return paddle_step::LaunchAdvanceStep(params, stream);
}

// The timing floor (test_gpu_timing.py): the cheapest useful kernel, one
// int64 increment per element.
__global__ void AddOneKernel(int64_t* x, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1;
}

}  // namespace

extern "C" {

// seq_lens_bits / block_tables_bits: 32 or 64 (int32 or int64 tensors).
// active: nullptr when absent.
int paddle_step_advance_step(void* input_tokens, const void* sampled_token_ids,
                             void* input_positions, void* seq_lens,
                             int seq_lens_bits, void* slot_mapping,
                             const void* block_tables, int block_tables_bits,
                             const void* active, int64_t num_seqs,
                             int64_t num_queries, int64_t blocks_per_seq,
                             int64_t block_size, void* stream) {
  if (block_size <= 0 || num_queries > num_seqs || blocks_per_seq < 0) {
    return cudaErrorInvalidValue;
  }
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  auto run = AdvanceStep<int32_t, int32_t>;
  if (seq_lens_bits == 32 && block_tables_bits == 64) {
    run = AdvanceStep<int32_t, int64_t>;
  } else if (seq_lens_bits == 64 && block_tables_bits == 32) {
    run = AdvanceStep<int64_t, int32_t>;
  } else if (seq_lens_bits == 64 && block_tables_bits == 64) {
    run = AdvanceStep<int64_t, int64_t>;
  } else if (seq_lens_bits != 32 || block_tables_bits != 32) {
    return cudaErrorInvalidValue;
  }
  return run(input_tokens, sampled_token_ids, input_positions, seq_lens,
             slot_mapping, block_tables, active, num_seqs, num_queries,
             blocks_per_seq, block_size, s);
}

// tensors: the device pointers in the op's argument order
// (ops/include/step_paddle_tensors.h; STEP_PADDLE_TENSORS in Python). Sizes as
// the glue takes them: batch_size = stop_flags.shape[0], blocks_per_seq =
// block_tables.shape[1], free_list_capacity = free_list.size, input_ids_len =
// input_ids.shape[1], pre_ids_len = pre_ids.shape[1].
int paddle_step_step_paddle(void* const* tensors, int64_t batch_size,
                            int64_t blocks_per_seq, int64_t free_list_capacity,
                            int64_t input_ids_len, int64_t pre_ids_len,
                            int64_t block_size, void* stream) {
  if (block_size <= 0) return cudaErrorInvalidValue;
  paddle_step::StepPaddleParams p;
#define PADDLE_STEP_SET_POINTER(name, type, shape, access)            \
  p.name = static_cast<                                               \
      paddle_step::TensorPointer<type, paddle_step::Access::access>>( \
      tensors[paddle_step::step_paddle_tensor::name]);
  PADDLE_STEP_STEP_PADDLE_TENSORS(PADDLE_STEP_SET_POINTER)
#undef PADDLE_STEP_SET_POINTER
  p.batch_size = batch_size;
  p.blocks_per_seq = blocks_per_seq;
  p.free_list_capacity = free_list_capacity;
  p.input_ids_len = input_ids_len;
  p.pre_ids_len = pre_ids_len;
  p.block_size = block_size;
  p.max_dec_blocks = input_ids_len / block_size;
  return paddle_step::LaunchStepPaddle(p, static_cast<cudaStream_t>(stream));
}

int paddle_step_step_paddle_tensor_count() {
  return paddle_step::kStepPaddleTensorCount;
}

// cudaGetDeviceCount's status; *count is 0 on error.
int paddle_step_device_count(int* count) {
  *count = 0;
  const cudaError_t status = cudaGetDeviceCount(count);
  if (status != cudaSuccess) {
    *count = 0;
    cudaGetLastError();  // clear it so later calls do not report it
  }
  return status;
}

// Name, CUDA runtime and driver versions (e.g. 13000) and compute capability
// of the current device, for the timing report.
int paddle_step_device_info(char* name, int name_len, int* runtime_version,
                            int* driver_version, int* major, int* minor) {
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  cudaDeviceProp prop;
  status = cudaGetDeviceProperties(&prop, device);
  if (status != cudaSuccess) return status;
  if (name_len > 0) {
    std::strncpy(name, prop.name, static_cast<size_t>(name_len) - 1);
    name[name_len - 1] = '\0';
  }
  *major = prop.major;
  *minor = prop.minor;
  status = cudaRuntimeGetVersion(runtime_version);
  if (status != cudaSuccess) return status;
  return cudaDriverGetVersion(driver_version);
}

int paddle_step_gpu_count() {
  int count = 0;
  paddle_step_device_count(&count);
  return count;
}

const char* paddle_step_error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

// ---- Streams, graphs and events, so the tests need no backend API for them.

int paddle_step_device_synchronize() { return cudaDeviceSynchronize(); }

int paddle_step_stream_create(void** stream) {
  cudaStream_t s = nullptr;
  const cudaError_t status =
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  *stream = s;
  return status;
}

int paddle_step_stream_synchronize(void* stream) {
  return cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
}

int paddle_step_stream_destroy(void* stream) {
  return cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

int paddle_step_capture_begin(void* stream) {
  return cudaStreamBeginCapture(static_cast<cudaStream_t>(stream),
                                cudaStreamCaptureModeThreadLocal);
}

// Ends the capture and instantiates it; *graph_exec is the executable graph.
// *node_count is the number of nodes captured.
int paddle_step_capture_end(void* stream, void** graph_exec,
                            int64_t* node_count) {
  cudaGraph_t graph = nullptr;
  *graph_exec = nullptr;
  *node_count = 0;
  cudaError_t status =
      cudaStreamEndCapture(static_cast<cudaStream_t>(stream), &graph);
  if (status != cudaSuccess) return status;
  size_t nodes = 0;
  status = cudaGraphGetNodes(graph, nullptr, &nodes);
  *node_count = static_cast<int64_t>(nodes);
  cudaGraphExec_t exec = nullptr;
  if (status == cudaSuccess) {
    status = cudaGraphInstantiateWithFlags(&exec, graph, 0);
  }
  cudaGraphDestroy(graph);
  *graph_exec = exec;
  return status;
}

int paddle_step_graph_launch(void* graph_exec, void* stream) {
  return cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph_exec),
                         static_cast<cudaStream_t>(stream));
}

int paddle_step_graph_destroy(void* graph_exec) {
  return cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph_exec));
}

// Device-to-device copy on `stream` (capturable: a memcpy node in a graph).
int paddle_step_memcpy_device(void* dst, const void* src, int64_t bytes,
                              void* stream) {
  if (bytes < 0) return cudaErrorInvalidValue;
  return cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                         cudaMemcpyDeviceToDevice,
                         static_cast<cudaStream_t>(stream));
}

// x[i] += 1 for i < n (int64), on `stream`: the one-kernel timing floor.
int paddle_step_add_one(void* x, int64_t n, void* stream) {
  if (n <= 0) return cudaErrorInvalidValue;
  constexpr int kThreads = 256;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  AddOneKernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                 static_cast<cudaStream_t>(stream)>>>(static_cast<int64_t*>(x),
                                                      n);
  return cudaGetLastError();
}

int paddle_step_event_create(void** event) {
  cudaEvent_t e = nullptr;
  const cudaError_t status = cudaEventCreate(&e);
  *event = e;
  return status;
}

int paddle_step_event_record(void* event, void* stream) {
  return cudaEventRecord(static_cast<cudaEvent_t>(event),
                         static_cast<cudaStream_t>(stream));
}

// Waits for `end`, then *milliseconds = time from `start` to `end`.
int paddle_step_event_elapsed_ms(void* start, void* end, float* milliseconds) {
  const cudaError_t status =
      cudaEventSynchronize(static_cast<cudaEvent_t>(end));
  if (status != cudaSuccess) return status;
  return cudaEventElapsedTime(milliseconds, static_cast<cudaEvent_t>(start),
                              static_cast<cudaEvent_t>(end));
}

int paddle_step_event_destroy(void* event) {
  return cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

}  // extern "C"
