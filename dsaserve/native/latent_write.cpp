// The latent cache rows of a step's tokens in one operator: for each token t, row slots[t] of the flattened
// cache becomes [rms_norm(kv[t, :rank]) | rope(kv[t, rank:])], what model/mla.py write_latents computes with
// a split, the two operators, a concatenation and an index_copy_: the same bits (row_math.h), without the five
// torch calls per layer and step that cost more than the arithmetic of a decode token.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>

#include "row_math.h"
#include "layer_pieces.h"

namespace {

template <typename T>
void write_rows(const at::Tensor& kv, const at::Tensor& weight, double eps, const at::Tensor& cos,
                const at::Tensor& sin, bool interleaved, at::Tensor& rows, const at::Tensor& slots) {
  const int64_t tokens = kv.size(0), rank = weight.size(0), width = kv.size(1), half = (width - rank) / 2;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    const T* in = kv.data_ptr<T>() + t * kv.stride(0);
    T* out = rows.data_ptr<T>() + slot[t] * width;
    dsaserve::rms_norm_row(in, weight.data_ptr<T>(), out, rank, static_cast<float>(eps));
    dsaserve::rope_row(in + rank, cos.data_ptr<T>() + t * half, sin.data_ptr<T>() + t * half, out + rank, half,
                       interleaved);
  }
}

void write_latent_rows(const at::Tensor& kv, const at::Tensor& weight, double eps, const at::Tensor& cos,
                       const at::Tensor& sin, bool interleaved, at::Tensor rows, const at::Tensor& slots) {
  const auto dtype = kv.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && weight.scalar_type() == dtype &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype && rows.scalar_type() == dtype,
              "dsaserve write_latent_rows: kv, weight, cos, sin and the cache must share one dtype, bf16 or fp32");
  TORCH_CHECK(kv.dim() == 2 && kv.stride(1) == 1, "dsaserve write_latent_rows: kv must be [T, width], unit column stride");
  const int64_t tokens = kv.size(0), width = kv.size(1), rank = weight.size(0);
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && rank <= width && (width - rank) % 2 == 0,
              "dsaserve write_latent_rows: weight must be [rank] with an even number (maybe none) of rope columns after it");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == (width - rank) / 2 && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "dsaserve write_latent_rows: cos and sin must be contiguous [T, rope / 2]");
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == width && rows.is_contiguous(),
              "dsaserve write_latent_rows: the cache must be contiguous [slots, width]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == tokens && slots.is_contiguous(),
              "dsaserve write_latent_rows: slots must be contiguous int64 [T]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < rows.size(0), "dsaserve write_latent_rows: slot ", slot[t], " outside the cache");
  if (dtype == at::kFloat) write_rows<float>(kv, weight, eps, cos, sin, interleaved, rows, slots);
  else write_rows<c10::BFloat16>(kv, weight, eps, cos, sin, interleaved, rows, slots);
}

}  // namespace

// For decode_plan.cpp (layer_pieces.h).
void dsaserve::write_latent_rows(const at::Tensor& kv, const at::Tensor& weight, double eps, const at::Tensor& cos,
                                 const at::Tensor& sin, bool interleaved, at::Tensor rows, const at::Tensor& slots) {
  ::write_latent_rows(kv, weight, eps, cos, sin, interleaved, rows, slots);
}

namespace {
// Meta kernel: it writes only into the cache rows, so nothing to shape (meta tensors, tracing).
void write_latent_rows_meta(const at::Tensor&, const at::Tensor&, double, const at::Tensor&, const at::Tensor&, bool,
                            at::Tensor, const at::Tensor&) {}
}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
  m.def("write_latent_rows(Tensor kv, Tensor weight, float eps, Tensor cos, Tensor sin, bool interleaved, "
        "Tensor(a!) rows, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) { m.impl("write_latent_rows", &write_latent_rows); }

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) { m.impl("write_latent_rows", &write_latent_rows_meta); }
