// Items of work over the kernels' thread pool (elastic_pool.h), each thread starting on a contiguous share of its
// own, and a thread that finishes its share early (preempted siblings, uneven shares) taking the items left at the
// back of the others' (#29). A statically cut region lasts as long as its slowest share: when the OS preempts one of
// the threads (a 2-core box that also runs the scheduler's processes), the other finished its share and waited, so
// the step lost twice the CPU the preemption took. With stealing it runs the preempted thread's remaining items.
// On the include path of every extension executor_service/kernels/build.py builds.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "elastic_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

namespace pagedserve {

// parallel_steal (below) on the pool, for fewer than Share::kMaxItems items.
template <class MakeState, class F>
void steal_on_pool(const std::vector<int64_t>& starts, MakeState& make_state, F& f) {
  const int64_t threads = static_cast<int64_t>(starts.size()) - 1, n = starts.back();
  const auto run_alone = [&] {
    auto state = make_state();
    for (int64_t i = 0; i < n; ++i) f(state, i, i + 1 < n ? i + 1 : -1);
  };
  if (threads <= 1 || threads > ElasticPool::kMaxThreads || at::in_parallel_region() || pool_thread_index != 0)
    return run_alone();
  struct Body {
    MakeState& make_state;
    F& f;
    std::atomic<bool> failed{false};
    std::exception_ptr error;  // the first item's exception, rethrown on the caller

    void fail(std::exception_ptr e) {
      if (!failed.exchange(true)) error = std::move(e);
    }
  } body{make_state, f};
  // An exception ends this thread's part: the item it held is counted done, and so is every item it can still take
  // (the region stops early); a worker's would otherwise end the process, a caller's leave the region running.
  Region region{[](const Region& r, int me, uint32_t tag, int64_t item, int64_t next) {
                  Body& b = *static_cast<Body*>(r.body);
                  const int threads = r.threads;
                  ElasticPool& pool = ElasticPool::instance();
                  try {
                    auto state = b.make_state();
                    for (;;) {
                      b.f(state, item, next);
                      const bool more = pool.claim(tag, threads, me, item, next);
                      pool.finish_item();  // with no item claimed, the region (r, b) may end here
                      if (!more) return;
                    }
                  } catch (...) {
                    b.fail(std::current_exception());
                    pool.finish_item();
                    while (pool.claim(tag, threads, me, item, next)) pool.finish_item();
                  }
                },
                &body, 0};
  if (!ElasticPool::instance().run(region, starts)) return run_alone();
  if (body.failed.load()) std::rethrow_exception(body.error);
}

// f(state, item, next) for every item in [0, starts.back()), state = make_state() once per thread (scratch
// buffers): thread t's share is [starts[t], starts[t + 1]) (starts[0] == 0); `next` is the item this thread most
// likely runs after `item` (to prefetch for), -1 where none is known. The calling thread takes share 0 and the pool's
// workers the others; a thread done with its share takes items from the back of the others'. Runs on the calling
// thread alone where there is one share, inside another region (OpenMP's or the pool's), or while the pool runs
// another caller's region; a thread given several shares runs them front to back before it steals.
template <class MakeState, class F>
void parallel_steal(const std::vector<int64_t>& starts, MakeState&& make_state, F&& f) {
  TORCH_CHECK(!starts.empty() && starts.front() == 0 && std::is_sorted(starts.begin(), starts.end()),
              "parallel_steal: shares must cut [0, n) in order");
  const int64_t n = starts.back();
  if (n < Share::kMaxItems) return steal_on_pool(starts, make_state, f);
  // More items than a share counts: consecutive items in groups, each handed out as one item.
  const int64_t size = n / (Share::kMaxItems - 1) + 1;
  std::vector<int64_t> groups(starts.size());
  for (size_t t = 0; t < starts.size(); ++t) groups[t] = (starts[t] + size - 1) / size;
  using State = decltype(make_state());
  auto grouped = [&](State& state, int64_t group, int64_t) {
    const int64_t end = std::min(n, (group + 1) * size);
    for (int64_t i = group * size; i < end; ++i) f(state, i, i + 1 < end ? i + 1 : -1);
  };
  steal_on_pool(groups, make_state, grouped);
}

// The same without a per-thread state: f(item, next).
template <class F>
void parallel_steal(const std::vector<int64_t>& starts, F&& f) {
  parallel_steal(starts, [] { return 0; }, [&](int, int64_t item, int64_t next) { f(item, next); });
}

// Threads for `items` items: torch's thread count, at most one per item and the pool's most, at least one.
inline int64_t team_size(int64_t items) {
  return std::max<int64_t>(1, std::min<int64_t>({at::get_num_threads(), items, ElasticPool::kMaxThreads}));
}

// Even shares of n items over team_size(n) threads.
inline std::vector<int64_t> even_shares(int64_t n) {
  const int64_t threads = team_size(n);
  std::vector<int64_t> starts(threads + 1);
  for (int64_t t = 0; t <= threads; ++t) starts[t] = n * t / threads;
  return starts;
}

// f(begin, end) over [0, n) in ranges of `grain` items (the last one shorter), on the pool as parallel_steal:
// at::parallel_for's contract, without OpenMP's team.
template <class F>
void parallel_ranges(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  grain = std::max(grain, int64_t{1});
  const int64_t ranges = (n + grain - 1) / grain;
  if (ranges == 1) return f(int64_t{0}, n);
  parallel_steal(even_shares(ranges), [&](int64_t r, int64_t) { f(r * grain, std::min(n, (r + 1) * grain)); });
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
    const int me = pool_thread_index;
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

// Probes of the pool (tests). The pool this extension runs its regions on (one per process: every extension answers
// the same).
inline int64_t pool_address() { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&ElasticPool::instance())); }

// How many distinct threads ran `items` one-item ranges (each holding its item ~0.2 ms, so every thread joins).
inline int64_t pool_threads_used(int64_t items) {
  std::atomic<uint64_t> seen{0};
  parallel_ranges(items, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << (pool_thread_index % 64), std::memory_order_relaxed);
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (std::chrono::steady_clock::now() < until) {
    }
  });
  return __builtin_popcountll(seen.load());
}

// `regions` regions of `items` items back to back, each item adding its region's number to its slot: the regions
// whose items did not all run exactly once, in the region they were handed out in (workers arriving late into the
// next one must take nothing of the last). 0 when the pool is sound.
inline int64_t pool_faulty_regions(int64_t regions, int64_t items) {
  std::vector<std::atomic<int64_t>> sum(items);
  int64_t faulty = 0;
  for (int64_t r = 1; r <= regions; ++r) {
    for (auto& s : sum) s.store(0, std::memory_order_relaxed);
    parallel_steal(even_shares(items), [&](int64_t item, int64_t) { sum[item].fetch_add(r); });
    bool sound = true;
    for (const auto& s : sum) sound = sound && s.load() == r;
    faulty += !sound;
  }
  return faulty;
}

// A region whose item `failing` throws: true if the exception reached the caller and the pool still runs the next
// region on every thread (tests).
inline bool pool_rethrows(int64_t items, int64_t failing) {
  try {
    parallel_ranges(items, 1, [&](int64_t begin, int64_t) { TORCH_CHECK(begin != failing, "item ", failing); });
    return false;
  } catch (const c10::Error&) {
    return pool_threads_used(64) == team_size(64) && pool_faulty_regions(100, items) == 0;
  }
}

}  // namespace pagedserve
