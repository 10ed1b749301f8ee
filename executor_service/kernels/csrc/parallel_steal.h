// Items of work over torch's OpenMP team, each thread starting on a contiguous share of its own, and a thread that
// finishes its share early (preempted siblings, uneven shares) taking the items left at the back of the others'
// (#29). A statically cut region lasts as long as its slowest share: when the OS preempts one of the team's threads
// (a 2-core box that also runs the scheduler's processes), the other finished its share and waited, so the step lost
// twice the CPU the preemption took. With stealing it runs the preempted thread's remaining items.
// On the include path of every extension executor_service/kernels/build.py builds.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

namespace pagedserve {

// The items [front, back) of one share not yet taken; the owner takes from the front, others from the back.
class alignas(64) Share {
 public:
  void reset(int64_t front, int64_t back) { range_.store(pack(front, back), std::memory_order_relaxed); }

  // The front item into `item` (and the one after it, if still in the share, into `next`, else -1).
  bool take_front(int64_t& item, int64_t& next) {
    uint64_t range = range_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = front_of(range), back = back_of(range);
      if (front >= back) return false;
      if (range_.compare_exchange_weak(range, pack(front + 1, back), std::memory_order_acq_rel)) {
        item = front;
        next = front + 1 < back ? front + 1 : -1;
        return true;
      }
    }
  }

  // The back item into `item` (and the one before it, if still in the share, into `next`, else -1).
  bool take_back(int64_t& item, int64_t& next) {
    uint64_t range = range_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = front_of(range), back = back_of(range);
      if (front >= back) return false;
      if (range_.compare_exchange_weak(range, pack(front, back - 1), std::memory_order_acq_rel)) {
        item = back - 1;
        next = back - 2 >= front ? back - 2 : -1;
        return true;
      }
    }
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
  }
  static int64_t front_of(uint64_t range) { return static_cast<int64_t>(range & 0xFFFFFFFFu); }
  static int64_t back_of(uint64_t range) { return static_cast<int64_t>(range >> 32); }

  std::atomic<uint64_t> range_{0};
};

// f(state, item, next) for every item in [0, starts.back()), state = make_state() once per thread (scratch
// buffers): thread t's share is [starts[t], starts[t + 1]) (starts[0] == 0, fewer than 2^32 items); `next` is the
// item this thread most likely runs after `item` (to prefetch for), -1 where none is known. A thread given several
// shares (a team smaller than the shares, or a nested call, which runs on one thread) runs them all front to back
// before it steals.
template <class MakeState, class F>
void parallel_steal(const std::vector<int64_t>& starts, MakeState&& make_state, F&& f) {
  TORCH_CHECK(!starts.empty() && starts.front() == 0 && starts.back() < (int64_t{1} << 32) &&
                  std::is_sorted(starts.begin(), starts.end()),
              "parallel_steal: shares must cut [0, n) in order, n < 2^32");
  const int64_t threads = static_cast<int64_t>(starts.size()) - 1;
  if (threads <= 1 || at::in_parallel_region()) {
    auto state = make_state();
    const int64_t n = starts.back();
    for (int64_t i = 0; i < n; ++i) f(state, i, i + 1 < n ? i + 1 : -1);
    return;
  }
  const std::unique_ptr<Share[]> shares(new Share[threads]);
  for (int64_t t = 0; t < threads; ++t) shares[t].reset(starts[t], starts[t + 1]);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    auto state = make_state();
    int64_t item = 0, next = -1;
    for (int64_t t = first; t < last; ++t)
      while (shares[t].take_front(item, next)) f(state, item, next);
    for (int64_t k = 0; k < threads; ++k)
      if (k < first || k >= last)
        while (shares[k].take_back(item, next)) f(state, item, next);
  });
}

// The same without a per-thread state: f(item, next).
template <class F>
void parallel_steal(const std::vector<int64_t>& starts, F&& f) {
  parallel_steal(starts, [] { return 0; }, [&](int, int64_t item, int64_t next) { f(item, next); });
}

// Threads for `items` items: torch's thread count, at most one per item, at least one.
inline int64_t team_size(int64_t items) { return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)); }

// Even shares of n items over team_size(n) threads.
inline std::vector<int64_t> even_shares(int64_t n) {
  const int64_t threads = team_size(n);
  std::vector<int64_t> starts(threads + 1);
  for (int64_t t = 0; t <= threads; ++t) starts[t] = n * t / threads;
  return starts;
}

// A probe of the stealing (tests): `items` items in even shares; the team's first thread, whose share is the first,
// holds the first item it runs until other threads have run all but one of that share's items (at most `wait_ms`),
// as a thread preempted for long would. Returns how many of the first share's items other threads ran, or -1 if any
// item ran other than once.
inline int64_t stolen_items(int64_t items, int64_t wait_ms) {
  const std::vector<int64_t> starts = even_shares(items);
  const int64_t share = starts.size() > 2 ? starts[1] : 0;
  std::vector<std::atomic<int>> runner(items), runs(items);
  for (auto& r : runner) r = -1;
  const auto others_ran = [&] {
    int64_t count = 0;
    for (int64_t i = 0; i < share; ++i) count += runner[i].load() > 0;
    return count;
  };
  std::atomic<bool> held{false};
  parallel_steal(starts, [&](int64_t item, int64_t) {
    const int me = at::get_thread_num();
    runner[item] = me;
    ++runs[item];
    if (me != 0 || held.exchange(true)) return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
    while (others_ran() < share - 1 && std::chrono::steady_clock::now() < until) {
    }
  });
  for (const auto& count : runs)
    if (count.load() != 1) return -1;
  return others_ran();
}

}  // namespace pagedserve
