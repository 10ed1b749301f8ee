// Paged attention for the CPU that reads K/V where they lie in the block-structured cache (no gather copies).
//
// One work item = rows of one sequence (all of them, or a few KV heads' when the step has few rows per thread:
// split_work): its query heads and query tokens are the rows of a tile; keys are visited front
// to back, 16 at a time, with an online softmax (float32 throughout), so each K/V row is read from memory once
// per tile of query rows. Causal: the q query tokens of a sequence are its last q positions.
// Two implementations of a tile: with AVX-512 (built with -march=native on a CPU that has it; head sizes that
// are multiples of 16) a row scores 16 keys into one vector (16 partial dot products reduced together by a
// shuffle tree), takes a vector softmax over them and adds P.V with broadcast FMAs; the portable one (any CPU,
// any head size; also registered as paged_attention_portable, for tests and benchmarks) scores a block's keys
// row by row (with AVX2 and FMA, 8 keys a vector, reduced by a transpose: prefill attention 1.2x one dot product
// per key on an AMD Zen 3), takes a scalar softmax step per key, then each row's P.V over the block (with AVX2 and
// FMA, in registers: 12 - 15% faster than adding key by key into memory). Decode rows (one query token) of the
// common (head size, group) pairs take a decode tile instead (attend_decode_rows: AVX-512's steps, or with AVX2 and
// FMA alone, over float16 caches, AVX2's): two passes, all scores then P.V, each K/V row loaded once for the query
// heads of its GQA group, prefetches spread over the compute (#29).
// Registered as torch.ops.pagedserve_cpu.{paged_attention,paged_attention_portable,write_kv}; built by
// executor_service/attention/cpu.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"
#include "kv_cache_element.h"
#include "parallel_probe.h"
#include "parallel_steal.h"

