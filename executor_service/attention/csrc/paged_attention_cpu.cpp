// Paged attention for the CPU that reads K/V where they lie in the block-structured cache (no gather copies).
//
// One work item = one sequence x one KV head: the query heads of that KV head and the sequence's query tokens
// are its rows; keys are visited block by block with an online softmax (float32 throughout), so each K/V row is
// read once per tile of query rows. Causal: the q query tokens of a sequence are its last q positions.
// Registered as torch.ops.pagedserve_cpu.{paged_attention,write_kv}; built by executor_service/attention/cpu.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kRowTile = 16;

struct Layout {
  const float* query;
  const float* k_cache;
  const float* v_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  float* out;
  int64_t q_token_stride, q_head_stride;
  int64_t cache_block_stride, cache_token_stride, cache_head_stride;
  int64_t table_stride;
  int64_t out_token_stride, out_head_stride;
  int64_t num_kv_heads, group, head_dim, block_size;
  float scale;
};

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// exp(x) for x <= 0 (Cephes' expf polynomial, within 2 ulp; below -87.3, 2^-126 instead of 0): vectorizes,
// unlike std::exp.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline void add_scaled(float* __restrict acc, const float* __restrict v, float p, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * v[d];
}

// Rows [row0, row1) of one sequence: row r is query token r / num_heads, query head r % num_heads. The rows of a
// tile read the same K/V blocks, each block (all KV heads, contiguous) once per tile, front to back.
// kD > 0: the head size as a compile-time constant (fully unrolled loops); 0: L.head_dim at run time.
template <int64_t kD>
void attend_rows(const Layout& L, int64_t seq, int64_t row0, int64_t row1, float* acc, float* max_score,
                 float* denom, float* scores) {
  const int64_t first = L.query_start_loc[seq];
  const int64_t q_len = L.query_start_loc[seq + 1] - first;
  const int64_t ctx = L.seq_lens[seq];
  const int64_t rows = row1 - row0;
  const int64_t D = kD > 0 ? kD : L.head_dim, BS = L.block_size, H = L.num_kv_heads * L.group;
  const int32_t* table = L.block_tables + seq * L.table_stride;
  const float* q[kRowTile];
  int64_t last_key[kRowTile], head_offset[kRowTile];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row0 + r, token = row / H, head = row % H;
    q[r] = L.query + (first + token) * L.q_token_stride + head * L.q_head_stride;
    last_key[r] = ctx - q_len + token;
    head_offset[r] = (head / L.group) * L.cache_head_stride;
    max_score[r] = -std::numeric_limits<float>::infinity();
    denom[r] = 0.f;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
  }
  const int64_t end = *std::max_element(last_key, last_key + rows) + 1;
  for (int64_t start = 0; start < end; start += BS) {
    const int64_t n = std::min(BS, end - start);
    const int64_t base = static_cast<int64_t>(table[start / BS]) * L.cache_block_stride;
    if (start + BS < end) {
      const int64_t next = static_cast<int64_t>(table[start / BS + 1]) * L.cache_block_stride;
      for (int64_t line = 0; line < 4; ++line) {
        __builtin_prefetch(L.k_cache + next + line * 16);
        __builtin_prefetch(L.v_cache + next + line * 16);
      }
    }
    // Token by token, every row's head: K and V are read front to back, as laid out. Keys before `end` are
    // all written, so a row's masked keys (probability 0) may take part in the V sum.
    const float* k = L.k_cache + base;
    const float* v = L.v_cache + base;
    int64_t visible[kRowTile];
    for (int64_t r = 0; r < rows; ++r) visible[r] = std::max<int64_t>(0, std::min(n, last_key[r] - start + 1));
    for (int64_t t = 0; t < n; ++t)
      for (int64_t r = 0; r < rows; ++r)
        if (t < visible[r]) scores[r * BS + t] = dot(q[r], k + t * L.cache_token_stride + head_offset[r], D) * L.scale;
    for (int64_t r = 0; r < rows; ++r) {
      float* s = scores + r * BS;
      const int64_t m = visible[r];
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < m; ++t) block_max = std::max(block_max, s[t]);
      const float new_max = std::max(max_score[r], block_max);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < m; ++t) {
        s[t] = exp_nonpositive(s[t] - new_max);
        sum += s[t];
      }
      for (int64_t t = m; t < n; ++t) s[t] = 0.f;
      if (m == 0) continue;
      const float corr = exp_nonpositive(max_score[r] - new_max);
      denom[r] = denom[r] * corr + sum;
      max_score[r] = new_max;
      if (corr != 1.f) {
        float* a = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] *= corr;
      }
    }
    for (int64_t t = 0; t < n; ++t)
      for (int64_t r = 0; r < rows; ++r)
        add_scaled(acc + r * D, v + t * L.cache_token_stride + head_offset[r], scores[r * BS + t], D);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row0 + r, token = row / H, head = row % H;
    float* o = L.out + (first + token) * L.out_token_stride + head * L.out_head_stride;
    const float inv = 1.f / denom[r];
    const float* a = acc + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
  }
}

