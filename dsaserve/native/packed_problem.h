// The packed weights' layout as the product bodies see it (quant_linear.cpp's AVX-512 bodies, quant_linear_avx2.cpp's
// AVX2 ones): the kinds, one product's problem, the scale groups. See quant_linear.cpp for the layout itself.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

namespace dsaserve::packed {

constexpr int64_t kBF16 = 0, kFP8 = 1, kINT8 = 2, kINT4 = 3;
constexpr int64_t kMaxRows = 16;  // activation rows per call; more go to a dequantized GEMM

struct Problem {
  int64_t M, N, K, K2;
  bool out_bf16;  // y in bf16 (converted in registers) rather than fp32
  const uint8_t* w;  // block b starts at w + b * block_bytes
  int64_t block_bytes;
  const float* scale;  // [N / 16, G, 16]
  int64_t G, group, col_offset;
  int64_t kind;
};

inline int64_t entry_bytes(int64_t kind) { return kind == kBF16 ? 2 : 1; }

inline int64_t block_bytes_of(int64_t kind, int64_t K2) { return kind == kINT4 ? K2 * 16 : K2 * 32 * entry_bytes(kind); }

inline int64_t scale_column_count(int64_t K, int64_t group, int64_t col_offset) {
  return (K - 1 + col_offset) / group - col_offset / group + 1;
}

inline int64_t scale_column(const Problem& p, int64_t k) { return (k + p.col_offset) / p.group - p.col_offset / p.group; }

// The end of the scale group that column k0 starts (a group's columns are [k0, group_end)).
inline int64_t group_end(const Problem& p, int64_t k0) {
  return std::min(p.K, ((k0 + p.col_offset) / p.group + 1) * p.group - p.col_offset);
}

inline float fp8_e4m3_to_float(uint8_t b) {
  // Exponent and mantissa into an fp16's bits: the fp16 value is the e4m3 value times 2^-8, for
  // normal and subnormal numbers alike.
  uint16_t h = static_cast<uint16_t>(((b & 0x7F) << 7) | ((b & 0x80) << 8));
  return static_cast<float>(c10::Half(h, c10::Half::from_bits())) * 256.0f;
}

constexpr int64_t kActChunk = 128;  // columns per int16 activation scale (int32 sums stay far from overflow)

// The AVX2 body's activations for bf16 and fp8 weights: M rows of 2·K2 fp32 values, `stride` apart.
struct FloatRows {
  const float* x;
  int64_t stride;
};

// Its activations for int8 and int4 weights: M rows of 2·K2 int16 values (a column pair is one 32-bit word), with a
// scale per row and chunk of kActChunk columns (NaN where the chunk holds a NaN or an infinity); for fp32
// activations also each value's remainder, in steps of the scale times 2^-15.
struct Int16Rows {
  const int16_t* values;  // row m's pair kp at values + 2 * (m * K2 + kp)
  const int16_t* rest;    // the remainders, laid out as values (fp32 activations), or null
  const float* scales;    // row m's chunk j at scales[m * chunks + j]
  int64_t K2, chunks;
};

// Rows of bf16 activations rounded to int8 per weight scale group for int4 weights (the AVX2 families' path, the
// AVX-512 VNNI one's rounding): each column pair's two bytes twice over in a 32-bit word (what vpmaddubsw multiplies
// a row's nibble pair by, broadcast by one load), zero words past a row's last pair.
struct Int8Pairs {
  const uint32_t* pairs;  // row m's pair kp at pairs[m * stride + kp]
  const int32_t* sums;    // row m's group g: the sum of its int8 values, at sums[m * G + g]
  const float* scales;    // its scale, absmax / 127 (NaN where the group holds a NaN or an infinity)
  int64_t stride, G;
};

// Whether the bodies may take their faster paths that round activations (native_kernels 'auto'; 'avx512' keeps
// the products exact in bf16 activations, for comparing: set_isa_extensions in quant_linear.cpp).
bool isa_extensions_allowed();

// Blocks [b0, b1) of p against p.M <= 4 prepared activation rows into y (rows y_row bytes apart): the AVX2 body's
// arithmetic lane for lane, a block's 16 rows in one 512-bit register (quant_linear_avx512f.cpp).
void avx512f_blocks(const Problem& p, const FloatRows& x, int64_t b0, int64_t b1, uint8_t* y, int64_t y_row);
void avx512f_blocks(const Problem& p, const Int16Rows& x, int64_t b0, int64_t b1, uint8_t* y, int64_t y_row);
// int4 weights by Int8Pairs with AVX-512 VNNI (use_avx512f_vnni): the AVX2 body's integers by vpdpbusd, its bits.
void avx512f_blocks(const Problem& p, const Int8Pairs& x, int64_t b0, int64_t b1, uint8_t* y, int64_t y_row);

// The bodies' entry for blocks [b0, b1) of p against p.M <= 16 activation rows (x_row bytes apart; bf16 when
// p.out_bf16, else fp32) into y [p.M, N] in the same dtype.
void avx2_row_sweeps(const Problem& p, const uint8_t* x, int64_t x_row, int64_t b0, int64_t b1, uint8_t* y);

// Blocks [b0, b1) of p dequantized into out [K, N] (fp32), the weight transposed.
void avx2_dequantize_blocks(const Problem& p, int64_t b0, int64_t b1, float* out);

}  // namespace dsaserve::packed
