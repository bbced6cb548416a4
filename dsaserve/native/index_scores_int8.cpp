/* Lightning-indexer scores against int8 keys, with int8 dot products (AVX-512 VNNI):
 *
 * out[i, s] = ks[s] · Σ_h weights[i, h] · qs[i, h] · relu(Σ_d qi[i, h, d] · ki[s, d])
 *
 * Keys come as a paged cache of int8 values with one fp16 scale per token (ks: amax / 127; the cache's `int8`
 * kind), kept in this kernel's layout: `cache[block][g][p][lane]` holds key 16g + lane's dims 4p .. 4p+3 as four
 * unsigned bytes (the value + 128), so one vpdpbusd multiplies a broadcast of four of one head's query bytes into
 * 16 keys' running sums, 64 multiply-adds per instruction against vdpbf16ps's 32. The queries are rounded here,
 * per call, per query and head, to int8 (qs = amax / 127, nearest even); the +128 of the keys adds 128 · Σ_d qi to
 * every sum, which the sum starts without. Integer sums are exact; the scales factor out of the relu (both are
 * positive), the key's after the head sum. Work items are 64 keys × 4 heads at a time, shared out over torch's
 * threads, as in index_scores.cpp.
 *
 * With AMX tiles (amx_tiles.h; the mode amx.py chose), tdpbsud takes 16 heads × 64 keys × 64 columns per
 * product, the query tile read from the rounded queries and the key tiles in place (16 keys × column quads is a
 * tile's layout); same bits. Heads not in 16s or dims not in 64s keep the VNNI body.
 *
 * The AVX2 body (the avx2 and avx512 families) makes the same integer sums without vpdpbusd: each key byte back to
 * its signed value (xor 128, so the sum starts at 0), and vpmaddubsw on |key| and the query byte carrying the key's
 * sign (products of 128 · 127 at most: an int16 pair never saturates), widened to int32 by vpmaddwd; the heads are
 * summed in the same order, so the scores are the VNNI body's bits.
 *
 * Queries come in bf16, or fp32 (an fp32 model's indexer on the AVX2 body), rounded from their own values.
 * Registered as torch.ops.dsaserve.index_scores_int8_blocks (and write_int8_keys, portable C++, which rounds keys
 * and stores them in the layout); the scoring bodies run only where the CPU and the chosen family have them (the
 * caller checks index_scores_int8_fits).
 */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "cpu_features.h"
#include "layer_pieces.h"

#if DSASERVE_X86
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kKeysPerItem = 64;  // 4 registers of 16 keys

struct Job {
    const int8_t* q;          // [n, heads, dim], rounded
    const int32_t* offset;    // [n, heads]: -128 · Σ_d q
    const float* weight;      // [n, heads]: weights · the query's scale
    const uint32_t* cache;    // groups of 16 keys, [dim / 4][16] each
    const c10::Half* scales;  // [num_blocks, block_size]
    const int64_t* blocks;    // the listed blocks, in order
    int64_t groups_per_block, groups;
    const uint32_t* zero;     // one group standing in past the last block
    float* out;               // [n, out_stride], columns < keys written
    int64_t n, heads, dim, keys, out_stride;
    int64_t next;             // next work item, shared by the workers
};

const uint32_t* group_of(const Job* job, int64_t j) {
    if (j >= job->groups) return job->zero;
    const int64_t per = job->groups_per_block;
    return job->cache + (job->blocks[j / per] * per + j % per) * (job->dim / 4 * 16);
}

#if DSASERVE_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")
// The scales of the item's 4 groups of 16 keys (zero past the last block).
void key_scales_of(const Job* job, int64_t item, __m512* key_scale) {
    const int64_t per = job->groups_per_block;
    for (int g = 0; g < 4; g++) {
        const int64_t j = item * 4 + g;
        key_scale[g] = j < job->groups ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                             job->scales + job->blocks[j / per] * per * 16 + (j % per) * 16)))
                                       : _mm512_setzero_ps();
    }
}

// Query i's head sums for the item's 64 keys, times the keys' scales, into out (columns < keys).
void store_scores(const Job* job, int64_t i, int64_t k0, const __m512* score, const __m512* key_scale) {
    float* o = job->out + i * job->out_stride + k0;
    for (int g = 0; g < 4; g++) {
        const int64_t left = job->keys - (k0 + 16 * g);
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
        _mm512_mask_storeu_ps(o + 16 * g, mask, _mm512_mul_ps(score[g], key_scale[g]));
    }
}

