// Weight-only quantized matrix products for a few rows of activations (decode, draft verification),
// registered as torch operators in the `dsaserve` namespace.
//
//   y[m, n] = sum_k x[m, k] * dequant(w)[n, k]      dequant(w)[n, k] = q[n, k] * scale[n, g(k)]
//
// with g(k) = (k + col_offset) / group - col_offset / group: one scale per row and `group` columns
// (col_offset: a slice's first column in the full tensor, whose scale blocks it keeps).
//
// Weights are stored packed for the kernel, 16 output rows by 2 columns at a time: the pair (row
// n, columns k and k + 1) of a 16-row block is one 32-bit lane, so one vector holds 16 rows' products
// for two columns (vdpbf16ps) and no horizontal sums are needed. Element (n, k) of a [N, K] weight
// (N padded to 16, K to 2) is entry ((n / 16) * K2 + k / 2) * 32 + (n % 16) * 2 + k % 2, K2 = K / 2;
// scales are [N / 16, G, 16]. Kinds:
//   0 bf16   2-byte entries (the unquantized weight, at memory bandwidth)
//   1 fp8    float8 e4m3 bytes with their block scales as shipped (128 x 128, kept per row)
//   2 int8   bytes, symmetric, one scale per row (group = K) or per group
//   3 int4   half bytes, value + 8: byte (n / 16 * K2 + k / 2) * 16 + n % 16 holds column k of row n in its
//            low nibble and column k + 1 in its high one
//
// The AVX-512 BF16 body decodes 32 weights to bf16 (exact for every kind), multiplies them into every
// activation row, scales each group's sum once, and shares 16-row blocks out over torch's intra-op
// threads (at::parallel_for). It is compiled for that ISA alone and chosen at run time from the CPU's
// flags. int4 and int8 weights with bf16 activations take an integer path where the CPU has AVX-512 VNNI and
// VBMI (Int8Acts below): the activations are quantized to int8 once per call, per row and group of columns.
// `dequantize_t` (vectorized there, portable elsewhere) gives the transposed float weight for the torch
// GEMM: many activation rows, or a CPU without the kernels. `moe_experts` runs a MoE layer's routed experts
// for a few tokens in one call (gate|up product, SiLU gate, down product, weighted sum), each expert
// reading its own packed weights in place.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_features.h"
#include "fp8_decode_avx512.h"
#include "packed_problem.h"
#include "packed_product.h"
#include "layer_pieces.h"

#if DSASERVE_X86
#include <immintrin.h>
#endif

namespace {

using namespace dsaserve::packed;

// Activations quantized for the VNNI paths: per row and group of columns (act_group_end), symmetric int8
// (absmax / 127, rounded to nearest even). For int4 weights, within a chunk of 8 columns (one vpermb-transposed
// chunk of packed weights) the bytes are the 4 even columns, then the 4 odd ones, matching the weights' low and
// high nibbles; for int8 weights they are in column order.
struct Int8Acts {
  const int8_t* q;      // row r at q + r * row_bytes
  const int32_t* sums;  // [rows, G]: each group's sum of q (the weights' unsigned offset takes a multiple off)
  const float* scales;  // [rows, G]: each group's scale; NaN where the group holds a NaN or infinity
  int64_t row_bytes, G;
};

float weight_at(const Problem& p, int64_t n, int64_t k) {
  const uint8_t* block = p.w + (n / 16) * p.block_bytes;
  const int64_t lane = (n % 16) * 2 + k % 2;
  switch (p.kind) {
    case kBF16: {
      uint16_t bits;
      std::memcpy(&bits, block + ((k / 2) * 32 + lane) * 2, 2);
      uint32_t f = static_cast<uint32_t>(bits) << 16;
      float v;
      std::memcpy(&v, &f, 4);
      return v;
    }
    case kFP8:
      return fp8_e4m3_to_float(block[(k / 2) * 32 + lane]);
    case kINT8:
      return static_cast<float>(static_cast<int8_t>(block[(k / 2) * 32 + lane]));
    default: {
      uint8_t byte = block[(k / 2) * 16 + n % 16];
      return static_cast<float>((k % 2 == 0 ? (byte & 0xF) : (byte >> 4)) - 8);
    }
  }
}

float scale_at(const Problem& p, int64_t n, int64_t column) {
  return p.scale[((n / 16) * p.G + column) * 16 + n % 16];
}

#if DSASERVE_X86
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c,fma")))

// Sixteen outputs (one per row of a block) at element `index` of y, in y's dtype; `rows` < 16 for a
// last, partial block (masked stores only there: they are slow on Zen 4).
AVX512BF16 inline void store16(const Problem& p, void* y, int64_t index, __m512 v, int64_t rows) {
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  if (p.out_bf16) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    uint16_t* dst = static_cast<uint16_t*>(y) + index;
    if (rows == 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
    else _mm256_mask_storeu_epi16(dst, mask, h);
  } else {
    float* dst = static_cast<float*>(y) + index;
    if (rows == 16) _mm512_storeu_ps(dst, v);
    else _mm512_mask_storeu_ps(dst, mask, v);
  }
}

// The 32 entries of a block at column pair kp (16 rows x 2 columns) as bf16 bits, exact for every kind
// (fp8 values times 2^-8, folded into the scales).
template <int64_t Kind>
AVX512BF16 inline __m512i decode32(const uint8_t* block, int64_t kp) {
  if constexpr (Kind == kBF16) {
    return _mm512_loadu_si512(block + kp * 64);
  } else if constexpr (Kind == kINT8) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kp * 32));
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  } else if constexpr (Kind == kFP8) {
    return fp8_bf16_bits(block + kp * 32);  // bf16 bits of the e4m3 values times 2^-8 (fp8_decode_avx512.h)
  } else {  // int4: lane r = (low nibble, high nibble) of byte r; a table maps each to bf16(nibble - 8)
    // The lookup reads the low 5 bits of each 16-bit index: with the table written twice, byte b | b << 12
    // indexes its low nibble in the lane's low half (bit 4, the high nibble's, selects the copy) and its
    // high nibble in the upper half, with no masking.
    const __m512i table = _mm512_set_epi16(
        0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
        (short)0xBF80, (short)0xC000, (short)0xC040, (short)0xC080, (short)0xC0A0, (short)0xC0C0, (short)0xC0E0,
        (short)0xC100,
        0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
        (short)0xBF80, (short)0xC000, (short)0xC040, (short)0xC080, (short)0xC0A0, (short)0xC0C0, (short)0xC0E0,
        (short)0xC100);
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kp * 16)));
    return _mm512_permutexvar_epi16(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), table);
  }
}

// One 16-row block against M activation rows. bf16 activations: x holds M rows of K2 bf16 pairs
// (32-bit lanes), one vdpbf16ps per row and column pair. fp32 activations: x holds M rows of K fp32
// values; each pair splits into its even and odd column (16 rows each) and takes two FMAs.
template <int64_t Kind, int M, bool Bf16Act>
AVX512BF16 void block_rows(const Problem& p, const void* x, int64_t b, void* y) {
  constexpr float kFactor = Kind == kFP8 ? 256.f : 1.f;
  const uint8_t* block = p.w + b * p.block_bytes;
  __m512 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0);
    __m512 even[M], odd[M];  // two chains per row: half the latency of one
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    const int64_t p0 = k0 / 2, p1 = (k1 + 1) / 2;
    if constexpr (Bf16Act) {
      const uint32_t* xp = static_cast<const uint32_t*>(x);
      int64_t kp = p0;
      for (; kp + 2 <= p1; kp += 2) {
        const __m512bh w0 = (__m512bh)decode32<Kind>(block, kp);
        const __m512bh w1 = (__m512bh)decode32<Kind>(block, kp + 1);
        for (int m = 0; m < M; ++m) {
          even[m] = _mm512_dpbf16_ps(even[m], w0, (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * p.K2 + kp])));
          odd[m] = _mm512_dpbf16_ps(odd[m], w1, (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * p.K2 + kp + 1])));
        }
      }
      if (kp < p1) {
        const __m512bh w0 = (__m512bh)decode32<Kind>(block, kp);
        for (int m = 0; m < M; ++m)
          even[m] = _mm512_dpbf16_ps(even[m], w0, (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * p.K2 + kp])));
      }
    }
    if constexpr (!Bf16Act) {  // fp32 activations: the pair's even and odd columns, 16 rows each
      const float* xf = static_cast<const float*>(x);
      for (int64_t kp = p0; kp < p1; ++kp) {
        const __m512i w = decode32<Kind>(block, kp);
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
        for (int m = 0; m < M; ++m) {
          even[m] = _mm512_fmadd_ps(we, _mm512_set1_ps(xf[m * 2 * p.K2 + 2 * kp]), even[m]);
          odd[m] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xf[m * 2 * p.K2 + 2 * kp + 1]), odd[m]);
        }
      }
    }
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(p.scale + (b * p.G + scale_column(p, k0)) * 16),
                                   _mm512_set1_ps(kFactor));
    for (int m = 0; m < M; ++m) total[m] = _mm512_fmadd_ps(_mm512_add_ps(even[m], odd[m]), s, total[m]);
    k0 = k1;
  }
  const int64_t rows = std::min<int64_t>(16, p.N - b * 16);
  for (int m = 0; m < M; ++m) store16(p, y, m * p.N + b * 16, total[m], rows);
}

