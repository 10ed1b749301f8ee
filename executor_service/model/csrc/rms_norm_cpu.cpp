// RMSNorm of float32 rows in one pass each, optionally after adding a layer's output into the residual stream
// (vLLM's fused_add_rms_norm): torch's rms_norm is a chain of about eight ops on the CPU (pow, sum, div, add,
// rsqrt, two muls), each a dispatch and a pass over the rows, which at a few rows costs more than the arithmetic.
// Hugging Face's formula, weight * (x * rsqrt(mean(x^2) + eps)), each product rounded (-ffp-contract=off);
// the sum of squares is taken in another order than torch's, so the result equals it up to rounding.
// Registered as torch.ops.pagedserve_model.{rms_norm,add_rms_norm}; built by executor_service/model/cpu_ops.py.

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

float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float sum = 0.0f;
#ifdef __AVX512F__
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (; i + 64 <= n; i += 64)
    for (int j = 0; j < 4; ++j) {
      const __m512 v = _mm512_loadu_ps(x + i + 16 * j);
      acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(v, v));
    }
  sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
#endif
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

void norm_row(const float* __restrict x, const float* __restrict weight, float eps, float* __restrict out,
              int64_t n) {
  const float rstd = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * rstd);
}

void add_row(const float* __restrict x, float* __restrict residual, int64_t n) {
  for (int64_t i = 0; i < n; ++i) residual[i] += x[i];
}

void check_rows(const at::Tensor& t, const char* name, int64_t hidden) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(1) == hidden &&
                  t.stride(1) == 1, name, " must be a float32 CPU matrix of rows of ", hidden, " contiguous values");
}

void check_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.is_contiguous(), "weight must be a contiguous float32 CPU vector");
}

// Rows per parallel chunk: at least kChunkElems elements, so that a chunk's work (~10 ns per 16 elements) outweighs
// waking a team thread for it (25 - 75 us with sleeping OpenMP threads, #29); a decode step's few rows stay on one
// thread and skip the parallel region altogether.
constexpr int64_t kChunkElems = 1 << 16;
int64_t chunk_rows(int64_t row_elems) {
  return std::max<int64_t>(16, kChunkElems / std::max<int64_t>(1, row_elems));
}

// The norm of each row of x [T, H]: a new contiguous [T, H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_weight(weight);
  const int64_t H = weight.size(0);
  check_rows(x, "x", H);
  at::Tensor out = at::empty({x.size(0), H}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  pagedserve::parallel_ranges(x.size(0), chunk_rows(H), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) norm_row(xp + t * ldx, wp, static_cast<float>(eps), op + t * H, H);
  });
  return out;
}

// residual += x (in place), then the norm of each row of the sum: a new contiguous [T, H].
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_weight(weight);
  const int64_t H = weight.size(0);
  check_rows(x, "x", H);
  check_rows(residual, "residual", H);
  TORCH_CHECK(x.size(0) == residual.size(0), "x has ", x.size(0), " rows, the residual ", residual.size(0));
  at::Tensor out = at::empty({x.size(0), H}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *rp = residual.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldr = residual.stride(0);
  pagedserve::parallel_ranges(x.size(0), chunk_rows(H), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      add_row(xp + t * ldx, rp + t * ldr, H);
      norm_row(rp + t * ldr, wp, static_cast<float>(eps), op + t * H, H);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_model, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_model, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
}