void score_item(const Job* job, int64_t item) {
    const int64_t quads = job->dim / 4, k0 = item * kKeysPerItem;
    const __m512i* groups[4];
    __m512 key_scale[4];
    for (int g = 0; g < 4; g++) groups[g] = reinterpret_cast<const __m512i*>(group_of(job, item * 4 + g));
    key_scales_of(job, item, key_scale);
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < job->n; i++) {
        __m512 score[4] = {zero, zero, zero, zero};
        for (int64_t h0 = 0; h0 < job->heads; h0 += 4) {
            const int32_t* q = reinterpret_cast<const int32_t*>(job->q + (i * job->heads + h0) * job->dim);
            __m512i a[4][4];
            for (int j = 0; j < 4; j++) {
                const __m512i start = _mm512_set1_epi32(job->offset[i * job->heads + h0 + j]);
                a[j][0] = a[j][1] = a[j][2] = a[j][3] = start;
            }
            for (int64_t p = 0; p < quads; p++) {
                __m512i k[4];
                for (int g = 0; g < 4; g++) k[g] = _mm512_load_si512(groups[g] + p);
                for (int j = 0; j < 4; j++) {
                    const __m512i b = _mm512_set1_epi32(q[j * quads + p]);
                    for (int g = 0; g < 4; g++) a[j][g] = _mm512_dpbusd_epi32(a[j][g], k[g], b);
                }
            }
            for (int j = 0; j < 4; j++) {
                const __m512 w = _mm512_set1_ps(job->weight[i * job->heads + h0 + j]);
                for (int g = 0; g < 4; g++)
                    score[g] = _mm512_fmadd_ps(_mm512_max_ps(_mm512_cvtepi32_ps(a[j][g]), zero), w, score[g]);
            }
        }
        store_scores(job, i, k0, score, key_scale);
    }
}

// One row of `dim` bf16 query values (dim % 16 == 0) to int8 per round_queries below, 16 at a time: the same
// division and the same rounding (nearest even), so the same bytes.
float round_row(const c10::BFloat16* x, int64_t dim, int8_t* out, int32_t* sum) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + d))), 16));
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const float top = _mm512_reduce_max_ps(amax);
    const float scale = top > 0.f ? top / 127.f : 1.f;
    const __m512 scale_v = _mm512_set1_ps(scale), low = _mm512_set1_ps(-127.f), high = _mm512_set1_ps(127.f);
    __m512i total = _mm512_setzero_si512();
    for (int64_t d = 0; d < dim; d += 16) {
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + d))), 16));
        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, scale_v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(high, _mm512_max_ps(low, r)));
        total = _mm512_add_epi32(total, c);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d), _mm512_cvtepi32_epi8(c));
    }
    *sum = _mm512_reduce_add_epi32(total);
    return scale;
}

void worker(Job* job) {
    const int64_t items = (job->keys + kKeysPerItem - 1) / kKeysPerItem;
    for (int64_t item; (item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < items;) score_item(job, item);
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// The item's scores on the AVX2 body: a head at a time, its 4 query bytes of a column quad broadcast against the
// quad of 64 keys (8 registers of 8 keys).
void score_item_avx2(const Job* job, int64_t item) {
    const int64_t quads = job->dim / 4, k0 = item * kKeysPerItem, per = job->groups_per_block;
    const __m256i* groups[4];
    alignas(32) float key_scale[kKeysPerItem];
    for (int g = 0; g < 4; g++) {
        const int64_t j = item * 4 + g;
        groups[g] = reinterpret_cast<const __m256i*>(group_of(job, j));
        for (int half = 0; half < 2; half++)
            _mm256_store_ps(key_scale + 16 * g + 8 * half, j < job->groups ? _mm256_cvtph_ps(_mm_loadu_si128(
                reinterpret_cast<const __m128i*>(job->scales + job->blocks[j / per] * per * 16 + (j % per) * 16 +
                                                 8 * half))) : _mm256_setzero_ps());
    }
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t i = 0; i < job->n; i++) {
        __m256 score[8];
        for (int r = 0; r < 8; r++) score[r] = zero;
        for (int64_t h = 0; h < job->heads; h++) {
            const int32_t* q = reinterpret_cast<const int32_t*>(job->q + (i * job->heads + h) * job->dim);
            __m256i acc[8];
            for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_si256();
            for (int64_t p = 0; p < quads; p++) {
                const __m256i b = _mm256_set1_epi32(q[p]);
                for (int r = 0; r < 8; r++) {
                    const __m256i k = _mm256_xor_si256(_mm256_load_si256(groups[r / 2] + 2 * p + r % 2), bias);
                    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(k), _mm256_sign_epi8(b, k));
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
                }
            }
            const __m256 w = _mm256_set1_ps(job->weight[i * job->heads + h]);
            for (int r = 0; r < 8; r++)
                score[r] = _mm256_fmadd_ps(_mm256_max_ps(_mm256_cvtepi32_ps(acc[r]), zero), w, score[r]);
        }
        float* o = job->out + i * job->out_stride + k0;
        for (int r = 0; r < 8 && k0 + 8 * r < job->keys; r++) {
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, _mm256_mul_ps(score[r], _mm256_load_ps(key_scale + 8 * r)));
            std::copy(lanes, lanes + std::min<int64_t>(8, job->keys - k0 - 8 * r), o + 8 * r);
        }
    }
}

