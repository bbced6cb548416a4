// The packed-weight products' AVX2 body (AVX2 with FMA and F16C: every x86-64 server CPU since 2013), for CPUs
// without AVX-512 BF16 or where cpu_isa='avx2' asks for it. Same packed layout as the AVX-512 body
// (quant_linear.cpp): a 16-row block's column pair is 16 lanes of (column k, column k + 1), two 256-bit halves
// of 8 rows here.
//
//   bf16, fp8 weights   widened to fp32 in registers (bf16 by a shift and a mask; e4m3 by shifts and masks into
//                       bf16 bits, times 2^-8 as in the AVX-512 body), multiplied by fp32 activations (FMA).
//   int8, int4 weights  widened to int16 pairs and multiplied by the activations quantized to int16 (vpmaddwd:
//                       both columns of a pair in one instruction, summed in int32), per row and 128 columns
//                       (absmax / 32767). bf16 activations: one int16 each, whose rounding (15 bits of the
//                       chunk's largest) is far below bf16's own. fp32 activations: two, the value and its
//                       remainder in 2^-15 steps, so the product is as exact as fp32's own rounding (30 bits
//                       of the chunk's largest) and greedy decoding follows the float weights' (the tests).
//   int4 weights, bf16  the activations rounded to int8 per row and weight scale group instead (absmax / 127), the
//   activations         nibbles kept unsigned and multiplied by vpmaddubsw: the AVX-512 VNNI path's integers and
//                       arithmetic (quant_linear.cpp), so its bits, in fewer instructions than the int16 products.
//                       native_kernels 'avx512' keeps the int16 products (set_isa_extensions).
//
// Rows of activations are taken four at a time per sweep of the weights (the registers: two 8-row halves per
// row, and for one or two rows separate even and odd sums to shorten the dependency chains). The avx2 family
// runs these blocks; the avx512 family runs the same arithmetic with a block's 16 rows in one 512-bit register
// (quant_linear_avx512f.cpp), on these activations and sweeps.
#include "cpu_features.h"
#include "packed_problem.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if DSASERVE_X86
#include <immintrin.h>
#endif

namespace dsaserve::packed {

#if DSASERVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

namespace {

constexpr int kRowsPerSweep = 4;

// A column pair's 8 rows (half 0: rows 0-7, half 1: rows 8-15) as fp32 even and odd columns; fp8 values times
// 2^-8 (the scale takes 256).
template <int64_t Kind>
AVX2 inline void decode_f32(const uint8_t* block, int64_t kp, int half, __m256& even, __m256& odd) {
  if constexpr (Kind == kBF16) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kp * 64 + half * 32));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else if constexpr (Kind == kFP8) {
    // As the AVX-512 decode32: byte seeeemmm shifted into bf16 bits s|0…|eeee|mmm|0000, exponent + 112 where it
    // is not 0; exponent 0 is zero, or a subnormal (rare) whose bits come from a table.
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kp * 32 + half * 16)));
    const __m256i z = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 4), _mm256_set1_epi16(short(0x87F0)));
    const __m256i exp_zero = _mm256_cmpeq_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x78)), _mm256_setzero_si256());
    __m256i r = _mm256_add_epi16(z, _mm256_andnot_si256(exp_zero, _mm256_set1_epi16(0x3800)));
    const __m256i mant_zero = _mm256_cmpeq_epi16(_mm256_and_si256(v, _mm256_set1_epi16(7)), _mm256_setzero_si256());
    if (__builtin_expect(_mm256_movemask_epi8(_mm256_andnot_si256(mant_zero, exp_zero)) != 0, 0)) {
      static constexpr uint16_t kSubnormal[8] = {0, 0x3700, 0x3780, 0x37C0, 0x3800, 0x3820, 0x3840, 0x3860};
      alignas(32) uint16_t bits[16], bytes[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(bits), r);
      _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), v);
      for (int i = 0; i < 16; ++i)
        if ((bytes[i] & 0x78) == 0 && (bytes[i] & 7) != 0)
          bits[i] = static_cast<uint16_t>(kSubnormal[bytes[i] & 7] | ((bytes[i] & 0x80) << 8));
      r = _mm256_load_si256(reinterpret_cast<const __m256i*>(bits));
    }
    even = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else if constexpr (Kind == kINT8) {
    const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kp * 32 + half * 16)));
    even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16));
    odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16));
  } else {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + kp * 16 + half * 8)));
    const __m256i eight = _mm256_set1_epi32(8);
    even = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xF)), eight));
    odd = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), eight));
  }
}

