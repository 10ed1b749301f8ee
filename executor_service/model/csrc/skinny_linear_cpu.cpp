// Linear layers for skinny batches (a few rows) that stream the weight from memory at the machine's read bandwidth.
//
// A decode step of a few sequences reads every weight once and does little arithmetic per byte: it is bound by
// memory bandwidth. MKL's sgemm does not keep the memory busy while it computes (8 layers + LM head of the 32M
// benchmark model, weights cold: 4 rows 13.5 ms against 9.9 ms here, 16 rows 19.9 against 16.8). This kernel
// reads the weight in place ([out, in], the layout F.linear takes, so no second copy): a tile is 4 weight rows
// by up to 6 rows of x, 24 dot products kept in 24 AVX-512 registers along `in`, reduced 16 at a time at the end;
// the x rows' tiles reuse the 4 weight rows from cache, and while they compute, the weight rows kPrefetchBlocks
// tiles ahead are prefetched into L2 evenly over the tile's iterations. Equal to F.linear up to rounding (the
// order of the sums differs). AVX-512 only (has_skinny() says whether it was built so); in_features a multiple
// of 16 and out_features a multiple of 4.
// Registered as torch.ops.pagedserve_model.{skinny_linear,has_skinny}; built by executor_service/model/cpu_ops.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "cpu_simd.h"
#include "parallel_probe.h"

namespace {

constexpr int64_t kCols = 4;  // weight rows (outputs) per tile
constexpr int64_t kRows = 6;  // x rows per tile (6 x 4 beats 4 x 4 by 5 - 10% at 12 - 32 rows)
constexpr int64_t kLane = 16;

#ifdef __AVX512F__
constexpr int64_t kPrefetchBlocks = 2;

using pagedserve::sum_lanes16;

// Cache lines still to prefetch, handed out a few per iteration.
struct Prefetcher {
  const float* next;
  int64_t lines_left;
  int64_t per_iteration;

  ALWAYS_INLINE void step() {
    for (int64_t j = 0; j < per_iteration && lines_left > 0; ++j, --lines_left, next += kLane)
      _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
  }
};

// out[r, c] = x[r] . w[c] (+ bias[c]) for r < R, c < kCols.
template <int64_t R>
ALWAYS_INLINE void tile(const float* x, const float* w, int64_t K, const float* bias, float* out, int64_t ldo,
                        Prefetcher& prefetch) {
  constexpr int64_t kAccs = (R * kCols + kLane - 1) / kLane * kLane;  // whole groups of 16 for sum_lanes16
  __m512 acc[kAccs];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kLane) {
    prefetch.step();
    __m512 wv[kCols];
    for (int64_t c = 0; c < kCols; ++c) wv[c] = _mm512_loadu_ps(w + c * K + k);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int64_t c = 0; c < kCols; ++c) acc[r * kCols + c] = _mm512_fmadd_ps(xv, wv[c], acc[r * kCols + c]);
    }
  }
  alignas(64) float sums[kAccs];
  for (int64_t g = 0; g < kAccs; g += kLane) _mm512_store_ps(sums + g, sum_lanes16(acc + g));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < kCols; ++c) out[r * ldo + c] = bias ? sums[r * kCols + c] + bias[c] : sums[r * kCols + c];
}

// Output columns [block0 * kCols, block1 * kCols) of out [M, N] = x [M, K] @ w [N, K]^T (+ bias).
void column_blocks(const float* x, const float* w, const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                   int64_t block0, int64_t block1) {
  const int64_t lines = kCols * K / kLane, iterations = (M + kRows - 1) / kRows * (K / kLane);
  for (int64_t b = block0; b < block1; ++b) {
    const float* wb = w + b * kCols * K;
    Prefetcher prefetch{wb + kPrefetchBlocks * kCols * K, b + kPrefetchBlocks < block1 ? lines : 0,
                        (lines + iterations - 1) / iterations};
    const float* bb = bias ? bias + b * kCols : nullptr;
    float* ob = out + b * kCols;
    int64_t m = 0;
    for (; m + kRows <= M; m += kRows) tile<kRows>(x + m * K, wb, K, bb, ob + m * N, N, prefetch);
    switch (M - m) {
      case 5: tile<5>(x + m * K, wb, K, bb, ob + m * N, N, prefetch); break;
      case 4: tile<4>(x + m * K, wb, K, bb, ob + m * N, N, prefetch); break;
      case 3: tile<3>(x + m * K, wb, K, bb, ob + m * N, N, prefetch); break;
      case 2: tile<2>(x + m * K, wb, K, bb, ob + m * N, N, prefetch); break;
      case 1: tile<1>(x + m * K, wb, K, bb, ob + m * N, N, prefetch); break;
      default: break;
    }
  }
}
#endif  // __AVX512F__

bool has_skinny() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

// y [rows, out] = x [rows, in] @ weight^T (+ bias).
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_skinny(), "skinny_linear needs a build with AVX-512");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous(), "weight must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "x has ", K, " features, the weight ", weight.size(1));
  TORCH_CHECK(K > 0 && K % kLane == 0 && N % kCols == 0, "skinny_linear needs in_features a multiple of ", kLane,
              " and out_features a multiple of ", kCols, ", got ", K, " and ", N);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N &&
                    bias->is_contiguous(), "bias must be a contiguous float32 [out]");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
#ifdef __AVX512F__
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (M > 0)
    at::parallel_for(0, N / kCols, 16, [&](int64_t block0, int64_t block1) {
      column_blocks(xp, wp, b, op, M, N, K, block0, block1);
    });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_model, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("has_skinny() -> bool", has_skinny);
  m.def("threads_used(int items) -> int", pagedserve::threads_used);
}

TORCH_LIBRARY_IMPL(pagedserve_model, CPU, m) { m.impl("skinny_linear", skinny_linear); }
