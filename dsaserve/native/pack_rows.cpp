// The loader's conversions of a chunk of checkpoint rows into a weight's packed layout (quantization/formats.py),
// what torch computed in several whole-chunk passes (fp32 copies, a zero-filled padded copy, a permute) that kept a
// 2-core load at a third of the disk's speed:
//   pack_rows:          rows in their stored form (bf16, FP8 bytes, int8, int4 values) and their scales, written into
//                       their place in the packed bytes and scales (formats.pack, bit for bit);
//   quantize_rows:      rows of a checkpoint (FP8 bytes with their block-scale grid, bf16 or fp32) to int8 (a scale
//                       per row) or int4 (a scale per 128 columns): formats.quantize_int8/int4 of the rows as fp32,
//                       bit for bit (the same fp32 products, the same division and round-half-to-even), with one
//                       row of fp32 scratch per thread instead of the chunk's.
// One portable body, compiled for the AVX-512 family, AVX2
// and neither (cpu_features.h). Row blocks are shared out over torch's threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_features.h"

namespace {

enum Kind : int64_t { kBf16 = 0, kFp8 = 1, kInt8 = 2, kInt4 = 3 };  // formats.KINDS
constexpr int64_t kInt4Group = 128;                                  // formats.INT4_GROUP

// The bytes' values times `factor` (one tile's scale), as fp8 → fp32 → × factor in torch. Decoded from the bits in
// lane-wise integer and float operations the compiler vectorises: a normal byte's exponent and mantissa moved into
// fp32's places and rebiased (by adding 120 to the exponent), a subnormal one (exponent 0) as its mantissa × 2^-9
// (a normal fp32, so no slow subnormal arithmetic), 0x7F as NaN (e4m3fn has no infinities), then the sign.
__attribute__((always_inline)) inline void decode_fp8(const uint8_t* in, float factor, float* out, int64_t count) {
    for (int64_t c = 0; c < count; ++c) {  // (selections by masks: a branch would keep it from vectorising)
        const uint32_t byte = in[c], magnitude = byte & 0x7Fu;
        const float subnormal = static_cast<float>(magnitude) * 0x1p-9f;
        uint32_t subnormal_bits;
        std::memcpy(&subnormal_bits, &subnormal, 4);
        const uint32_t is_subnormal = 0u - static_cast<uint32_t>(magnitude < 8);
        const uint32_t is_nan = 0u - static_cast<uint32_t>(magnitude == 0x7F);
        uint32_t bits = (subnormal_bits & is_subnormal) | (((magnitude << 20) + (120u << 23)) & ~is_subnormal);
        bits = ((bits & ~is_nan) | (0x7FC00000u & is_nan)) | ((byte & 0x80u) << 24);
        float value;
        std::memcpy(&value, &bits, 4);
        out[c] = value * factor;
    }
}

// Round half to even, as torch's round_: exact for |x| < 2^22 (the quotients here are at most 127 in size).
__attribute__((always_inline)) inline float round_even(float x) {
    constexpr float shifter = 0x1.8p23f;
    return (x + shifter) - shifter;
}

// q[c] = clamp(round(v[c] / scale), lo, hi) with scale = max(amax(v), 1e-12) / top; returns scale.
__attribute__((always_inline)) inline float quantize_span(const float* v, int64_t count, float top, float lo, float hi,
                                                          int8_t* q) {
    // The largest |v| as the largest of their bit patterns (sign cleared): an integer maximum, which vectorises
    // where a float one (not associative for NaN) does not; the same value for finite v.
    uint32_t amax_bits = 0;
    for (int64_t c = 0; c < count; ++c) {
        uint32_t bits;
        std::memcpy(&bits, v + c, 4);
        amax_bits = std::max(amax_bits, bits & 0x7FFFFFFFu);
    }
    float amax;
    std::memcpy(&amax, &amax_bits, 4);
    const float scale = std::max(amax, 1e-12f) / top;
    for (int64_t c = 0; c < count; ++c) q[c] = static_cast<int8_t>(std::clamp(round_even(v[c] / scale), lo, hi));
    return scale;
}

enum Source : int { kFp8Bytes, kBf16Values, kFp32Values };

struct SourceRows {
    const void* data;   // [n, k]
    Source source;
    const float* grid;  // FP8 bytes: their scales [grid_r, grid_c], a tile of tile_r × tile_c each
    int64_t n, k, grid_c, tile_r, tile_c, row0, col0;  // FP8 bytes: the chunk's first row and column in the tensor
};

// Row r of the chunk as fp32 into `row` (k floats).
__attribute__((always_inline)) inline void widen_row(const SourceRows& p, int64_t r, float* row) {
    const int64_t k = p.k;  // (a local: the loops' bounds are then known not to change through `row`)
    if (p.source == kFp32Values) {
        std::memcpy(row, static_cast<const float*>(p.data) + r * k, k * sizeof(float));
    } else if (p.source == kBf16Values) {
        const uint16_t* in = static_cast<const uint16_t*>(p.data) + r * k;
        for (int64_t c = 0; c < k; ++c) {
            const uint32_t bits = static_cast<uint32_t>(in[c]) << 16;
            std::memcpy(row + c, &bits, 4);
        }
    } else {
        const float* tile_scales = p.grid + (p.row0 + r) / p.tile_r * p.grid_c;
        const uint8_t* in = static_cast<const uint8_t*>(p.data) + r * k;
        for (int64_t c = 0; c < k;) {
            const int64_t tile = (p.col0 + c) / p.tile_c, end = std::min(k, (tile + 1) * p.tile_c - p.col0);
            decode_fp8(in + c, tile_scales[tile], row + c, end - c);
            c = end;
        }
    }
}

// Row r of the chunk, widened into `row`, then quantized into q (and its scales).
__attribute__((always_inline)) inline void quantize_row(const SourceRows& p, int64_t r, int64_t kind, float* row,
                                                        int8_t* q, float* scales) {
    widen_row(p, r, row);
    if (kind == kInt8) {
        scales[0] = quantize_span(row, p.k, 127.f, -127.f, 127.f, q);
        return;
    }
    for (int64_t g = 0; g * kInt4Group < p.k; ++g) {
        const int64_t c0 = g * kInt4Group, count = std::min(kInt4Group, p.k - c0);
        scales[g] = quantize_span(row + c0, count, 7.f, -8.f, 7.f, q + c0);
    }
}

using QuantizeBody = void (*)(const SourceRows&, int64_t, int64_t, int64_t, float*, int8_t*, float*, int64_t);
#define DSASERVE_QUANTIZE_BODY(name, attributes)                                                                    \
    attributes void name(const SourceRows& p, int64_t r0, int64_t r1, int64_t kind, float* row, int8_t* q,          \
                         float* scales, int64_t groups) {                                                         \
        for (int64_t r = r0; r < r1; ++r) quantize_row(p, r, kind, row, q + r * p.k, scales + r * groups);       \
    }
#if DSASERVE_X86
DSASERVE_QUANTIZE_BODY(quantize_avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))))
DSASERVE_QUANTIZE_BODY(quantize_avx2, __attribute__((target("avx2,fma"))))
#endif
DSASERVE_QUANTIZE_BODY(quantize_portable, )

