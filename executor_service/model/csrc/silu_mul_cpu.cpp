// The MLP's activation in one pass: silu(gate) * up over the fused gate/up projection's output, into a new
// contiguous tensor (torch takes a pass for the SiLU and another for the product, and the down projection then
// reads a strided half). silu(g) = g / (1 + e^-g), then times up, each step rounded as torch's; e^x comes from
// Cephes' expf polynomial (cpu_simd.h, within 2 ulp; 16 lanes with AVX-512, 8 with AVX2 and FMA; torch uses
// SLEEF's) with -g clamped from below at -87.3 (above 87.3, g / (1 + e^-g) is g), and from std::exp for vectors
// with a gate below -88.3 and elsewhere, so the result equals torch's up to rounding, its -0, infinities and NaNs
// included.
// Registered as torch.ops.pagedserve_model.silu_and_mul; built by executor_service/model/cpu_ops.py.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_simd.h"
#include "parallel_steal.h"

namespace {

ALWAYS_INLINE float silu_mul_one(float gate, float up) { return gate / (1.0f + std::exp(-gate)) * up; }

// Lanes whose gate is below kVectorLowest go to silu_mul_one: there e^-g outgrows the vector exponential's range
// (g / (1 + e^-g) is then a tiny negative, -0 once e^-g overflows, NaN at -inf), which it must not clamp.
constexpr float kVectorLowest = -88.3f;

void silu_mul_row(const float* __restrict gate, const float* __restrict up, float* __restrict out, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.0f), lowest = _mm512_set1_ps(-87.3f), low_gate = _mm512_set1_ps(kVectorLowest);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    if (_mm512_cmp_ps_mask(g, low_gate, _CMP_LT_OQ)) {
      for (int64_t j = i; j < i + 16; ++j) out[j] = silu_mul_one(gate[j], up[j]);
      continue;
    }
    const __m512 minus_g = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), lowest);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, pagedserve::exp16(minus_g)));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.0f), lowest = _mm256_set1_ps(-87.3f), low_gate = _mm256_set1_ps(kVectorLowest);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(g, low_gate, _CMP_LT_OQ))) {
      for (int64_t j = i; j < i + 8; ++j) out[j] = silu_mul_one(gate[j], up[j]);
      continue;
    }
    const __m256 minus_g = _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), lowest);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, pagedserve::exp8(minus_g)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = silu_mul_one(gate[i], up[i]);
}

// Rows per parallel chunk: at least kChunkElems elements, so that a chunk's work (~10 ns per 16 elements) outweighs
// waking a team thread for it (25 - 75 us with sleeping OpenMP threads, #29); a decode step's few rows stay on one
// thread and skip the parallel region altogether.
constexpr int64_t kChunkElems = 1 << 16;
int64_t chunk_rows(int64_t row_elems) {
  return std::max<int64_t>(16, kChunkElems / std::max<int64_t>(1, row_elems));
}

// gate_up [T, 2 I] (rows may be strided): returns silu(gate_up[:, :I]) * gate_up[:, I:], a new contiguous [T, I].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 &&
                  gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "gate_up must be a float32 CPU matrix of contiguous rows of even length");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, ld = gate_up.stride(0);
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  pagedserve::parallel_ranges(T, chunk_rows(I), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) silu_mul_row(in + t * ld, in + t * ld + I, op + t * I, I);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_model, m) { m.def("silu_and_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedserve_model, CPU, m) { m.impl("silu_and_mul", silu_and_mul); }
