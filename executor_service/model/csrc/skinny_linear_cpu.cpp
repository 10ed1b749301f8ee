// Linear layers for skinny batches (a few rows) that stream the weight from memory at the machine's read bandwidth.
//
// A decode step of a few sequences reads every weight once and does little arithmetic per byte: it is bound by
// memory bandwidth. MKL's sgemm does not keep the memory busy while it computes (8 layers + LM head of the 32M
// benchmark model, weights cold: 4 rows 13.5 ms against 9.9 ms here, 16 rows 19.9 against 16.8).
//
// The weight is read in panels of 64 output columns, each [in, 64] (pack_skinny_panels lays them out once; a
// linear keeps them beside its GEMM's pack): a tile is up to 6 rows of x by the panel's 64 columns, 24 registers of
// outer products (one x value broadcast times 4 x 16 weights per step along `in`), stored with no horizontal sums;
// the x rows' tiles reuse the panel from L2 while the next panel is prefetched into L2, evenly over the tile's
// iterations. On an AMD Zen 4 (2 cores) that is 1.1 - 1.4x the former kernel (4 weight rows x 6 x rows of dot
// products along `in` over the weight in place, reduced at the end) at 2 - 64 rows, and 1.1 - 1.4x oneDNN's packed
// GEMM up to 64 rows (BENCHMARKS.md section 17, eighth session).
// skinny_panel_linear reads the panels; skinny_linear reads the weight [out, in] in place (until a linear's packs
// are made), packing each panel into a scratch panel first, so both sum in the same order: equal bit for bit.
// Equal to F.linear up to rounding (the sums run along `in` in order, one fused multiply-add each). Built with
// AVX-512, or with AVX2 and FMA (a CPU without AVX-512, e.g. AMD Zen 2/3): there tiles of 6 x rows by a quarter panel
// (16 columns, 2 vectors of 8) over chunks of 64 steps along `in` read from L1, the next chunk prefetched (on a Zen 3,
// over the benchmark model's linears, 1.1 - 1.4x the former 3 x 32 tiles over whole panels at 2 - 8 rows, even from
// 20: BENCHMARKS.md section 17, tenth session), the same sums in the same order; has_skinny() says whether it was
// built either way.
// skinny_linear needs in_features a multiple of 16 and out_features a multiple of 4 (model/packed.py's can_skinny).
// Registered as torch.ops.pagedserve_model.{skinny_linear,pack_skinny_panels,skinny_panel_linear,has_skinny};
// built by executor_service/model/cpu_ops.py.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"
#include "parallel_probe.h"
#include "parallel_steal.h"

namespace {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define SKINNY_SIMD 1
#include <immintrin.h>
#endif

constexpr int64_t kCols = 4;  // skinny_linear's weight: out_features a multiple of this
constexpr int64_t kRows = 6;    // x rows per tile: 24 accumulators of 16 lanes (AVX2: 12 of 8 lanes)
constexpr int64_t kLane = 16;   // floats per cache line and per AVX-512 vector
constexpr int64_t kPanel = 64;  // output columns per panel: 4 vectors of 16 (AVX2: four quarters of 2 vectors of 8)

#ifdef __AVX512F__
// dst[j * ldd + i] = src[i * lds + j] for i, j < 16, rows i >= rows taken as zeros: four rounds of shuffles.
ALWAYS_INLINE void transpose16(const float* src, int64_t lds, int64_t rows, float* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int64_t i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_ps(src + i * lds) : _mm512_setzero_ps();
  for (int64_t i = 0; i < 8; ++i) {  // per 128-bit lane L: (a[4L], b[4L], a[4L+1], b[4L+1]) and the next two
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  const auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  const auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int64_t g = 0; g < 4; ++g) {  // r[4g + q], lane L: rows 4g .. 4g + 3 of column 4L + q
    r[4 * g] = lo(t[4 * g], t[4 * g + 2]);
    r[4 * g + 1] = hi(t[4 * g], t[4 * g + 2]);
    r[4 * g + 2] = lo(t[4 * g + 1], t[4 * g + 3]);
    r[4 * g + 3] = hi(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int64_t q = 0; q < 4; ++q) {
    const __m512 u0 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0x44), u1 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0xEE),
                 u2 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0x44),
                 u3 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0xEE);
    _mm512_storeu_ps(dst + q * ldd, _mm512_shuffle_f32x4(u0, u2, 0x88));
    _mm512_storeu_ps(dst + (4 + q) * ldd, _mm512_shuffle_f32x4(u0, u2, 0xDD));
    _mm512_storeu_ps(dst + (8 + q) * ldd, _mm512_shuffle_f32x4(u1, u3, 0x88));
    _mm512_storeu_ps(dst + (12 + q) * ldd, _mm512_shuffle_f32x4(u1, u3, 0xDD));
  }
}
#endif