namespace {

constexpr int64_t kRowTile = 128;  // most rows in a tile (sized for the AVX-512 one)

constexpr int64_t kKeyChunk = 16;  // keys per step of the AVX-512 tile
constexpr int64_t kStreamBytes = int64_t{8} << 20;  // K/V per call above which the AVX-512 tile prefetches chunks
// K/V per call above which the decode tile prefetches (below, they may well be in L2, where the prefetches cost
// 7 - 20%; above, even a layer's K/V that fits the L3 reads 1.7 - 2x faster with them: BENCHMARKS.md section 17).
constexpr int64_t kDecodePrefetchBytes = int64_t{256} << 10;

template <class KV>  // float or c10::Half: the cache's element (--kv-cache-dtype)
struct Layout {
  const float* query;
  const KV* k_cache;
  const KV* v_cache;
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
  bool stream_from_memory;  // the call reads more than kStreamBytes of K/V: prefetch whole chunks ahead
  bool prefetch_decode;     // more than kDecodePrefetchBytes: the decode tile prefetches rows kDecodeAhead chunks ahead
};

// A cache element as a float32 (the cache holds float32, or float16 under --kv-cache-dtype float16).
ALWAYS_INLINE float widen(float x) { return x; }
ALWAYS_INLINE float widen(c10::Half x) { return static_cast<float>(x); }

// Floats of a cache element type per 64-byte line (what a prefetch of one line covers).
template <class KV>
constexpr int64_t kLineElements = 64 / static_cast<int64_t>(sizeof(KV));

#if defined(__AVX2__) && defined(__FMA__)
// 8 cache elements from p as floats.
ALWAYS_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
ALWAYS_INLINE __m256 load8(const c10::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float wide[8];
  for (int i = 0; i < 8; ++i) wide[i] = widen(p[i]);
  return _mm256_load_ps(wide);
#endif
}
#endif

#ifdef __AVX512F__
// 16 cache elements from p as floats.
ALWAYS_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

template <class KV>
ALWAYS_INLINE float dot(const float* __restrict a, const KV* __restrict b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * widen(b[d]);
  return sum;
}

// exp(x) for x <= 0 (Cephes' expf polynomial, within 2 ulp; below -87.3, 2^-126 instead of 0): vectorizes,
// unlike std::exp.
ALWAYS_INLINE float exp_nonpositive(float x) {
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

// s[t] = exp(s[t] - shift) for t < m (each s[t] <= shift); returns their sum. With AVX2 and FMA 8 at a time (exp8,
// the same polynomial): GCC does not vectorize the scalar loop (the portable tile spent ~10% of a decode step in it).
ALWAYS_INLINE float exponentiate(float* s, int64_t m, float shift) {
  float sum = 0.f;
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 by = _mm256_set1_ps(shift), floor = _mm256_set1_ps(-87.3f);
  __m256 sums = _mm256_setzero_ps();
  for (; t + 8 <= m; t += 8) {
    // max(floor, x), not max(x, floor): a NaN score (an inf or NaN key) stays NaN, as in the scalar loop and the
    // reference, instead of turning into a tiny probability
    const __m256 e = pagedserve::exp8(_mm256_max_ps(floor, _mm256_sub_ps(_mm256_loadu_ps(s + t), by)));
    _mm256_storeu_ps(s + t, e);
    sums = _mm256_add_ps(sums, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sums);
  for (const float lane : lanes) sum += lane;
#endif
  for (; t < m; ++t) {
    s[t] = exp_nonpositive(s[t] - shift);
    sum += s[t];
  }
  return sum;
}

template <class KV>
ALWAYS_INLINE void add_scaled(float* __restrict acc, const KV* __restrict v, float p, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * widen(v[d]);
}

// acc += sum over keys t < n of p[t] * v[t * stride] (rows of D floats), key by key, the same sums in the same order
// as add_scaled's. With AVX2 and FMA and kD a multiple of 8, acc stays in registers over the keys, each V row read
// once, instead of acc loaded and stored again for every key.
template <int64_t kD, class KV>
ALWAYS_INLINE void add_block_values(float* __restrict acc, const KV* __restrict v, int64_t stride,
                                    const float* __restrict p, int64_t n, int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kD > 0 && kD % 8 == 0) {
    constexpr int64_t kV = kD / 8;
    __m256 a[kV];
    for (int64_t i = 0; i < kV; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 pt = _mm256_broadcast_ss(p + t);
      for (int64_t i = 0; i < kV; ++i) a[i] = _mm256_fmadd_ps(pt, load8(v + t * stride + 8 * i), a[i]);
    }
    for (int64_t i = 0; i < kV; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) add_scaled(acc, v + t * stride, p[t], D);
}

// Every cache line that floats [from, to) touch, into L1.
ALWAYS_INLINE void prefetch_lines(const void* from, const void* to) {
  constexpr uintptr_t kLine = 64;
  const uintptr_t end = reinterpret_cast<uintptr_t>(to);
  for (uintptr_t at = reinterpret_cast<uintptr_t>(from) & ~(kLine - 1); at < end; at += kLine)
    __builtin_prefetch(reinterpret_cast<const void*>(at));
}

// s[t] = scale * (q . k[t * stride]) for keys t < n (D floats each). With AVX2 and FMA and kD a multiple of 8, 8 keys
// at a time: a vector of partial sums per key, reduced together by a transpose (no horizontal sum per key); keys
// past n in the last 8 repeat key n - 1 and are not stored.
template <int64_t kD, class KV>
ALWAYS_INLINE void score_block(const float* __restrict q, const KV* __restrict k, int64_t stride, int64_t n,
                               float scale, float* __restrict s, int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kD > 0 && kD % 8 == 0) {
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      const KV* keys[8];
      for (int64_t t = 0; t < 8; ++t) keys[t] = k + std::min(t0 + t, n - 1) * stride;
      __m256 partial[8];
      for (int64_t t = 0; t < 8; ++t) partial[t] = _mm256_setzero_ps();
      for (int64_t i = 0; i < kD; i += 8) {
        const __m256 query = _mm256_loadu_ps(q + i);
        for (int64_t t = 0; t < 8; ++t) partial[t] = _mm256_fmadd_ps(query, load8(keys[t] + i), partial[t]);
      }
      const __m256 sums = _mm256_mul_ps(pagedserve::sum_lanes8(partial), _mm256_set1_ps(scale));
      if (n - t0 >= 8) {
        _mm256_storeu_ps(s + t0, sums);
      } else {
        alignas(32) float last[8];
        _mm256_store_ps(last, sums);
        std::copy(last, last + (n - t0), s + t0);
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) s[t] = dot(q, k + t * stride, D) * scale;
}

// Rows [row0, row1) of one sequence: row r is query token r / num_heads, query head r % num_heads. Where each
// row's query, output and KV head lie, the last key it sees, and its accumulators cleared.
struct TileRows {
  template <class KV>
  TileRows(const Layout<KV>& L, int64_t seq, int64_t row0, int64_t row1, int64_t D, float* acc, float* max_score,
           float* denom)
      : table(L.block_tables + seq * L.table_stride), rows(row1 - row0) {
    const int64_t first = L.query_start_loc[seq], q_len = L.query_start_loc[seq + 1] - first;
    const int64_t ctx = L.seq_lens[seq], H = L.num_kv_heads * L.group;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = row0 + r, token = row / H, head = row % H;
      q[r] = L.query + (first + token) * L.q_token_stride + head * L.q_head_stride;
      out[r] = L.out + (first + token) * L.out_token_stride + head * L.out_head_stride;
      last_key[r] = ctx - q_len + token;
      head_offset[r] = (head / L.group) * L.cache_head_stride;
      max_score[r] = -std::numeric_limits<float>::infinity();
      denom[r] = 0.f;
      std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
    }
    end = *std::max_element(last_key, last_key + rows) + 1;
  }

  const int32_t* table;
  int64_t rows, end;
  const float* q[kRowTile];
  float* out[kRowTile];
  int64_t last_key[kRowTile], head_offset[kRowTile];
};

// The portable tile (rows as in TileRows). The rows of a tile read the same K/V blocks, each block (all KV
// heads, contiguous) once per tile, front to back. kD > 0: the head size as a compile-time constant (fully
// unrolled loops); 0: L.head_dim.
template <int64_t kD, class KV>
void attend_rows_portable(const Layout<KV>& L, int64_t seq, int64_t row0, int64_t row1, float* acc, float* max_score,
                 float* denom, float* scores) {
  const int64_t D = kD > 0 ? kD : L.head_dim, BS = L.block_size;
  const TileRows tile(L, seq, row0, row1, D, acc, max_score, denom);
  const int64_t rows = tile.rows, end = tile.end;
  const int32_t* table = tile.table;
  const float* const* q = tile.q;
  const int64_t *last_key = tile.last_key, *head_offset = tile.head_offset;
  // The floats of a token's K (or V) row that the tile's KV heads take.
  const int64_t span0 = *std::min_element(head_offset, head_offset + rows);
  const int64_t span1 = *std::max_element(head_offset, head_offset + rows) + D;
  for (int64_t start = 0; start < end; start += BS) {
    const int64_t n = std::min(BS, end - start);
    const int64_t base = static_cast<int64_t>(table[start / BS]) * L.cache_block_stride;
    // While the rows are scored, the next block's K rows (the tile's heads) are fetched, a few keys per row, and
    // its V rows while the rows add their values: the block after a random jump arrives whole, not line by line
    // behind the hardware prefetcher (decode attention from memory 5 - 15% faster on an AMD Zen 3 than fetching only
    // the next block's first lines); each phase fetching what the same phase of the next block reads is 0.96 - 1.23x
    // the speed of fetching both while scoring (BENCHMARKS.md section 17, twelfth session).
    const bool fetch_next = start + BS < end;
    const int64_t next = fetch_next ? static_cast<int64_t>(table[start / BS + 1]) * L.cache_block_stride : 0;
    // Row by row, the block's keys of the row's head (the block's K rows in L1 after the first rows). Keys before
    // `end` are all written, so a row's masked keys (probability 0) may take part in the V sum.
    const KV* k = L.k_cache + base;
    const KV* v = L.v_cache + base;
    int64_t visible[kRowTile];
    for (int64_t r = 0; r < rows; ++r) visible[r] = std::max<int64_t>(0, std::min(n, last_key[r] - start + 1));
    // Row r's share of the next block's keys: their rows of `cache` (K or V), the tile's heads.
    const auto fetch_share = [&](const KV* cache, int64_t r) {
      for (int64_t t = r * n / rows; fetch_next && t < (r + 1) * n / rows; ++t) {
        const KV* row = cache + next + t * L.cache_token_stride;
        prefetch_lines(row + span0, row + span1);
      }
    };
    for (int64_t r = 0; r < rows; ++r) {
      fetch_share(L.k_cache, r);
      if (visible[r] > 0)
        score_block<kD>(q[r], k + head_offset[r], L.cache_token_stride, visible[r], L.scale, scores + r * BS, D);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* s = scores + r * BS;
      const int64_t m = visible[r];
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < m; ++t) block_max = std::max(block_max, s[t]);
      const float new_max = std::max(max_score[r], block_max);
      const float sum = exponentiate(s, m, new_max);
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
    for (int64_t r = 0; r < rows; ++r) {
      fetch_share(L.v_cache, r);
      add_block_values<kD>(acc + r * D, v + head_offset[r], L.cache_token_stride, scores + r * BS, n, D);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = tile.out[r];
    const float inv = 1.f / denom[r];
    const float* a = acc + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
  }
}

// What the chunked tiles share (the AVX-512 tile, and the decode tiles of AVX-512 and of AVX2).
// Where a tile's 16 keys starting at `start` lie: the cache offset of each key's token (its KV heads follow).
struct KeyChunk {
  int64_t offset[kKeyChunk];
  int64_t count;
};

// Every line of the K/V rows of keys [from, to) into L2 (rows of a block are contiguous), kPrefetchAhead chunks
// ahead of the one being computed: with K/V in memory the hardware prefetcher alone keeps too few lines in flight.
// Only for calls that read more than kStreamBytes of K/V (likely not in cache); for the others the prefetch
// instructions cost more than they save (BENCHMARKS.md section 8).
constexpr int64_t kPrefetchAhead = 2;

// Which caches a pass over the keys reads (the decode tile reads K, then V, in two passes).
struct Reads {
  bool k, v;
};
constexpr Reads kBoth{true, true};

template <class KV>
ALWAYS_INLINE void prefetch_keys(const Layout<KV>& L, const int32_t* table, int64_t from, int64_t to, Reads reads) {
  const int64_t BS = L.block_size;
  for (int64_t key = from; key < to;) {
    const int64_t in_block = key % BS, n = std::min(BS - in_block, to - key);
    const int64_t base = static_cast<int64_t>(table[key / BS]) * L.cache_block_stride + in_block * L.cache_token_stride;
    for (int64_t x = 0; x < n * L.cache_token_stride; x += kLineElements<KV>) {
      if (reads.k) __builtin_prefetch(L.k_cache + base + x, 0, 2);
      if (reads.v) __builtin_prefetch(L.v_cache + base + x, 0, 2);
    }
    key += n;
  }
}

// Where the chunk of keys [start, start + 16) lies (block, in_block: where it starts; moved to where the next one
// starts), and the prefetch of what follows it: whole chunks kPrefetchAhead ahead where the call streams from
// memory, else the first lines of the next chunk (the hardware prefetcher does the rest).
template <class KV>
ALWAYS_INLINE void locate_chunk(const Layout<KV>& L, const int32_t* table, int64_t start, int64_t end, int64_t& block,
                                int64_t& in_block, KeyChunk& chunk, Reads reads = kBoth) {
  const int64_t BS = L.block_size;
  chunk.count = std::min(kKeyChunk, end - start);
  for (int64_t t = 0; t < chunk.count; ++t) {
    chunk.offset[t] = static_cast<int64_t>(table[block]) * L.cache_block_stride + in_block * L.cache_token_stride;
    if (++in_block == BS) in_block = 0, ++block;
  }
  if (L.stream_from_memory) {
    const int64_t ahead = start + kPrefetchAhead * kKeyChunk;
    prefetch_keys(L, table, ahead, std::min(end, ahead + kKeyChunk), reads);
  } else if (start + kKeyChunk < end) {
    const int64_t next = static_cast<int64_t>(table[block]) * L.cache_block_stride + in_block * L.cache_token_stride;
    for (int64_t line = 0; line < 4; ++line) {
      if (reads.k) __builtin_prefetch(L.k_cache + next + line * kLineElements<KV>);
      if (reads.v) __builtin_prefetch(L.v_cache + next + line * kLineElements<KV>);
    }
  }
}

// The kD elements at `row` into the caches (one prefetch per 64-byte line).
template <int64_t kD, class KV>
ALWAYS_INLINE void prefetch_row(const KV* row) {
  for (int64_t i = 0; i < kD; i += kLineElements<KV>) __builtin_prefetch(row + i, 0, 2);
}

// How many chunks ahead of the one computed the decode tile prefetches its rows (L.prefetch_decode).
constexpr int64_t kDecodeAhead = 4;

// The chunk kDecodeAhead ahead of the one the decode tile computes, over its two passes in turn: the K rows of the
// keys, then their V rows (so the first V rows are on their way while the last scores are computed), then the K
// rows of the sequence the thread computes next, if any (next_table: its block table, next_end: its context).
struct Ahead {
  const int32_t* table;
  int64_t end;
  const int32_t* next_table;
  int64_t next_end;
  int64_t start = 0, block = 0, in_block = 0;
  bool values = false;
  KeyChunk chunk{{}, 0};

  // The next chunk (count 0 past the last).
  template <class KV>
  void advance(const Layout<KV>& L) {
    if (start >= end && !values) {
      values = true, start = block = in_block = 0;
    } else if (start >= end && next_table != nullptr) {
      table = next_table, end = next_end, next_table = nullptr;
      values = false, start = block = in_block = 0;
    }
    chunk.count = 0;
    if (start >= end) return;
    locate_chunk(L, table, start, end, block, in_block, chunk, Reads{false, false});
    start += kKeyChunk;
  }
};

#ifdef __AVX512F__
using pagedserve::sum_lanes16;

// exp_nonpositive on 16 lanes (the same polynomial).
// (max(floor, x): a NaN stays NaN, as in exponentiate.)
ALWAYS_INLINE __m512 exp16_nonpositive(__m512 x) { return pagedserve::exp16(_mm512_max_ps(_mm512_set1_ps(-87.3f), x)); }

// Lane t: q . k[offset[t]] for the first `m` keys of the chunk, 0 for the rest.
template <int64_t kD, class KV>
ALWAYS_INLINE __m512 score_keys(const float* __restrict q, const KV* __restrict k, const KeyChunk& chunk, int64_t m,
                         int64_t D) {
  __m512 partial[kKeyChunk];
#pragma GCC unroll 16
  for (int64_t t = 0; t < kKeyChunk; ++t) {
    if (t >= m) {
      partial[t] = _mm512_setzero_ps();
      continue;
    }
    const KV* key = k + chunk.offset[t];
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(q), load16(key));
#pragma GCC unroll 8
    for (int64_t d = 16; d < D; d += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(key + d), sum);
    partial[t] = sum;
  }
  return sum_lanes16(partial);
}

// acc = acc * corr + sum over the first m keys of p[t] * v[offset[t]]. p[t] is broadcast from memory once per key
// (a load, not a shuffle); kD > 0: acc in 2 x kD / 16 registers (even and odd keys), else 16 lanes at a time.
template <int64_t kD, class KV>
ALWAYS_INLINE void add_values(float* __restrict acc, const KV* __restrict v, const KeyChunk& chunk, const float* p,
                       int64_t m, float corr, int64_t D) {
  asm volatile("" : : "r"(p) : "memory");  // read p back from memory: GCC would otherwise permute it out of a register
  const __m512 c = _mm512_set1_ps(corr);
  if constexpr (kD > 0) {
    constexpr int64_t kC = kD / 16;
    __m512 even[kC], odd[kC];
    for (int64_t i = 0; i < kC; ++i) even[i] = odd[i] = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 1 < m; t += 2) {
      const KV* v0 = v + chunk.offset[t];
      const KV* v1 = v + chunk.offset[t + 1];
      const __m512 p0 = _mm512_broadcastss_ps(_mm_load_ss(p + t)), p1 = _mm512_broadcastss_ps(_mm_load_ss(p + t + 1));
      for (int64_t i = 0; i < kC; ++i) {
        even[i] = _mm512_fmadd_ps(p0, load16(v0 + 16 * i), even[i]);
        odd[i] = _mm512_fmadd_ps(p1, load16(v1 + 16 * i), odd[i]);
      }
    }
    if (t < m) {
      const KV* v0 = v + chunk.offset[t];
      const __m512 p0 = _mm512_broadcastss_ps(_mm_load_ss(p + t));
      for (int64_t i = 0; i < kC; ++i) even[i] = _mm512_fmadd_ps(p0, load16(v0 + 16 * i), even[i]);
    }
    for (int64_t i = 0; i < kC; ++i)
      _mm512_storeu_ps(acc + 16 * i, _mm512_fmadd_ps(_mm512_loadu_ps(acc + 16 * i), c, _mm512_add_ps(even[i], odd[i])));
  } else {
    for (int64_t d = 0; d < D; d += 16) {
      __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(acc + d), c);
      for (int64_t t = 0; t < m; ++t)
        sum = _mm512_fmadd_ps(_mm512_broadcastss_ps(_mm_load_ss(p + t)), load16(v + chunk.offset[t] + d), sum);
      _mm512_storeu_ps(acc + d, sum);
    }
  }
}