// Two 16-row blocks against M bf16 activation rows (M >= 3): each broadcast of an activation pair
// feeds both blocks, which halves the activation loads per weight where they, not the weights, bound
// the loop.
template <int64_t Kind, int M>
AVX512BF16 void block_pair_rows(const Problem& p, const void* x, int64_t b, void* y) {
  constexpr float kFactor = Kind == kFP8 ? 256.f : 1.f;
  const uint8_t* blocks[2] = {p.w + b * p.block_bytes, p.w + (b + 1) * p.block_bytes};
  const uint32_t* xp = static_cast<const uint32_t*>(x);
  __m512 total[2][M];
  for (int r = 0; r < 2; ++r)
    for (int m = 0; m < M; ++m) total[r][m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0);
    __m512 part[2][M];
    for (int r = 0; r < 2; ++r)
      for (int m = 0; m < M; ++m) part[r][m] = _mm512_setzero_ps();
    for (int64_t kp = k0 / 2; kp < (k1 + 1) / 2; ++kp) {
      const __m512bh w0 = (__m512bh)decode32<Kind>(blocks[0], kp);
      const __m512bh w1 = (__m512bh)decode32<Kind>(blocks[1], kp);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * p.K2 + kp]));
        part[0][m] = _mm512_dpbf16_ps(part[0][m], w0, xv);
        part[1][m] = _mm512_dpbf16_ps(part[1][m], w1, xv);
      }
    }
    const int64_t column = scale_column(p, k0);
    for (int r = 0; r < 2; ++r) {
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(p.scale + ((b + r) * p.G + column) * 16), _mm512_set1_ps(kFactor));
      for (int m = 0; m < M; ++m) total[r][m] = _mm512_fmadd_ps(part[r][m], s, total[r][m]);
    }
    k0 = k1;
  }
  for (int r = 0; r < 2; ++r)
    for (int m = 0; m < M; ++m) store16(p, y, m * p.N + (b + r) * 16, total[r][m], 16);  // both blocks full
}

template <int64_t Kind, int M, bool Bf16Act>
AVX512BF16 void blocks_m(const Problem& p, const void* x, int64_t b0, int64_t b1, void* y) {
  int64_t b = b0;
  if constexpr (Bf16Act && M >= 3 && M <= 8) {
    const int64_t full = p.N / 16;  // blocks with 16 real rows
    for (; b + 2 <= std::min(b1, full); b += 2) block_pair_rows<Kind, M>(p, x, b, y);
  }
  for (; b < b1; ++b) block_rows<Kind, M, Bf16Act>(p, x, b, y);
}

template <int64_t Kind, bool Bf16Act>
AVX512BF16 void blocks(const Problem& p, const void* x, int64_t b0, int64_t b1, void* y) {
  switch (p.M) {
    case 1: return blocks_m<Kind, 1, Bf16Act>(p, x, b0, b1, y);
    case 2: return blocks_m<Kind, 2, Bf16Act>(p, x, b0, b1, y);
    case 3: return blocks_m<Kind, 3, Bf16Act>(p, x, b0, b1, y);
    case 4: return blocks_m<Kind, 4, Bf16Act>(p, x, b0, b1, y);
    case 5: return blocks_m<Kind, 5, Bf16Act>(p, x, b0, b1, y);
    case 6: return blocks_m<Kind, 6, Bf16Act>(p, x, b0, b1, y);
    case 7: return blocks_m<Kind, 7, Bf16Act>(p, x, b0, b1, y);
    default: return blocks_m<Kind, 8, Bf16Act>(p, x, b0, b1, y);
  }
}

bool fp8_table_enabled();
void blocks_fp8_table(const Problem& p, const void* x, int64_t b0, int64_t b1, void* y);

template <bool Bf16Act>
AVX512BF16 void blocks_any(const Problem& p, const void* x, int64_t b0, int64_t b1, void* y) {
  switch (p.kind) {
    case kBF16: return blocks<kBF16, Bf16Act>(p, x, b0, b1, y);
    case kFP8:
      if (Bf16Act && fp8_table_enabled()) return blocks_fp8_table(p, x, b0, b1, y);
      return blocks<kFP8, Bf16Act>(p, x, b0, b1, y);
    case kINT8: return blocks<kINT8, Bf16Act>(p, x, b0, b1, y);
    default: return blocks<kINT4, Bf16Act>(p, x, b0, b1, y);
  }
}

#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx512vbmi,f16c,fma")))

// Whether the VNNI and VBMI product paths may run: the CPU has their instructions and the process allows them
// (native_kernels 'auto'; 'avx512' keeps the bf16 bodies, for comparing: set_isa_extensions).
std::atomic<bool> g_extensions_allowed{true};

bool vnni_allowed() {
  return dsaserve::use_avx512_vnni_vbmi() && g_extensions_allowed.load(std::memory_order_relaxed);
}

void set_isa_extensions(bool allowed) { g_extensions_allowed.store(allowed, std::memory_order_relaxed); }

bool int4_vnni_enabled() { return vnni_allowed(); }

bool int8_vnni_enabled() { return vnni_allowed(); }

bool fp8_table_enabled() { return vnni_allowed(); }

// Whether p's product takes a VNNI path: bf16 activations, and for int4 scale groups that start on a chunk of 8
// columns, for int8 one scale per row (else the bf16 body, exact in the activations, runs).
bool vnni_applies(const Problem& p) {
  if (!p.out_bf16) return false;
  if (p.kind == kINT4) return p.group % 8 == 0 && p.col_offset % 8 == 0 && int4_vnni_enabled();
  return p.kind == kINT8 && p.G == 1 && int8_vnni_enabled();
}

// The activations' groups on the VNNI paths: the weight's scale groups for int4, 128 columns for int8 (whose
// weight has one scale per row: a group per row would round a whole row's activations to one step).
constexpr int64_t kInt8ActGroup = 128;

int64_t act_group_end(const Problem& p, int64_t k0) {
  return p.kind == kINT8 ? std::min(p.K, k0 + kInt8ActGroup) : group_end(p, k0);
}

int64_t act_group_index(const Problem& p, int64_t k0) {
  return p.kind == kINT8 ? k0 / kInt8ActGroup : scale_column(p, k0);
}

int64_t act_group_count(const Problem& p) { return p.kind == kINT8 ? (p.K + kInt8ActGroup - 1) / kInt8ActGroup : p.G; }

// A row's bytes: a group's last 16-column store may reach 15 bytes past its end.
int64_t int8_row_bytes(int64_t K) { return (K + 15) / 16 * 16 + 16; }

// Columns [k, min(k + 16, k1)) of a bf16 row as floats, zeros past k1.
AVX512VNNI inline __m512 load_bf16(const uint16_t* x, int64_t k, int64_t k1) {
  const __mmask16 mask = k1 - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (k1 - k)) - 1);
  const __m256i h = _mm256_maskz_loadu_epi16(mask, x + k);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One bf16 row of K values into acts' row r (its bytes, group sums and scales).
AVX512VNNI void quantize_row(const Problem& p, const uint16_t* x, const Int8Acts& acts, int64_t r) {
  int8_t* q = const_cast<int8_t*>(acts.q) + r * acts.row_bytes;
  int32_t* sums = const_cast<int32_t*>(acts.sums) + r * acts.G;
  float* scales = const_cast<float*>(acts.scales) + r * acts.G;
  // int4: per 16 columns, the even columns of each 8, then the odd ones; int8: column order.
  const __m128i order = p.kind == kINT4 ? _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
                                        : _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = act_group_end(p, k0);
    const int64_t g = act_group_index(p, k0);
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = k0; k < k1; k += 16) {
      const __m512 v = load_bf16(x, k, k1);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float m = _mm512_reduce_max_ps(amax);
    const bool finite = nan == 0 && m <= 3.4e38f;
    const __m512 inv = _mm512_set1_ps(finite && m > 1e-30f ? 127.f / m : 0.f);  // (127 / m overflows below 4e-37)
    __m512i total = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 16) {  // a group's last store may spill zeros into the next group's first chunk
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16(x, k, k1), inv));
      total = _mm512_add_epi32(total, qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(qi), order));
    }
    sums[g] = _mm512_reduce_add_epi32(total);
    scales[g] = finite ? m / 127.f : std::numeric_limits<float>::quiet_NaN();
    k0 = k1;
  }
}

