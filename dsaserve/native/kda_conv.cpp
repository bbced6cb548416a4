// A KDA layer's short causal convolution and its SiLU (model/kda.py) over one request's rows, in one pass:
// out[t, c] = silu(sum_j seq[t + j, c] * weight[j, c]), seq = [tail; x] (the request's last `taps - 1` inputs
// before these rows, then the rows), accumulated in fp32 and rounded once to x's dtype. The torch path makes a
// [rows, channels, taps] product or taps passes over fp32 copies; this reads each input once per tap from cache.
// x [n, C] bf16 or fp32, contiguous; tail [taps - 1, C] fp32; weight [taps, C] fp32 (the checkpoint's [C, taps]
// transposed once, so channels are the unit-stride loop). Portable C++; rows are shared over torch's threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <typename T>
void convolve_rows(const T* x, const float* tail, const float* weight, T* out, int64_t n, int64_t C, int64_t taps) {
  const int64_t width = taps - 1;
  at::parallel_for(0, n, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(C);
    for (int64_t t = t0; t < t1; ++t) {
      const float* w = weight + width * C;  // the row's own input: the last tap
      const T* row = x + t * C;
      for (int64_t c = 0; c < C; ++c) acc[c] = w[c] * static_cast<float>(row[c]);
      for (int64_t j = 0; j < width; ++j) {
        const int64_t r = t - width + j;  // seq row t + j, as a row of x (negative: of the tail)
        w = weight + j * C;
        if (r >= 0) {
          const T* in = x + r * C;
          for (int64_t c = 0; c < C; ++c) acc[c] += w[c] * static_cast<float>(in[c]);
        } else {
          const float* in = tail + (width + r) * C;
          for (int64_t c = 0; c < C; ++c) acc[c] += w[c] * in[c];
        }
      }
      T* o = out + t * C;
      for (int64_t c = 0; c < C; ++c) o[c] = static_cast<T>(acc[c] / (1.0f + std::exp(-acc[c])));
    }
  });
}

at::Tensor kda_conv(const at::Tensor& x, const at::Tensor& tail, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "dsaserve kda_conv: x must be contiguous [n, C], bf16 or fp32");
  const int64_t n = x.size(0), C = x.size(1), taps = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == C && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "dsaserve kda_conv: weight must be contiguous fp32 [taps, C]");
  TORCH_CHECK(tail.dim() == 2 && tail.size(0) == taps - 1 && tail.size(1) == C && tail.is_contiguous() &&
                  tail.scalar_type() == at::kFloat,
              "dsaserve kda_conv: tail must be contiguous fp32 [taps - 1, C]");
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    convolve_rows(x.data_ptr<float>(), tail.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), n, C,
                  taps);
  else
    convolve_rows(x.data_ptr<c10::BFloat16>(), tail.data_ptr<float>(), weight.data_ptr<float>(),
                  out.data_ptr<c10::BFloat16>(), n, C, taps);
  return out;
}

// Meta kernel: the output shape without computing (meta tensors, tracing).
at::Tensor kda_conv_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&) { return at::empty_like(x); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) { m.def("kda_conv(Tensor x, Tensor tail, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) { m.impl("kda_conv", &kda_conv); }

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) { m.impl("kda_conv", &kda_conv_meta); }