// The AVX-512 tile (head size a multiple of 16): rows as in attend_rows_portable; keys 16 at a time (a chunk may
// span blocks), every row of the tile scoring the chunk's keys of its KV head while they are in L1.
template <int64_t kD, class KV>
void attend_rows_avx512(const Layout<KV>& L, int64_t seq, int64_t row0, int64_t row1, float* acc, float* max_score,
                        float* denom) {
  const int64_t D = kD > 0 ? kD : L.head_dim, BS = L.block_size;
  const TileRows tile(L, seq, row0, row1, D, acc, max_score, denom);
  const int64_t rows = tile.rows, end = tile.end;
  const int32_t* table = tile.table;
  const float* const* q = tile.q;
  const int64_t *last_key = tile.last_key, *head_offset = tile.head_offset;
  const __m512 scale = _mm512_set1_ps(L.scale), minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float p[kRowTile][kKeyChunk];  // per row: scores, then probabilities
  float corr[kRowTile];
  int64_t visible[kRowTile];
  KeyChunk chunk;
  int64_t block = 0, in_block = 0;  // where the next chunk starts
  for (int64_t start = 0; start < end; start += kKeyChunk) {
    locate_chunk(L, table, start, end, block, in_block, chunk);
    // Three passes over the rows (scores, softmax, P.V), so that the rows' dependency chains overlap. Keys before
    // `end` are all written; row r sees the first visible[r] keys of the chunk.
    for (int64_t r = 0; r < rows; ++r) {
      visible[r] = std::max<int64_t>(0, std::min(chunk.count, last_key[r] - start + 1));
      if (visible[r] > 0)
        _mm512_store_ps(p[r], score_keys<kD>(q[r], L.k_cache + head_offset[r], chunk, visible[r], D));
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t m = visible[r];
      if (m == 0) continue;
      const __mmask16 mask = static_cast<__mmask16>(m >= kKeyChunk ? 0xFFFF : (1u << m) - 1);
      const __m512 s = _mm512_mask_mov_ps(minus_inf, mask, _mm512_mul_ps(_mm512_load_ps(p[r]), scale));
      const float new_max = std::max(max_score[r], _mm512_reduce_max_ps(s));
      const __m512 e = _mm512_maskz_mov_ps(mask, exp16_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
      _mm512_store_ps(p[r], e);
      corr[r] = exp_nonpositive(max_score[r] - new_max);
      denom[r] = denom[r] * corr[r] + _mm512_reduce_add_ps(e);
      max_score[r] = new_max;
    }
    for (int64_t r = 0; r < rows; ++r)
      if (visible[r] > 0)
        add_values<kD>(acc + r * D, L.v_cache + head_offset[r], chunk, p[r], visible[r], corr[r], D);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = tile.out[r];
    const __m512 inv = _mm512_set1_ps(1.f / denom[r]);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), inv));
  }
}


