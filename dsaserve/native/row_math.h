// Per-row RMSNorm and rotary embedding, shared by the operators that apply them (rms_norm.cpp, rope.cpp) and
// the one that writes latent cache rows with both (latent_write.cpp), so that all give the same bits. Rounding
// follows model/layers.py's torch operators: see those files. Portable C++.
#pragma once

#include <cmath>
#include <cstdint>

namespace dsaserve {

// y = weight * to_T(x * rsqrt(mean(x^2) + eps)), the mean in fp32.
template <typename T>
inline void rms_norm_row(const T* x, const T* weight, T* y, int64_t dim, float eps) {
  float sum = 0.f;
  for (int64_t k = 0; k < dim; ++k) {
    const float v = static_cast<float>(x[k]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
  for (int64_t k = 0; k < dim; ++k) y[k] = weight[k] * static_cast<T>(static_cast<float>(x[k]) * inv);
}

// Pairs (a, b) of x (interleaved: columns 2i, 2i+1; else i and half + i) rotated by c, s into out, half-split:
// out[i] = a*c - b*s, out[half + i] = b*c + a*s, each product and sum rounded to T.
template <typename T>
inline void rope_row(const T* x, const T* c, const T* s, T* out, int64_t half, bool interleaved) {
  for (int64_t j = 0; j < half; ++j) {
    const T a = interleaved ? x[2 * j] : x[j];
    const T b = interleaved ? x[2 * j + 1] : x[half + j];
    out[j] = a * c[j] - b * s[j];
    out[half + j] = b * c[j] + a * s[j];
  }
}

}  // namespace dsaserve