// One 16-row int4 block against M quantized activation rows (acts' rows row0…): per chunk of 64 packed bytes
// (16 rows x 8 columns), one vpermb puts each row's 4 bytes in its own 32-bit lane, low nibbles (even columns)
// and high nibbles (odd columns) are split, and vpdpbusd adds their products with the rows' int8 values; each
// group's integer sum, less 8 x the activations' sum, is scaled once by the weight's and the activation's scale.
template <int M>
AVX512VNNI void block_rows_int4_vnni(const Problem& p, const Int8Acts& acts, int64_t row0, int64_t b, void* y) {
  alignas(64) static const uint8_t transpose_index[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54,
      7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59, 12, 28, 44, 60, 13, 29, 45, 61,
      14, 30, 46, 62, 15, 31, 47, 63};
  const __m512i transpose = _mm512_load_si512(transpose_index);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const uint8_t* block = p.w + b * p.block_bytes;
  const int64_t full_chunks = p.K2 / 4;  // chunks with all 4 column pairs (64 bytes) in the block
  __m512 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0);
    __m512i even[M], odd[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_si512();
    for (int64_t c = k0 / 8; c < (k1 + 7) / 8; ++c) {
      const __m512i raw = c < full_chunks
          ? _mm512_loadu_si512(block + c * 64)
          : _mm512_maskz_loadu_epi8((__mmask64(1) << ((p.K2 - 4 * c) * 16)) - 1, block + c * 64);
      const __m512i t = _mm512_permutexvar_epi8(transpose, raw);
      const __m512i lo = _mm512_and_si512(t, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), nibble);
      for (int m = 0; m < M; ++m) {
        const int8_t* xq = acts.q + (row0 + m) * acts.row_bytes + c * 8;
        int32_t xe, xo;
        std::memcpy(&xe, xq, 4);
        std::memcpy(&xo, xq + 4, 4);
        even[m] = _mm512_dpbusd_epi32(even[m], lo, _mm512_set1_epi32(xe));
        odd[m] = _mm512_dpbusd_epi32(odd[m], hi, _mm512_set1_epi32(xo));
      }
    }
    const int64_t g = scale_column(p, k0);
    const __m512 sw = _mm512_loadu_ps(p.scale + (b * p.G + g) * 16);
    for (int m = 0; m < M; ++m) {
      const int64_t r = (row0 + m) * acts.G + g;
      const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(even[m], odd[m]), _mm512_set1_epi32(8 * acts.sums[r]));
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sw, _mm512_set1_ps(acts.scales[r])), total[m]);
    }
    k0 = k1;
  }
  const int64_t rows = std::min<int64_t>(16, p.N - b * 16);
  for (int m = 0; m < M; ++m) store16(p, y, m * p.N + b * 16, total[m], rows);
}

// Chunk c of an int8 block (columns 4c … 4c + 3 of its 16 rows) with each row's 4 bytes in its own 32-bit lane,
// made unsigned (w + 128): the first 32 bytes only past the block's full chunks (an odd number of column pairs).
AVX512VNNI inline __m512i int8_chunk(const uint8_t* block, int64_t c, int64_t full_chunks, __m512i transpose) {
  const __m512i raw = c < full_chunks ? _mm512_loadu_si512(block + c * 64)
                                      : _mm512_maskz_loadu_epi8((__mmask64(1) << 32) - 1, block + c * 64);
  return _mm512_xor_si512(_mm512_permutexvar_epi8(transpose, raw), _mm512_set1_epi8(static_cast<char>(0x80)));
}

// Four int8 activations, broadcast to every 32-bit lane.
AVX512VNNI inline __m512i four_bytes(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

// One 16-row int8 block (one scale per row) against M quantized activation rows (acts' rows row0…): per chunk
// of 64 packed bytes (16 rows x 4 columns), one vpermb puts each row's 4 bytes in its own 32-bit lane, a xor with
// 0x80 makes them unsigned (w + 128) and vpdpbusd adds their products with the rows' int8 values; each
// activation group's integer sum, less 128 x the activations' sum, is scaled by the activation's scale, and
// the row's total by the weight's.
template <int M>
AVX512VNNI void block_rows_int8_vnni(const Problem& p, const Int8Acts& acts, int64_t row0, int64_t b, void* y) {
  alignas(64) static const uint8_t transpose_index[64] = {
      0, 1, 32, 33, 2, 3, 34, 35, 4, 5, 36, 37, 6, 7, 38, 39, 8, 9, 40, 41, 10, 11, 42, 43, 12, 13, 44, 45,
      14, 15, 46, 47, 16, 17, 48, 49, 18, 19, 50, 51, 20, 21, 52, 53, 22, 23, 54, 55, 24, 25, 56, 57, 26, 27, 58,
      59, 28, 29, 60, 61, 30, 31, 62, 63};
  const __m512i transpose = _mm512_load_si512(transpose_index);
  const uint8_t* block = p.w + b * p.block_bytes;
  const int64_t full_chunks = p.K2 / 2;  // chunks with both column pairs (64 bytes) in the block
  constexpr int C = M == 1 ? 2 : 1;  // chains per row: one row alone would wait on its one chain's latency
  const int8_t* xq[M];
  for (int m = 0; m < M; ++m) xq[m] = acts.q + (row0 + m) * acts.row_bytes;
  __m512 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K; k0 = act_group_end(p, k0)) {
    const int64_t c1 = (act_group_end(p, k0) + 3) / 4;
    __m512i part[C][M];
    for (int j = 0; j < C; ++j)
      for (int m = 0; m < M; ++m) part[j][m] = _mm512_setzero_si512();
    int64_t c = k0 / 4;
    for (; c + C <= c1; c += C)
      for (int j = 0; j < C; ++j) {
        const __m512i w = int8_chunk(block, c + j, full_chunks, transpose);
        for (int m = 0; m < M; ++m) part[j][m] = _mm512_dpbusd_epi32(part[j][m], w, four_bytes(xq[m] + (c + j) * 4));
      }
    if (c < c1) {
      const __m512i w = int8_chunk(block, c, full_chunks, transpose);
      for (int m = 0; m < M; ++m) part[0][m] = _mm512_dpbusd_epi32(part[0][m], w, four_bytes(xq[m] + c * 4));
    }
    const int64_t g = act_group_index(p, k0);
    for (int m = 0; m < M; ++m) {
      const int64_t r = (row0 + m) * acts.G + g;
      __m512i sum = part[0][m];
      if constexpr (C == 2) sum = _mm512_add_epi32(sum, part[1][m]);
      sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * acts.sums[r]));
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(acts.scales[r]), total[m]);
    }
  }
  const __m512 sw = _mm512_loadu_ps(p.scale + b * 16);  // one scale group
  const int64_t rows = std::min<int64_t>(16, p.N - b * 16);
  for (int m = 0; m < M; ++m) store16(p, y, m * p.N + b * 16, _mm512_mul_ps(total[m], sw), rows);
}

template <int64_t Kind, int M>
AVX512VNNI void blocks_vnni_m(const Problem& p, const Int8Acts& acts, int64_t row0, int64_t b0, int64_t b1, void* y) {
  for (int64_t b = b0; b < b1; ++b) {
    if constexpr (Kind == kINT4) block_rows_int4_vnni<M>(p, acts, row0, b, y);
    else block_rows_int8_vnni<M>(p, acts, row0, b, y);
  }
}

template <int64_t Kind>
AVX512VNNI void blocks_vnni_kind(const Problem& p, const Int8Acts& acts, int64_t row0, int64_t b0, int64_t b1,
                                 void* y) {
  switch (p.M) {
    case 1: return blocks_vnni_m<Kind, 1>(p, acts, row0, b0, b1, y);
    case 2: return blocks_vnni_m<Kind, 2>(p, acts, row0, b0, b1, y);
    case 3: return blocks_vnni_m<Kind, 3>(p, acts, row0, b0, b1, y);
    case 4: return blocks_vnni_m<Kind, 4>(p, acts, row0, b0, b1, y);
    case 5: return blocks_vnni_m<Kind, 5>(p, acts, row0, b0, b1, y);
    case 6: return blocks_vnni_m<Kind, 6>(p, acts, row0, b0, b1, y);
    case 7: return blocks_vnni_m<Kind, 7>(p, acts, row0, b0, b1, y);
    default: return blocks_vnni_m<Kind, 8>(p, acts, row0, b0, b1, y);
  }
}

