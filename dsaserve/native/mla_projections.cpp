// MLA's projections around attention for a few tokens (decode, draft verification), one operator on each side,
// with the bits of model/mla.py's operators:
//   mla_query:  q_resid = q_a_layernorm(q_a_proj(x)), q = q_b_proj(q_resid) per head as [nope | rope], and
//               query = [q_nope · W_UK | rope(q_rope)] [T, heads, rank + rope]; returns (query, q_resid), the
//               indexer reads q_resid;
//   mla_output: o_proj(each head's attended latent · W_UVᵀ, heads side by side) [T, hidden].
// The products are the packed-weight kernels (packed_product.h), the norm and rotary embedding row_math.h's;
// what this saves is a dozen torch calls and their Python per layer and step, which cost more than the
// arithmetic of one token.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "packed_product.h"
#include "row_math.h"
#include "layer_pieces.h"

namespace {

at::Tensor product(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, at::IntArrayRef args) {
  TORCH_CHECK(args.size() == 5, "dsaserve MLA projections: a weight's args are (kind, group, col_offset, N, K)");
  return dsaserve::packed_product(x, q, s, args[0], args[1], args[2], args[3], args[4]);
}

template <typename T>
void finish(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& cos, const at::Tensor& sin,
            bool interleaved, int64_t heads, int64_t nope, int64_t rope, at::Tensor& query) {
  const int64_t tokens = q.size(0), rank = latent.size(2), half = rope / 2, width = rank + rope;
  const T* qp = q.data_ptr<T>();
  const T* lp = latent.data_ptr<T>();
  T* out = query.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      T* row = out + (t * heads + h) * width;
      const T* l = lp + (h * tokens + t) * rank;
      std::copy(l, l + rank, row);
      dsaserve::rope_row(qp + (t * heads + h) * (nope + rope) + nope, cos.data_ptr<T>() + t * half,
                         sin.data_ptr<T>() + t * half, row + rank, half, interleaved);
    }
}

std::tuple<at::Tensor, at::Tensor> mla_query(const at::Tensor& x, const at::Tensor& q_a_q, const at::Tensor& q_a_s,
                                             at::IntArrayRef q_a_args, const at::Tensor& norm_weight, double eps,
                                             const at::Tensor& q_b_q, const at::Tensor& q_b_s, at::IntArrayRef q_b_args,
                                             const at::Tensor& w_uk_q, const at::Tensor& w_uk_s,
                                             at::IntArrayRef w_uk_args, const at::Tensor& cos, const at::Tensor& sin,
                                             bool interleaved, int64_t heads, int64_t nope, int64_t rope) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kBFloat16 || dtype == at::kFloat) && norm_weight.scalar_type() == dtype &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "dsaserve mla_query: x [T, hidden], the norm's weight, cos and sin must share one dtype, bf16 or fp32");
  const int64_t tokens = x.size(0);
  TORCH_CHECK(rope % 2 == 0 && cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == rope / 2 &&
                  sin.sizes() == cos.sizes(), "dsaserve mla_query: cos and sin must be [T, rope / 2]");
  const at::Tensor a = product(x, q_a_q, q_a_s, q_a_args);  // [T, q_lora_rank]
  const int64_t lora = a.size(1);
  TORCH_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == lora && norm_weight.is_contiguous(),
              "dsaserve mla_query: the norm's weight must be [q_lora_rank]");
  at::Tensor q_resid = at::empty_like(a);
  for (int64_t t = 0; t < tokens; ++t) {
    if (dtype == at::kFloat)
      dsaserve::rms_norm_row(a.data_ptr<float>() + t * lora, norm_weight.data_ptr<float>(),
                             q_resid.data_ptr<float>() + t * lora, lora, static_cast<float>(eps));
    else
      dsaserve::rms_norm_row(a.data_ptr<c10::BFloat16>() + t * lora, norm_weight.data_ptr<c10::BFloat16>(),
                             q_resid.data_ptr<c10::BFloat16>() + t * lora, lora, static_cast<float>(eps));
  }
  const at::Tensor q = product(q_resid, q_b_q, q_b_s, q_b_args);  // [T, heads * (nope + rope)]
  TORCH_CHECK(q.size(1) == heads * (nope + rope), "dsaserve mla_query: q_b_proj gives ", q.size(1),
              " columns, heads * (nope + rope) is ", heads * (nope + rope));
  // Each head's nope columns of every token, [heads, T, nope] (a view), by that head's W_UK: [heads, T, rank].
  const at::Tensor latent = product(q.view({tokens, heads, nope + rope}).narrow(2, 0, nope).transpose(0, 1), w_uk_q,
                                    w_uk_s, w_uk_args);
  at::Tensor query = at::empty({tokens, heads, latent.size(2) + rope}, x.options());
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  if (dtype == at::kFloat) finish<float>(q, latent, c, s, interleaved, heads, nope, rope, query);
  else finish<c10::BFloat16>(q, latent, c, s, interleaved, heads, nope, rope, query);
  return {query, q_resid};
}