// A column pair's 16 rows of int8 or int4 weights as int16 pairs (even column low, odd column high), rows 0-7
// in w0 and 8-15 in w1: what vpmaddwd multiplies by an activation pair. int4: the low and high nibbles of the 16
// bytes split, interleaved back into (even, odd) byte pairs and made signed before widening.
template <int64_t Kind>
AVX2 inline void decode_i16(const uint8_t* block, int64_t kp, __m256i& w0, __m256i& w1) {
  if constexpr (Kind == kINT8) {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kp * 32)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kp * 32 + 16)));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kp * 16));
    const __m128i nibble = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i even = _mm_sub_epi8(_mm_and_si128(v, nibble), eight);
    const __m128i odd = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), nibble), eight);
    w0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(even, odd));
    w1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(even, odd));
  }
}

constexpr float factor_of(int64_t kind) { return kind == kFP8 ? 256.f : 1.f; }

// The weight's scales of block b, scale column `column`: rows 0-7 and 8-15, times the decode's factor.
AVX2 inline void block_scales(const Problem& p, int64_t b, int64_t column, __m256 s[2]) {
  const float* at = p.scale + (b * p.G + column) * 16;
  const __m256 f = _mm256_set1_ps(factor_of(p.kind));
  s[0] = _mm256_mul_ps(_mm256_loadu_ps(at), f);
  s[1] = _mm256_mul_ps(_mm256_loadu_ps(at + 8), f);
}

// fp32 to bf16 bits, rounded to nearest even (torch's rounding), NaN kept a NaN.
AVX2 inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

// A block's 16 outputs of one row (rows 0-7 in lo, 8-15 in hi) at element `index` of y; `rows` < 16 for a last,
// partial block.
AVX2 inline void store16(const Problem& p, uint8_t* y, int64_t index, __m256 lo, __m256 hi, int64_t rows) {
  if (p.out_bf16) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(lo), bf16_bits(hi)), 0xD8);
    uint16_t* dst = reinterpret_cast<uint16_t*>(y) + index;
    if (rows == 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
    } else {
      alignas(32) uint16_t tmp[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), packed);
      std::memcpy(dst, tmp, rows * 2);
    }
    return;
  }
  float* dst = reinterpret_cast<float*>(y) + index;
  if (rows == 16) {
    _mm256_storeu_ps(dst, lo);
    _mm256_storeu_ps(dst + 8, hi);
  } else {
    alignas(32) float tmp[16];
    _mm256_store_ps(tmp, lo);
    _mm256_store_ps(tmp + 8, hi);
    std::memcpy(dst, tmp, rows * 4);
  }
}

// One 16-row block of a bf16 or fp8 weight against M <= 4 fp32 rows into y.
template <int64_t Kind, int M>
AVX2 void block_float(const Problem& p, const FloatRows& x, int64_t b, uint8_t* y, int64_t y_row) {
  constexpr bool kSplit = M <= 2;  // separate even and odd sums: more independent chains for few rows
  const uint8_t* block = p.w + b * p.block_bytes;
  __m256 total[M][2];
  for (int m = 0; m < M; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0);
    __m256 even[M][2], odd[M][2];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) even[m][h] = odd[m][h] = _mm256_setzero_ps();
    for (int64_t kp = k0 / 2; kp < (k1 + 1) / 2; ++kp) {
      for (int h = 0; h < 2; ++h) {
        __m256 we, wo;
        decode_f32<Kind>(block, kp, h, we, wo);
        for (int m = 0; m < M; ++m) {
          const float* xm = x.x + m * x.stride + 2 * kp;
          even[m][h] = _mm256_fmadd_ps(we, _mm256_broadcast_ss(xm), even[m][h]);
          if constexpr (kSplit) odd[m][h] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(xm + 1), odd[m][h]);
          else even[m][h] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(xm + 1), even[m][h]);
        }
      }
    }
    __m256 s[2];
    block_scales(p, b, scale_column(p, k0), s);
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) total[m][h] = _mm256_fmadd_ps(_mm256_add_ps(even[m][h], odd[m][h]), s[h], total[m][h]);
    k0 = k1;
  }
  const int64_t rows = std::min<int64_t>(16, p.N - b * 16);
  for (int m = 0; m < M; ++m) store16(p, y + m * y_row, b * 16, total[m][0], total[m][1], rows);
}