// Panel p of the weight [N, K] into dst [K, 64]: dst[k, c] = w[p * 64 + c, k], zeros past N; 16 x 16 blocks
// transposed in registers, the columns past the last whole 16 one by one.
void pack_panel(const float* w, int64_t N, int64_t K, int64_t p, float* dst) {
  const int64_t columns = std::min(kPanel, N - p * kPanel);
  int64_t k0 = 0;
#ifdef __AVX512F__
  for (; k0 + kLane <= K; k0 += kLane)
    for (int64_t c0 = 0; c0 < kPanel; c0 += kLane)
      transpose16(w + (p * kPanel + c0) * K + k0, K, std::max<int64_t>(0, columns - c0), dst + k0 * kPanel + c0,
                  kPanel);
#endif
  for (int64_t c = 0; c < kPanel; ++c) {
    const float* row = w + (p * kPanel + c) * K;
    for (int64_t k = k0; k < K; ++k) dst[k * kPanel + c] = c < columns ? row[k] : 0.f;
  }
}

#ifdef SKINNY_SIMD
#ifdef __AVX512F__
constexpr auto kPrefetchHint = _MM_HINT_T1;  // the next panel, into L2
#else
constexpr auto kPrefetchHint = _MM_HINT_T0;  // AVX2: the next chunk of kChunk steps along `in`, into L1
#endif

// Cache lines to prefetch, spread evenly over a known number of iterations: each step earns `lines` credits and
// fetches a line for every `iterations` of them, so the last of `iterations` steps fetches the last line. Handing
// them out a few per step from the first one instead front-loads a tile's fetches when there are more iterations
// than lines (over 6 rows): its first tile stalls on the misses while the rest fetch nothing (on a Zen 3, the
// benchmark model's linears at 8 - 32 rows 1.1 - 1.2x: BENCHMARKS.md section 17, twelfth session).
struct Prefetcher {
  const float* next;
  int64_t lines;
  int64_t iterations;
  int64_t credit;

  ALWAYS_INLINE void step() {
    for (credit += lines; credit >= iterations; credit -= iterations, next += kLane)
      _mm_prefetch(reinterpret_cast<const char*>(next), kPrefetchHint);
  }
};

// `floats` from `next` prefetched evenly over `iterations` steps.
Prefetcher spread(const float* next, int64_t floats, int64_t iterations) {
  return Prefetcher{next, floats / kLane, std::max<int64_t>(1, iterations), 0};
}

// f(std::integral_constant<int64_t, R>{}, m) for tiles of rows [m, m + R) covering [0, M): whole tiles of kRows rows,
// then one of the rows left.
template <typename F>
ALWAYS_INLINE void for_row_tiles(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) f(std::integral_constant<int64_t, kRows>{}, m);
  switch (M - m) {
    case 5: f(std::integral_constant<int64_t, 5>{}, m); break;
    case 4: f(std::integral_constant<int64_t, 4>{}, m); break;
    case 3: f(std::integral_constant<int64_t, 3>{}, m); break;
    case 2: f(std::integral_constant<int64_t, 2>{}, m); break;
    case 1: f(std::integral_constant<int64_t, 1>{}, m); break;
    default: break;
  }
}

