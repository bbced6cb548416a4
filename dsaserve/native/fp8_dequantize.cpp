// FP8 weights as checkpoints ship them (float8 e4m3 bytes, one fp32 scale per tile of tile_r × tile_c) to fp32, for
// the loader's conversions (quantization/fp8_blocks.py dequantize_fp8): a 256-entry table turns a byte into its
// value, and each row multiplies a tile's columns by that tile's scale. torch's own float8 → float32 conversion
// runs at about 0.3 G values/s on one core; this is what a load into int8 or int4 otherwise waits on. `weight` may
// be a part of the tensor starting at row row0, column col0 (a chunk of rows, a rank's slice). Portable C++; rows
// are shared out over torch's intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

std::array<float, 256> make_table() {
  std::array<float, 256> table{};
  for (int b = 0; b < 256; ++b) {
    const int exponent = (b >> 3) & 0xF, mantissa = b & 7;
    float value;
    if (exponent == 0xF && mantissa == 7) {
      value = std::numeric_limits<float>::quiet_NaN();  // e4m3fn has no infinities, one NaN per sign
    } else if (exponent == 0) {
      value = std::ldexp(static_cast<float>(mantissa) / 8.0f, -6);  // subnormal
    } else {
      value = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
    }
    table[b] = (b & 0x80) ? -value : value;
  }
  return table;
}

const std::array<float, 256> kTable = make_table();

at::Tensor fp8_block_dequantize(const at::Tensor& weight, const at::Tensor& scale, int64_t tile_r, int64_t tile_c,
                                int64_t row0, int64_t col0) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "dsaserve fp8_block_dequantize: weight must be contiguous uint8 [n, k] (the float8 bytes)");
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "dsaserve fp8_block_dequantize: scale must be contiguous fp32 [grid_r, grid_c]");
  TORCH_CHECK(tile_r > 0 && tile_c > 0 && row0 >= 0 && col0 >= 0, "dsaserve fp8_block_dequantize: bad tiles");
  const int64_t n = weight.size(0), k = weight.size(1), grid_c = scale.size(1);
  TORCH_CHECK(n == 0 || ((row0 + n - 1) / tile_r < scale.size(0) && (col0 + k - 1) / tile_c < grid_c),
              "dsaserve fp8_block_dequantize: the scale grid does not cover the weight's rows and columns");
  at::Tensor out = at::empty({n, k}, weight.options().dtype(at::kFloat));
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const float* s = scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row_scales = s + (row0 + r) / tile_r * grid_c;
      const uint8_t* in = w + r * k;
      float* dst = o + r * k;
      for (int64_t c = 0; c < k;) {
        const int64_t tile = (col0 + c) / tile_c, end = std::min(k, (tile + 1) * tile_c - col0);
        const float factor = row_scales[tile];
        for (; c < end; ++c) dst[c] = kTable[in[c]] * factor;
      }
    }
  });
  return out;
}

at::Tensor fp8_block_dequantize_meta(const at::Tensor& weight, const at::Tensor&, int64_t, int64_t, int64_t,
                                     int64_t) {
  return at::empty(weight.sizes(), weight.options().dtype(at::kFloat));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
  m.def("fp8_block_dequantize(Tensor weight, Tensor scale, int tile_r, int tile_c, int row0, int col0) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) { m.impl("fp8_block_dequantize", &fp8_block_dequantize); }

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) { m.impl("fp8_block_dequantize", &fp8_block_dequantize_meta); }