template <int64_t kD, int64_t kG, class KV>
ALWAYS_INLINE void score_group(const float* const* q, const KV* __restrict k, const KeyChunk& chunk, int64_t m,
                               const KeyChunk& ahead, const KV* ahead_rows, float* const* scores) {
  constexpr int64_t kC = kD / 16;
  __m512 qv[kG][kC];
  for (int64_t g = 0; g < kG; ++g)
    for (int64_t i = 0; i < kC; ++i) qv[g][i] = _mm512_loadu_ps(q[g] + 16 * i);
  __m512 partial[kG][kKeyChunk];
  for (int64_t t = 0; t < kKeyChunk; ++t) {
    if (t >= m) {
      for (int64_t g = 0; g < kG; ++g) partial[g][t] = _mm512_setzero_ps();
      continue;
    }
    const KV* key = k + chunk.offset[t];
    if (t < ahead.count) prefetch_row<kD>(ahead_rows + ahead.offset[t]);
    __m512 kv[kC];
    for (int64_t i = 0; i < kC; ++i) kv[i] = load16(key + 16 * i);
    for (int64_t g = 0; g < kG; ++g) {
      __m512 sum = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int64_t i = 1; i < kC; ++i) sum = _mm512_fmadd_ps(qv[g][i], kv[i], sum);
      partial[g][t] = sum;
    }
  }
  for (int64_t g = 0; g < kG; ++g) _mm512_storeu_ps(scores[g], sum_lanes16(partial[g]));
}