AVX512VNNI void blocks_vnni(const Problem& p, const Int8Acts& acts, int64_t row0, int64_t b0, int64_t b1, void* y) {
  if (p.kind == kINT4) blocks_vnni_kind<kINT4>(p, acts, row0, b0, b1, y);
  else blocks_vnni_kind<kINT8>(p, acts, row0, b0, b1, y);
}

// fp8 weights by bf16 activations where the CPU has VBMI: each e4m3 byte's bf16 bits (times 2^-8, as decode32
// gives them) looked up in two 128-byte tables, one for the low bytes and one for the high bytes (vpermi2b reads
// an index's low 7 bits: sign-free), the sign or-ed into the high bytes, and the two byte planes interleaved into
// bf16 lanes by vpermt2b: five instructions decode two column pairs (64 weights), where decode32's shifts, masks
// and subnormal test take eight for one pair. Subnormals and zeros come out of the table like every other byte.
// (The loops below repeat block_rows' and block_pair_rows': this decode needs a VBMI target, which the bf16 body,
// run on CPUs without VBMI, must not be compiled for.)
struct Fp8Tables {
  alignas(64) uint8_t low[128];
  alignas(64) uint8_t high[128];
  alignas(64) uint8_t first_pair[64];   // bytes of the first column pair's lanes: low j, high j
  alignas(64) uint8_t second_pair[64];  // the second pair's: low 32 + j, high 32 + j
};

const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables = [] {
    Fp8Tables t{};
    for (int b = 0; b < 128; ++b) {
      const float v = fp8_e4m3_to_float(static_cast<uint8_t>(b)) / 256.f;  // exact: 4 significant bits
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      t.low[b] = static_cast<uint8_t>(bits >> 16);
      t.high[b] = static_cast<uint8_t>(bits >> 24);
    }
    for (int j = 0; j < 32; ++j) {  // vpermt2b's index: bit 6 picks the high-byte plane
      t.first_pair[2 * j] = static_cast<uint8_t>(j);
      t.first_pair[2 * j + 1] = static_cast<uint8_t>(64 + j);
      t.second_pair[2 * j] = static_cast<uint8_t>(32 + j);
      t.second_pair[2 * j + 1] = static_cast<uint8_t>(96 + j);
    }
    return t;
  }();
  return tables;
}

struct Fp8Decoder {
  __m512i low0, low1, high0, high1, first_pair, second_pair, sign;

  AVX512VNNI explicit Fp8Decoder(const Fp8Tables& t)
      : low0(_mm512_load_si512(t.low)), low1(_mm512_load_si512(t.low + 64)), high0(_mm512_load_si512(t.high)),
        high1(_mm512_load_si512(t.high + 64)), first_pair(_mm512_load_si512(t.first_pair)),
        second_pair(_mm512_load_si512(t.second_pair)), sign(_mm512_set1_epi8(static_cast<char>(0x80))) {}

  // The 64 bytes of column pairs kp and kp + 1 (a vector whose upper half is unused when only kp is there) as
  // the two pairs' bf16 lanes.
  AVX512VNNI void decode(__m512i raw, __m512i& w0, __m512i& w1) const {
    const __m512i low = _mm512_permutex2var_epi8(low0, raw, low1);
    // high | (raw & 0x80): ternary logic A | (B & C) on (high, raw, sign)
    const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high0, raw, high1), raw, sign, 0xF8);
    w0 = _mm512_permutex2var_epi8(low, first_pair, high);
    w1 = _mm512_permutex2var_epi8(low, second_pair, high);
  }
};

// One 16-row fp8 block against M bf16 activation rows (block_rows' sums, with the table decode).
template <int M>
AVX512VNNI void block_rows_fp8_table(const Problem& p, const Fp8Decoder& decoder, const uint32_t* xp, int64_t b,
                                     void* y) {
  const uint8_t* block = p.w + b * p.block_bytes;
  __m512 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0);
    __m512 even[M], odd[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    const int64_t p1 = (k1 + 1) / 2;
    int64_t kp = k0 / 2;
    __m512i w0, w1;
    for (; kp + 2 <= p1; kp += 2) {
      decoder.decode(_mm512_loadu_si512(block + kp * 32), w0, w1);
      for (int m = 0; m < M; ++m) {
        even[m] = _mm512_dpbf16_ps(even[m], (__m512bh)w0, (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * p.K2 + kp])));
        odd[m] = _mm512_dpbf16_ps(odd[m], (__m512bh)w1, (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * p.K2 + kp + 1])));
      }
    }
    if (kp < p1) {  // a group's odd last column pair: its 32 bytes alone (the next ones may be past the block)
      decoder.decode(_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kp * 32))),
                     w0, w1);
      for (int m = 0; m < M; ++m)
        even[m] = _mm512_dpbf16_ps(even[m], (__m512bh)w0, (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * p.K2 + kp])));
    }
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(p.scale + (b * p.G + scale_column(p, k0)) * 16), _mm512_set1_ps(256.f));
    for (int m = 0; m < M; ++m) total[m] = _mm512_fmadd_ps(_mm512_add_ps(even[m], odd[m]), s, total[m]);
    k0 = k1;
  }
  const int64_t rows = std::min<int64_t>(16, p.N - b * 16);
  for (int m = 0; m < M; ++m) store16(p, y, m * p.N + b * 16, total[m], rows);
}

// Two full 16-row fp8 blocks against M >= 3 bf16 activation rows: each activation broadcast feeds both blocks
// (block_pair_rows' reason).
template <int M>
AVX512VNNI void block_pair_rows_fp8_table(const Problem& p, const Fp8Decoder& decoder, const uint32_t* xp, int64_t b,
                                          void* y) {
  const uint8_t* blocks[2] = {p.w + b * p.block_bytes, p.w + (b + 1) * p.block_bytes};
  __m512 total[2][M];
  for (int r = 0; r < 2; ++r)
    for (int m = 0; m < M; ++m) total[r][m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0);
    __m512 part[2][M];
    for (int r = 0; r < 2; ++r)
      for (int m = 0; m < M; ++m) part[r][m] = _mm512_setzero_ps();
    const int64_t p1 = (k1 + 1) / 2;
    int64_t kp = k0 / 2;
    __m512i w[2][2];
    for (; kp + 2 <= p1; kp += 2) {
      for (int r = 0; r < 2; ++r) decoder.decode(_mm512_loadu_si512(blocks[r] + kp * 32), w[r][0], w[r][1]);
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < 2; ++j) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * p.K2 + kp + j]));
          part[0][m] = _mm512_dpbf16_ps(part[0][m], (__m512bh)w[0][j], xv);
          part[1][m] = _mm512_dpbf16_ps(part[1][m], (__m512bh)w[1][j], xv);
        }
    }
    if (kp < p1) {
      for (int r = 0; r < 2; ++r)
        decoder.decode(_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks[r] + kp * 32))),
                       w[r][0], w[r][1]);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * p.K2 + kp]));
        part[0][m] = _mm512_dpbf16_ps(part[0][m], (__m512bh)w[0][0], xv);
        part[1][m] = _mm512_dpbf16_ps(part[1][m], (__m512bh)w[1][0], xv);
      }
    }
    const int64_t column = scale_column(p, k0);
    for (int r = 0; r < 2; ++r) {
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(p.scale + ((b + r) * p.G + column) * 16), _mm512_set1_ps(256.f));
      for (int m = 0; m < M; ++m) total[r][m] = _mm512_fmadd_ps(part[r][m], s, total[r][m]);
    }
    k0 = k1;
  }
  for (int r = 0; r < 2; ++r)
    for (int m = 0; m < M; ++m) store16(p, y, m * p.N + (b + r) * 16, total[r][m], 16);
}

template <int M>
AVX512VNNI void blocks_fp8_table_m(const Problem& p, const void* x, int64_t b0, int64_t b1, void* y) {
  const Fp8Decoder decoder(fp8_tables());
  const uint32_t* xp = static_cast<const uint32_t*>(x);
  int64_t b = b0;
  if constexpr (M >= 3) {
    const int64_t full = p.N / 16;  // blocks with 16 real rows
    for (; b + 2 <= std::min(b1, full); b += 2) block_pair_rows_fp8_table<M>(p, decoder, xp, b, y);
  }
  for (; b < b1; ++b) block_rows_fp8_table<M>(p, decoder, xp, b, y);
}

