// A sparse MoE block's experts in one call (#32): for every expert the tokens routed to it are gathered into a
// contiguous block, gate/up -> silu(gate) * up -> down run over that block in registers-tiled AVX-512 GEMMs, and each
// token's output is the routing-weighted sum of its experts' rows. One op instead of a Python loop of ~8 torch ops
// per expert (index_select, two linears, split, silu, mul, weight, index_add): at decode sizes (16 rows an expert)
// those ops' overhead was as large as the arithmetic.
//
// Weights are packed once (moe.py's pack_experts) into panels that the tile reads sequentially:
//   w13 [E, I / 16, H, 32]: panel p, row k = gate rows 16p..16p+15 then up rows 16p..16p+15, column k of each,
//     so one tile computes 16 gate and the matching 16 up outputs and writes silu(gate) * up directly;
//   w2 [E, H / 32, I, 32]: panel q, row k = down rows 32q..32q+31, column k.
// A tile is up to kRows rows by one panel (32 outputs): 2 * kRows accumulators, the panel's row k loaded once per k
// and each row's x[k] broadcast. silu(g) * up is computed as silu_mul_cpu.cpp does (g / (1 + e^-g), then * up);
// each token's sum adds its experts' rows in expert order, as index_add over the experts does (transformers, the
// torch path). Equal to the torch path up to the GEMMs' rounding (the order of their sums differs).
// AVX-512 only (has_moe() says whether it was built so).
// Registered as torch.ops.pagedserve_model.{moe_experts,has_moe}; built by executor_service/model/cpu_ops.py.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_simd.h"
#include "parallel_steal.h"

namespace {

constexpr int64_t kRows = 8;    // rows per tile: 16 accumulators of 32
constexpr int64_t kPanel = 32;  // outputs per panel

struct Shapes {
  int64_t T, H, I, E, k;
};

#ifdef __AVX512F__

ALWAYS_INLINE __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f), lowest = _mm512_set1_ps(-87.3f), highest = _mm512_set1_ps(88.3f);
  const __m512 minus_g = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), lowest), highest);
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, pagedserve::exp16(minus_g))), u);
}

// acc[2r], acc[2r + 1] = x row r @ the panel's 32 columns, for r < R (x rows lda apart, K long).
template <int64_t R>
ALWAYS_INLINE void tile(const float* x, int64_t lda, const float* panel, int64_t K, __m512* acc) {
  for (int64_t i = 0; i < 2 * R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_loadu_ps(panel + k * kPanel), b1 = _mm512_loadu_ps(panel + k * kPanel + 16);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * lda + k]);
      acc[2 * r] = _mm512_fmadd_ps(a, b0, acc[2 * r]);
      acc[2 * r + 1] = _mm512_fmadd_ps(a, b1, acc[2 * r + 1]);
    }
  }
}

// act[r, 16p .. 16p + 15] = silu(gate) * up of rows r < R over panel p of w13.
template <int64_t R>
void gate_up_tile(const float* x, int64_t H, const float* panel, float* act, int64_t I) {
  __m512 acc[2 * R];
  tile<R>(x, H, panel, H, acc);
  for (int64_t r = 0; r < R; ++r) _mm512_storeu_ps(act + r * I, silu_mul16(acc[2 * r], acc[2 * r + 1]));
}

// out row r (of `slots`) [32q .. 32q + 31] = scale[r] * (act row r @ panel q of w2), for r < R.
template <int64_t R>
void down_tile(const float* act, int64_t I, const float* panel, const float* scale, float* const* out) {
  __m512 acc[2 * R];
  tile<R>(act, I, panel, I, acc);
  for (int64_t r = 0; r < R; ++r) {
    const __m512 s = _mm512_set1_ps(scale[r]);
    _mm512_storeu_ps(out[r], _mm512_mul_ps(acc[2 * r], s));
    _mm512_storeu_ps(out[r] + 16, _mm512_mul_ps(acc[2 * r + 1], s));
  }
}

// Rows [0, m) in tiles of kRows, the last one shorter: Op<R>::run(row0, args...) for each.
template <template <int64_t> class Op, typename... Args>
ALWAYS_INLINE void for_tiles(int64_t m, Args... args) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) Op<kRows>::run(r, args...);
  switch (m - r) {
    case 7: Op<7>::run(r, args...); break;
    case 6: Op<6>::run(r, args...); break;
    case 5: Op<5>::run(r, args...); break;
    case 4: Op<4>::run(r, args...); break;
    case 3: Op<3>::run(r, args...); break;
    case 2: Op<2>::run(r, args...); break;
    case 1: Op<1>::run(r, args...); break;
    default: break;
  }
}

template <int64_t R>
struct GateUp {
  static void run(int64_t r, const float* rows, int64_t H, const float* panel, float* act, int64_t I) {
    gate_up_tile<R>(rows + r * H, H, panel, act + r * I, I);
  }
};

template <int64_t R>
struct Down {
  static void run(int64_t r, const float* act, int64_t I, const float* panel, const float* scale, float* const* out) {
    down_tile<R>(act + r * I, I, panel, scale + r, out + r);
  }
};

