// The kernels' own thread pool (#29): a region of work handed out in shares, that ends when its items are done,
// whoever ran them. OpenMP's parallel region ends at a barrier every thread of the team must reach: when the OS keeps
// a team thread off its core (a 2-core box that also runs the scheduler's processes), the others wait for it even
// after they have run its items, so a step loses up to twice the CPU the preemption took. Here a worker that wakes
// late finds the region over and goes back to waiting; the caller waits only for items a worker has already begun.
//
// One pool per process: instance() is an inline function's static, which g++ emits as a unique symbol that the
// dynamic loader binds to one object across every extension that includes this header, so the attention and model
// extensions share one set of workers. The workers run on the cores the process may use when they start (the
// executor binds itself before its first forward pass, and starts them from its forward thread). An idle worker polls for new work for kSpin before it sleeps
// on a futex, so a busy server's back-to-back regions and steps cost no wake-up; it yields its core while it polls,
// to OpenMP's team (torch's GEMMs still run there) and the scheduler's processes, which a plain poll holds off for
// its whole time slice (prefill at 2 threads ran 1.8x slower beside a polling pool).
// On the include path of every extension executor_service/kernels/build.py builds.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <thread>
#include <vector>

namespace pagedserve {

// The items [front, back) of one share not yet taken in the region `tag`; the owner takes from the front, others
// from the back. A thread that wakes after the region ended carries a stale tag and can take nothing.
class alignas(64) Share {
 public:
  static constexpr int64_t kMaxItems = int64_t{1} << 16;

  void reset(uint32_t tag, int64_t front, int64_t back) { range_.store(pack(tag, front, back), std::memory_order_relaxed); }

  // The front item into `item` (and the one after it, if still in the share, into `next`, else -1).
  bool take_front(uint32_t tag, int64_t& item, int64_t& next) {
    uint64_t range = range_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = front_of(range), back = back_of(range);
      if (tag_of(range) != tag || front >= back) return false;
      if (range_.compare_exchange_weak(range, pack(tag, front + 1, back), std::memory_order_acq_rel)) {
        item = front;
        next = front + 1 < back ? front + 1 : -1;
        return true;
      }
    }
  }

  // The back item into `item` (and the one before it, if still in the share, into `next`, else -1).
  bool take_back(uint32_t tag, int64_t& item, int64_t& next) {
    uint64_t range = range_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = front_of(range), back = back_of(range);
      if (tag_of(range) != tag || front >= back) return false;
      if (range_.compare_exchange_weak(range, pack(tag, front, back - 1), std::memory_order_acq_rel)) {
        item = back - 1;
        next = back - 2 >= front ? back - 2 : -1;
        return true;
      }
    }
  }

 private:
  static uint64_t pack(uint32_t tag, int64_t front, int64_t back) {
    return static_cast<uint64_t>(tag) << 32 | static_cast<uint64_t>(front) << 16 | static_cast<uint64_t>(back);
  }
  static uint32_t tag_of(uint64_t range) { return static_cast<uint32_t>(range >> 32); }
  static int64_t front_of(uint64_t range) { return static_cast<int64_t>(range >> 16 & 0xFFFF); }
  static int64_t back_of(uint64_t range) { return static_cast<int64_t>(range & 0xFFFF); }

  std::atomic<uint64_t> range_{0};
};

class ElasticPool;

// What a region runs: run(region, me, tag, item, next) runs `item` on thread `me` and then every item it can still
// take in the region `tag`, calling finish_item() after each. body: the caller's closure, valid until the region ends.
struct Region {
  void (*run)(const Region&, int me, uint32_t tag, int64_t item, int64_t next);
  void* body;
  int threads;
};

inline thread_local int pool_thread_index = 0;  // 0: a caller; 1..: the pool's workers

class ElasticPool {
 public:
  static constexpr int kMaxThreads = 64;
  static constexpr std::chrono::microseconds kSpin{4000};  // an idle worker's polling before it sleeps

  static ElasticPool& instance() {
    static ElasticPool* pool = new ElasticPool();  // never destroyed: its workers outlive static destructors
    return *pool;
  }