// Blocks [b0, b1) of an fp8 weight against p.M <= 8 bf16 activation rows.
AVX512VNNI void blocks_fp8_table(const Problem& p, const void* x, int64_t b0, int64_t b1, void* y) {
  switch (p.M) {
    case 1: return blocks_fp8_table_m<1>(p, x, b0, b1, y);
    case 2: return blocks_fp8_table_m<2>(p, x, b0, b1, y);
    case 3: return blocks_fp8_table_m<3>(p, x, b0, b1, y);
    case 4: return blocks_fp8_table_m<4>(p, x, b0, b1, y);
    case 5: return blocks_fp8_table_m<5>(p, x, b0, b1, y);
    case 6: return blocks_fp8_table_m<6>(p, x, b0, b1, y);
    case 7: return blocks_fp8_table_m<7>(p, x, b0, b1, y);
    default: return blocks_fp8_table_m<8>(p, x, b0, b1, y);
  }
}

// Room for `rows` quantized activation rows of p's shape.
struct Int8ActsStorage {
  at::Tensor bytes;  // the rows' int8 values, then their group sums, then their group scales (one allocation)
  int64_t rows = 0, row_bytes = 0, G = 0;
  Int8ActsStorage() = default;
  Int8ActsStorage(const Problem& p, int64_t rows)
      : bytes(at::empty({rows * (int8_row_bytes(p.K) + 8 * act_group_count(p))}, at::kChar)), rows(rows),
        row_bytes(int8_row_bytes(p.K)), G(act_group_count(p)) {}
  Int8Acts acts() const {
    int8_t* base = bytes.data_ptr<int8_t>();
    const auto* sums = reinterpret_cast<const int32_t*>(base + rows * row_bytes);  // row_bytes: a multiple of 16
    return {base, sums, reinterpret_cast<const float*>(sums + rows * G), row_bytes, G};
  }
};

// Blocks [b0, b1) of p (p.M rows of x, x_row bytes apart; bf16 activations and outputs when p.out_bf16,
// else fp32) into y [p.M, N]: more than 8 rows go 8 at a time, one sweep of the weights each. With acts, the
// rows are acts' rows row0… (a VNNI path) and x is not read.
AVX512BF16 void row_sweeps(const Problem& p, const uint8_t* x, int64_t x_row, int64_t b0, int64_t b1, uint8_t* y,
                           const Int8Acts* acts = nullptr, int64_t row0 = 0) {
  const int64_t item = p.out_bf16 ? 2 : 4;
  // More than 8 rows take several sweeps; each covers a span of blocks small enough to stay in L2 for the next,
  // so the weights come from memory once (an even span: blocks_m pairs blocks from the span's start, as from b0).
  const int64_t span = p.M <= 8 ? b1 - b0 : std::max<int64_t>(2, ((int64_t(256) << 10) / p.block_bytes) & ~int64_t(1));
  for (int64_t s0 = b0; s0 < b1; s0 += span) {
    const int64_t s1 = std::min(b1, s0 + span);
    for (int64_t m0 = 0; m0 < p.M; m0 += 8) {
      Problem q = p;
      q.M = std::min<int64_t>(8, p.M - m0);
      if (acts) blocks_vnni(q, *acts, row0 + m0, s0, s1, y + m0 * p.N * item);
      else if (p.out_bf16) blocks_any<true>(q, x + m0 * x_row, s0, s1, y + m0 * p.N * item);
      else blocks_any<false>(q, x + m0 * x_row, s0, s1, y + m0 * p.N * item);
    }
  }
}

// Blocks [b0, b1) dequantized into out [K, N] (the weight transposed): column k of block b is a run of 16
// values at out[k, 16 b]; consecutive blocks' runs are written one after the other, column by column.
template <int64_t Kind, typename Out>
AVX512BF16 void dequantize_blocks_kind(const Problem& p, int64_t b0, int64_t b1, Out* out) {
  constexpr float kFactor = Kind == kFP8 ? 256.f : 1.f;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k0 = 0; k0 < p.K;) {
    const int64_t k1 = group_end(p, k0);
    const int64_t column = scale_column(p, k0);
    for (int64_t k = k0; k < k1; k += 2) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t rows = std::min<int64_t>(16, p.N - b * 16);
        const __mmask16 mask = rows == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rows) - 1);
        const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(p.scale + (b * p.G + column) * 16), _mm512_set1_ps(kFactor));
        const __m512i w = decode32<Kind>(p.w + b * p.block_bytes, k / 2);
        const __m512 values[2] = {_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), s),
                                  _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high)), s)};
        for (int c = 0; c < 2 && k + c < p.K; ++c) {  // masked stores only for a last, partial block (slow on Zen 4)
          Out* dst = out + (k + c) * p.N + b * 16;
          if constexpr (std::is_same_v<Out, float>) {
            if (rows == 16) _mm512_storeu_ps(dst, values[c]);
            else _mm512_mask_storeu_ps(dst, mask, values[c]);
          } else {
            const __m256i half = (__m256i)_mm512_cvtneps_pbh(values[c]);
            if (rows == 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), half);
            else _mm256_mask_storeu_epi16(dst, mask, half);
          }
        }
      }
    }
    k0 = k1;
  }
}

template <typename Out>
AVX512BF16 void dequantize_blocks(const Problem& p, int64_t b0, int64_t b1, Out* out) {
  switch (p.kind) {
    case kBF16: return dequantize_blocks_kind<kBF16, Out>(p, b0, b1, out);
    case kFP8: return dequantize_blocks_kind<kFP8, Out>(p, b0, b1, out);
    case kINT8: return dequantize_blocks_kind<kINT8, Out>(p, b0, b1, out);
    default: return dequantize_blocks_kind<kINT4, Out>(p, b0, b1, out);
  }
}

#endif

// Whether a body of the products runs here: AVX-512 BF16, or AVX2 (cpu_features.h: the process's choice).
bool cpu_has_kernels() { return dsaserve::use_avx512_bf16() || dsaserve::use_avx2(); }

#if DSASERVE_X86
// Blocks [b0, b1) of p by the chosen body (row_sweeps' arguments; the AVX2 body takes no quantized rows).
void sweep(const Problem& p, const uint8_t* x, int64_t x_row, int64_t b0, int64_t b1, uint8_t* y, const Int8Acts* acts,
           int64_t row0) {
  if (dsaserve::use_avx2()) return avx2_row_sweeps(p, x, x_row, b0, b1, y);
  row_sweeps(p, x, x_row, b0, b1, y, acts, row0);
}
#endif

void check(bool ok, const std::string& what) { TORCH_CHECK(ok, "dsaserve quantized weights: ", what); }

// The problem of the first of `stacked` [N, K] weights laid end to end in qweight and scale (experts, heads).
Problem problem_of(const at::Tensor& qweight, const at::Tensor& scale, int64_t kind, int64_t group,
                   int64_t col_offset, int64_t N, int64_t K, int64_t stacked = 1) {
  check(kind >= kBF16 && kind <= kINT4, "unknown weight kind");
  check(N >= 1 && K >= 1 && group >= 1 && col_offset >= 0 && col_offset % 2 == 0 && group % 2 == 0,
        "N, K, group >= 1, col_offset and group even");
  const int64_t K2 = (K + 1) / 2, blocks = (N + 15) / 16, block_bytes = block_bytes_of(kind, K2);
  check(qweight.is_contiguous() && qweight.numel() * qweight.element_size() == stacked * blocks * block_bytes,
        "qweight must be the contiguous packed form of a [N, K] weight (one per expert or head)");
  const int64_t G = scale_column_count(K, group, col_offset);
  check(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == stacked * blocks * G * 16,
        "scale must be contiguous fp32 [ceil(N / 16), G, 16] (one per expert or head)");
  return Problem{0, N, K, K2, false, static_cast<const uint8_t*>(qweight.data_ptr()), block_bytes,
                 scale.data_ptr<float>(), G, group, col_offset, kind};
}