void worker_avx2(Job* job) {
    const int64_t items = (job->keys + kKeysPerItem - 1) / kKeysPerItem;
    for (int64_t item; (item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < items;)
        score_item_avx2(job, item);
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,amx-tile,amx-int8,amx-bf16")
/* The item's scores with tiles: accumulators 0-3 hold 16 heads × the 4 groups of 16 keys as int32 sums, tile 4
 * the query's 16 heads × 64 rounded columns, tiles 5-7 the key groups' 16 column quads in turn (the cache's
 * layout is a tile's). The sums' start, -128 · Σ q, is added after; integer sums are exact and the heads are
 * summed in the same order, so the scores are score_item's bits. */
template <class Tiles>
void score_item_tiles(const Job* job, int64_t item, int32_t* products /* [4][16 heads][16 keys] */) {
    const int64_t steps = job->dim / 64, k0 = item * kKeysPerItem, H = job->heads;
    const uint8_t* groups[4];
    __m512 key_scale[4];
    for (int g = 0; g < 4; g++) groups[g] = reinterpret_cast<const uint8_t*>(group_of(job, item * 4 + g));
    key_scales_of(job, item, key_scale);
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < job->n; i++) {
        __m512 score[4] = {zero, zero, zero, zero};
        for (int64_t h0 = 0; h0 < H; h0 += 16) {
            const int8_t* q = job->q + (i * H + h0) * job->dim;
            dsaserve::products_of_four_groups<Tiles, true>(reinterpret_cast<const uint8_t*>(q), job->dim, groups, steps,
                                                           products);
            for (int64_t h = 0; h < 16; h++) {
                const __m512i start = _mm512_set1_epi32(job->offset[i * H + h0 + h]);
                const __m512 w = _mm512_set1_ps(job->weight[i * H + h0 + h]);
                for (int g = 0; g < 4; g++) {
                    const __m512i sum = _mm512_add_epi32(_mm512_load_si512(products + g * 256 + h * 16), start);
                    score[g] = _mm512_fmadd_ps(_mm512_max_ps(_mm512_cvtepi32_ps(sum), zero), w, score[g]);
                }
            }
        }
        store_scores(job, i, k0, score, key_scale);
    }
}

template <class Tiles>
void worker_tiles(Job* job) {
    alignas(64) int32_t products[4 * 256];
    const dsaserve::TileSession<Tiles> session;
    const int64_t items = (job->keys + kKeysPerItem - 1) / kKeysPerItem;
    for (int64_t item; (item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < items;)
        score_item_tiles<Tiles>(job, item, products);
}
#pragma GCC pop_options
#endif

// Shapes the tile body takes: whole tiles of heads (16) and of columns (64 bytes).
bool tiles_fit(int64_t heads, int64_t dim) { return heads % 16 == 0 && dim % 64 == 0; }

bool fits(int64_t heads, int64_t dim) {
    return (dsaserve::use_avx512_vnni() || dsaserve::use_avx2()) && heads % 4 == 0 && dim % 4 == 0;
}

// The queries' int8 form: per query and head, q / (amax / 127) rounded to nearest even; weights times that scale;
// the VNNI sum's start, -128 · Σ_d q (the keys' bytes are their values + 128). q bf16, or fp32 where `f32`.
struct RoundedQueries {
    std::vector<int8_t> q;
    std::vector<int32_t> offset;
    std::vector<float> weight;
};

template <typename T>
float value(const T* x, int64_t d) { return static_cast<float>(x[d]); }

template <typename T>
RoundedQueries round_queries(const T* q, const float* weights, int64_t n, int64_t heads, int64_t dim) {
    RoundedQueries r{std::vector<int8_t>(n * heads * dim), std::vector<int32_t>(n * heads), std::vector<float>(n * heads)};
    for (int64_t row = 0; row < n * heads; ++row) {
        const T* x = q + row * dim;
#if DSASERVE_X86
        if (std::is_same_v<T, c10::BFloat16> && dim % 16 == 0 && dsaserve::use_avx512_vnni()) {
            int32_t sum = 0;
            const float scale = round_row(reinterpret_cast<const c10::BFloat16*>(x), dim, r.q.data() + row * dim, &sum);
            r.offset[row] = -128 * sum;
            r.weight[row] = weights[row] * scale;
            continue;
        }
#endif
        float amax = 0.f;
        for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(value(x, d)));
        const float scale = amax > 0.f ? amax / 127.f : 1.f;
        int32_t sum = 0;
        for (int64_t d = 0; d < dim; ++d) {
            const float v = std::nearbyint(value(x, d) / scale);
            const int32_t c = static_cast<int32_t>(std::min(127.f, std::max(-127.f, v)));
            r.q[row * dim + d] = static_cast<int8_t>(c);
            sum += c;
        }
        r.offset[row] = -128 * sum;
        r.weight[row] = weights[row] * scale;
    }
    return r;
}

void run(Job& job) {
#if DSASERVE_X86
    const int64_t items = (job.keys + kKeysPerItem - 1) / kKeysPerItem;
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
    if (!dsaserve::use_avx512_vnni()) {  // the AVX2 body (fits() checked one of the two)
        at::parallel_for(0, workers, 1, [&](int64_t a, int64_t b) {
            for (int64_t w = a; w < b; ++w) worker_avx2(&job);
        });
        return;
    }
    const auto form = dsaserve::tile_form(tiles_fit(job.heads, job.dim));
    at::parallel_for(0, workers, 1, [&](int64_t a, int64_t b) {
        for (int64_t w = a; w < b; ++w)
            dsaserve::by_form(form, [&](auto tiles) { worker_tiles<decltype(tiles)>(&job); }, [&] { worker(&job); });
    });
#endif
}

// Scores of n queries (bf16, or fp32 where `f32`) against the first `keys` keys of `count` listed blocks (ids checked
// by the caller).
void score(const void* q, bool f32, const float* weights, int64_t n, int64_t heads, int64_t dim,
           const at::Tensor& cache, const at::Tensor& scales, const int64_t* blocks, int64_t count, int64_t keys,
           float* out, int64_t out_stride) {
    const RoundedQueries r = f32 ? round_queries(static_cast<const float*>(q), weights, n, heads, dim)
                                 : round_queries(static_cast<const c10::BFloat16*>(q), weights, n, heads, dim);
    // One group of zero keys (bytes 128), 64-byte aligned as the kernel loads it; never scored into an output.
    thread_local std::vector<uint32_t> zero;
    if (static_cast<int64_t>(zero.size()) < dim / 4 * 16 + 16) zero.assign(dim / 4 * 16 + 16, 0x80808080u);
    const uintptr_t address = (reinterpret_cast<uintptr_t>(zero.data()) + 63) & ~uintptr_t(63);
    const auto* aligned = reinterpret_cast<const uint32_t*>(address);
    Job job{r.q.data(), r.offset.data(), r.weight.data(), static_cast<const uint32_t*>(cache.data_ptr()),
            scales.data_ptr<c10::Half>(), blocks, cache.size(1), count * cache.size(1), aligned, out, n, heads, dim,
            keys, out_stride, 0};
    run(job);
}

void check_cache(const at::Tensor& cache, const at::Tensor& scales, int64_t dim, const char* op) {
    TORCH_CHECK(cache.scalar_type() == at::kInt && cache.is_contiguous() && cache.dim() == 4 &&
                    cache.size(2) == dim / 4 && cache.size(3) == 16,
                op, ": the cache must be contiguous int32 [num_blocks, block_size / 16, ", dim / 4, ", 16]");
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                    scales.size(0) == cache.size(0) && scales.size(1) == cache.size(1) * 16,
                op, ": scales must be contiguous fp16 [num_blocks, block_size], one per cached key");
}