void attend(const Layout& L, int64_t seq, int64_t row0, int64_t row1, float* acc, float* max_score, float* denom,
            float* scores) {
  switch (L.head_dim) {
    case 64: return attend_rows<64>(L, seq, row0, row1, acc, max_score, denom, scores);
    case 128: return attend_rows<128>(L, seq, row0, row1, acc, max_score, denom, scores);
    case 32: return attend_rows<32>(L, seq, row0, row1, acc, max_score, denom, scores);
    default: return attend_rows<0>(L, seq, row0, row1, acc, max_score, denom, scores);
  }
}

// Every read the named sequences imply stays inside the tensors (bad metadata raises instead of crashing).
void check_metadata(const Layout& L, const int32_t* seq_ids, int64_t count, int64_t num_seqs, int64_t num_tokens,
                    int64_t table_width, int64_t num_blocks) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t seq = seq_ids[i];
    TORCH_CHECK(seq >= 0 && seq < num_seqs, "sequence index ", seq, " out of range [0, ", num_seqs, ")");
    const int64_t first = L.query_start_loc[seq], last = L.query_start_loc[seq + 1], ctx = L.seq_lens[seq];
    TORCH_CHECK(first >= 0 && first <= last && last <= num_tokens, "sequence ", seq, ": query rows [", first, ", ",
                last, ") outside [0, ", num_tokens, ")");
    TORCH_CHECK(last - first <= ctx, "sequence ", seq, ": ", last - first, " query tokens but context ", ctx);
    const int64_t blocks = (ctx + L.block_size - 1) / L.block_size;
    TORCH_CHECK(blocks <= table_width, "sequence ", seq, ": context ", ctx, " needs ", blocks, " blocks, table has ",
                table_width);
    const int32_t* table = L.block_tables + seq * L.table_stride;
    for (int64_t b = 0; b < blocks; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "sequence ", seq, ": block id ", table[b],
                  " out of range [0, ", num_blocks, ")");
  }
}

void check_float(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == dim && t.stride(dim - 1) == 1, name, " must be ", dim, "-D with a contiguous last dim");
}

void check_int(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == dim, name,
              " must be a ", dim, "-D int32 CPU tensor");
  TORCH_CHECK(t.stride(dim - 1) == 1, name, " must have a contiguous last dim");
}

// out [T, H, D] = attention of query [T, H, D] against caches [blocks, block_size, kv_heads, D].
// `seqs` (int32) names the sequences to compute; the rows of other sequences in out are left untouched.
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& seqs, double scale) {
  check_float(out, "out", 3);
  check_float(query, "query", 3);
  check_float(k_cache, "k_cache", 4);
  check_float(v_cache, "v_cache", 4);
  check_int(block_tables, "block_tables", 2);
  check_int(seq_lens, "seq_lens", 1);
  check_int(query_start_loc, "query_start_loc", 1);
  check_int(seqs, "seqs", 1);
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) == seq_lens.size(0),
              "block_tables, seq_lens and query_start_loc disagree on the number of sequences");
  TORCH_CHECK(k_cache.strides() == v_cache.strides() && k_cache.sizes() == v_cache.sizes(), "k/v caches differ");
  TORCH_CHECK(k_cache.stride(2) == k_cache.size(3), "cache heads must be contiguous");
  const int64_t num_kv_heads = k_cache.size(2), num_heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && head_dim == k_cache.size(3) && out.sizes() == query.sizes(),
              "query, out and cache shapes disagree");
  Layout L{query.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
           block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
           out.data_ptr<float>(), query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
           k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1), num_kv_heads,
           num_heads / num_kv_heads, head_dim, k_cache.size(1), static_cast<float>(scale)};
  const int32_t* seq_ids = seqs.data_ptr<int32_t>();
  check_metadata(L, seq_ids, seqs.size(0), seq_lens.size(0), query.size(0), block_tables.size(1), k_cache.size(0));
  at::parallel_for(0, seqs.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kRowTile * head_dim), max_score(kRowTile), denom(kRowTile), scores(kRowTile * L.block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = seq_ids[item];
      const int64_t rows = (L.query_start_loc[seq + 1] - L.query_start_loc[seq]) * num_heads;
      for (int64_t row0 = 0; row0 < rows; row0 += kRowTile)
        attend(L, seq, row0, std::min(rows, row0 + kRowTile), acc.data(), max_score.data(), denom.data(),
               scores.data());
    }
  });
}

// Scatter key/value [T, kv_heads, D] into the caches at flat slots (slot < 0: skipped).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  check_float(key, "key", 3);
  check_float(value, "value", 3);
  check_float(k_cache, "k_cache", 4);
  check_float(v_cache, "v_cache", 4);
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1,
              "slot_mapping must be a 1-D int64 CPU tensor");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t tokens = key.size(0), heads = key.size(1), D = key.size(2);
  TORCH_CHECK(slot_mapping.size(0) == tokens && value.sizes() == key.sizes() && heads == k_cache.size(2) &&
              D == k_cache.size(3), "key, value, slots and cache shapes disagree");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), row = heads * D;
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " out of range [0, ", num_slots, ")");
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + slot[t] * row + h * D, k + t * key.stride(0) + h * key.stride(1), D * sizeof(float));
      std::memcpy(vc + slot[t] * row + h * D, v + t * value.stride(0) + h * value.stride(1), D * sizeof(float));
    }
  }
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor seqs, float scale) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_attention", paged_attention);
  m.impl("write_kv", write_kv);
}
