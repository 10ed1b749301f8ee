// Rotary embedding of a step's queries and keys, and the keys and values written into the paged KV cache, in one
// pass over the fused QKV projection's output (the torch path takes about ten ops per layer for the same).
// The products and sums are Hugging Face's (x1 * cos - x2 * sin, x2 * cos + x1 * sin, each product rounded
// before the sum: built with -ffp-contract=off), so the result is bit-identical to model/llama.py's apply_rope.
// The caches hold float32, or float16 (--kv-cache-dtype float16: keys and values rounded to nearest even as they
// are written).
// Registered as torch.ops.pagedserve_model.rope_write_kv; built by executor_service/model/cpu_ops.py.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "kv_cache_element.h"

namespace {

inline void rotate(const float* __restrict x, const float* __restrict c, const float* __restrict s, float* __restrict out,
                   int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * c[i] - x[i + half] * s[i];
    out[i + half] = x[i + half] * c[i] + x[i] * s[i];
  }
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

// The rotated queries into `query`; the rotated keys and the values into the caches (elements KV) at the slots.
template <class KV>
void rotate_and_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const int64_t* slot, at::Tensor& query, int64_t num_heads,
                      int64_t num_kv_heads) {
  const int64_t tokens = qkv.size(0), D = k_cache.size(3), half = D / 2, kv_row = num_kv_heads * D;
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* q = query.data_ptr<float>();
  KV* kc = reinterpret_cast<KV*>(k_cache.data_ptr());
  KV* vc = reinterpret_cast<KV*>(v_cache.data_ptr());
  std::vector<float> rotated(std::is_same_v<KV, float> ? 0 : D);  // a float16 key, rotated before it is rounded
  for (int64_t t = 0; t < tokens; ++t) {
    const float* x = qkv.data_ptr<float>() + t * qkv.stride(0);
    const float* ct = c + t * half;
    const float* st = s + t * half;
    for (int64_t h = 0; h < num_heads; ++h) rotate(x + h * D, ct, st, q + (t * num_heads + h) * D, half);
    if (slot[t] < 0) continue;
    const float* k = x + num_heads * D;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      if constexpr (std::is_same_v<KV, float>) {
        rotate(k + h * D, ct, st, kc + slot[t] * kv_row + h * D, half);
      } else {
        rotate(k + h * D, ct, st, rotated.data(), half);
        pagedserve::store_row(kc + slot[t] * kv_row + h * D, rotated.data(), D);
      }
    }
    pagedserve::store_row(vc + slot[t] * kv_row, k + kv_row, kv_row);
  }
}

// qkv [T, (H + 2 KV) * D] (rows may be strided); cos, sin [T, (1,) D / 2] contiguous; caches [blocks, block_size,
// KV, D] contiguous; slot_mapping int64 [T] (< 0: not written). Returns the rotated queries [T, H, D].
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  check_float(qkv, "qkv");
  check_float(cos, "cos");
  check_float(sin, "sin");
  pagedserve::check_caches(k_cache, v_cache);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == num_kv_heads,
              "caches must be contiguous [blocks, block_size, ", num_kv_heads, ", head_dim] and alike");
  const int64_t tokens = qkv.size(0), D = k_cache.size(3), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && num_heads > 0 && qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * D,
              "qkv must be [tokens, (heads + 2 kv_heads) * head_dim] with contiguous rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * half &&
                  sin.numel() == tokens * half, "cos and sin must be contiguous [tokens, head_dim / 2]");
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == tokens && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous 1-D int64 CPU tensor with one slot per token");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " out of range [0, ", num_slots, ")");
  at::Tensor query = at::empty({tokens, num_heads, D}, qkv.options());
  if (k_cache.scalar_type() == at::kHalf)
    rotate_and_write<c10::Half>(qkv, cos, sin, k_cache, v_cache, slot, query, num_heads, num_kv_heads);
  else
    rotate_and_write<float>(qkv, cos, sin, k_cache, v_cache, slot, query, num_heads, num_kv_heads);
  return query;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_model, m) {
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_model, CPU, m) { m.impl("rope_write_kv", rope_write_kv); }