#ifdef __AVX512F__
// The columns of a panel's vector c that exist (the last panel may be cut short by out_features).
ALWAYS_INLINE __mmask16 vector_mask(int64_t columns, int64_t c) {
  const int64_t n = columns - c * kLane;
  return n >= kLane ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// out[r, :columns] = x[r] @ panel (+ bias) for r < R; the panel is [K, 64].
template <int64_t R>
ALWAYS_INLINE void panel_tile(const float* x, const float* panel, int64_t K, const float* bias, int64_t columns,
                              float* out, int64_t ldo, Prefetcher& prefetch) {
  __m512 acc[R][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    prefetch.step();
    const float* wk = panel + k * kPanel;
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32),
                 w3 = _mm512_loadu_ps(wk + 48);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
    }
  }
  for (int64_t c = 0; c < 4; ++c) {
    const __mmask16 mask = vector_mask(columns, c);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c * kLane) : _mm512_setzero_ps();
    for (int64_t r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo + c * kLane, mask, _mm512_add_ps(acc[r][c], b));
  }
}

// Panel p's columns of out [M, N] = x [M, K] @ weight^T (+ bias), from the panel [K, 64]; `next_floats` floats from
// `next` (the next panel) prefetched into L2 evenly over the tiles' iterations.
void panel_rows(const float* x, const float* panel, const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                int64_t p, const float* next, int64_t next_floats) {
  const int64_t columns = std::min(kPanel, N - p * kPanel);
  const float* pb = bias ? bias + p * kPanel : nullptr;
  float* po = out + p * kPanel;
  Prefetcher prefetch = spread(next, next_floats, (M + kRows - 1) / kRows * K);
  for_row_tiles(M, [&](auto rows, int64_t m) {
    panel_tile<rows.value>(x + m * K, panel, K, pb, columns, po + m * N, N, prefetch);
  });
}
#else
constexpr int64_t kChunk = 64;  // steps along `in` per pass of the AVX2 tiles: 16 KiB of a panel, read from L1

// AVX2: lanes [0, n) of 8 set (the columns of an 8-wide vector that exist).
ALWAYS_INLINE __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(n, 0, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 floats at p, of which the lanes in `mask` exist: a plain load or store where all 8 do (`whole`), a masked one
// only at the end of a short last panel. AMD's Zen 1 - 3 microcode masked moves, a masked store among them ~10x
// slower than a plain one: the partial sums between chunks made the 1,536-step `in` of a down projection run at
// half the speed of a 512-step one.
ALWAYS_INLINE __m256 load_lanes(const float* p, bool whole, __m256i mask) {
  return whole ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask);
}

ALWAYS_INLINE void store_lanes(float* p, bool whole, __m256i mask, __m256 v) {
  if (whole)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, mask, v);
}

