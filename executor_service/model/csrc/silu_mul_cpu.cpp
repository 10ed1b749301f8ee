// The MLP's activation in one pass: silu(gate) * up over the fused gate/up projection's output, into a new
// contiguous tensor (torch takes a pass for the SiLU and another for the product, and the down projection then
// reads a strided half). silu(g) = g / (1 + e^-g), then times up, each step rounded as torch's; e^x comes from
// Cephes' expf polynomial (cpu_simd.h, within 2 ulp; 16 lanes with AVX-512, 8 with AVX2 and FMA, std::exp
// elsewhere; torch uses SLEEF's) with -g clamped to [-87.3, 88.3] (beyond it g / (1 + e^-g) is g, or g * 5e-39
// where torch's is -0), so the result equals torch's up to rounding.
// Registered as torch.ops.pagedserve_model.silu_and_mul; built by executor_service/model/cpu_ops.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_simd.h"

namespace {

void silu_mul_row(const float* __restrict gate, const float* __restrict up, float* __restrict out, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.0f), lowest = _mm512_set1_ps(-87.3f), highest = _mm512_set1_ps(88.3f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 minus_g = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), lowest), highest);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, pagedserve::exp16(minus_g)));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.0f), lowest = _mm256_set1_ps(-87.3f), highest = _mm256_set1_ps(88.3f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 minus_g = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), lowest), highest);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, pagedserve::exp8(minus_g)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
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
  at::parallel_for(0, T, chunk_rows(I), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) silu_mul_row(in + t * ld, in + t * ld + I, op + t * I, I);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_model, m) { m.def("silu_and_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedserve_model, CPU, m) { m.impl("silu_and_mul", silu_and_mul); }