QuantizeBody quantize_body() {
#if DSASERVE_X86
    if (dsaserve::use_avx512_bf16()) return quantize_avx512;
    if (dsaserve::use_avx2()) return quantize_avx2;
#endif
    return quantize_portable;
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& source, const c10::optional<at::Tensor>& grid,
                                                 int64_t tile_r, int64_t tile_c, int64_t row0, int64_t col0,
                                                 int64_t kind) {
    TORCH_CHECK(source.dim() == 2 && source.is_contiguous(), "dsaserve quantize_rows: source must be contiguous [n, k]");
    TORCH_CHECK(kind == kInt8 || kind == kInt4, "dsaserve quantize_rows: kind must be int8 (2) or int4 (3)");
    const int64_t n = source.size(0), k = source.size(1);
    SourceRows p{source.data_ptr(), kFp32Values, nullptr, n, k, 1, 1, 1, 0, 0};
    if (grid.has_value()) {
        TORCH_CHECK(source.scalar_type() == at::kByte, "dsaserve quantize_rows: with a grid, source holds FP8 bytes");
        TORCH_CHECK(grid->dim() == 2 && grid->scalar_type() == at::kFloat && grid->is_contiguous(),
                    "dsaserve quantize_rows: grid must be contiguous fp32 [grid_r, grid_c]");
        TORCH_CHECK(tile_r > 0 && tile_c > 0 && row0 >= 0 && col0 >= 0, "dsaserve quantize_rows: bad tiles");
        TORCH_CHECK(n == 0 || k == 0 ||
                        ((row0 + n - 1) / tile_r < grid->size(0) && (col0 + k - 1) / tile_c < grid->size(1)),
                    "dsaserve quantize_rows: the scale grid does not cover the weight's rows and columns");
        p = {source.data_ptr(), kFp8Bytes, grid->data_ptr<float>(), n, k, grid->size(1), tile_r, tile_c, row0, col0};
    } else {
        TORCH_CHECK(source.scalar_type() == at::kBFloat16 || source.scalar_type() == at::kFloat,
                    "dsaserve quantize_rows: without a grid, source must be bf16 or fp32");
        p.source = source.scalar_type() == at::kBFloat16 ? kBf16Values : kFp32Values;
    }
    const int64_t groups = kind == kInt8 ? 1 : (k + kInt4Group - 1) / kInt4Group;
    at::Tensor q = at::empty({n, k}, source.options().dtype(at::kChar));
    at::Tensor scales = at::empty({n, groups}, source.options().dtype(at::kFloat));
    const QuantizeBody body = quantize_body();
    at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
        std::vector<float> row(std::max<int64_t>(k, 1));
        body(p, r0, r1, kind, row.data(), q.data_ptr<int8_t>(), scales.data_ptr<float>(), groups);
    });
    return {q, scales};
}

