// A probe of how a kernel extension was built (#29): the number of distinct threads at::parallel_for runs `items`
// one-item chunks on. ATen's parallel_for is a plain serial loop in a translation unit compiled without OpenMP
// (_OPENMP undefined), so a build that lost -fopenmp answers 1 however many threads torch is given; an OpenMP build
// answers min(items, at::get_num_threads()). Registered by each extension as threads_used(int items) -> int.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

namespace pagedserve {

inline int64_t threads_used(int64_t items) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << (at::get_thread_num() % 64), std::memory_order_relaxed);
  });
  return __builtin_popcountll(seen.load());
}

}  // namespace pagedserve
