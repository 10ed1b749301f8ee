// Linear layers over weights packed once into MKL's GEMM panel format (cblas_sgemm_pack / cblas_sgemm_compute).
//
// sgemm re-packs its B operand (the weight) into panels on every call; for decode-sized batches that re-packing is a
// large part of the call. Packing once at load time skips it. For 16 rows or more MKL runs the same kernels on the
// same panels, so the result is bit-identical to torch's F.linear; below 16 rows F.linear takes MKL's small-matrix
// path and the two differ by rounding. The MKL symbols come from libtorch_cpu (torch's CPU build links MKL statically).
// Registered as torch.ops.pagedserve_model.{pack_weight,linear}; built by executor_service/model/cpu_ops.py.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>

extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k);
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                      int ld, float* dest);
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc);
}

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
constexpr int kNominalRows = 64;  // the packed panels do not depend on the row count they are used with

int checked_int(int64_t v, const char* what) {
  TORCH_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), what, " ", v, " does not fit MKL's int");
  return static_cast<int>(v);
}

void check_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "weight must be a 2-D float32 CPU tensor");
  TORCH_CHECK(weight.stride(1) == 1 && weight.stride(0) >= weight.size(1), "weight rows must be contiguous");
}

// The weight [out, in] as B = weight^T, packed; a float32 buffer of MKL's packed size.
at::Tensor pack_weight(const at::Tensor& weight) {
  check_weight(weight);
  const int n = checked_int(weight.size(0), "out_features"), k = checked_int(weight.size(1), "in_features");
  const size_t bytes = cblas_sgemm_pack_get_size(kBMatrix, kNominalRows, n, k);
  at::Tensor packed = at::empty({static_cast<int64_t>((bytes + sizeof(float) - 1) / sizeof(float))},
                                weight.options());
  cblas_sgemm_pack(kRowMajor, kBMatrix, kTrans, kNominalRows, n, k, 1.0f, weight.data_ptr<float>(),
                   checked_int(weight.stride(0), "weight row stride"), packed.data_ptr<float>());
  return packed;
}

// y [rows, out] = x [rows, in] @ weight^T (+ bias), with `packed` = pack_weight(weight).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  check_weight(weight);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "x must be 2-D float32 CPU");
  TORCH_CHECK(x.size(1) == weight.size(1), "x has ", x.size(1), " features, the weight ", weight.size(1));
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) >= x.size(1), "x rows must be contiguous");
  const int64_t n = weight.size(0);
  const size_t bytes = cblas_sgemm_pack_get_size(kBMatrix, kNominalRows, checked_int(n, "out_features"),
                                                 checked_int(weight.size(1), "in_features"));
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  static_cast<size_t>(packed.numel()) * sizeof(float) >= bytes,
              "packed does not hold this weight's packed panels");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  float beta = 0.f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n, "bias must be [out]");
    out.copy_(bias->unsqueeze(0).expand({x.size(0), n}));
    beta = 1.f;
  }
  if (x.size(0) == 0 || n == 0) return out;
  if (weight.size(1) == 0) return bias.has_value() ? out : out.zero_();
  cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, checked_int(x.size(0), "rows"), checked_int(n, "out_features"),
                      checked_int(x.size(1), "in_features"), x.data_ptr<float>(), checked_int(x.stride(0), "x stride"),
                      packed.data_ptr<float>(), checked_int(x.size(1), "in_features"), beta, out.data_ptr<float>(),
                      checked_int(n, "out_features"));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_model, m) {
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_model, CPU, m) {
  m.impl("pack_weight", pack_weight);
  m.impl("linear", linear);
}