void index_scores_int8_blocks(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                              const at::Tensor& scales, const at::Tensor& blocks, int64_t keys, at::Tensor& out) {
    const bool f32 = q.scalar_type() == at::kFloat;
    TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == at::kBFloat16 || f32) && q.is_contiguous(),
                "index_scores_int8_blocks: q must be contiguous bf16 or fp32 [t, heads, dim]");
    const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
    TORCH_CHECK(fits(heads, dim), "index_scores_int8_blocks: this shape or CPU is not the kernel's (see "
                "index_scores_int8_fits)");
    TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2 &&
                    weights.size(0) == n && weights.size(1) == heads,
                "index_scores_int8_blocks: weights must be contiguous fp32 [t, heads]");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == n && out.size(1) >= keys &&
                    out.stride(1) == 1, "index_scores_int8_blocks: out must be fp32 [t, >= keys] with unit column stride");
    check_cache(cache, scales, dim, "index_scores_int8_blocks");
    dsaserve::check_block_list(blocks, keys, cache, "index_scores_int8_blocks");
    score(q.data_ptr(), f32, weights.data_ptr<float>(), n, heads, dim, cache, scales,
          blocks.data_ptr<int64_t>(), blocks.numel(), keys, out.data_ptr<float>(), out.stride(0));
}