// acc[g] += sum over the first m keys of p[g][t] * v[offset[t]], each V row loaded once for the kG rows.
template <int64_t kD, int64_t kG, class KV>
ALWAYS_INLINE void add_values_group(float* __restrict acc, const KV* __restrict v, const KeyChunk& chunk,
                                    const float* const* p, int64_t m, const KeyChunk& ahead,
                                    const KV* ahead_rows) {
  asm volatile("" : : "r"(p) : "memory");  // broadcast p from memory (as add_values)
  constexpr int64_t kC = kD / 16;
  __m512 sum[kG][kC];
  for (int64_t g = 0; g < kG; ++g)
    for (int64_t i = 0; i < kC; ++i) sum[g][i] = _mm512_loadu_ps(acc + g * kD + 16 * i);
  for (int64_t t = 0; t < m; ++t) {
    const KV* row = v + chunk.offset[t];
    if (t < ahead.count) prefetch_row<kD>(ahead_rows + ahead.offset[t]);
    for (int64_t i = 0; i < kC; ++i) {
      const __m512 value = load16(row + 16 * i);
      for (int64_t g = 0; g < kG; ++g)
        sum[g][i] = _mm512_fmadd_ps(_mm512_broadcastss_ps(_mm_load_ss(p[g] + t)), value, sum[g][i]);
    }
  }
  for (int64_t g = 0; g < kG; ++g)
    for (int64_t i = 0; i < kC; ++i) _mm512_storeu_ps(acc + g * kD + 16 * i, sum[g][i]);
}

// s[0, n) = exp(s * scale - max) (n rounded up to 16 with zeros past it); returns their sum (the denominator).
ALWAYS_INLINE float softmax_numerators(float* s, int64_t n, float scale_) {
  const __m512 scale = _mm512_set1_ps(scale_), minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const auto mask_of = [n](int64_t t) {
    return static_cast<__mmask16>(n - t >= kKeyChunk ? 0xFFFF : (1u << (n - t)) - 1);
  };
  // The scaled scores are stored before the max is subtracted from them: a product fused into the subtraction
  // (GCC contracts the two into an FMA) would leave the largest score its rounding error, not 0, which can be
  // positive, beyond exp_nonpositive's range (wrong weights, or inf / inf, for scores of 1e9 and up).
  __m512 best = minus_inf;
  for (int64_t t = 0; t < n; t += kKeyChunk) {
    const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(s + t), scale);
    _mm512_storeu_ps(s + t, scaled);
    best = _mm512_max_ps(best, _mm512_mask_mov_ps(minus_inf, mask_of(t), scaled));
  }
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += kKeyChunk) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + t), max);
    const __m512 e = _mm512_maskz_mov_ps(mask_of(t), exp16_nonpositive(x));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// The AVX-512 steps of the decode tile (attend_decode_rows).
struct DecodeAvx512 {
  template <int64_t kD, int64_t kG, class KV>
  ALWAYS_INLINE static void score(const float* const* q, const KV* k, const KeyChunk& chunk, const KeyChunk& ahead,
                                  const KV* ahead_rows, float* const* scores) {
    score_group<kD, kG>(q, k, chunk, chunk.count, ahead, ahead_rows, scores);
  }
  template <int64_t kD, int64_t kG, class KV>
  ALWAYS_INLINE static void add_values(float* acc, const KV* v, const KeyChunk& chunk, const float* const* p,
                                       const KeyChunk& ahead, const KV* ahead_rows) {
    add_values_group<kD, kG>(acc, v, chunk, p, chunk.count, ahead, ahead_rows);
  }
  ALWAYS_INLINE static float softmax(float* s, int64_t n, float scale) { return softmax_numerators(s, n, scale); }
};
#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
// The decode tile's steps with AVX2 and FMA (CPUs without AVX-512, e.g. AMD Zen 1 - 3), in 16 ymm registers.
// Scores: kKeys = 8 / kG keys at a time, one accumulator per (query head, key), each K vector loaded once for the
// group and the 8 accumulators reduced together (sum_lanes8). P.V: the head size in slabs of at most 8 accumulators
// (kG x kS / 8), each V vector loaded once for the group.
template <int64_t kD, int64_t kG, class KV>
ALWAYS_INLINE void score_group8(const float* const* q, const KV* __restrict k, const KeyChunk& chunk,
                                const KeyChunk& ahead, const KV* ahead_rows, float* const* scores) {
  static_assert(kD % 8 == 0 && 8 % kG == 0, "head size a multiple of 8, group dividing 8");
  constexpr int64_t kKeys = 8 / kG;
  const int64_t m = chunk.count;
  for (int64_t t0 = 0; t0 < m; t0 += kKeys) {
    const KV* keys[kKeys];
    for (int64_t t = 0; t < kKeys; ++t) {
      keys[t] = k + chunk.offset[std::min(t0 + t, m - 1)];  // past m: the last key again, its score unused
      if (t0 + t < ahead.count) prefetch_row<kD>(ahead_rows + ahead.offset[t0 + t]);
    }
    __m256 partial[8];
    for (int64_t j = 0; j < 8; ++j) partial[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < kD; i += 8) {
      __m256 qv[kG];
      for (int64_t g = 0; g < kG; ++g) qv[g] = _mm256_loadu_ps(q[g] + i);
      for (int64_t t = 0; t < kKeys; ++t) {
        const __m256 kv = load8(keys[t] + i);
        for (int64_t g = 0; g < kG; ++g) partial[g * kKeys + t] = _mm256_fmadd_ps(qv[g], kv, partial[g * kKeys + t]);
      }
    }
    alignas(32) float sums[8];
    _mm256_store_ps(sums, pagedserve::sum_lanes8(partial));
    for (int64_t g = 0; g < kG; ++g) std::memcpy(scores[g] + t0, sums + g * kKeys, sizeof(float) * kKeys);
  }
}

// acc[g] += sum over the chunk's keys of p[g][t] * v[offset[t]].
template <int64_t kD, int64_t kG, class KV>
ALWAYS_INLINE void add_values_group8(float* __restrict acc, const KV* __restrict v, const KeyChunk& chunk,
                                     const float* const* p, const KeyChunk& ahead, const KV* ahead_rows) {
  constexpr int64_t kS = std::min<int64_t>(kD, 64 / kG), kA = kS / 8;
  const int64_t m = chunk.count;
  for (int64_t t = 0; t < ahead.count; ++t) prefetch_row<kD>(ahead_rows + ahead.offset[t]);
  for (int64_t s0 = 0; s0 < kD; s0 += kS) {
    __m256 sum[kG][kA];
    for (int64_t g = 0; g < kG; ++g)
      for (int64_t i = 0; i < kA; ++i) sum[g][i] = _mm256_loadu_ps(acc + g * kD + s0 + 8 * i);
    for (int64_t t = 0; t < m; ++t) {
      const KV* row = v + chunk.offset[t] + s0;
      __m256 pt[kG];
      for (int64_t g = 0; g < kG; ++g) pt[g] = _mm256_broadcast_ss(p[g] + t);
      for (int64_t i = 0; i < kA; ++i) {
        const __m256 value = load8(row + 8 * i);
        for (int64_t g = 0; g < kG; ++g) sum[g][i] = _mm256_fmadd_ps(pt[g], value, sum[g][i]);
      }
    }
    for (int64_t g = 0; g < kG; ++g)
      for (int64_t i = 0; i < kA; ++i) _mm256_storeu_ps(acc + g * kD + s0 + 8 * i, sum[g][i]);
  }
}