// x [M, K] by one weight, or x [B, M, K] by B weights stacked in qweight [B, ...] (attention heads).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale, int64_t kind,
                        int64_t group, int64_t col_offset, int64_t N, int64_t K) {
  const bool batched = x.dim() == 3;
  check((x.dim() == 2 || batched) && x.size(-1) == K, "x must be [M, K] or [B, M, K]");
  const int64_t B = batched ? x.size(0) : 1;
  check(!batched || (qweight.size(0) == B && scale.size(0) == B), "a weight per batch entry");
  Problem p = problem_of(qweight, scale, kind, group, col_offset, N, K, B);
  const int64_t rows = x.size(-2);
  check(rows >= 1 && rows <= kMaxRows, "at most 16 activation rows");
  p.M = rows;
  check(cpu_has_kernels(), "no body of the packed products runs here (cpu_isa): use dequantize_t");
  const bool bf16_act = x.scalar_type() == at::kBFloat16;
  p.out_bf16 = bf16_act;
  const at::ScalarType act = bf16_act ? at::kBFloat16 : at::kFloat;
  // Each entry's rows as 2·K2 consecutive activations (the kernel bodies step from row to row by that): x
  // itself where it is so, whatever the stride between entries (one token's heads, as MLA's per-head
  // products take them at decode), else a zero-padded copy.
  at::Tensor xs = batched ? x : x.unsqueeze(0);
  if (!(xs.stride(2) == 1 && (rows == 1 || xs.stride(1) == 2 * p.K2) && xs.scalar_type() == act && K == 2 * p.K2)) {
    at::Tensor padded = at::zeros({B, rows, 2 * p.K2}, x.options().dtype(act));
    padded.narrow(2, 0, K).copy_(xs);
    xs = padded;
  }
  const int64_t blocks = (N + 15) / 16, item = bf16_act ? 2 : 4;
  at::Tensor y = batched ? at::empty({B, rows, N}, x.options().dtype(act)) : at::empty({rows, N}, x.options().dtype(act));
  const int64_t w_stride = blocks * p.block_bytes, s_stride = blocks * p.G * 16;
  const int64_t x_row = 2 * p.K2 * item, x_entry = xs.stride(0) * item;
  const uint8_t* xbase = static_cast<const uint8_t*>(xs.data_ptr());
  uint8_t* out = static_cast<uint8_t*>(y.data_ptr());
  // Enough weight bytes per task that waking a thread pays off.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / p.block_bytes);
#if DSASERVE_X86
  const bool vnni = vnni_applies(p);
  Int8ActsStorage storage;
  Int8Acts acts{};
  if (vnni) {  // every row quantized once, before the weights are swept
    storage = Int8ActsStorage(p, B * rows);
    acts = storage.acts();
    for (int64_t r = 0; r < B * rows; ++r)
      quantize_row(p, reinterpret_cast<const uint16_t*>(xbase + (r / rows) * x_entry + (r % rows) * x_row), acts, r);
  }
  at::parallel_for(0, B * blocks, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {  // runs of blocks within one batch entry
      const int64_t b = i / blocks, first = i % blocks, last = std::min(blocks, first + (i1 - i));
      Problem q = p;
      q.w = p.w + b * w_stride;
      q.scale = p.scale + b * s_stride;
      sweep(q, xbase + b * x_entry, x_row, first, last, out + b * rows * N * item, vnni ? &acts : nullptr, b * rows);
      i += last - first;
    }
  });
#endif
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

#if DSASERVE_X86
// Runs `product(entry, first block, last block)` over every entry's blocks of one weight (the active experts,
// and a shared one), laid end to end and shared out over torch's threads as one range.
template <typename F>
void parallel_over_expert_blocks(int64_t entries, int64_t blocks, int64_t block_bytes, const F& product) {
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / block_bytes);
  at::parallel_for(0, entries * blocks, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {
      const int64_t a = i / blocks, first = i % blocks, last = std::min(blocks, first + (i1 - i));
      product(a, first, last);
      i += last - first;
    }
  });
}
#endif

float round_like(float v, bool bf16) { return bf16 ? static_cast<float>(c10::BFloat16(v)) : v; }

// Where one gated MLP's packed weights are (an expert of a stacked tensor, or a weight of its own).
struct GatedWeights {
  const uint8_t* gate_up_w;
  const float* gate_up_s;
  const uint8_t* down_w;
  const float* down_s;
};

// Weight set e of the stacked gate|up and down packed tensors whose shapes gate_up and down describe.
GatedWeights stacked(const Problem& gate_up, const at::Tensor& gate_up_q, const at::Tensor& gate_up_s,
                     const Problem& down, const at::Tensor& down_q, const at::Tensor& down_s, int64_t e) {
  const int64_t gu_blocks = (gate_up.N + 15) / 16, d_blocks = (down.N + 15) / 16;
  return {static_cast<const uint8_t*>(gate_up_q.data_ptr()) + e * gu_blocks * gate_up.block_bytes,
          gate_up_s.data_ptr<float>() + e * gu_blocks * gate_up.G * 16,
          static_cast<const uint8_t*>(down_q.data_ptr()) + e * d_blocks * down.block_bytes,
          down_s.data_ptr<float>() + e * d_blocks * down.G * 16};
}

// a[r, j] = gate[r, j] * h[r, inter + j] in T (each product rounded to T) for rows r of gate [rows, inter] and
// h [rows, 2 * inter] (its up half), into a [rows, a_row].
template <typename T>
void gate_products(const T* gate, const T* h, T* a, int64_t rows, int64_t inter, int64_t a_row) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < inter; ++j)
      a[r * a_row + j] = static_cast<T>(static_cast<float>(gate[r * inter + j]) *
                                        static_cast<float>(h[r * 2 * inter + inter + j]));
}

// Entry i of xs [A, S, hidden2] (its first rows[i] <= S rows; columns past hidden zero) through the gated MLP
// whose weights are sources[i], all of the shapes gate_up [2 * inter, hidden] and down [hidden, inter] describe:
// y [A, S, hidden] = down(silu(gate) * up). Each product runs over every entry's blocks in one parallel pass.
// Rounding is torch's on the same tensors: each product in x's dtype, the SiLU, then the gating product. With
// swiglu_limit > 0 (GLM-5.3-Flash) gate is clamped to <= limit and up to [-limit, limit] first, in x's dtype.
at::Tensor gated_rows(Problem gate_up, Problem down, const std::vector<GatedWeights>& sources,
                      const std::vector<int64_t>& rows, const at::Tensor& xs, double swiglu_limit = 0.0) {
  const int64_t A = static_cast<int64_t>(sources.size()), inter = gate_up.N / 2, hidden = down.N, S = xs.size(1);
  const bool bf16 = xs.scalar_type() == at::kBFloat16;
  const int64_t item = bf16 ? 2 : 4, inter2 = down.K2 * 2;
  at::Tensor h = at::empty({A, S, 2 * inter}, xs.options());
  at::Tensor a = inter2 > inter ? at::zeros({A, S, inter2}, xs.options()) : at::empty({A, S, inter2}, xs.options());
  at::Tensor y = at::empty({A, S, hidden}, xs.options());
#if DSASERVE_X86
  auto run = [&](Problem base, bool first, const at::Tensor& in, at::Tensor& result) {
    base.out_bf16 = bf16;
    const int64_t blocks = (base.N + 15) / 16;
    const uint8_t* xb = static_cast<const uint8_t*>(in.data_ptr());
    uint8_t* yb = static_cast<uint8_t*>(result.data_ptr());
    const int64_t x_rows = in.size(2) * item, y_rows = base.N * item;
    // A VNNI path: each entry's rows quantized once (slot i * S + r), before the weights are swept.
    const bool vnni = vnni_applies(base);
    Int8ActsStorage storage;
    Int8Acts acts{};
    if (vnni) {
      storage = Int8ActsStorage(base, A * S);
      acts = storage.acts();
      for (int64_t i = 0; i < A; ++i)
        for (int64_t r = 0; r < rows[i]; ++r)
          quantize_row(base, reinterpret_cast<const uint16_t*>(xb + (i * S + r) * x_rows), acts, i * S + r);
    }
    parallel_over_expert_blocks(A, blocks, base.block_bytes, [&](int64_t i, int64_t b0, int64_t b1) {
      Problem p = base;
      p.M = rows[i];
      p.w = first ? sources[i].gate_up_w : sources[i].down_w;
      p.scale = first ? sources[i].gate_up_s : sources[i].down_s;
      sweep(p, xb + i * S * x_rows, x_rows, b0, b1, yb + i * S * y_rows, vnni ? &acts : nullptr, i * S);
    });
  };
  run(gate_up, true, xs, h);
#endif
  // The gating as torch computes it on the loop's [rows, 2 * inter] outputs: torch's SiLU on the same view (its
  // bits), then each product rounded to the dtype as torch's multiplication rounds it, written in place.
  at::Tensor gate;
  if (swiglu_limit > 0) {
    // Per entry, on a clamped copy of its rows, as torch's clamp makes one per expert: its SiLU then runs over
    // those rows as one contiguous range, whose vector and remainder elements are the torch path's.
    gate = at::zeros({A, S, inter}, xs.options());
    for (int64_t i = 0; i < A; ++i)
      if (rows[i] > 0)
        gate[i].narrow(0, 0, rows[i])
            .copy_(at::silu(h[i].narrow(0, 0, rows[i]).narrow(1, 0, inter).clamp_max(swiglu_limit)));
    h.narrow(2, inter, inter).clamp_(-swiglu_limit, swiglu_limit);
  } else {
    gate = at::silu(h.narrow(2, 0, inter)).contiguous();
  }
  if (bf16) gate_products(gate.data_ptr<c10::BFloat16>(), h.data_ptr<c10::BFloat16>(), a.data_ptr<c10::BFloat16>(),
                          A * S, inter, inter2);
  else gate_products(gate.data_ptr<float>(), h.data_ptr<float>(), a.data_ptr<float>(), A * S, inter, inter2);
#if DSASERVE_X86
  run(down, false, a, y);
#endif
  return y;
}