// One expert over its m rows: slots[j] (token * k + choice) with routing weights scale[j]; writes ys rows `slots`.
void run_expert(const Shapes& s, const float* x, const float* w13, const float* w2, const int64_t* slots,
                const float* scale, int64_t m, float* ys) {
  std::vector<float> rows(m * s.H), act(m * s.I);
  for (int64_t j = 0; j < m; ++j) std::copy_n(x + (slots[j] / s.k) * s.H, s.H, rows.data() + j * s.H);
  for (int64_t p = 0; p < s.I / 16; ++p) {
    const float* panel = w13 + p * s.H * kPanel;
    for_tiles<GateUp>(m, rows.data(), s.H, panel, act.data() + p * 16, s.I);
  }
  std::vector<float*> out(m);
  for (int64_t q = 0; q < s.H / kPanel; ++q) {
    const float* panel = w2 + q * s.I * kPanel;
    for (int64_t j = 0; j < m; ++j) out[j] = ys + slots[j] * s.H + q * kPanel;
    for_tiles<Down>(m, static_cast<const float*>(act.data()), s.I, panel, scale, static_cast<float* const*>(out.data()));
  }
}

// out[t] = its experts' rows of ys added in expert order (as index_add over the experts does), from zero.
void sum_choices(const Shapes& s, const int64_t* ids, const float* ys, float* out, int64_t t0, int64_t t1) {
  std::vector<int64_t> order(s.k);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t j = 0; j < s.k; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[t * s.k + a] < ids[t * s.k + b]; });
    float* o = out + t * s.H;
    const float* first = ys + (t * s.k + order[0]) * s.H;
    for (int64_t h = 0; h < s.H; ++h) o[h] = 0.0f + first[h];  // as added to zeros: -0 becomes +0
    for (int64_t j = 1; j < s.k; ++j) {
      const float* y = ys + (t * s.k + order[j]) * s.H;
      for (int64_t h = 0; h < s.H; ++h) o[h] += y[h];
    }
  }
}

#endif  // __AVX512F__

bool has_moe() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

void check_inputs(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w13,
                  const at::Tensor& w2) {
  TORCH_CHECK(has_moe(), "moe_experts needs a build with AVX-512");
  const auto f32 = [](const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(); };
  TORCH_CHECK(f32(x) && x.dim() == 2, "x must be a contiguous float32 CPU [tokens, hidden]");
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.dim() == 2 &&
                  ids.size(0) == x.size(0), "expert ids must be a contiguous int64 CPU [tokens, top_k]");
  TORCH_CHECK(f32(weights) && weights.sizes() == ids.sizes(), "routing weights must be float32 like the ids");
  TORCH_CHECK(f32(w13) && w13.dim() == 4 && w13.size(2) == x.size(1) && w13.size(3) == kPanel,
              "w13 must be packed [experts, intermediate / 16, hidden, 32]");
  TORCH_CHECK(f32(w2) && w2.dim() == 4 && w2.size(0) == w13.size(0) && w2.size(1) * kPanel == x.size(1) &&
                  w2.size(2) == w13.size(1) * 16 && w2.size(3) == kPanel,
              "w2 must be packed [experts, hidden / 32, intermediate, 32]");
  if (ids.numel() > 0) {
    const auto [low, high] = std::minmax_element(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
    TORCH_CHECK(*low >= 0 && *high < w13.size(0), "expert ids must lie in [0, ", w13.size(0), ")");
  }
}

// x [T, H], ids / weights [T, k]: returns [T, H] = sum over each token's k experts of weight * expert(x row).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w13,
                       const at::Tensor& w2) {
  check_inputs(x, ids, weights, w13, w2);
  const Shapes s{x.size(0), x.size(1), w13.size(1) * 16, w13.size(0), ids.size(1)};
  if (s.T == 0 || s.k == 0) return at::zeros({s.T, s.H}, x.options());
  at::Tensor out = at::empty({s.T, s.H}, x.options());
#ifdef __AVX512F__
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(s.E + 1, 0), slots(s.T * s.k);
  for (int64_t i = 0; i < s.T * s.k; ++i) ++start[id[i] + 1];
  for (int64_t e = 0; e < s.E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < s.T * s.k; ++i) slots[fill[id[i]]++] = i;  // slots grouped by expert, in token order
  std::vector<float> scale(s.T * s.k);
  const float* wp = weights.data_ptr<float>();
  for (int64_t i = 0; i < s.T * s.k; ++i) scale[i] = wp[slots[i]];
  std::vector<float> ys(s.T * s.k * s.H);
  const float *xp = x.data_ptr<float>(), *w13p = w13.data_ptr<float>(), *w2p = w2.data_ptr<float>();
  pagedserve::parallel_ranges(s.E, 1, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t m = start[e + 1] - start[e];
      if (m > 0)
        run_expert(s, xp, w13p + e * s.I * s.H * 2, w2p + e * s.H * s.I, slots.data() + start[e],
                   scale.data() + start[e], m, ys.data());
    }
  });
  pagedserve::parallel_ranges(s.T, 64, [&](int64_t t0, int64_t t1) { sum_choices(s, id, ys.data(), out.data_ptr<float>(), t0, t1); });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_model, m) {
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor w2) -> Tensor");
  m.def("has_moe() -> bool", has_moe);
}

TORCH_LIBRARY_IMPL(pagedserve_model, CPU, m) { m.impl("moe_experts", moe_experts); }