// softmax_numerators on 8 lanes: s[0, n) = exp(s * scale - max), zeros past n up to a multiple of 8; returns their sum.
ALWAYS_INLINE float softmax_numerators8(float* s, int64_t n, float scale_) {
  const __m256 scale = _mm256_set1_ps(scale_), minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 lane = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  const auto valid = [&](int64_t t) {
    return _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n - t)), _CMP_LT_OQ);
  };
  __m256 best = minus_inf;
  for (int64_t t = 0; t < n; t += 8) {  // the scaled scores stored first (as in softmax_numerators)
    const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(s + t), scale);
    _mm256_storeu_ps(s + t, scaled);
    best = _mm256_max_ps(best, _mm256_blendv_ps(minus_inf, scaled, valid(t)));
  }
  best = _mm256_max_ps(best, _mm256_permute2f128_ps(best, best, 0x01));
  best = _mm256_max_ps(best, _mm256_permute_ps(best, _MM_SHUFFLE(1, 0, 3, 2)));
  best = _mm256_max_ps(best, _mm256_permute_ps(best, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m256 floor = _mm256_set1_ps(-87.3f);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + t), best);
    const __m256 e = _mm256_and_ps(pagedserve::exp8(_mm256_max_ps(floor, x)), valid(t));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0.f;
  for (const float x : lanes) total += x;
  return total;
}

// The AVX2 steps of the decode tile (attend_decode_rows).
struct DecodeAvx2 {
  template <int64_t kD, int64_t kG, class KV>
  ALWAYS_INLINE static void score(const float* const* q, const KV* k, const KeyChunk& chunk, const KeyChunk& ahead,
                                  const KV* ahead_rows, float* const* scores) {
    score_group8<kD, kG>(q, k, chunk, ahead, ahead_rows, scores);
  }
  template <int64_t kD, int64_t kG, class KV>
  ALWAYS_INLINE static void add_values(float* acc, const KV* v, const KeyChunk& chunk, const float* const* p,
                                       const KeyChunk& ahead, const KV* ahead_rows) {
    add_values_group8<kD, kG>(acc, v, chunk, p, ahead, ahead_rows);
  }
  ALWAYS_INLINE static float softmax(float* s, int64_t n, float scale) { return softmax_numerators8(s, n, scale); }
};
#endif  // __AVX2__ && __FMA__

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The decode tile (#29): rows [row0, row1) of a sequence with one query token, i.e. whole groups of kG query heads
// that share a KV head (split_work cuts on KV-head boundaries). Every row sees every key, so instead of an online
// softmax per chunk of 16 keys (a max, an exp and a rescale of the accumulators per row and chunk, and P.V waiting
// on them) it takes two passes: the scores of all keys (K only, chunk by chunk, each K row loaded into registers
// once for the kG query heads of its group), one softmax per row over all of them, then P.V (V only, each V row
// loaded once for the group). The scores wait in `scores` (rows x the context rounded up to 16 floats).
// Vec: the steps of one vector ISA (DecodeAvx512 or DecodeAvx2).
template <class Vec, int64_t kD, int64_t kG, class KV>
void attend_decode_rows(const Layout<KV>& L, int64_t seq, int64_t row0, int64_t row1, int64_t next_seq, float* acc,
                        float* max_score, float* denom, float* scores) {
  const TileRows tile(L, seq, row0, row1, kD, acc, max_score, denom);
  const int64_t rows = tile.rows, end = tile.end, padded = (end + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
  float* row_scores[kRowTile];
  for (int64_t r = 0; r < rows; ++r) row_scores[r] = scores + r * padded;
  Ahead ahead{tile.table, end, next_seq < 0 ? nullptr : L.block_tables + next_seq * L.table_stride,
              next_seq < 0 ? 0 : L.seq_lens[next_seq]};
  if (L.prefetch_decode)
    for (int64_t skip = 0; skip < kDecodeAhead; ++skip) ahead.advance(L);
  for (const bool values : {false, true}) {  // the scores (K), then P.V (V)
    KeyChunk chunk;
    int64_t block = 0, in_block = 0;
    for (int64_t start = 0; start < end; start += kKeyChunk) {
      locate_chunk(L, tile.table, start, end, block, in_block, chunk, Reads{false, false});
      if (L.prefetch_decode) ahead.advance(L);
      const KV* ahead_cache = ahead.values ? L.v_cache : L.k_cache;
      float* at[kRowTile];
      for (int64_t r = 0; r < rows; ++r) at[r] = row_scores[r] + start;
      for (int64_t r0 = 0; r0 < rows; r0 += kG) {
        const int64_t head = tile.head_offset[r0];
        if (values)
          Vec::template add_values<kD, kG>(acc + r0 * kD, L.v_cache + head, chunk, at + r0, ahead.chunk,
                                           ahead_cache + head);
        else
          Vec::template score<kD, kG>(tile.q + r0, L.k_cache + head, chunk, ahead.chunk, ahead_cache + head, at + r0);
      }
    }
    if (!values)
      for (int64_t r = 0; r < rows; ++r) denom[r] = Vec::softmax(row_scores[r], end, L.scale);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = tile.out[r];
    const float inv = 1.f / denom[r];
#pragma omp simd
    for (int64_t d = 0; d < kD; ++d) o[d] = acc[r * kD + d] * inv;
  }
}

// The decode tile of the widest vectors built: AVX-512's where built, else AVX2's.
template <int64_t kD, int64_t kG, class KV>
void attend_decode_tile(const Layout<KV>& L, int64_t seq, int64_t row0, int64_t row1, int64_t next_seq, float* acc,
                        float* max_score, float* denom, float* scores) {
#ifdef __AVX512F__
  attend_decode_rows<DecodeAvx512, kD, kG>(L, seq, row0, row1, next_seq, acc, max_score, denom, scores);
#else
  attend_decode_rows<DecodeAvx2, kD, kG>(L, seq, row0, row1, next_seq, acc, max_score, denom, scores);
#endif
}

#ifdef __AVX512F__
template <class KV>
constexpr bool kDecodeTileReads = true;  // whether the decode tile takes caches of element KV
#else
// With AVX2 alone the decode tile is the faster one over float16 caches only: 1.1 - 1.5x the portable tile on an
// AMD Zen 1, where over float32 ones (twice the bytes) its two passes read slower than the portable tile's one,
// 0.7 - 0.9x (BENCHMARKS.md section 17, "Twenty-third session").
template <class KV>
constexpr bool kDecodeTileReads = !std::is_same_v<KV, float>;
#endif

// The decode tile for the (head size, group) pairs and caches it is compiled for, where the rows are one query
// token's; false where it does not apply (the caller runs the general tile).
template <class KV>
bool attend_decode(const Layout<KV>& L, int64_t seq, int64_t row0, int64_t row1, int64_t next_seq, float* acc,
                   float* max_score, float* denom, std::vector<float>& scores) {
  if constexpr (!kDecodeTileReads<KV>) {
    return false;
  } else {
    if (L.query_start_loc[seq + 1] - L.query_start_loc[seq] != 1) return false;
    const int64_t padded = (L.seq_lens[seq] + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
    scores.resize(std::max<size_t>(scores.size(), static_cast<size_t>((row1 - row0) * padded)));
    const auto run = [&](auto tile) {
      tile(L, seq, row0, row1, next_seq, acc, max_score, denom, scores.data());
      return true;
    };
    switch (L.head_dim * 16 + L.group) {
      case 64 * 16 + 2: return run(attend_decode_tile<64, 2, KV>);
      case 64 * 16 + 4: return run(attend_decode_tile<64, 4, KV>);
      case 128 * 16 + 2: return run(attend_decode_tile<128, 2, KV>);
      case 32 * 16 + 2: return run(attend_decode_tile<32, 2, KV>);
      case 32 * 16 + 4: return run(attend_decode_tile<32, 4, KV>);
#ifndef __AVX512F__  // (AVX-512's tile keeps a group's queries in registers: too many for these)
      case 64 * 16 + 1: return run(attend_decode_tile<64, 1, KV>);
      case 128 * 16 + 1: return run(attend_decode_tile<128, 1, KV>);
      case 128 * 16 + 4: return run(attend_decode_tile<128, 4, KV>);
#endif
      default: return false;
    }
  }
}
#endif

// The decode tile where it applies (rows of one query token), then the AVX-512 tile where it is built and the head
// size allows, else (or when `portable`) the portable one.
// next_seq: the sequence this thread computes next (-1: none), which the decode tile starts fetching.
template <class KV>
void attend(const Layout<KV>& L, [[maybe_unused]] bool portable, int64_t seq, int64_t row0, int64_t row1,
            [[maybe_unused]] int64_t next_seq, float* acc, float* max_score, float* denom, std::vector<float>& scores) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (!portable && attend_decode(L, seq, row0, row1, next_seq, acc, max_score, denom, scores)) return;
#endif
#ifdef __AVX512F__
  if (!portable && L.head_dim % 16 == 0) {
    switch (L.head_dim) {
      case 64: return attend_rows_avx512<64>(L, seq, row0, row1, acc, max_score, denom);
      case 128: return attend_rows_avx512<128>(L, seq, row0, row1, acc, max_score, denom);
      case 32: return attend_rows_avx512<32>(L, seq, row0, row1, acc, max_score, denom);
      default: return attend_rows_avx512<0>(L, seq, row0, row1, acc, max_score, denom);
    }
  }
#endif
  switch (L.head_dim) {
    case 64: return attend_rows_portable<64>(L, seq, row0, row1, acc, max_score, denom, scores.data());
    case 128: return attend_rows_portable<128>(L, seq, row0, row1, acc, max_score, denom, scores.data());
    case 32: return attend_rows_portable<32>(L, seq, row0, row1, acc, max_score, denom, scores.data());
    default: return attend_rows_portable<0>(L, seq, row0, row1, acc, max_score, denom, scores.data());
  }
}

// Every read the named sequences imply stays inside the tensors (bad metadata raises instead of crashing).
// Returns the number of context keys they read.
template <class KV>
int64_t check_metadata(const Layout<KV>& L, const int32_t* seq_ids, int64_t count, int64_t num_seqs, int64_t num_tokens,
                       int64_t table_width, int64_t num_blocks) {
  int64_t keys = 0;
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
    keys += ctx;
  }
  return keys;
}

void check_float(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == dim && t.stride(dim - 1) == 1, name, " must be ", dim, "-D with a contiguous last dim");
}