// Steps [k0, k1) of out[r, :columns] = x[r] @ panel (+ bias) for r < R: starting from zeros at k0 = 0 and from out's
// partial sums after, the bias added after the last step. The panel [K, 64] is taken a quarter at a time (16
// columns): per step two weight vectors stay in registers while each row's x value is broadcast in turn (12
// accumulators, 2 weights and a broadcast in 16 registers). The same sums, in the same order, as the AVX-512 tile's.
template <int64_t R>
ALWAYS_INLINE void panel_tile(const float* x, const float* panel, int64_t K, int64_t k0, int64_t k1, const float* bias,
                              int64_t columns, float* out, int64_t ldo, Prefetcher& prefetch) {
  for (int64_t c0 = 0; c0 < columns; c0 += 16) {
    const __m256i mask[2] = {lanes_below(columns - c0), lanes_below(columns - c0 - 8)};
    const bool whole[2] = {columns - c0 >= 8, columns - c0 >= 16};
    __m256 acc[R][2];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < 2; ++c)
        acc[r][c] = k0 == 0 ? _mm256_setzero_ps() : load_lanes(out + r * ldo + c0 + c * 8, whole[c], mask[c]);
    const float* wk = panel + k0 * kPanel + c0;
    for (int64_t k = k0; k < k1; ++k, wk += kPanel) {
      prefetch.step();
      const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
      for (int64_t r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
        acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
    const bool last = k1 == K;
    for (int64_t c = 0; c < 2; ++c) {
      const __m256 b = bias && last ? load_lanes(bias + c0 + c * 8, whole[c], mask[c]) : _mm256_setzero_ps();
      for (int64_t r = 0; r < R; ++r)
        store_lanes(out + r * ldo + c0 + c * 8, whole[c], mask[c], last ? _mm256_add_ps(acc[r][c], b) : acc[r][c]);
    }
  }
}

// Panel p's columns of out [M, N] = x [M, K] @ weight^T (+ bias), from the panel [K, 64], in chunks of kChunk steps
// along `in`: every tile reads a chunk from L1 while the next one (after the last, `next_floats` floats from `next`:
// the next panel) is prefetched into L1, evenly over the chunk's iterations. A panel's rows of 256 bytes are read in
// order, as a stream; quarter tiles over the panel in place read four strided streams and reach ~70% of the
// bandwidth at 1 - 8 rows.
void panel_rows(const float* x, const float* panel, const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                int64_t p, const float* next, int64_t next_floats) {
  const int64_t columns = std::min(kPanel, N - p * kPanel), quarters = (columns + 15) / 16;
  const float* pb = bias ? bias + p * kPanel : nullptr;
  float* po = out + p * kPanel;
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk), iterations = (M + kRows - 1) / kRows * quarters * (k1 - k0);
    Prefetcher prefetch = k1 < K ? spread(panel + k1 * kPanel, std::min(kChunk, K - k1) * kPanel, iterations)
                                 : spread(next, std::min(next_floats, kChunk * kPanel), iterations);
    for_row_tiles(M, [&](auto rows, int64_t m) {
      panel_tile<rows.value>(x + m * K, panel, K, k0, k1, pb, columns, po + m * N, N, prefetch);
    });
  }
}
#endif  // __AVX512F__

// Panel p of out [M, N] = x [M, K] @ weight^T (+ bias), the weight as pack_skinny_panels made it; panel `next`
// (-1: none) prefetched meanwhile.
void packed_panel(const float* x, const float* panels, const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                  int64_t p, int64_t next) {
  panel_rows(x, panels + p * K * kPanel, bias, out, M, N, K, p, next < 0 ? nullptr : panels + next * K * kPanel,
             next < 0 ? 0 : K * kPanel);
}

// The same over the weight [N, K] in place: each panel packed into a scratch panel first, so the sums are the
// packed path's, bit for bit (a linear's results do not change when its packs are swapped in).
void in_place_range(const float* x, const float* w, const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                    int64_t panel0, int64_t panel1) {
  std::vector<float> scratch(K * kPanel);
  for (int64_t p = panel0; p < panel1; ++p) {
    const int64_t next_rows = p + 1 < panel1 ? std::min(kPanel, N - (p + 1) * kPanel) : 0;
    pack_panel(w, N, K, p, scratch.data());
    panel_rows(x, scratch.data(), bias, out, M, N, K, p, w + (p + 1) * kPanel * K, next_rows * K);
  }
}
#endif  // SKINNY_SIMD

bool has_skinny() {
#ifdef SKINNY_SIMD
  return true;
#else
  return false;
#endif
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D float32 CPU tensor");
}

const float* checked_bias(const std::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
              "bias must be a contiguous float32 [out]");
  return bias->data_ptr<float>();
}