// What gated_rows reads: rows of contiguous x [T, hidden] gathered into xs [entries, S, hidden2], S the most rows
// an entry holds, entry i holding rows tokens[i] in order, padded to hidden2 >= hidden columns with zeros (pairs
// of columns are the kernel's unit). (S, not 16: a decode step's entries hold a row or two each.)
at::Tensor entry_rows(const at::Tensor& x, int64_t hidden2, const std::vector<std::vector<int64_t>>& tokens) {
  const int64_t hidden = x.size(1), item = x.element_size(), entries = static_cast<int64_t>(tokens.size());
  size_t most = 1;
  for (const auto& t : tokens) most = std::max(most, t.size());
  const int64_t S = static_cast<int64_t>(most);
  at::Tensor xs = hidden2 > hidden ? at::zeros({entries, S, hidden2}, x.options())
                                   : at::empty({entries, S, hidden2}, x.options());
  const uint8_t* src = static_cast<const uint8_t*>(x.data_ptr());
  for (int64_t i = 0; i < entries; ++i) {
    uint8_t* dst = static_cast<uint8_t*>(xs.data_ptr()) + i * S * hidden2 * item;
    for (size_t r = 0; r < tokens[i].size(); ++r)
      std::memcpy(dst + r * hidden2 * item, src + tokens[i][r] * hidden * item, hidden * item);
  }
  return xs;
}

std::vector<int64_t> first_tokens(int64_t T) {
  std::vector<int64_t> tokens(T);
  for (int64_t t = 0; t < T; ++t) tokens[t] = t;
  return tokens;
}

// out[t] += sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j] (-1: an expert of
// another rank, skipped), for x [T <= 16, hidden]. gate|up is [E, 2 * inter, hidden] packed, down [E, hidden,
// inter]. With a shared expert's weights (shared_inter > 0), out is first set to that expert's output (its
// blocks swept in the routed experts' passes where its shapes are theirs). Rounding follows the torch path step
// by step in x's dtype (each product, the SiLU, the gating product, the weighted output and every addition into
// out, experts in id order): the same bits as the shared expert and the per-expert calls one by one.
void moe_experts(const at::Tensor& x, const at::Tensor& gate_up_q, const at::Tensor& gate_up_s,
                 const at::Tensor& down_q, const at::Tensor& down_s, const at::Tensor& ids, const at::Tensor& weights,
                 at::Tensor out, int64_t kind, int64_t inter, int64_t gate_up_group, int64_t down_group,
                 int64_t down_col_offset, const std::optional<at::Tensor>& shared_gate_up_q,
                 const std::optional<at::Tensor>& shared_gate_up_s, const std::optional<at::Tensor>& shared_down_q,
                 const std::optional<at::Tensor>& shared_down_s, int64_t shared_inter, int64_t shared_gate_up_group,
                 int64_t shared_down_group, int64_t shared_down_col_offset, double swiglu_limit) {
  check(cpu_has_kernels(), "no body of the packed products runs here (cpu_isa)");
  check(x.dim() == 2 && x.is_contiguous() && x.size(0) <= kMaxRows, "x must be contiguous [T <= 16, hidden]");
  const int64_t T = x.size(0), hidden = x.size(1), E = gate_up_q.size(0), top = ids.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  check(bf16 || x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
  check(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && out.is_contiguous(), "out must be like x");
  check(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.size(0) == T, "ids must be int64 [T, top_k]");
  check(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.sizes() == ids.sizes(),
        "weights must be fp32 like ids");
  check(down_q.size(0) == E && gate_up_s.size(0) == E && down_s.size(0) == E, "one weight per expert");
  const Problem gate_up = problem_of(gate_up_q, gate_up_s, kind, gate_up_group, 0, 2 * inter, hidden, E);
  const Problem down = problem_of(down_q, down_s, kind, down_group, down_col_offset, hidden, inter, E);
  const bool with_shared = shared_inter > 0;
  check(!with_shared || (shared_gate_up_q && shared_gate_up_s && shared_down_q && shared_down_s),
        "a shared expert needs its four tensors");
  // Each expert's (token, choice) pairs, in token order, experts in id order (a stable sort by id).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> pairs(E);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < top; ++j) {
      const int64_t e = id[t * top + j];
      check(e >= -1 && e < E, "expert id out of range");
      if (e >= 0) pairs[e].emplace_back(t, j);
    }
  std::vector<int64_t> active;
  std::vector<GatedWeights> sources;
  std::vector<std::vector<int64_t>> tokens;  // each entry's rows of x
  for (int64_t e = 0; e < E; ++e)
    if (!pairs[e].empty()) {
      active.push_back(e);
      sources.push_back(stacked(gate_up, gate_up_q, gate_up_s, down, down_q, down_s, e));
      tokens.emplace_back();
      for (const auto& [t, j] : pairs[e]) tokens.back().push_back(t);
    }
  const int64_t A = static_cast<int64_t>(active.size()), item = bf16 ? 2 : 4;
  bool shared_in_pass = false;  // the shared expert as one more entry of the routed experts' passes
  at::Tensor shared_y;
  if (with_shared) {
    const Problem sgu = problem_of(*shared_gate_up_q, *shared_gate_up_s, kind, shared_gate_up_group, 0,
                                   2 * shared_inter, hidden);
    const Problem sd = problem_of(*shared_down_q, *shared_down_s, kind, shared_down_group, shared_down_col_offset,
                                  hidden, shared_inter);
    const GatedWeights source = stacked(sgu, *shared_gate_up_q, *shared_gate_up_s, sd, *shared_down_q, *shared_down_s, 0);
    shared_in_pass = shared_inter == inter && shared_gate_up_group == gate_up_group &&
                     shared_down_group == down_group && shared_down_col_offset == down_col_offset;
    if (shared_in_pass) {
      sources.push_back(source);
      tokens.push_back(first_tokens(T));
    } else {  // other shapes: a pass of its own
      shared_y = gated_rows(sgu, sd, {source}, {T}, entry_rows(x, sgu.K2 * 2, {first_tokens(T)}), swiglu_limit)[0]
                     .narrow(0, 0, T);
    }
  }
  if (sources.empty()) {
    if (with_shared) out.copy_(shared_y);
    return;
  }
  std::vector<int64_t> rows;
  for (const auto& t : tokens) rows.push_back(static_cast<int64_t>(t.size()));
  const at::Tensor y = gated_rows(gate_up, down, sources, rows, entry_rows(x, gate_up.K2 * 2, tokens), swiglu_limit);
  if (with_shared && shared_in_pass)  // the shared expert's first T rows of y [A + 1, S, hidden]
    std::memcpy(out.data_ptr(), static_cast<const uint8_t*>(y.data_ptr()) + A * y.size(1) * hidden * item,
                T * hidden * item);
  else if (with_shared) out.copy_(shared_y);
  const float* w = weights.data_ptr<float>();
  auto value = [bf16](const void* base, int64_t index) {
    return bf16 ? static_cast<float>(static_cast<const c10::BFloat16*>(base)[index])
                : static_cast<const float*>(base)[index];
  };
  void* o = out.data_ptr();
  for (int64_t i = 0; i < A; ++i) {
    const uint8_t* ye = static_cast<const uint8_t*>(y.data_ptr()) + i * y.size(1) * hidden * item;
    for (size_t r = 0; r < pairs[active[i]].size(); ++r) {
      const auto [t, j] = pairs[active[i]][r];
      const float weight = w[t * top + j];
      for (int64_t k = 0; k < hidden; ++k) {
        const float sum = value(o, t * hidden + k) + round_like(value(ye, r * hidden + k) * weight, bf16);
        if (bf16) static_cast<c10::BFloat16*>(o)[t * hidden + k] = c10::BFloat16(sum);
        else static_cast<float*>(o)[t * hidden + k] = sum;
      }
    }
  }
}