  // Runs `region` over the shares `starts` cuts (starts[0] == 0, at most kMaxThreads shares, fewer than
  // Share::kMaxItems items), the calling thread taking share 0; false (nothing run) if the pool is busy with another
  // caller's region, for that caller to run it alone.
  bool run(Region& region, const std::vector<int64_t>& starts) {
    if (busy_.exchange(true, std::memory_order_acquire)) return false;
    const struct Release {
      std::atomic<bool>& busy;
      ~Release() { busy.store(false, std::memory_order_release); }
    } release{busy_};
    const int threads = static_cast<int>(starts.size()) - 1;
    start_workers(threads - 1);
    const uint32_t tag = generation_.load(std::memory_order_relaxed) + 1;
    for (int t = 0; t < threads; ++t) shares_[t].reset(tag, starts[t], starts[t + 1]);
    remaining_.store(starts.back(), std::memory_order_relaxed);
    region.threads = threads;
    region_.store(&region, std::memory_order_release);
    shape_.store(static_cast<uint64_t>(tag) << 32 | static_cast<uint32_t>(threads), std::memory_order_release);
    generation_.store(tag, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(FUTEX_WAKE_PRIVATE, INT_MAX);
    int64_t item = 0, next = -1;
    if (claim(tag, threads, 0, item, next)) region.run(region, 0, tag, item, next);
    wait_for_items();
    return true;
  }

  // An item of the region `tag` for thread `me` of `threads`: the front of its own share, else the back of another's.
  // Workers beyond the region's thread count (started for a larger one) take nothing.
  bool claim(uint32_t tag, int threads, int me, int64_t& item, int64_t& next) {
    if (me >= threads) return false;
    if (shares_[me].take_front(tag, item, next)) return true;
    for (int k = 1; k < threads; ++k)
      if (shares_[(me + k) % threads].take_back(tag, item, next)) return true;
    return false;
  }

  // Called after each item a region's run finishes; the last call of a region may end it (the caller returns).
  void finish_item() { remaining_.fetch_sub(1, std::memory_order_acq_rel); }

 private:
  ElasticPool() {
    pthread_atfork(nullptr, nullptr, [] {
      if (ElasticPool* pool = constructed_.load()) pool->forget_workers();
    });
    constructed_.store(this);
  }

  // A forked child has none of the parent's threads: the next region starts its own.
  void forget_workers() {
    busy_.store(false);
    workers_ = 0;
    sleepers_.store(0);
  }

  // Workers 1..wanted, as far as the OS lets this process start threads (a pids limit): a share without its worker
  // is taken by the threads that run.
  void start_workers(int wanted) {
    try {
      for (; workers_ < wanted && workers_ < kMaxThreads - 1; ++workers_)
        std::thread([this, me = workers_ + 1, seen = generation_.load()] { work(me, seen); }).detach();
    } catch (const std::system_error&) {
    }
  }

  // Worker `me`'s loop, from the generation before the region that started it.
  void work(int me, uint32_t seen) {
    pool_thread_index = me;
    for (;;) {
      const uint32_t tag = wait_for_region(seen);
      seen = tag;
      const Region* region = region_.load(std::memory_order_acquire);
      const int threads = region_threads(tag);
      int64_t item = 0, next = -1;
      // The claim keeps the region from ending until this thread finishes the item, so `region` is valid for it; a
      // region read from a later generation has its shares under another tag, and nothing is claimed.
      if (threads > 0 && claim(tag, threads, me, item, next)) region->run(*region, me, tag, item, next);
    }
  }

  // The thread count of the region `tag`, 0 once another region is being set up.
  int region_threads(uint32_t tag) {
    const uint64_t shape = shape_.load(std::memory_order_acquire);
    return static_cast<uint32_t>(shape >> 32) == tag ? static_cast<int>(shape & 0xFFFFFFFFu) : 0;
  }

  uint32_t wait_for_region(uint32_t seen) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int polls = 0;; ++polls) {
      const uint32_t now = generation_.load(std::memory_order_acquire);
      if (now != seen) return now;
      _mm_pause();
      if ((polls & 63) != 63) continue;
      if (std::chrono::steady_clock::now() > until) break;
      sched_yield();  // to any other thread this core has to run: OpenMP's team in a GEMM, the scheduler's processes
    }
    for (;;) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (generation_.load(std::memory_order_seq_cst) == seen) futex(FUTEX_WAIT_PRIVATE, static_cast<int>(seen));
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      const uint32_t now = generation_.load(std::memory_order_acquire);
      if (now != seen) return now;
    }
  }

  void wait_for_items() {
    for (int polls = 0; remaining_.load(std::memory_order_acquire) > 0; ++polls) {
      _mm_pause();
      if (polls > 4096) sched_yield();  // the worker holding the last item may be waiting for this core
    }
  }

  long futex(int op, int value) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), op, value, nullptr, nullptr, 0);
  }

  Share shares_[kMaxThreads];
  alignas(64) std::atomic<uint32_t> generation_{0};
  std::atomic<const Region*> region_{nullptr};
  std::atomic<uint64_t> shape_{0};  // the tag << 32 | the thread count of the region region_ holds
  alignas(64) std::atomic<int64_t> remaining_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<bool> busy_{false};
  static inline std::atomic<ElasticPool*> constructed_{nullptr};  // for the fork handler, which must not wait on
                                                                   // instance()'s guard (held by a thread now gone)
  int workers_ = 0;
};

}  // namespace pagedserve