// keys [n, dim] (bf16 or fp32) into an int8 key cache in this kernel's layout at slots [n], as
// attention/indexer_cache.py quantizes them: per key, scale = max(amax, 1e-8) / 127 in fp32, each value divided by
// it, rounded to nearest even and clamped to ±127, stored as the byte value + 128; the scale stored in fp16.
void write_int8_keys(at::Tensor& cache, at::Tensor& scales, const at::Tensor& slots, const at::Tensor& keys) {
    TORCH_CHECK(keys.dim() == 2 && keys.is_contiguous() && (keys.scalar_type() == at::kBFloat16 ||
                                                             keys.scalar_type() == at::kFloat),
                "write_int8_keys: keys must be contiguous bf16 or fp32 [n, dim]");
    const int64_t n = keys.size(0), dim = keys.size(1);
    check_cache(cache, scales, dim, "write_int8_keys");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() && slots.size(0) == n,
                "write_int8_keys: slots must be int64 [n], one per key");
    const int64_t quads = dim / 4, block_size = cache.size(1) * 16, capacity = cache.size(0) * block_size;
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
        TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "write_int8_keys: slot ", slot[i], " is not in the cache's ",
                    capacity);
    const at::Tensor values = keys.to(at::kFloat);
    const float* v = values.data_ptr<float>();
    auto* bytes = static_cast<uint8_t*>(cache.data_ptr());
    c10::Half* scale_of = scales.data_ptr<c10::Half>();
    at::parallel_for(0, n, 256, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            const float* k = v + i * dim;
            float amax = 0.f;
            for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(k[d]));
            const float scale = std::max(amax, 1e-8f) / 127.f;
            const int64_t token = slot[i] % block_size;
            const int64_t group_index = (slot[i] / block_size) * (block_size / 16) + token / 16;
            uint8_t* group = bytes + group_index * quads * 64 + token % 16 * 4;  // this key's lane: 4 bytes
            for (int64_t d = 0; d < dim; ++d) {
                const float c = std::min(127.f, std::max(-127.f, std::nearbyint(k[d] / scale)));
                group[d / 4 * 64 + d % 4] = static_cast<uint8_t>(static_cast<int32_t>(c) + 128);
            }
            scale_of[slot[i]] = c10::Half(scale);
        }
    });
}

}  // namespace

// For decode_plan.cpp (layer_pieces.h).
void dsaserve::write_int8_keys(at::Tensor& cache, at::Tensor& scales, const at::Tensor& slots, const at::Tensor& keys) {
    ::write_int8_keys(cache, scales, slots, keys);
}

// For decode_selection.cpp (layer_pieces.h): one query's scores against `count` blocks, ids checked by the caller.
void dsaserve::index_scores_int8_of_blocks(const void* q, bool f32, const float* weights, int64_t heads, int64_t dim,
                                           const at::Tensor& cache, const at::Tensor& scales, const int64_t* blocks,
                                           int64_t count, int64_t keys, float* out) {
    score(q, f32, weights, 1, heads, dim, cache, scales, blocks, count, keys, out, keys);
}

bool dsaserve::index_scores_int8_fits(int64_t heads, int64_t dim) { return fits(heads, dim); }

namespace {
// Meta kernels: they write only into their outputs, so nothing to shape (meta tensors, tracing).
void index_scores_int8_blocks_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, int64_t, at::Tensor&) {}
void write_int8_keys_meta(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&) {}
}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
    m.def("index_scores_int8_fits(int heads, int dim) -> bool", &fits);
    m.def("index_scores_int8_blocks(Tensor q, Tensor weights, Tensor cache, Tensor scales, Tensor blocks, int keys, "
          "Tensor(a!) out) -> ()");
    m.def("write_int8_keys(Tensor(a!) cache, Tensor(b!) scales, Tensor slots, Tensor keys) -> ()");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) {
    m.impl("index_scores_int8_blocks", &index_scores_int8_blocks);
    m.impl("write_int8_keys", &write_int8_keys);
}

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) {
    m.impl("index_scores_int8_blocks", &index_scores_int8_blocks_meta);
    m.impl("write_int8_keys", &write_int8_keys_meta);
}
