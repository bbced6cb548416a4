// The packed-weight products' blocks for the avx512 family (AVX-512F/BW/VL/DQ without BF16: Skylake-SP to Ice
// Lake, Zen 4 under cpu_isa 'avx512'): quant_linear_avx2.cpp's arithmetic, lane for lane, with a 16-row block in
// one 512-bit register instead of two 256-bit halves, so each product has the AVX2 body's bits in half the
// instructions. The activations (fp32 rows, int16 values, remainders and scales, or int8 pairs) and the sweeps over
// blocks are the AVX2 body's; only the innermost block loops are here.
//
//   bf16, fp8 weights   widened to fp32 in registers, FMA with the fp32 activations (even and odd columns apart
//                       for one or two rows, as the AVX2 body sums them).
//   int8, int4 weights  widened to int16 pairs, multiplied by the int16 activations (vpmaddwd: both columns of a
//                       pair in one instruction) and summed in int32.
//   int4 weights, bf16  where the CPU has AVX-512 VNNI: the AVX2 body's int8-rounded activations (Int8Pairs) and
//   activations         unsigned nibbles, four columns of a row per 32-bit lane, multiplied and summed by vpdpbusd:
//                       the same integers, so the same bits (without VNNI the AVX2 body's vpmaddubsw blocks run).
// The exact int16 products do not use VNNI (its vpdpwssd would fuse each product with its sum: left until a
// measurement shows it pays beside the weights' decode and the memory).
#include "cpu_features.h"
#include "fp8_decode_avx512.h"
#include "packed_problem.h"

#include <cstring>
#include <type_traits>

#if DSASERVE_X86
#include <immintrin.h>
#endif

namespace dsaserve::packed {

#if DSASERVE_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

namespace {

// A column pair's 16 rows as fp32 even and odd columns (fp8 values times 2^-8: the scale takes 256).
template <int64_t Kind>
AVX512 inline void decode_f32(const uint8_t* block, int64_t kp, __m512& even, __m512& odd) {
  // bf16 as stored; fp8 by the AVX-512 BF16 body's decode (fp8_decode_avx512.h)
  const __m512i r = Kind == kBF16 ? _mm512_loadu_si512(block + kp * 64) : fp8_bf16_bits(block + kp * 32);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// A column pair's 16 rows of int8 or int4 weights as int16 pairs (even column low, odd column high).
template <int64_t Kind>
AVX512 inline __m512i decode_i16(const uint8_t* block, int64_t kp) {
  if constexpr (Kind == kINT8) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kp * 32)));
  } else {
    // A row's byte per 32-bit lane; its high nibble moved up to bit 16, the pair's two values less 8 as int16s.
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kp * 16)));
    const __m512i pair = _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), _mm512_set1_epi32(0x000F000F));
    return _mm512_sub_epi16(pair, _mm512_set1_epi16(8));
  }
}

// The weight's 16 scales of block b, scale column `column`, times the decode's factor.
AVX512 inline __m512 block_scales(const Problem& p, int64_t b, int64_t column) {
  const __m512 factor = _mm512_set1_ps(p.kind == kFP8 ? 256.f : 1.f);
  return _mm512_mul_ps(_mm512_loadu_ps(p.scale + (b * p.G + column) * 16), factor);
}

// A block's 16 outputs of one row at element `index` of y (`rows` < 16 for a last, partial block): fp32, or bf16
// rounded to nearest even with NaN kept a NaN (the AVX2 body's rounding).
AVX512 inline void store16(const Problem& p, uint8_t* y, int64_t index, __m512 v, int64_t rows) {
  const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
  if (!p.out_bf16) {
    _mm512_mask_storeu_ps(reinterpret_cast<float*>(y) + index, live, v);
    return;
  }
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(y) + index, live, _mm512_cvtepi32_epi16(rounded));
}

template <int64_t Kind, int M>
AVX512 void block_float(const Problem& p, const FloatRows& x, int64_t b, uint8_t* y, int64_t y_row) {
  constexpr bool kSplit = M <= 2;  // as the AVX2 body: separate even and odd sums for few rows
  const uint8_t* block = p.w + b * p.block_bytes;
  __m512 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0);
    __m512 even[M], odd[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    for (int64_t kp = k0 / 2; kp < (k1 + 1) / 2; ++kp) {
      __m512 we, wo;
      decode_f32<Kind>(block, kp, we, wo);
      for (int m = 0; m < M; ++m) {
        const float* xm = x.x + m * x.stride + 2 * kp;
        even[m] = _mm512_fmadd_ps(we, _mm512_set1_ps(xm[0]), even[m]);
        if constexpr (kSplit) odd[m] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xm[1]), odd[m]);
        else even[m] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xm[1]), even[m]);
      }
    }
    const __m512 s = block_scales(p, b, scale_column(p, k0));
    for (int m = 0; m < M; ++m) total[m] = _mm512_fmadd_ps(_mm512_add_ps(even[m], odd[m]), s, total[m]);
    k0 = k1;
  }
  const int64_t rows = std::min<int64_t>(16, p.N - b * 16);
  for (int m = 0; m < M; ++m) store16(p, y + m * y_row, b * 16, total[m], rows);
}

