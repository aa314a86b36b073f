// A fixed pool of worker threads that run one parallel loop at a time, for
// kernels called hundreds of times per decode step on a few cores.
//
// The calling thread takes part in every loop, so a pool of size n holds n - 1
// workers and a pool of size 1 runs everything inline, with no thread, atomic
// or lock on the way. Threads claim a loop's tasks one at a time from a shared
// counter: on a machine shared with other processes a worker may not get a
// core for milliseconds, and then the caller runs the tasks it would have run
// instead of waiting for it (a static split would make every loop as slow as
// its least lucky thread). A loop returns once each of its tasks has run; a
// worker that wakes after that finds nothing left to claim.
//
// A worker that has finished a loop polls for a while (kSpinMicroseconds)
// before it sleeps: the next product of a step usually comes within
// microseconds, the first of the next decode step after the host's work
// between two steps (about half a millisecond at B = 1), and waking a
// sleeping thread costs tens of microseconds, more on a virtual machine; with
// a window shorter than that work, the first layers of every step ran on the
// calling thread alone (h512, B = 1, 2 threads: 10% fewer tokens/s with
// 200 us, docs/performance-cpu.md). An idle engine's workers sleep once the
// window has passed. It polls with sched_yield, not a pure spin, so that any
// other thread ready on its core (Paddle's own OpenMP threads between two
// products, another process) runs first: a spinning worker would hold the
// core they wait for.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace paddle_step::cpu {

class ThreadPool {
 public:
  // How long an idle worker polls for the next loop before it sleeps.
  static constexpr int64_t kSpinMicroseconds = 2000;
  // Tasks in one loop (the claim word keeps the count in 16 bits).
  static constexpr int kMaxTasks = 0xFFFF;

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
      workers_.emplace_back([this, seen] { WorkerLoop(seen); });
    }
  }

  // Calls task(i) once for each i in [0, tasks) (tasks <= kMaxTasks), at most
  // size() at a time in parallel, in no fixed order, and returns when all have
  // returned. `task` must not throw.
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
    done_.store(0, std::memory_order_relaxed);
    const uint64_t generation = generation_.load(std::memory_order_relaxed) + 1;
    claim_.store(ClaimWord(generation, tasks, 0), std::memory_order_release);
    {
      // Under the lock: a worker about to sleep checks the generation under
      // it too, so it cannot miss this one.
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.store(generation, std::memory_order_release);
    }
    wake_.notify_all();
    Work(generation);
    while (done_.load(std::memory_order_acquire) != tasks) Relax();
  }

 private:
  // The claim word: the loop's generation (32 bits), its task count (16) and
  // the next unclaimed task (16). A thread late for a loop holds a word whose
  // tasks are all claimed, so it can claim nothing of the next loop.
  static uint64_t ClaimWord(uint64_t generation, int tasks, int next) {
    return (generation << 32) | (static_cast<uint64_t>(tasks) << 16) |
           static_cast<uint64_t>(next);
  }

  // Lets another thread ready on this core run, if there is one.
  static void Relax() { std::this_thread::yield(); }

  // Claims and runs tasks of loop `generation` until none is left.
  void Work(uint64_t generation) {
    uint64_t claim = claim_.load(std::memory_order_acquire);
    for (;;) {
      const int tasks = static_cast<int>((claim >> 16) & 0xFFFF);
      const int next = static_cast<int>(claim & 0xFFFF);
      if ((claim >> 32) != (generation & 0xFFFFFFFFu) || next >= tasks) return;
      if (claim_.compare_exchange_weak(claim, claim + 1,
                                       std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
        job_function_(job_context_, next);
        done_.fetch_add(1, std::memory_order_acq_rel);
        claim = claim_.load(std::memory_order_acquire);
      }
    }
  }

  void WorkerLoop(uint64_t seen) {
    for (;;) {
      const auto spin_until = std::chrono::steady_clock::now() +
                              std::chrono::microseconds(kSpinMicroseconds);
      while (generation_.load(std::memory_order_acquire) == seen &&
             !stop_.load(std::memory_order_relaxed) &&
             std::chrono::steady_clock::now() < spin_until) {
        Relax();
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
      Work(seen);
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
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> stop_{false};
  // The loop being run; written before claim_ is published (release).
  const void* job_context_ = nullptr;
  void (*job_function_)(const void*, int) = nullptr;
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace paddle_step::cpu