at::Tensor mla_output(const at::Tensor& latent, const at::Tensor& w_uv_q, const at::Tensor& w_uv_s,
                      at::IntArrayRef w_uv_args, const at::Tensor& o_q, const at::Tensor& o_s, at::IntArrayRef o_args) {
  TORCH_CHECK(latent.dim() == 3, "dsaserve mla_output: the attended latents must be [T, heads, rank]");
  const int64_t tokens = latent.size(0), heads = latent.size(1);
  const at::Tensor values = product(latent.transpose(0, 1), w_uv_q, w_uv_s, w_uv_args);  // [heads, T, v]
  return product(values.transpose(0, 1).reshape({tokens, heads * values.size(2)}), o_q, o_s, o_args);
}

}  // namespace

// For decode_plan.cpp (layer_pieces.h).
std::tuple<at::Tensor, at::Tensor> dsaserve::mla_query(
    const at::Tensor& x, const at::Tensor& q_a_q, const at::Tensor& q_a_s, at::IntArrayRef q_a_args,
    const at::Tensor& norm_weight, double eps, const at::Tensor& q_b_q, const at::Tensor& q_b_s,
    at::IntArrayRef q_b_args, const at::Tensor& w_uk_q, const at::Tensor& w_uk_s, at::IntArrayRef w_uk_args,
    const at::Tensor& cos, const at::Tensor& sin, bool interleaved, int64_t heads, int64_t nope, int64_t rope) {
  return ::mla_query(x, q_a_q, q_a_s, q_a_args, norm_weight, eps, q_b_q, q_b_s, q_b_args, w_uk_q, w_uk_s, w_uk_args,
                     cos, sin, interleaved, heads, nope, rope);
}
at::Tensor dsaserve::mla_output(const at::Tensor& latent, const at::Tensor& w_uv_q, const at::Tensor& w_uv_s,
                                at::IntArrayRef w_uv_args, const at::Tensor& o_q, const at::Tensor& o_s,
                                at::IntArrayRef o_args) {
  return ::mla_output(latent, w_uv_q, w_uv_s, w_uv_args, o_q, o_s, o_args);
}

namespace {
// Meta kernels: the output shapes without computing (meta tensors, tracing).
std::tuple<at::Tensor, at::Tensor> mla_query_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                                  at::IntArrayRef q_a_args, const at::Tensor&, double,
                                                  const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                                                  const at::Tensor&, const at::Tensor&, at::IntArrayRef w_uk_args,
                                                  const at::Tensor&, const at::Tensor&, bool, int64_t heads, int64_t,
                                                  int64_t rope) {
  return {at::empty({x.size(0), heads, w_uk_args[3] + rope}, x.options()), at::empty({x.size(0), q_a_args[3]},
                                                                                      x.options())};
}
at::Tensor mla_output_meta(const at::Tensor& latent, const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                           const at::Tensor&, const at::Tensor&, at::IntArrayRef o_args) {
  return at::empty({latent.size(0), o_args[3]}, latent.options());
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
  m.def("mla_query(Tensor x, Tensor q_a_q, Tensor q_a_s, int[] q_a_args, Tensor norm_weight, float eps, "
        "Tensor q_b_q, Tensor q_b_s, int[] q_b_args, Tensor w_uk_q, Tensor w_uk_s, int[] w_uk_args, Tensor cos, "
        "Tensor sin, bool interleaved, int heads, int nope, int rope) -> (Tensor, Tensor)");
  m.def("mla_output(Tensor latent, Tensor w_uv_q, Tensor w_uv_s, int[] w_uv_args, Tensor o_q, Tensor o_s, "
        "int[] o_args) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) {
  m.impl("mla_query", &mla_query);
  m.impl("mla_output", &mla_output);
}

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) {
  m.impl("mla_query", &mla_query_meta);
  m.impl("mla_output", &mla_output_meta);
}