AVX512 inline __m512i broadcast_pair(const int16_t* at) {
  int32_t pair;
  std::memcpy(&pair, at, 4);
  return _mm512_set1_epi32(pair);
}

// acc + the int16 pair products of w and x summed per int32 lane.
AVX512 inline __m512i dot_pairs(__m512i acc, __m512i w, __m512i x) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
}

template <int64_t Kind, int M, bool Rest>
AVX512 void block_int(const Problem& p, const Int16Rows& x, int64_t b, uint8_t* y, int64_t y_row) {
  const uint8_t* block = p.w + b * p.block_bytes;
  __m512 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0);
    __m512 group[M];
    for (int m = 0; m < M; ++m) group[m] = _mm512_setzero_ps();
    for (int64_t c0 = k0; c0 < k1;) {
      const int64_t c1 = std::min(k1, (c0 / kActChunk + 1) * kActChunk), chunk = c0 / kActChunk;
      __m512i acc[M], rest[Rest ? M : 1];
      for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
      if constexpr (Rest)
        for (int m = 0; m < M; ++m) rest[m] = _mm512_setzero_si512();
      for (int64_t kp = c0 / 2; kp < (c1 + 1) / 2; ++kp) {
        const __m512i w = decode_i16<Kind>(block, kp);
        for (int m = 0; m < M; ++m) {
          const int64_t at = 2 * (m * x.K2 + kp);
          acc[m] = dot_pairs(acc[m], w, broadcast_pair(x.values + at));
          if constexpr (Rest) rest[m] = dot_pairs(rest[m], w, broadcast_pair(x.rest + at));
        }
      }
      for (int m = 0; m < M; ++m) {
        __m512 sum = _mm512_cvtepi32_ps(acc[m]);
        if constexpr (Rest) sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rest[m]), _mm512_set1_ps(1.f / 32768), sum);
        group[m] = _mm512_fmadd_ps(sum, _mm512_set1_ps(x.scales[m * x.chunks + chunk]), group[m]);
      }
      c0 = c1;
    }
    const __m512 s = block_scales(p, b, scale_column(p, k0));
    for (int m = 0; m < M; ++m) total[m] = _mm512_fmadd_ps(group[m], s, total[m]);
    k0 = k1;
  }
  const int64_t rows = std::min<int64_t>(16, p.N - b * 16);
  for (int m = 0; m < M; ++m) store16(p, y + m * y_row, b * 16, total[m], rows);
}

#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