// Block b of the packed layout: entry ((b · K2 + c2) · 16 + r) holds row 16b + r's column pair c2 (as one unit of
// `Unit`'s size: two bytes, two bf16, or one byte of two int4 nibbles). Rows past n and the column past k hold zeros
// (int4: the value 0 stored as 8).
template <typename Unit, typename Value>
void pack_block(const Value* q, int64_t n, int64_t k, int64_t b, Unit* out) {
    const int64_t k2 = (k + 1) / 2;
    const Value* rows[16];
    for (int64_t r = 0; r < 16; ++r) rows[r] = 16 * b + r < n ? q + (16 * b + r) * k : nullptr;
    Unit* dst = out + b * k2 * 16;
    for (int64_t c2 = 0; c2 < k2; ++c2) {
        const bool whole = 2 * c2 + 1 < k;
        for (int64_t r = 0; r < 16; ++r) {
            Value pair[2] = {Value{}, Value{}};
            if (rows[r]) {
                pair[0] = rows[r][2 * c2];
                if (whole) pair[1] = rows[r][2 * c2 + 1];
            }
            Unit unit;
            if constexpr (sizeof(Unit) == 1) {  // int4: two nibbles, value + 8
                unit = static_cast<Unit>((pair[0] + 8) | ((pair[1] + 8) << 4));
            } else {
                std::memcpy(&unit, pair, sizeof(Unit));
            }
            dst[c2 * 16 + r] = unit;
        }
    }
}

void pack_rows(const at::Tensor& q, const at::Tensor& scale, int64_t kind, at::Tensor qweight, at::Tensor scales) {
    TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && scale.dim() == 2 && scale.is_contiguous() &&
                    scale.scalar_type() == at::kFloat && scale.size(0) == q.size(0),
                "dsaserve pack_rows: q must be contiguous [n, k] and scale contiguous fp32 [n, G]");
    const int64_t n = q.size(0), k = q.size(1), blocks = (n + 15) / 16, k2 = (k + 1) / 2, groups = scale.size(1);
    const int64_t unit_bytes = kind == kBf16 ? 4 : kind == kInt4 ? 1 : 2;
    const int64_t value_bytes = kind == kBf16 ? 2 : 1;
    TORCH_CHECK(kind >= kBf16 && kind <= kInt4 && q.element_size() == value_bytes,
                "dsaserve pack_rows: q's element size does not fit kind ", kind);
    TORCH_CHECK(qweight.is_contiguous() && qweight.dim() == 3 && qweight.size(0) == blocks && qweight.size(1) == k2 &&
                    qweight.size(2) * qweight.element_size() == 16 * unit_bytes,
                "dsaserve pack_rows: qweight must be the contiguous packed blocks [", blocks, ", ", k2, ", ...] of ",
                "the rows");
    TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.dim() == 3 &&
                    scales.size(0) == blocks && scales.size(1) == groups && scales.size(2) == 16,
                "dsaserve pack_rows: scales must be contiguous fp32 [", blocks, ", ", groups, ", 16]");
    const float* s = scale.data_ptr<float>();
    float* s_out = scales.data_ptr<float>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
            if (kind == kBf16)
                pack_block(static_cast<const uint16_t*>(q.data_ptr()), n, k, b,
                           static_cast<uint32_t*>(qweight.data_ptr()));
            else if (kind == kInt4)
                pack_block(static_cast<const int8_t*>(q.data_ptr()), n, k, b,
                           static_cast<uint8_t*>(qweight.data_ptr()));
            else
                pack_block(static_cast<const uint8_t*>(q.data_ptr()), n, k, b,
                           static_cast<uint16_t*>(qweight.data_ptr()));
            for (int64_t g = 0; g < groups; ++g)
                for (int64_t r = 0; r < 16; ++r)
                    s_out[(b * groups + g) * 16 + r] = 16 * b + r < n ? s[(16 * b + r) * groups + g] : 0.f;
        }
    });
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_meta(const at::Tensor& weight, const c10::optional<at::Tensor>&,
                                                      int64_t, int64_t, int64_t, int64_t, int64_t kind) {
    const int64_t groups = kind == kInt8 ? 1 : (weight.size(1) + kInt4Group - 1) / kInt4Group;
    return {at::empty(weight.sizes(), weight.options().dtype(at::kChar)),
            at::empty({weight.size(0), groups}, weight.options().dtype(at::kFloat))};
}

void pack_rows_meta(const at::Tensor&, const at::Tensor&, int64_t, at::Tensor, at::Tensor) {}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
    m.def("pack_rows(Tensor q, Tensor scale, int kind, Tensor(a!) qweight, Tensor(b!) scales) -> ()");
    m.def("quantize_rows(Tensor source, Tensor? grid, int tile_r, int tile_c, int row0, int col0, int kind) -> "
          "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) {
    m.impl("pack_rows", &pack_rows);
    m.impl("quantize_rows", &quantize_rows);
}

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) {
    m.impl("pack_rows", &pack_rows_meta);
    m.impl("quantize_rows", &quantize_rows_meta);
}