template <class KV>
const KV* cache_data(const at::Tensor& t) {
  return reinterpret_cast<const KV*>(t.const_data_ptr());
}

void check_int(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == dim, name,
              " must be a ", dim, "-D int32 CPU tensor");
  TORCH_CHECK(t.stride(dim - 1) == 1, name, " must have a contiguous last dim");
}

// Rows per tile: each tile reads the sequence's K/V once, so as many as keep the AVX-512 tile's accumulators in L1
// (32 KiB); 16 for the portable tile.
int64_t row_tile([[maybe_unused]] bool portable, [[maybe_unused]] int64_t head_dim) {
#ifdef __AVX512F__
  if (!portable && head_dim % 16 == 0) return std::clamp<int64_t>(8192 / head_dim, 16, kRowTile);
#endif
  return 16;
}

// Rows [row0, row1) of a sequence: one unit of parallel work.
struct WorkItem {
  int64_t seq, row0, row1;
};

// The sequences' rows cut into work items of at most `tile` rows, and small enough that there are about
// kItemsPerThread items per thread where the rows allow (#29: a decode step of a few sequences still spreads over
// every thread). Cuts fall on KV-head boundaries (rows = token * H + head, heads of a KV head adjacent), so no K/V
// row is read by two items of the same query token; each row's result does not depend on how rows are grouped.
constexpr int64_t kItemsPerThread = 4;

template <class KV>
std::vector<WorkItem> split_work(const Layout<KV>& L, const int32_t* seq_ids, int64_t count, int64_t tile) {
  const int64_t H = L.num_kv_heads * L.group;
  int64_t total_rows = 0;
  for (int64_t i = 0; i < count; ++i)
    total_rows += (L.query_start_loc[seq_ids[i] + 1] - L.query_start_loc[seq_ids[i]]) * H;
  const int64_t wanted = kItemsPerThread * at::get_num_threads();
  const int64_t per_item = std::max<int64_t>(1, (total_rows + wanted - 1) / wanted);
  const int64_t size = std::min(tile, std::max(L.group, per_item / L.group * L.group));
  std::vector<WorkItem> items;
  items.reserve(total_rows / size + count);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t seq = seq_ids[i], rows = (L.query_start_loc[seq + 1] - L.query_start_loc[seq]) * H;
    for (int64_t row0 = 0; row0 < rows; row0 += size) items.push_back({seq, row0, std::min(rows, row0 + size)});
  }
  return items;
}

