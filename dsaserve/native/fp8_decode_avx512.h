// 32 fp8 e4m3 bytes as the bf16 bits of their values times 2^-8, in one 512-bit register, with AVX-512BW shifts,
// masks and a table (no BF16 instruction): the decode of both 512-bit product bodies, the AVX-512 BF16 one
// (quant_linear.cpp) and the avx512 family's (quant_linear_avx512f.cpp).
#pragma once

#include <cstdint>

#include "cpu_features.h"

#if DSASERVE_X86
#include <immintrin.h>

namespace dsaserve::packed {

// The byte in the high half of its lane, shifted right 4 with its sign, gives s|ssss|eeee|mmm|0000, and masking
// bits 11-14 leaves sign, exponent and mantissa in place; exponent + 112 rebiases 7 - 8 to bf16's 127. Exponent 0
// keeps s|0|mmm0000: zero for mantissa 0; a subnormal (mantissa > 0, rare) takes its value, m · 2^-17, from a table.
__attribute__((target("avx512f,avx512bw"))) inline __m512i fp8_bf16_bits(const uint8_t* bytes) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
  const __m512i z = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 4), _mm512_set1_epi16(short(0x87F0)));
  const __mmask32 normal = _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x78));
  const __m512i r = _mm512_mask_add_epi16(z, normal, z, _mm512_set1_epi16(0x3800));
  const __mmask32 subnormal = _mm512_mask_test_epi16_mask(static_cast<__mmask32>(~normal), v, _mm512_set1_epi16(7));
  if (__builtin_expect(subnormal == 0, 1)) return r;
  const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0x3860, 0x3840, 0x3820, 0x3800, 0x37C0, 0x3780, 0x3700, 0);
  const __m512i sign = _mm512_and_si512(z, _mm512_set1_epi16(short(0x8000)));
  return _mm512_mask_mov_epi16(r, subnormal, _mm512_or_si512(_mm512_permutexvar_epi16(v, table), sign));
}

}  // namespace dsaserve::packed
#endif
