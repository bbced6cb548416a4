// Rotary embedding as one operator, with the rounding of model/layers.py apply_rope's torch operators:
// for each pair (a, b) of x's last dimension (interleaved: columns 2i, 2i+1; else i and i + dim/2) and
// its cos/sin c, s, out[i] = (a*c) - (b*s) and out[dim/2 + i] = (b*c) + (a*s), every product and sum
// rounded to x's dtype (c10's BFloat16 arithmetic is exactly that). The output is written half-split
// (all first elements, then all second ones), as apply_rope does. x [T, ..., width] with a unit stride in
// its last dimension; cos, sin [T, dim/2] in x's dtype. The first dim = 2 · cos.size(1) columns are rotated;
// any columns past them (the indexer's, whose rope dims come first) are copied. Portable C++.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "row_math.h"
#include "layer_pieces.h"

namespace {

template <typename T>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out, bool interleaved) {
  const int64_t tokens = x.size(0), heads = x.size(1), width = x.size(2), half = cos.size(1);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, tokens * heads, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const T* row = xp + t * st + h * sh;
      dsaserve::rope_row(row, cp + t * half, sp + t * half, op + i * width, half, interleaved);
      std::copy(row + 2 * half, row + width, op + i * width + 2 * half);
    }
  });
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "dsaserve apply_rope: x, cos and sin must share one dtype, bf16 or fp32");
  const int64_t dim = x.size(-1), tokens = x.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == tokens && 2 * cos.size(1) <= dim && sin.sizes() == cos.sizes(),
              "dsaserve apply_rope: cos and sin must be [tokens, rotated dims / 2], at most half of x's last dimension");
  at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor rows = x.dim() == 2 ? x.unsqueeze(1) : x.reshape({tokens, -1, dim});
  if (rows.stride(2) != 1) rows = rows.contiguous();
  at::Tensor out = at::empty({tokens, rows.size(1), dim}, x.options());
  if (x.scalar_type() == at::kFloat) rotate<float>(rows, c, s, out, interleaved);
  else rotate<c10::BFloat16>(rows, c, s, out, interleaved);
  return out.view(x.sizes());
}

}  // namespace

// For decode_plan.cpp (layer_pieces.h).
at::Tensor dsaserve::apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  return ::apply_rope(x, cos, sin, interleaved);
}

namespace {
// Meta kernel: the output shape without computing (meta tensors, tracing).
at::Tensor apply_rope_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, bool) {
  return at::empty(x.sizes(), x.options());
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
  m.def("apply_rope(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) { m.impl("apply_rope", &apply_rope); }

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) { m.impl("apply_rope", &apply_rope_meta); }