AVX2 inline __m256i broadcast_pair(const int16_t* at) {
  int32_t pair;
  std::memcpy(&pair, at, 4);
  return _mm256_set1_epi32(pair);
}

// One 16-row block of an int8 or int4 weight against M <= 4 int16 rows into y: per run of columns within one
// weight scale group and one activation chunk, int32 sums of vpmaddwd products (the remainders' apart, Rest),
// scaled by the activation's scale at the run's end and by the weight's at the group's.
template <int64_t Kind, int M, bool Rest>
AVX2 void block_int(const Problem& p, const Int16Rows& x, int64_t b, uint8_t* y, int64_t y_row) {
  const uint8_t* block = p.w + b * p.block_bytes;
  __m256 total[M][2];
  for (int m = 0; m < M; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0);
    __m256 group[M][2];
    for (int m = 0; m < M; ++m) group[m][0] = group[m][1] = _mm256_setzero_ps();
    for (int64_t c0 = k0; c0 < k1;) {
      const int64_t c1 = std::min(k1, (c0 / kActChunk + 1) * kActChunk), chunk = c0 / kActChunk;
      __m256i acc[M][2], rest[Rest ? M : 1][2];
      for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
      if constexpr (Rest)
        for (int m = 0; m < M; ++m) rest[m][0] = rest[m][1] = _mm256_setzero_si256();
      for (int64_t kp = c0 / 2; kp < (c1 + 1) / 2; ++kp) {
        __m256i w0, w1;
        decode_i16<Kind>(block, kp, w0, w1);
        for (int m = 0; m < M; ++m) {
          const int64_t at = 2 * (m * x.K2 + kp);
          const __m256i xv = broadcast_pair(x.values + at);
          acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(w0, xv));
          acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(w1, xv));
          if constexpr (Rest) {
            const __m256i rv = broadcast_pair(x.rest + at);
            rest[m][0] = _mm256_add_epi32(rest[m][0], _mm256_madd_epi16(w0, rv));
            rest[m][1] = _mm256_add_epi32(rest[m][1], _mm256_madd_epi16(w1, rv));
          }
        }
      }
      for (int m = 0; m < M; ++m) {
        const float scale = x.scales[m * x.chunks + chunk];
        const __m256 s = _mm256_set1_ps(scale);
        for (int h = 0; h < 2; ++h) {
          __m256 sum = _mm256_cvtepi32_ps(acc[m][h]);
          if constexpr (Rest) sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rest[m][h]), _mm256_set1_ps(1.f / 32768), sum);
          group[m][h] = _mm256_fmadd_ps(sum, s, group[m][h]);
        }
      }
      c0 = c1;
    }
    __m256 s[2];
    block_scales(p, b, scale_column(p, k0), s);
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) total[m][h] = _mm256_fmadd_ps(group[m][h], s[h], total[m][h]);
    k0 = k1;
  }
  const int64_t rows = std::min<int64_t>(16, p.N - b * 16);
  for (int m = 0; m < M; ++m) store16(p, y + m * y_row, b * 16, total[m][0], total[m][1], rows);
}