// A gated MLP (the dense layers' MLP, a MoE layer's shared experts) for x [T <= 16, hidden] in one call:
// down(silu(gate) * up) with gate|up [2 * inter, hidden] and down [hidden, inter] packed, the same bits as
// its products called one by one with torch's SiLU and product between them.
at::Tensor gated_mlp(const at::Tensor& x, const at::Tensor& gate_up_q, const at::Tensor& gate_up_s,
                     const at::Tensor& down_q, const at::Tensor& down_s, int64_t kind, int64_t inter,
                     int64_t gate_up_group, int64_t down_group, int64_t down_col_offset, double swiglu_limit) {
  check(cpu_has_kernels(), "no body of the packed products runs here (cpu_isa)");
  check(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows, "x must be [1 <= T <= 16, hidden]");
  check(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
  const int64_t T = x.size(0), hidden = x.size(1);
  const Problem gate_up = problem_of(gate_up_q, gate_up_s, kind, gate_up_group, 0, 2 * inter, hidden);
  const Problem down = problem_of(down_q, down_s, kind, down_group, down_col_offset, hidden, inter);
  const at::Tensor y = gated_rows(gate_up, down, {stacked(gate_up, gate_up_q, gate_up_s, down, down_q, down_s, 0)}, {T},
                                 entry_rows(x.contiguous(), gate_up.K2 * 2, {first_tokens(T)}), swiglu_limit);
  return y[0].narrow(0, 0, T);
}

// The weight transposed, [K, N] in `dtype` (fp32 or bf16): what the torch GEMM multiplies many rows by.
at::Tensor dequantize_t(const at::Tensor& qweight, const at::Tensor& scale, int64_t kind, int64_t group,
                        int64_t col_offset, int64_t N, int64_t K, at::ScalarType dtype) {
  const Problem p = problem_of(qweight, scale, kind, group, col_offset, N, K);
  check(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize to fp32 or bf16");
#if DSASERVE_X86
  if (dsaserve::use_avx2()) {
    at::Tensor out = at::empty({K, N}, scale.options().dtype(at::kFloat));
    at::parallel_for(0, (N + 15) / 16, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; b += 16) avx2_dequantize_blocks(p, b, std::min(b1, b + 16), out.data_ptr<float>());
    });
    return dtype == at::kFloat ? out : out.to(dtype);
  }
  if (dsaserve::use_avx512_bf16()) {
    at::Tensor out = at::empty({K, N}, scale.options().dtype(dtype));
    const int64_t blocks = (N + 15) / 16;
    at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; b += 16) {  // 256 rows at a time: 512-byte runs per column
        if (dtype == at::kFloat) dequantize_blocks<float>(p, b, std::min(b1, b + 16), out.data_ptr<float>());
        else dequantize_blocks<uint16_t>(p, b, std::min(b1, b + 16), static_cast<uint16_t*>(out.data_ptr()));
      }
    });
    return out;
  }
#endif
  at::Tensor out = at::empty({K, N}, scale.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k) o[k * N + n] = weight_at(p, n, k) * scale_at(p, n, scale_column(p, k));
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

std::string cpu_kernels() { return dsaserve::isa_name(dsaserve::chosen_isa()); }  // (cpu_isa.cpp's operator)

// How int4 weights meet bf16 activations here: "avx512_vnni", "avx512_int8" or "avx2_int8" (activations quantized to
// int8 per row and group, integer dot products: vpdpbusd in the AVX-512 BF16 family, and in the avx512 family where
// the CPU has VNNI; else vpmaddubsw), the family's name (exact in the activations: "avx512_bf16", "avx2",
// "avx512"), or "none". (Scale groups of whole chunks of 8 columns.)
std::string int4_bf16_path() {
#if DSASERVE_X86
  if (int4_vnni_enabled()) return "avx512_vnni";
  if (dsaserve::use_avx2() && g_extensions_allowed.load(std::memory_order_relaxed))
    return dsaserve::use_avx512f_vnni() ? "avx512_int8" : "avx2_int8";
#endif
  return cpu_kernels();
}

// How fp8 weights meet bf16 activations here: "avx512_vbmi" (decoded by table lookups), "avx512_bf16" (by
// shifts and masks), or "none".
std::string fp8_bf16_path() {
#if DSASERVE_X86
  if (fp8_table_enabled()) return "avx512_vbmi";
#endif
  return cpu_kernels();
}

// The same for int8 weights (one scale per row; activations quantized per row and 128 columns).
std::string int8_bf16_path() {
#if DSASERVE_X86
  if (int8_vnni_enabled()) return "avx512_vnni";
#endif
  return cpu_kernels();
}

}  // namespace

#if DSASERVE_X86
bool dsaserve::packed::isa_extensions_allowed() { return g_extensions_allowed.load(std::memory_order_relaxed); }
#endif

// For decode_plan.cpp (layer_pieces.h).
void dsaserve::moe_experts(const at::Tensor& x, const at::Tensor& gate_up_q, const at::Tensor& gate_up_s,
                           const at::Tensor& down_q, const at::Tensor& down_s, const at::Tensor& ids,
                           const at::Tensor& weights, at::Tensor out, int64_t kind, int64_t inter,
                           int64_t gate_up_group, int64_t down_group, int64_t down_col_offset,
                           const std::optional<at::Tensor>& shared_gate_up_q,
                           const std::optional<at::Tensor>& shared_gate_up_s,
                           const std::optional<at::Tensor>& shared_down_q,
                           const std::optional<at::Tensor>& shared_down_s, int64_t shared_inter,
                           int64_t shared_gate_up_group, int64_t shared_down_group, int64_t shared_down_col_offset) {
  ::moe_experts(x, gate_up_q, gate_up_s, down_q, down_s, ids, weights, out, kind, inter, gate_up_group, down_group,
                down_col_offset, shared_gate_up_q, shared_gate_up_s, shared_down_q, shared_down_s, shared_inter,
                shared_gate_up_group, shared_down_group, shared_down_col_offset, 0.0);
}
at::Tensor dsaserve::gated_mlp(const at::Tensor& x, const at::Tensor& gate_up_q, const at::Tensor& gate_up_s,
                               const at::Tensor& down_q, const at::Tensor& down_s, int64_t kind, int64_t inter,
                               int64_t gate_up_group, int64_t down_group, int64_t down_col_offset) {
  return ::gated_mlp(x, gate_up_q, gate_up_s, down_q, down_s, kind, inter, gate_up_group, down_group,
                     down_col_offset, 0.0);
}

at::Tensor dsaserve::packed_product(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                    int64_t kind, int64_t group, int64_t col_offset, int64_t N, int64_t K) {
  return quant_linear(x, qweight, scale, kind, group, col_offset, N, K);
}

// Meta kernels: the operators' output shapes without computing (meta tensors, tracing).
at::Tensor quant_linear_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                             int64_t N, int64_t) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return at::empty(shape, x.options());
}
at::Tensor dequantize_t_meta(const at::Tensor&, const at::Tensor& scale, int64_t, int64_t, int64_t, int64_t N,
                             int64_t K, at::ScalarType dtype) {
  return at::empty({K, N}, scale.options().dtype(dtype));
}
void moe_experts_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, at::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t,
                      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t, int64_t, int64_t,
                      int64_t, double) {}
at::Tensor gated_mlp_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, double) {
  return at::empty_like(x);  // down maps the intermediate back to hidden
}

TORCH_LIBRARY(dsaserve, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scale, int kind, int group, int col_offset, int N, int K) "
        "-> Tensor");
  m.def("dequantize_t(Tensor qweight, Tensor scale, int kind, int group, int col_offset, int N, int K, "
        "ScalarType dtype) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor gate_up_q, Tensor gate_up_s, Tensor down_q, Tensor down_s, Tensor ids, "
        "Tensor weights, Tensor(a!) out, int kind, int inter, int gate_up_group, int down_group, int down_col_offset, "
        "Tensor? shared_gate_up_q=None, Tensor? shared_gate_up_s=None, Tensor? shared_down_q=None, "
        "Tensor? shared_down_s=None, int shared_inter=0, int shared_gate_up_group=0, int shared_down_group=0, "
        "int shared_down_col_offset=0, float swiglu_limit=0.) -> ()");
  m.def("gated_mlp(Tensor x, Tensor gate_up_q, Tensor gate_up_s, Tensor down_q, Tensor down_s, int kind, int inter, "
        "int gate_up_group, int down_group, int down_col_offset, float swiglu_limit=0.) -> Tensor");
  m.def("int4_bf16_path() -> str", &int4_bf16_path);
  m.def("int8_bf16_path() -> str", &int8_bf16_path);
  m.def("fp8_bf16_path() -> str", &fp8_bf16_path);
  m.def("set_isa_extensions(bool allowed) -> ()", &set_isa_extensions);
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("dequantize_t", &dequantize_t);
  m.impl("moe_experts", &moe_experts);
  m.impl("gated_mlp", &gated_mlp);
}

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) {
  m.impl("quant_linear", &quant_linear_meta);
  m.impl("dequantize_t", &dequantize_t_meta);
  m.impl("moe_experts", &moe_experts_meta);
  m.impl("gated_mlp", &gated_mlp_meta);
}
