// RMSNorm as one operator: y = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), the mean in fp32, as
// model/layers.py RMSNorm computes it in several torch operators (whose per-call cost, not the
// arithmetic, is what a decode step of a few rows pays). Rounding follows those operators: the
// normalized row is rounded to x's dtype, then multiplied by the weight and rounded again. Only the
// order of the fp32 sum differs. Portable C++; rows are shared out over torch's intra-op threads. add_rms_norm
// takes the residual addition before the norm into the same call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "row_math.h"
#include "layer_pieces.h"

namespace {

template <typename T>
void normalize_rows(const T* x, const T* weight, T* y, int64_t rows, int64_t dim, int64_t x_row, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dsaserve::rms_norm_row(x + r * x_row, weight, y + r * dim, dim, eps);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "dsaserve rms_norm: x and weight must both be bf16 or both fp32");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && weight.is_contiguous(), "dsaserve rms_norm: weight must be [dim]");
  at::Tensor rows = x.reshape({-1, dim});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  at::Tensor y = at::empty(rows.sizes(), x.options());
  if (x.scalar_type() == at::kFloat)
    normalize_rows(rows.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows.size(0), dim,
                   rows.stride(0), static_cast<float>(eps));
  else
    normalize_rows(rows.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(),
                   rows.size(0), dim, rows.stride(0), static_cast<float>(eps));
  return y.view(x.sizes());
}

// (rms_norm(x + residual), x + residual) for x, residual [T, dim] of one dtype: a decoder layer's residual
// addition and the norm after it in one call, the sum rounded to the dtype first as torch's addition rounds it.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "dsaserve add_rms_norm: x and residual must be [T, dim] of one dtype");
  const at::Tensor sum = at::add(x, residual);
  return {rms_norm(sum, weight, eps), sum};
}

// A KDA layer's output norm (model/kda.py gated_norm) per head row of o [..., D]: weight * (o * rsqrt(mean(o^2) +
// eps)) * sigmoid(gate), all in fp32 and rounded once to o's dtype, as the torch operators compute it (only the
// order of the fp32 sum differs). o and gate of one dtype (bf16 or fp32) and shape; weight fp32 [D].
template <typename T>
void gate_rows(const T* o, const T* gate, const float* weight, T* y, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = o + r * dim;
      const T* g = gate + r * dim;
      float squares = 0.0f;
      for (int64_t i = 0; i < dim; ++i) squares += static_cast<float>(x[i]) * static_cast<float>(x[i]);
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) {
        const float normed = static_cast<float>(x[i]) * scale;
        y[r * dim + i] = static_cast<T>(weight[i] * normed / (1.0f + std::exp(-static_cast<float>(g[i]))));
      }
    }
  });
}

at::Tensor gated_rms_norm(const at::Tensor& o, const at::Tensor& gate, const at::Tensor& weight, double eps) {
  TORCH_CHECK(o.scalar_type() == gate.scalar_type() && o.sizes() == gate.sizes() && o.is_contiguous() &&
                  gate.is_contiguous() && (o.scalar_type() == at::kBFloat16 || o.scalar_type() == at::kFloat),
              "dsaserve gated_rms_norm: o and gate must be contiguous, of one shape and dtype (bf16 or fp32)");
  const int64_t dim = o.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "dsaserve gated_rms_norm: weight must be fp32 [dim]");
  at::Tensor y = at::empty_like(o);
  const int64_t rows = o.numel() / dim;
  if (o.scalar_type() == at::kFloat)
    gate_rows(o.data_ptr<float>(), gate.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows, dim,
              static_cast<float>(eps));
  else
    gate_rows(o.data_ptr<c10::BFloat16>(), gate.data_ptr<c10::BFloat16>(), weight.data_ptr<float>(),
              y.data_ptr<c10::BFloat16>(), rows, dim, static_cast<float>(eps));
  return y;
}

}  // namespace

// For decode_plan.cpp (layer_pieces.h).
at::Tensor dsaserve::rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return ::rms_norm(x, weight, eps);
}
std::tuple<at::Tensor, at::Tensor> dsaserve::add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps) {
  return ::add_rms_norm(x, residual, weight, eps);
}

namespace {
// Meta kernels: the output shapes without computing (meta tensors, tracing).
at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor&, double) { return at::empty_like(x); }
at::Tensor gated_rms_norm_meta(const at::Tensor& o, const at::Tensor&, const at::Tensor&, double) {
  return at::empty_like(o);
}
std::tuple<at::Tensor, at::Tensor> add_rms_norm_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                                     double) {
  return {at::empty_like(x), at::empty_like(x)};
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("gated_rms_norm(Tensor o, Tensor gate, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("gated_rms_norm", &gated_rms_norm);
}

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) {
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("add_rms_norm", &add_rms_norm_meta);
  m.impl("gated_rms_norm", &gated_rms_norm_meta);
}