// One 16-row block of an int4 weight against M <= 4 rows of int8 pairs: per two column pairs, the 32 packed bytes'
// quarters reordered so one 128-bit lane holds rows 0-7 and the other rows 8-15, the nibbles (0-15, unsigned)
// split and interleaved into each row's byte pair, and vpmaddubsw by the rows' int8 pairs. Four such steps add in
// int16 (a step's two products are at most 2 x 2 x 15 x 127 = 7,620), then widen into the group's int32 sums;
// each group's sum less 8 x the activations' sum is scaled by the weight's scale times the activation's.
template <int M>
AVX2 void block_int4_int8(const Problem& p, const Int8Pairs& x, int64_t b, uint8_t* y, int64_t y_row) {
  const uint8_t* block = p.w + b * p.block_bytes;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 total[M][2];
  for (int m = 0; m < M; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0), g = scale_column(p, k0), kp1 = (k1 + 1) / 2;
    __m256i sum[M][2];
    for (int m = 0; m < M; ++m) sum[m][0] = sum[m][1] = _mm256_setzero_si256();
    for (int64_t kp = k0 / 2; kp < kp1;) {
      __m256i acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
      for (const int64_t run_end = std::min(kp1, kp + 8); kp < run_end; kp += 2) {
        // Quarters: pair kp rows 0-7, rows 8-15, pair kp + 1 rows 0-7, rows 8-15 (a last, odd pair: zeros).
        const __m256i raw = kp + 1 < kp1
            ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kp * 16))
            : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kp * 16)));
        const __m256i v = _mm256_permute4x64_epi64(raw, 0xD8);
        const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        const __m256i first = _mm256_unpacklo_epi8(lo, hi), second = _mm256_unpackhi_epi8(lo, hi);
        for (int m = 0; m < M; ++m) {
          const uint32_t* xm = x.pairs + m * x.stride + kp;
          const __m256i a = _mm256_maddubs_epi16(first, _mm256_set1_epi32(static_cast<int>(xm[0])));
          const __m256i c = _mm256_maddubs_epi16(second, _mm256_set1_epi32(static_cast<int>(xm[1])));
          acc[m] = _mm256_add_epi16(acc[m], _mm256_add_epi16(a, c));
        }
      }
      for (int m = 0; m < M; ++m) {
        sum[m][0] = _mm256_add_epi32(sum[m][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[m])));
        sum[m][1] = _mm256_add_epi32(sum[m][1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[m], 1)));
      }
    }
    __m256 s[2];
    block_scales(p, b, g, s);
    for (int m = 0; m < M; ++m) {
      const __m256i offset = _mm256_set1_epi32(8 * x.sums[m * x.G + g]);
      const __m256 sx = _mm256_set1_ps(x.scales[m * x.G + g]);
      for (int h = 0; h < 2; ++h)
        total[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[m][h], offset)),
                                      _mm256_mul_ps(s[h], sx), total[m][h]);
    }
    k0 = k1;
  }
  const int64_t rows = std::min<int64_t>(16, p.N - b * 16);
  for (int m = 0; m < M; ++m) store16(p, y + m * y_row, b * 16, total[m][0], total[m][1], rows);
}

template <int64_t Kind, int M, typename Rows>
AVX2 void blocks_m(const Problem& p, const Rows& x, int64_t b0, int64_t b1, uint8_t* y, int64_t y_row) {
  for (int64_t b = b0; b < b1; ++b) {
    if constexpr (std::is_same_v<Rows, Int8Pairs>) block_int4_int8<M>(p, x, b, y, y_row);
    else if constexpr (!std::is_same_v<Rows, Int16Rows>) block_float<Kind, M>(p, x, b, y, y_row);
    else if (x.rest) block_int<Kind, M, true>(p, x, b, y, y_row);
    else block_int<Kind, M, false>(p, x, b, y, y_row);
  }
}

template <int64_t Kind, typename Rows>
AVX2 void blocks(const Problem& p, const Rows& x, int64_t b0, int64_t b1, uint8_t* y, int64_t y_row) {
  if constexpr (std::is_same_v<Rows, Int8Pairs>) {
    if (use_avx512f_vnni()) return avx512f_blocks(p, x, b0, b1, y, y_row);  // vpdpbusd: the same integers
  } else if (use_avx512f()) {
    return avx512f_blocks(p, x, b0, b1, y, y_row);  // the same sums, a block per register
  }
  switch (p.M) {
    case 1: return blocks_m<Kind, 1>(p, x, b0, b1, y, y_row);
    case 2: return blocks_m<Kind, 2>(p, x, b0, b1, y, y_row);
    case 3: return blocks_m<Kind, 3>(p, x, b0, b1, y, y_row);
    default: return blocks_m<Kind, 4>(p, x, b0, b1, y, y_row);
  }
}

