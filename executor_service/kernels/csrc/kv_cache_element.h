// A KV cache's element as the attention kernel (attention/csrc) and the fused RoPE write (model/csrc) share it: float32,
// or float16 under --kv-cache-dtype float16. check_caches refuses anything else; store_row writes a row of floats.
// On the include path of every extension executor_service/kernels/build.py builds.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace pagedserve {

// Both caches on the CPU, float32 or float16, and the same.
inline void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  for (const at::Tensor* cache : {&k_cache, &v_cache})
    TORCH_CHECK(cache->device().is_cpu() && (cache->scalar_type() == at::kFloat || cache->scalar_type() == at::kHalf),
                cache == &k_cache ? "k_cache" : "v_cache", " must be a float32 or float16 CPU tensor");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k/v caches differ");
}

// n floats into a cache row: copied into a float32 cache, rounded to nearest even into a float16 one (as torch's
// .to(torch.float16), so the C++ writes and the reference's agree bit for bit).
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void store_row(c10::Half* dst, const float* src, int64_t n) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = c10::Half(src[i]);
}

}  // namespace pagedserve