// One 16-row block of an int4 weight against M <= 4 rows of int8 pairs: per step of four column pairs (64 packed
// bytes), the quarters reordered so each 128-bit lane holds one pair's 8 rows next to the following pair's, the
// nibbles split and interleaved twice, so that a 32-bit lane holds four consecutive columns of one row: rows 0-3
// and 8-11 (c) or 4-7 and 12-15 (d) of the step's first four columns in lanes 0-1, of its last four in lanes 2-3.
// vpdpbusd multiplies them by each lane's four activation bytes; at the group's end the lanes' halves are added
// and put in row order, and the sum less 8 x the activations' is scaled as the AVX2 body scales it.
template <int M>
AVX512VNNI void block_int4_vnni(const Problem& p, const Int8Pairs& x, int64_t b, uint8_t* y, int64_t y_row) {
  alignas(64) static const int8_t pick_bytes[64] = {
      0, 1, 4, 5, 0, 1, 4, 5, 0, 1, 4, 5, 0, 1, 4, 5, 0, 1, 4, 5, 0, 1, 4, 5, 0, 1, 4, 5, 0, 1, 4, 5,
      8, 9, 12, 13, 8, 9, 12, 13, 8, 9, 12, 13, 8, 9, 12, 13, 8, 9, 12, 13, 8, 9, 12, 13, 8, 9, 12, 13, 8, 9, 12, 13};
  const __m512i pick = _mm512_load_si512(pick_bytes);  // a lane's four activation bytes from its pairs' words
  const __m512i order = _mm512_setr_epi64(0, 2, 1, 3, 4, 6, 5, 7);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const uint8_t* block = p.w + b * p.block_bytes;
  __m512 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0), g = scale_column(p, k0), kp1 = (k1 + 1) / 2;
    __m512i c_sum[M], d_sum[M];
    for (int m = 0; m < M; ++m) c_sum[m] = d_sum[m] = _mm512_setzero_si512();
    for (int64_t kp = k0 / 2; kp < kp1; kp += 4) {
      const int64_t pairs = std::min<int64_t>(4, kp1 - kp);  // fewer only at the weight's last columns
      const __m512i raw = pairs == 4 ? _mm512_loadu_si512(block + kp * 16)
                                     : _mm512_maskz_loadu_epi8((__mmask64(1) << (pairs * 16)) - 1, block + kp * 16);
      const __m512i v = _mm512_permutexvar_epi64(order, raw);
      const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      const __m512i first = _mm512_unpacklo_epi8(lo, hi), second = _mm512_unpackhi_epi8(lo, hi);
      const __m512i c = _mm512_unpacklo_epi16(first, second), d = _mm512_unpackhi_epi16(first, second);
      for (int m = 0; m < M; ++m) {
        const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.pairs + m * x.stride + kp));
        const __m512i xv = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(words), pick);
        c_sum[m] = _mm512_dpbusd_epi32(c_sum[m], c, xv);
        d_sum[m] = _mm512_dpbusd_epi32(d_sum[m], d, xv);
      }
    }
    const __m512 s = block_scales(p, b, g);
    for (int m = 0; m < M; ++m) {
      const __m256i cs = _mm256_add_epi32(_mm512_castsi512_si256(c_sum[m]), _mm512_extracti64x4_epi64(c_sum[m], 1));
      const __m256i ds = _mm256_add_epi32(_mm512_castsi512_si256(d_sum[m]), _mm512_extracti64x4_epi64(d_sum[m], 1));
      const __m512i lanes = _mm512_inserti64x4(_mm512_castsi256_si512(cs), ds, 1);  // rows 0-3, 8-11, 4-7, 12-15
      const __m512i sum = _mm512_shuffle_i64x2(lanes, lanes, _MM_SHUFFLE(3, 1, 2, 0));
      const __m512i offset = _mm512_set1_epi32(8 * x.sums[m * x.G + g]);
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, offset)),
                                 _mm512_mul_ps(s, _mm512_set1_ps(x.scales[m * x.G + g])), total[m]);
    }
    k0 = k1;
  }
  const int64_t rows = std::min<int64_t>(16, p.N - b * 16);
  for (int m = 0; m < M; ++m) store16(p, y + m * y_row, b * 16, total[m], rows);
}

template <int64_t Kind, int M, typename Rows>
AVX512 void blocks_m(const Problem& p, const Rows& x, int64_t b0, int64_t b1, uint8_t* y, int64_t y_row) {
  for (int64_t b = b0; b < b1; ++b) {
    if constexpr (std::is_same_v<Rows, Int8Pairs>) block_int4_vnni<M>(p, x, b, y, y_row);
    else if constexpr (std::is_same_v<Rows, FloatRows>) block_float<Kind, M>(p, x, b, y, y_row);
    else if (x.rest) block_int<Kind, M, true>(p, x, b, y, y_row);
    else block_int<Kind, M, false>(p, x, b, y, y_row);
  }
}

template <int64_t Kind, typename Rows>
void blocks(const Problem& p, const Rows& x, int64_t b0, int64_t b1, uint8_t* y, int64_t y_row) {
  switch (p.M) {
    case 1: return blocks_m<Kind, 1>(p, x, b0, b1, y, y_row);
    case 2: return blocks_m<Kind, 2>(p, x, b0, b1, y, y_row);
    case 3: return blocks_m<Kind, 3>(p, x, b0, b1, y, y_row);
    default: return blocks_m<Kind, 4>(p, x, b0, b1, y, y_row);
  }
}

}  // namespace

void avx512f_blocks(const Problem& p, const FloatRows& x, int64_t b0, int64_t b1, uint8_t* y, int64_t y_row) {
  if (p.kind == kBF16) blocks<kBF16>(p, x, b0, b1, y, y_row);
  else blocks<kFP8>(p, x, b0, b1, y, y_row);
}

void avx512f_blocks(const Problem& p, const Int16Rows& x, int64_t b0, int64_t b1, uint8_t* y, int64_t y_row) {
  if (p.kind == kINT8) blocks<kINT8>(p, x, b0, b1, y, y_row);
  else blocks<kINT4>(p, x, b0, b1, y, y_row);
}

void avx512f_blocks(const Problem& p, const Int8Pairs& x, int64_t b0, int64_t b1, uint8_t* y, int64_t y_row) {
  blocks<kINT4>(p, x, b0, b1, y, y_row);
}

#else  // not x86: use_avx512f() is never true

void avx512f_blocks(const Problem&, const Int8Pairs&, int64_t, int64_t, uint8_t*, int64_t) {}
void avx512f_blocks(const Problem&, const FloatRows&, int64_t, int64_t, uint8_t*, int64_t) {}
void avx512f_blocks(const Problem&, const Int16Rows&, int64_t, int64_t, uint8_t*, int64_t) {}

#endif

}  // namespace dsaserve::packed