AVX2 inline __m256 load8(const uint8_t* row, bool bf16, int64_t k) {
  if (bf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(row) + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
}

float value_at(const uint8_t* row, bool bf16, int64_t k) {
  if (!bf16) return reinterpret_cast<const float*>(row)[k];
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(row)[k]) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// M rows of x (bf16 or fp32, 2·K2 values each) as fp32 rows in `out`.
AVX2 void widen_rows(const Problem& p, const uint8_t* x, int64_t x_row, std::vector<float>& out) {
  const int64_t K = 2 * p.K2;
  out.resize(p.M * K);
  for (int64_t m = 0; m < p.M; ++m) {
    const uint8_t* row = x + m * x_row;
    float* dst = out.data() + m * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, load8(row, p.out_bf16, k));
    for (; k < K; ++k) dst[k] = value_at(row, p.out_bf16, k);
  }
}

// Eight int32 lanes as eight int16 (saturating).
AVX2 inline __m128i pack(__m256i v) { return _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)); }

// The largest magnitude among columns [c0, c1) of a row (bf16 or fp32) into absmax, and whether none is a NaN or an
// infinity (unordered or above the largest finite float: max_ps alone would drop a NaN).
AVX2 bool largest_magnitude(const uint8_t* row, bool bf16, int64_t c0, int64_t c1, float& absmax) {
  const __m256 sign_off = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 largest = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 most = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  int64_t k = c0;
  for (; k + 8 <= c1; k += 8) {
    const __m256 a = _mm256_and_ps(load8(row, bf16, k), sign_off);
    most = _mm256_max_ps(most, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, largest, _CMP_NLE_UQ));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, most);
  absmax = 0.f;
  for (float v : lanes) absmax = std::max(absmax, v);
  bool finite = _mm256_movemask_ps(bad) == 0;
  for (; k < c1; ++k) {
    const float v = value_at(row, bf16, k);
    finite = finite && std::isfinite(v);
    absmax = std::max(absmax, std::fabs(v));
  }
  return finite;
}

// M rows of x quantized to int16 per kActChunk columns (absmax / 32767, rounded to nearest even); for fp32 rows
// also each value's remainder in 2^-15 steps (rest).
AVX2 void quantize_rows(const Problem& p, const uint8_t* x, int64_t x_row, std::vector<int16_t>& q,
                        std::vector<int16_t>& rest, std::vector<float>& scales, int64_t chunks) {
  const int64_t K = 2 * p.K2;
  const bool with_rest = !p.out_bf16;
  q.assign(p.M * K, 0);
  rest.assign(with_rest ? p.M * K : 0, 0);
  scales.resize(p.M * chunks);
  for (int64_t m = 0; m < p.M; ++m) {
    const uint8_t* row = x + m * x_row;
    for (int64_t j = 0; j < chunks; ++j) {
      const int64_t c0 = j * kActChunk, c1 = std::min(K, c0 + kActChunk);
      float absmax;
      const bool finite = largest_magnitude(row, p.out_bf16, c0, c1, absmax);
      if (!finite) {
        scales[m * chunks + j] = std::numeric_limits<float>::quiet_NaN();
        continue;  // the chunk's values stay 0; its NaN scale makes every output of the row NaN, as in torch
      }
      const float scale = absmax / 32767.f;
      scales[m * chunks + j] = scale;
      if (absmax == 0.f) continue;
      // v / scale in fp32, its nearest integer (MXCSR: to even), and the remainder times 2^15 (|r| <= 2^14). The
      // quotient is v · (32767 / absmax) rounded once; the remainder is exact, so hi + rest · 2^-15 is the
      // quotient to within 2^-16.
      const float inv_scale = 32767.f / absmax;
      const __m256 inv = _mm256_set1_ps(inv_scale);
      int16_t* dst = q.data() + m * K;
      int16_t* dst_rest = with_rest ? rest.data() + m * K : nullptr;
      int64_t t = c0;
      for (; t + 8 <= c1; t += 8) {
        const __m256 quotient = _mm256_mul_ps(load8(row, p.out_bf16, t), inv);
        const __m256i hi = _mm256_cvtps_epi32(quotient);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + t), pack(hi));
        if (with_rest) {
          const __m256 r = _mm256_mul_ps(_mm256_sub_ps(quotient, _mm256_cvtepi32_ps(hi)), _mm256_set1_ps(32768.f));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst_rest + t), pack(_mm256_cvtps_epi32(r)));
        }
      }
      for (; t < c1; ++t) {
        const float quotient = value_at(row, p.out_bf16, t) * inv_scale;
        const float hi = std::nearbyint(quotient);
        dst[t] = static_cast<int16_t>(hi);
        if (with_rest) dst_rest[t] = static_cast<int16_t>(std::nearbyint((quotient - hi) * 32768.f));
      }
    }
  }
}