// Where each thread's run of items begins (threads + 1 entries, the last items.size()): contiguous runs of about equal
// cost, an item costing its rows times the keys they read. Equal counts of items would leave most of a causal
// prefill to the thread of its last rows, which read the most keys (1 x 512 tokens on 2 threads: 74% of the work).
template <class KV>
std::vector<int64_t> balance(const Layout<KV>& L, const std::vector<WorkItem>& items, int64_t threads) {
  const int64_t H = L.num_kv_heads * L.group;
  std::vector<double> prefix(items.size() + 1, 0.0);
  for (size_t i = 0; i < items.size(); ++i) {
    const WorkItem& w = items[i];
    const int64_t q_len = L.query_start_loc[w.seq + 1] - L.query_start_loc[w.seq];
    const double keys = static_cast<double>(L.seq_lens[w.seq] - q_len) + 0.5 * (w.row0 / H + (w.row1 - 1) / H) + 1.0;
    prefix[i + 1] = prefix[i] + static_cast<double>(w.row1 - w.row0) * keys;
  }
  std::vector<int64_t> starts(threads + 1, static_cast<int64_t>(items.size()));
  for (int64_t t = 0; t < threads; ++t) {
    const double target = prefix.back() * static_cast<double>(t) / static_cast<double>(threads);
    starts[t] = std::lower_bound(prefix.begin(), prefix.end() - 1, target) - prefix.begin();
  }
  return starts;
}

// A thread's accumulators for a tile of up to kRowTile rows (scores: the portable tile's block of scores per row,
// grown by the decode tile to a whole context per row).
struct TileScratch {
  TileScratch(int64_t head_dim, int64_t block_size)
      : acc(kRowTile * head_dim), max_score(kRowTile), denom(kRowTile), scores(kRowTile * block_size) {}
  std::vector<float> acc, max_score, denom, scores;
};

// The attention of the named sequences over caches of element KV (the metadata already checked for shape).
template <class KV>
void attend_sequences(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                      const at::Tensor& seqs, double scale, bool portable) {
  const int64_t num_kv_heads = k_cache.size(2), num_heads = query.size(1), head_dim = query.size(2);
  Layout<KV> L{query.data_ptr<float>(), cache_data<KV>(k_cache), cache_data<KV>(v_cache),
               block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
               out.data_ptr<float>(), query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
               k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1), num_kv_heads,
               num_heads / num_kv_heads, head_dim, k_cache.size(1), static_cast<float>(scale), false, false};
  const int32_t* seq_ids = seqs.data_ptr<int32_t>();
  const int64_t keys =
      check_metadata(L, seq_ids, seqs.size(0), seq_lens.size(0), query.size(0), block_tables.size(1), k_cache.size(0));
  const int64_t kv_bytes = keys * L.cache_token_stride * static_cast<int64_t>(2 * sizeof(KV));
  L.stream_from_memory = kv_bytes > kStreamBytes;
  L.prefetch_decode = kv_bytes > kDecodePrefetchBytes;
  const std::vector<WorkItem> items = split_work(L, seq_ids, seqs.size(0), row_tile(portable, head_dim));
  const std::vector<int64_t> starts = balance(L, items, pagedserve::team_size(static_cast<int64_t>(items.size())));
  pagedserve::parallel_steal(
      starts, [&] { return TileScratch(head_dim, L.block_size); },
      [&](TileScratch& s, int64_t i, int64_t next) {
        attend(L, portable, items[i].seq, items[i].row0, items[i].row1, next < 0 ? -1 : items[next].seq,
               s.acc.data(), s.max_score.data(), s.denom.data(), s.scores);
      });
}

// out [T, H, D] = attention of query [T, H, D] against caches [blocks, block_size, kv_heads, D].
// `seqs` (int32) names the sequences to compute; the rows of other sequences in out are left untouched.
void run_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                   const at::Tensor& seqs, double scale, bool portable) {
  check_float(out, "out", 3);
  check_float(query, "query", 3);
  pagedserve::check_caches(k_cache, v_cache);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1, "k_cache must be 4-D with a contiguous last dim");
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
  if (k_cache.scalar_type() == at::kHalf)
    attend_sequences<c10::Half>(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seqs, scale,
                                portable);
  else
    attend_sequences<float>(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seqs, scale,
                            portable);
}

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& seqs, double scale) {
  run_attention(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seqs, scale, false);
}

void paged_attention_portable(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, const at::Tensor& seqs, double scale) {
  run_attention(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seqs, scale, true);
}

// True when paged_attention runs the AVX-512 tile (for head sizes that are multiples of 16).
bool has_avx512() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

// Scatter key/value [T, kv_heads, D] into the caches at flat slots (slot < 0: skipped).
template <class KV>
void scatter_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                const int64_t* slot) {
  const int64_t tokens = key.size(0), heads = key.size(1), D = key.size(2), row = heads * D;
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  KV* kc = reinterpret_cast<KV*>(k_cache.data_ptr());
  KV* vc = reinterpret_cast<KV*>(v_cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      pagedserve::store_row(kc + slot[t] * row + h * D, k + t * key.stride(0) + h * key.stride(1), D);
      pagedserve::store_row(vc + slot[t] * row + h * D, v + t * value.stride(0) + h * value.stride(1), D);
    }
  }
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  check_float(key, "key", 3);
  check_float(value, "value", 3);
  pagedserve::check_caches(k_cache, v_cache);
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1,
              "slot_mapping must be a 1-D int64 CPU tensor");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t tokens = key.size(0), heads = key.size(1), D = key.size(2);
  TORCH_CHECK(slot_mapping.size(0) == tokens && value.sizes() == key.sizes() && heads == k_cache.size(2) &&
              D == k_cache.size(3), "key, value, slots and cache shapes disagree");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " out of range [0, ", num_slots, ")");
  if (k_cache.scalar_type() == at::kHalf)
    scatter_kv<c10::Half>(key, value, k_cache, v_cache, slot);
  else
    scatter_kv<float>(key, value, k_cache, v_cache, slot);
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor seqs, float scale) -> ()");
  m.def("paged_attention_portable(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor seqs, float scale) -> ()");
  m.def("has_avx512() -> bool", has_avx512);
  m.def("threads_used(int items) -> int", pagedserve::threads_used);
  m.def("stolen_items(int items, int wait_ms) -> int", pagedserve::stolen_items);
  m.def("pool_address() -> int", pagedserve::pool_address);
  m.def("pool_threads_used(int items) -> int", pagedserve::pool_threads_used);
  m.def("pool_faulty_regions(int regions, int items) -> int", pagedserve::pool_faulty_regions);
  m.def("pool_rethrows(int items, int failing) -> bool", pagedserve::pool_rethrows);
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_attention", paged_attention);
  m.impl("paged_attention_portable", paged_attention_portable);
  m.impl("write_kv", write_kv);
}
