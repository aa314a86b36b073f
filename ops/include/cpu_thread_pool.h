// A fixed pool of worker threads that run one parallel loop at a time, for
// kernels called hundreds of times per decode step on a few cores.
//
// The calling thread runs task 0 itself, so a pool of size n holds n - 1
// workers and a pool of size 1 runs everything inline, with no thread, atomic
// or lock on the way. A worker that has finished a loop spins for a while
// (kSpinMicroseconds) before it sleeps: the next product of a step usually
// comes within microseconds, and waking a sleeping thread costs tens of them.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace paddle_step::cpu {

class ThreadPool {
 public:
  // How long an idle worker polls for the next loop before it sleeps.
  static constexpr int64_t kSpinMicroseconds = 200;

  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() { StopWorkers(); }

  // Threads taking part in a loop, the caller included.
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Makes the pool `threads` strong (at least 1). Not thread-safe: call it
  // while no loop runs.
  void Resize(int threads) {
    threads = std::max(threads, 1);
    if (threads == size()) return;
    StopWorkers();
    stop_ = false;
    // New workers wait for the loop after the last one run.
    const uint64_t seen = generation_.load(std::memory_order_acquire);
    for (int index = 1; index < threads; ++index) {
      workers_.emplace_back([this, index, seen] { WorkerLoop(index, seen); });
    }
  }

  // Calls task(i) once for each i in [0, tasks), at most size() at a time in
  // parallel, and returns when all have returned. `task` must not throw.
  template <typename Task>
  void Run(int tasks, const Task& task) {
    if (tasks <= 0) return;
    if (tasks == 1 || workers_.empty()) {
      for (int i = 0; i < tasks; ++i) task(i);
      return;
    }
    job_context_ = &task;
    job_function_ = [](const void* context, int index) {
      (*static_cast<const Task*>(context))(index);
    };
    job_tasks_ = tasks;
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    {
      // Under the lock: a worker about to sleep checks the generation under
      // it too, so it cannot miss this one.
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    RunShare(0);
    while (pending_.load(std::memory_order_acquire) != 0) Relax();
  }

 private:
  static void Relax() {
#if defined(__x86_64__) && defined(__GNUC__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  // Tasks index, index + size(), ...: every thread's share of the loop.
  void RunShare(int index) {
    const int stride = size();
    for (int i = index; i < job_tasks_; i += stride) {
      job_function_(job_context_, i);
    }
  }

  void WorkerLoop(int index, uint64_t seen) {
    for (;;) {
      const auto spin_until = std::chrono::steady_clock::now() +
                              std::chrono::microseconds(kSpinMicroseconds);
      while (generation_.load(std::memory_order_acquire) == seen &&
             !stop_.load(std::memory_order_relaxed) &&
             std::chrono::steady_clock::now() < spin_until) {
        for (int i = 0; i < 64; ++i) Relax();
      }
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] {
          return generation_.load(std::memory_order_acquire) != seen ||
                 stop_.load(std::memory_order_relaxed);
        });
      }
      if (stop_.load(std::memory_order_relaxed)) return;
      seen = generation_.load(std::memory_order_acquire);
      RunShare(index);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void StopWorkers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
    workers_.clear();
  }

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  // The loop being run; written before generation_ is bumped (release).
  const void* job_context_ = nullptr;
  void (*job_function_)(const void*, int) = nullptr;
  int job_tasks_ = 0;
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace paddle_step::cpu