// Whether int4 weights meet p's activations as int8 (Int8Pairs): bf16 activations, scale groups of whole chunks
// of 8 columns (the VNNI path's rule, so both round the same groups), and the process allows it.
bool int8_pairs_apply(const Problem& p) {
  return p.kind == kINT4 && p.out_bf16 && p.group % 8 == 0 && p.col_offset % 8 == 0 && isa_extensions_allowed();
}

// M bf16 rows of x rounded to int8 per weight scale group, as quant_linear.cpp's quantize_row rounds them (v times
// 127 / absmax in fp32, to nearest even; a group with a NaN or an infinity: zeros and a NaN scale), laid out as
// Int8Pairs.
AVX2 void quantize_pairs(const Problem& p, const uint8_t* x, int64_t x_row, std::vector<uint32_t>& pairs,
                         std::vector<int32_t>& sums, std::vector<float>& scales, int64_t stride) {
  pairs.assign(p.M * stride, 0);
  sums.assign(p.M * p.G, 0);
  scales.assign(p.M * p.G, 0.f);
  // Each 32-bit lane's low byte, in pairs: (x0, x1, x0, x1), (x2, x3, x2, x3) per 128-bit lane.
  const __m256i gather = _mm256_setr_epi8(0, 4, 0, 4, 8, 12, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 0, 4, 8, 12, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int64_t m = 0; m < p.M; ++m) {
    const uint8_t* row = x + m * x_row;
    uint8_t* bytes = reinterpret_cast<uint8_t*>(pairs.data() + m * stride);
    for (int64_t k0 = 0; k0 < p.K;) {
      const int64_t k1 = group_end(p, k0), g = scale_column(p, k0);
      float absmax;
      const bool finite = largest_magnitude(row, true, k0, k1, absmax);
      const float inv_scale = finite && absmax > 1e-30f ? 127.f / absmax : 0.f;  // (127 / m overflows below 4e-37)
      const __m256 inv = _mm256_set1_ps(inv_scale);
      __m256i total = _mm256_setzero_si256();
      int64_t k = k0;
      for (; k + 8 <= k1; k += 8) {  // k0 even: whole pairs
        const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8(row, true, k), inv));
        total = _mm256_add_epi32(total, q);
        const __m256i words = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(q, gather), 0x08);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + 2 * k), _mm256_castsi256_si128(words));
      }
      alignas(32) int32_t parts[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(parts), total);
      int32_t sum = 0;
      for (int32_t v : parts) sum += v;
      for (; k < k1; ++k) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(value_at(row, true, k) * inv_scale));
        sum += q;
        bytes[2 * (k & ~int64_t(1)) + (k & 1)] = bytes[2 * (k & ~int64_t(1)) + 2 + (k & 1)] = static_cast<uint8_t>(q);
      }
      sums[m * p.G + g] = sum;
      scales[m * p.G + g] = finite ? absmax / 127.f : std::numeric_limits<float>::quiet_NaN();
      k0 = k1;
    }
  }
}

// Blocks [b0, b1) against p.M prepared rows, kRowsPerSweep rows per sweep of the weights (rows_at(m0): the rows
// from m0 on); more rows than one sweep takes go over spans of blocks small enough to stay in L2 for the next sweep.
template <int64_t Kind, typename RowsAt>
AVX2 void sweeps(const Problem& p, int64_t b0, int64_t b1, uint8_t* y, const RowsAt& rows_at) {
  const int64_t y_row = p.N * (p.out_bf16 ? 2 : 4);
  const int64_t span = p.M <= kRowsPerSweep ? b1 - b0 : std::max<int64_t>(1, (int64_t(256) << 10) / p.block_bytes);
  for (int64_t s0 = b0; s0 < b1; s0 += span)
    for (int64_t m0 = 0; m0 < p.M; m0 += kRowsPerSweep) {
      Problem part = p;
      part.M = std::min<int64_t>(kRowsPerSweep, p.M - m0);
      blocks<Kind>(part, rows_at(m0), s0, std::min(b1, s0 + span), y + m0 * y_row, y_row);
    }
}