// y [rows, out] = x [rows, in] @ weight^T (+ bias).
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_skinny(), "skinny_linear needs a build with AVX-512 or AVX2 and FMA");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous(), "weight must be a contiguous 2-D float32 CPU tensor");
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "x has ", K, " features, the weight ", weight.size(1));
  TORCH_CHECK(K > 0 && K % kLane == 0 && N % kCols == 0, "skinny_linear needs in_features a multiple of ", kLane,
              " and out_features a multiple of ", kCols, ", got ", K, " and ", N);
  [[maybe_unused]] const float* b = checked_bias(bias, N);
  at::Tensor out = at::empty({M, N}, x.options());
#ifdef SKINNY_SIMD
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (M > 0)
    pagedserve::parallel_ranges((N + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
      in_place_range(xp, wp, b, op, M, N, K, p0, p1);
    });
#endif
  return out;
}


// The weight [out, in] as panels [ceil(out / 64), in, 64]: panel p's row k holds weight[p * 64 + c, k] for c < 64
// (zeros past out).
at::Tensor pack_skinny_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous(), "weight must be a contiguous 2-D float32 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  at::Tensor panels = at::empty({P, K, kPanel}, weight.options());
  const float* w = weight.data_ptr<float>();
  float* d = panels.data_ptr<float>();
  pagedserve::parallel_ranges(P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) pack_panel(w, N, K, p, d + p * K * kPanel);
  });
  return panels;
}

// y [rows, out_features] = x [rows, in] @ weight^T (+ bias), with panels = pack_skinny_panels(weight).
at::Tensor skinny_panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_skinny(), "skinny_panel_linear needs a build with AVX-512 or AVX2 and FMA");
  check_x(x);
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == at::kFloat && panels.dim() == 3 &&
                  panels.size(2) == kPanel && panels.is_contiguous(), "panels must be pack_skinny_panels' [P, in, 64]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(panels.size(1) == K, "x has ", K, " features, the panels ", panels.size(1));
  TORCH_CHECK(N > (panels.size(0) - 1) * kPanel && N <= panels.size(0) * kPanel, "out_features ", N,
              " does not match ", panels.size(0), " panels of ", kPanel);
  [[maybe_unused]] const float* b = checked_bias(bias, N);
  at::Tensor out = at::empty({M, N}, x.options());
#ifdef SKINNY_SIMD
  const float *xp = x.data_ptr<float>(), *wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (M > 0 && K > 0)
    pagedserve::parallel_steal(pagedserve::even_shares(panels.size(0)),
                               [&](int64_t p, int64_t next) { packed_panel(xp, wp, b, op, M, N, K, p, next); });
  else if (M > 0)
    b ? out.copy_(bias->unsqueeze(0).expand({M, N})) : out.zero_();
#endif
  return out;
}

at::Tensor skinny_panel_linear_meta(const at::Tensor& x, const at::Tensor& /*panels*/, int64_t out_features,
                                    const std::optional<at::Tensor>&) {
  return at::empty({x.size(0), out_features}, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_model, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("pack_skinny_panels(Tensor weight) -> Tensor");
  m.def("skinny_panel_linear(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor");
  m.def("has_skinny() -> bool", has_skinny);
  m.def("threads_used(int items) -> int", pagedserve::threads_used);
  m.def("stolen_items(int items, int wait_ms) -> int", pagedserve::stolen_items);
  m.def("pool_address() -> int", pagedserve::pool_address);
  m.def("pool_threads_used(int items) -> int", pagedserve::pool_threads_used);
  m.def("pool_faulty_regions(int regions, int items) -> int", pagedserve::pool_faulty_regions);
  m.def("pool_rethrows(int items, int failing) -> bool", pagedserve::pool_rethrows);
}

TORCH_LIBRARY_IMPL(pagedserve_model, CPU, m) {
  m.impl("skinny_linear", skinny_linear);
  m.impl("pack_skinny_panels", pack_skinny_panels);
  m.impl("skinny_panel_linear", skinny_panel_linear);
}

TORCH_LIBRARY_IMPL(pagedserve_model, Meta, m) { m.impl("skinny_panel_linear", skinny_panel_linear_meta); }