template <int64_t Kind>
AVX2 void sweep_kind(const Problem& p, const uint8_t* x, int64_t x_row, int64_t b0, int64_t b1, uint8_t* y) {
  if constexpr (Kind == kINT4) {
    if (int8_pairs_apply(p)) {
      const int64_t stride = p.K2 + 3;  // zero words past each row's last pair: a last step's partners
      std::vector<uint32_t> pairs;
      std::vector<int32_t> sums;
      std::vector<float> scales;
      quantize_pairs(p, x, x_row, pairs, sums, scales, stride);
      return sweeps<Kind>(p, b0, b1, y, [&](int64_t m0) {
        return Int8Pairs{pairs.data() + m0 * stride, sums.data() + m0 * p.G, scales.data() + m0 * p.G, stride, p.G};
      });
    }
  }
  if constexpr (Kind == kINT8 || Kind == kINT4) {
    const int64_t chunks = (2 * p.K2 + kActChunk - 1) / kActChunk;
    std::vector<int16_t> q, rest;
    std::vector<float> scales;
    quantize_rows(p, x, x_row, q, rest, scales, chunks);
    sweeps<Kind>(p, b0, b1, y, [&](int64_t m0) {
      return Int16Rows{q.data() + m0 * 2 * p.K2, rest.empty() ? nullptr : rest.data() + m0 * 2 * p.K2,
                       scales.data() + m0 * chunks, p.K2, chunks};
    });
  } else {
    std::vector<float> widened;
    widen_rows(p, x, x_row, widened);
    sweeps<Kind>(p, b0, b1, y, [&](int64_t m0) { return FloatRows{widened.data() + m0 * 2 * p.K2, 2 * p.K2}; });
  }
}

template <int64_t Kind>
AVX2 void dequantize_kind(const Problem& p, int64_t b0, int64_t b1, float* out) {
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0), column = scale_column(p, k0);
    for (int64_t kp = k0 / 2; kp < (k1 + 1) / 2; ++kp)
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t rows = std::min<int64_t>(16, p.N - b * 16);
        __m256 s[2];
        block_scales(p, b, column, s);
        for (int h = 0; h < 2 && h * 8 < rows; ++h) {
          __m256 values[2];
          decode_f32<Kind>(p.w + b * p.block_bytes, kp, h, values[0], values[1]);
          for (int c = 0; c < 2 && 2 * kp + c < p.K; ++c) {
            float* dst = out + (2 * kp + c) * p.N + b * 16 + h * 8;
            const __m256 v = _mm256_mul_ps(values[c], s[h]);
            if (rows >= (h + 1) * 8) {
              _mm256_storeu_ps(dst, v);
            } else {
              alignas(32) float tmp[8];
              _mm256_store_ps(tmp, v);
              std::memcpy(dst, tmp, (rows - h * 8) * 4);
            }
          }
        }
      }
    k0 = k1;
  }
}

}  // namespace

void avx2_row_sweeps(const Problem& p, const uint8_t* x, int64_t x_row, int64_t b0, int64_t b1, uint8_t* y) {
  switch (p.kind) {
    case kBF16: return sweep_kind<kBF16>(p, x, x_row, b0, b1, y);
    case kFP8: return sweep_kind<kFP8>(p, x, x_row, b0, b1, y);
    case kINT8: return sweep_kind<kINT8>(p, x, x_row, b0, b1, y);
    default: return sweep_kind<kINT4>(p, x, x_row, b0, b1, y);
  }
}

void avx2_dequantize_blocks(const Problem& p, int64_t b0, int64_t b1, float* out) {
  switch (p.kind) {
    case kBF16: return dequantize_kind<kBF16>(p, b0, b1, out);
    case kFP8: return dequantize_kind<kFP8>(p, b0, b1, out);
    case kINT8: return dequantize_kind<kINT8>(p, b0, b1, out);
    default: return dequantize_kind<kINT4>(p, b0, b1, out);
  }
}

#else  // not x86: the dispatch never chooses AVX2

void avx2_row_sweeps(const Problem&, const uint8_t*, int64_t, int64_t, int64_t, uint8_t*) {}
void avx2_dequantize_blocks(const Problem&, int64_t, int64_t, float*) {}

#endif

}  // namespace dsaserve::packed
