/* Attention of each query over its own selected latent rows, read in place from the cache.
 *
 * out[i, h, :V] = softmax_k(scale * q[i, h] . rows[slot[i, k]]) @ rows[slot[i, k], :V]
 *
 * bf16 inputs and outputs, fp32 accumulation. A slot of -1 is an empty selection entry. Rows are
 * taken BLOCK at a time: scored, folded into an online softmax (running maximum and sum per head,
 * accumulator rescaled when the maximum grows) and multiplied into the values while they are still
 * in cache, so each selected row is read from memory once and never copied. Queries are shared out
 * over torch's intra-op threads (at::parallel_for), each pulling work from one counter. With fewer
 * queries than threads (batch-1 decode), each query's rows are split into parts, one work item
 * each; a part's running maximum, sum and accumulator are kept, and the parts are merged
 * (each rescaled to the largest maximum) before the output is written.
 *
 * The products use AVX-512 BF16 (vdpbf16ps, 32 multiply-adds per instruction): the score pass holds
 * 16 heads in one register (pairs of q columns against a broadcast pair of row columns), the value
 * pass holds 32 value columns of two rows interleaved against a broadcast pair of probabilities.
 * With AMX tiles (amx_tiles.h; the mode amx.py chose), a block is AMX_BLOCK rows gathered into one buffer
 * (a tile reads rows at a fixed stride), scored as rows × heads tiles against the query's column pairs, and
 * multiplied into the values as heads × columns tiles against the rows interleaved in pairs; the online
 * softmax, the parts and their merge are the AVX-512 body's own. Value widths not in 64s keep that body.
 * The body is compiled for AVX-512 BF16 alone (a target pragma) and runs only where the CPU has it;
 * without it, or for other shapes (see selected_rows_fits), the caller keeps its torch path.
 * Registered as torch.ops.dsaserve.attend_selected_rows.
 */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "amx_tiles.h"
#include "cpu_features.h"
#include "layer_pieces.h"

#if DSASERVE_X86
#include <immintrin.h>
#endif

namespace {

#define BLOCK 64     /* rows per online-softmax step (64 latent rows of 576 bf16: 72 KiB, in L2) */
#define MAX_DIM 4096 /* bound on the row width, for the zero row standing in for empty entries */
#define AMX_BLOCK 128 /* rows per online-softmax step with tiles: 128 gathered rows of 576 bf16, 144 KiB */

typedef struct {
    const uint16_t *q;     /* [n, heads, dim] */
    const uint16_t *rows;  /* [*, rows_stride] */
    const int64_t *slots;  /* [n, width], -1 = empty */
    uint16_t *out;         /* out[i * out_q_stride + h * out_h_stride + d], d < value_dim */
    int64_t n, heads, dim, width, value_dim, q_stride, rows_stride, out_q_stride, out_h_stride;
    float scale;
    int64_t parts;      /* work items per query: its rows split in `parts` ranges of part_rows */
    int64_t part_rows;  /* a multiple of 16 */
    float *partial;     /* parts > 1: per item, [heads * value_dim] accumulator, [heads] maximum, [heads] sum */
    int64_t next;       /* next work item to take, shared by the workers */
} Job;

/* A worker's 64-byte-aligned scratch buffers, freed however the worker ends. */
template <int N>
struct AlignedBuffers {
    void *ptr[N] = {};
    AlignedBuffers() = default;
    AlignedBuffers(const AlignedBuffers &) = delete;
    AlignedBuffers &operator=(const AlignedBuffers &) = delete;
    ~AlignedBuffers() {
        for (void *p : ptr) free(p);
    }
    void *&operator[](int k) { return ptr[k]; }
};

#if DSASERVE_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma")
alignas(64) const uint16_t zero_row[MAX_DIM] = {};

const uint16_t *row_of(const Job *job, int64_t i, int64_t k) {
    int64_t slot = job->slots[i * job->width + k];
    return slot < 0 ? NULL : job->rows + slot * job->rows_stride;
}

/* e^x for x <= 0 (x = -inf gives 0): 2^n by scalef, e^f on |f| <= ln2/2 by a degree-6 polynomial. */
inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), f);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

typedef struct {
    __m512i *q_pairs;  /* [groups][dim / 2]: lane h holds (q[h][2p], q[h][2p+1]) */
    float *acc;        /* [heads][value_dim], columns in unpack order (see finish_bf16) */
    float *maximum;    /* [heads] running maximum */
    float *total;      /* [heads] running sum */
    float *scores;     /* [BLOCK][16] */
    uint32_t *pairs;   /* [BLOCK / 2][16]: lane h holds (p[h][2r], p[h][2r+1]) as bf16 */
    float *rescale;    /* [16] */
} Scratch;

void score_block(const __m512i *q_pairs, const uint16_t *const *rows, int64_t count, int64_t pairs,
                        float scale, float *scores) {
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t r0 = 0; r0 < count; r0 += 8) {
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
        const int32_t *a0 = (const int32_t *)rows[r0], *a1 = (const int32_t *)rows[r0 + 1];
        const int32_t *a2 = (const int32_t *)rows[r0 + 2], *a3 = (const int32_t *)rows[r0 + 3];
        const int32_t *a4 = (const int32_t *)rows[r0 + 4], *a5 = (const int32_t *)rows[r0 + 5];
        const int32_t *a6 = (const int32_t *)rows[r0 + 6], *a7 = (const int32_t *)rows[r0 + 7];
        for (int64_t p = 0; p < pairs; p++) {
            __m512bh qv = (__m512bh)_mm512_load_si512(q_pairs + p);
            s0 = _mm512_dpbf16_ps(s0, qv, (__m512bh)_mm512_set1_epi32(a0[p]));
            s1 = _mm512_dpbf16_ps(s1, qv, (__m512bh)_mm512_set1_epi32(a1[p]));
            s2 = _mm512_dpbf16_ps(s2, qv, (__m512bh)_mm512_set1_epi32(a2[p]));
            s3 = _mm512_dpbf16_ps(s3, qv, (__m512bh)_mm512_set1_epi32(a3[p]));
            s4 = _mm512_dpbf16_ps(s4, qv, (__m512bh)_mm512_set1_epi32(a4[p]));
            s5 = _mm512_dpbf16_ps(s5, qv, (__m512bh)_mm512_set1_epi32(a5[p]));
            s6 = _mm512_dpbf16_ps(s6, qv, (__m512bh)_mm512_set1_epi32(a6[p]));
            s7 = _mm512_dpbf16_ps(s7, qv, (__m512bh)_mm512_set1_epi32(a7[p]));
        }
        _mm512_store_ps(scores + (r0 + 0) * 16, _mm512_mul_ps(s0, scale_v));
        _mm512_store_ps(scores + (r0 + 1) * 16, _mm512_mul_ps(s1, scale_v));
        _mm512_store_ps(scores + (r0 + 2) * 16, _mm512_mul_ps(s2, scale_v));
        _mm512_store_ps(scores + (r0 + 3) * 16, _mm512_mul_ps(s3, scale_v));
        _mm512_store_ps(scores + (r0 + 4) * 16, _mm512_mul_ps(s4, scale_v));
        _mm512_store_ps(scores + (r0 + 5) * 16, _mm512_mul_ps(s5, scale_v));
        _mm512_store_ps(scores + (r0 + 6) * 16, _mm512_mul_ps(s6, scale_v));
        _mm512_store_ps(scores + (r0 + 7) * 16, _mm512_mul_ps(s7, scale_v));
    }
}

/* Online softmax step for 16 heads: turns the block's scores into bf16 probability pairs relative
 * to the new running maximum, and returns in `rescale` what the accumulator must be multiplied by. */
void softmax_block(float *scores, const int *valid, int64_t count, float *maximum, float *total,
                          uint32_t *pairs, float *rescale) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    __m512 block_max = neg_inf;
    for (int64_t r = 0; r < count; r++) {
        if (!valid[r]) _mm512_store_ps(scores + r * 16, neg_inf);
        block_max = _mm512_max_ps(block_max, _mm512_load_ps(scores + r * 16));
    }
    __m512 old_max = _mm512_loadu_ps(maximum);
    __m512 new_max = _mm512_max_ps(old_max, block_max);
    /* No valid score yet: shift by 0 so that exp(-inf - shift) stays 0 rather than NaN. */
    __m512 shift = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(new_max, neg_inf, _CMP_EQ_OQ), new_max,
                                        _mm512_setzero_ps());
    __m512 alpha = exp_nonpositive(_mm512_sub_ps(old_max, shift));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t r = 0; r < count; r += 2) {
        __m512 p0 = exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(scores + r * 16), shift));
        __m512 p1 = exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(scores + (r + 1) * 16), shift));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p0));
        __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p1)), 16);
        _mm512_store_si512((__m512i *)(pairs + (r / 2) * 16), _mm512_or_si512(lo, hi));
    }
    _mm512_storeu_ps(total, _mm512_fmadd_ps(_mm512_loadu_ps(total), alpha, sum));
    _mm512_storeu_ps(maximum, new_max);
    _mm512_store_ps(rescale, alpha);
}

/* acc[h] = acc[h] * rescale[h] + Σ_r p[h][r] · rows[r][:V] for 8 heads, 32 value columns at a time. */
void value_block(const uint16_t *const *rows, int64_t count, const uint32_t *pairs, int64_t head0,
                        const float *rescale, float *acc, int64_t value_dim) {
    for (int64_t d0 = 0; d0 < value_dim; d0 += 32) {
        __m512 a[8][2];
        for (int k = 0; k < 8; k++) {
            __m512 r = _mm512_set1_ps(rescale[head0 % 16 + k]);
            a[k][0] = _mm512_mul_ps(_mm512_load_ps(acc + (head0 + k) * value_dim + d0), r);
            a[k][1] = _mm512_mul_ps(_mm512_load_ps(acc + (head0 + k) * value_dim + d0 + 16), r);
        }
        for (int64_t r = 0; r < count; r += 2) {
            __m512i x = _mm512_loadu_si512(rows[r] + d0), y = _mm512_loadu_si512(rows[r + 1] + d0);
            __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
            const uint32_t *p = pairs + (r / 2) * 16 + head0 % 16;
            for (int k = 0; k < 8; k++) {
                __m512bh pk = (__m512bh)_mm512_set1_epi32((int32_t)p[k]);
                a[k][0] = _mm512_dpbf16_ps(a[k][0], lo, pk);
                a[k][1] = _mm512_dpbf16_ps(a[k][1], hi, pk);
            }
        }
        for (int k = 0; k < 8; k++) {
            _mm512_store_ps(acc + (head0 + k) * value_dim + d0, a[k][0]);
            _mm512_store_ps(acc + (head0 + k) * value_dim + d0 + 16, a[k][1]);
        }
    }
}

/* Accumulator columns come in unpack order: within 32 columns, register 0 lane 4L+k is column
 * 8L+k and register 1 lane 4L+k is column 8L+4+k (L = 128-bit lane, k < 4). */
void finish_bf16(const Job *job, int64_t i, const Scratch *s) {
    __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const int64_t V = job->value_dim;
    for (int64_t h = 0; h < job->heads; h++) {
        __m512 inv = _mm512_set1_ps(s->total[h] > 0.f ? 1.f / s->total[h] : 0.f);
        uint16_t *o = job->out + i * job->out_q_stride + h * job->out_h_stride;
        for (int64_t d0 = 0; d0 < V; d0 += 32) {
            __m512 r0 = _mm512_load_ps(s->acc + h * V + d0), r1 = _mm512_load_ps(s->acc + h * V + d0 + 16);
            __m512 lo = _mm512_mul_ps(_mm512_permutex2var_ps(r0, first, r1), inv);
            __m512 hi = _mm512_mul_ps(_mm512_permutex2var_ps(r0, second, r1), inv);
            _mm256_storeu_si256((__m256i *)(o + d0), (__m256i)_mm512_cvtneps_pbh(lo));
            _mm256_storeu_si256((__m256i *)(o + d0 + 16), (__m256i)_mm512_cvtneps_pbh(hi));
        }
    }
}

/* Query i over its selected rows [k_begin, k_end): running maximum, sum and accumulator in s. */
void attend_range(const Job *job, int64_t i, int64_t k_begin, int64_t k_end, Scratch *s) {
    const int64_t H = job->heads, D = job->dim, K = k_end, V = job->value_dim, pairs = D / 2;
    const uint16_t *q = job->q + i * job->q_stride;
    for (int64_t h = 0; h < H; h++)
        for (int64_t p = 0; p < pairs; p++)
            ((uint32_t *)s->q_pairs)[((h / 16) * pairs + p) * 16 + h % 16] = ((const uint32_t *)(q + h * D))[p];
    for (int64_t h = 0; h < H; h++) {
        s->maximum[h] = -INFINITY;
        s->total[h] = 0.f;
    }
    memset(s->acc, 0, H * V * sizeof(float));
    const uint16_t *rows[BLOCK];
    int valid[BLOCK];
    for (int64_t k0 = k_begin; k0 < K; k0 += BLOCK) {
        int64_t count = K - k0 < BLOCK ? K - k0 : BLOCK;
        for (int64_t r = 0; r < count; r++) {
            rows[r] = row_of(job, i, k0 + r);
            valid[r] = rows[r] != NULL;
            if (!valid[r]) rows[r] = zero_row;
        }
        int64_t padded = (count + 7) & ~(int64_t)7; /* scores go 8 rows at a time */
        for (int64_t r = count; r < padded; r++) {
            rows[r] = zero_row;
            valid[r] = 0;
        }
        for (int64_t r = 0; r < count && k0 + BLOCK + r < K; r++) { /* the next block's rows, ahead */
            const char *next = (const char *)(row_of(job, i, k0 + BLOCK + r));
            if (next)
                for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(next + b, _MM_HINT_T1);
        }
        for (int64_t g = 0; g < H / 16; g++) {
            score_block(s->q_pairs + g * pairs, rows, padded, pairs, job->scale, s->scores);
            softmax_block(s->scores, valid, padded, s->maximum + g * 16, s->total + g * 16, s->pairs, s->rescale);
            value_block(rows, padded, s->pairs, g * 16, s->rescale, s->acc, V);
            value_block(rows, padded, s->pairs, g * 16 + 8, s->rescale, s->acc, V);
        }
    }
}

int64_t partial_floats(const Job *job) { return job->heads * (job->value_dim + 2); }

/* Work item `item`: a whole query written out, or one part of a query kept in job->partial. `attend(i, begin,
 * end)` leaves query i's running maximum, sum and accumulator over those rows in s. */
template <class Attend>
void attend_item(const Job *job, int64_t item, Scratch *s, Attend attend) {
    const int64_t i = item / job->parts, part = item % job->parts;
    const int64_t k_begin = part * job->part_rows;
    const int64_t k_end = job->parts == 1 ? job->width : std::min(job->width, k_begin + job->part_rows);
    attend(i, k_begin, k_end);
    if (job->parts == 1) {
        finish_bf16(job, i, s);
        return;
    }
    const int64_t H = job->heads, HV = H * job->value_dim;
    float *dst = job->partial + item * partial_floats(job);
    memcpy(dst, s->acc, HV * sizeof(float));
    memcpy(dst + HV, s->maximum, H * sizeof(float));
    memcpy(dst + HV + H, s->total, H * sizeof(float));
}

/* Query i's parts merged into part 0's slot (each part's sum and accumulator times e^(its maximum - the
 * largest)), then written out. A part without a valid row (maximum -inf) adds nothing. */
void merge_parts(const Job *job, int64_t i) {
    const int64_t H = job->heads, V = job->value_dim, HV = H * V, stride = partial_floats(job);
    float *first = job->partial + i * job->parts * stride;
    for (int64_t h = 0; h < H; h++) {
        float largest = -INFINITY;
        for (int64_t j = 0; j < job->parts; j++) largest = std::max(largest, first[j * stride + HV + h]);
        float total = 0.f;
        float *acc = first + h * V;
        for (int64_t j = 0; j < job->parts; j++) {
            const float *part = first + j * stride;
            const float m = part[HV + h];
            const float alpha = m == -INFINITY ? 0.f : std::exp(m - largest);
            total += part[HV + H + h] * alpha;
            if (j == 0)
                for (int64_t d = 0; d < V; d++) acc[d] *= alpha;
            else
                for (int64_t d = 0; d < V; d++) acc[d] += part[h * V + d] * alpha;
        }
        first[HV + H + h] = total;
    }
    Scratch merged = {};
    merged.acc = first;
    merged.total = first + HV + H;
    finish_bf16(job, i, &merged);
}

bool worker(Job *job) {
    Scratch s;
    AlignedBuffers<7> mem;
    int ok = !posix_memalign(&mem[0], 64, (job->heads / 16) * (job->dim / 2) * 64) &&
             !posix_memalign(&mem[1], 64, job->heads * job->value_dim * sizeof(float)) &&
             !posix_memalign(&mem[2], 64, job->heads * sizeof(float)) &&
             !posix_memalign(&mem[3], 64, job->heads * sizeof(float)) &&
             !posix_memalign(&mem[4], 64, BLOCK * 16 * sizeof(float)) &&
             !posix_memalign(&mem[5], 64, BLOCK / 2 * 16 * sizeof(uint32_t)) &&
             !posix_memalign(&mem[6], 64, 16 * sizeof(float));
    if (ok) {
        s.q_pairs = static_cast<__m512i *>(mem[0]), s.acc = static_cast<float *>(mem[1]);
        s.maximum = static_cast<float *>(mem[2]), s.total = static_cast<float *>(mem[3]);
        s.scores = static_cast<float *>(mem[4]), s.pairs = static_cast<uint32_t *>(mem[5]);
        s.rescale = static_cast<float *>(mem[6]);
        const int64_t items = job->n * job->parts;
        for (int64_t item; (item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < items;)
            attend_item(job, item, &s, [&](int64_t i, int64_t a, int64_t b) { attend_range(job, i, a, b, &s); });
    }
    return ok;
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma,amx-tile,amx-bf16,amx-int8")

/* The tile body's buffers, beyond the running maximum, sum and accumulator in `s` (Scratch's, so that the
 * parts' merge and finish_bf16 read them as they do the AVX-512 body's). */
typedef struct {
    Scratch s;
    int64_t padded_dim;  /* dim in 32s: the columns of a row's tiles */
    uint16_t *rows;      /* [AMX_BLOCK][padded_dim]: the block's rows, zero past dim and for empty entries */
    uint16_t *values;    /* [AMX_BLOCK / 2][2 * value_dim]: row pairs' value columns interleaved, unpack order */
    uint32_t *q_pairs;   /* [heads / 16][padded_dim / 2][16]: lane h holds (q[h][2p], q[h][2p+1]) */
    float *scores;       /* [heads / 16][AMX_BLOCK][16] */
    uint32_t *p_tiles;   /* [AMX_BLOCK / 32][16][16]: row h holds (p[h][2j], p[h][2j+1]) for 16 pairs of rows */
} TileScratch;

/* dst[c][r] = src[r][c] for 16 × 16 32-bit values: interleaves of 32 and 64 bits within 128-bit lanes, then
 * two rounds of lane shuffles. */
void transpose_16x16(const uint32_t *src, uint32_t *dst) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(src + 16 * i);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + c], lane L: column 4L + c of rows i .. i + 3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i x = _mm512_shuffle_i32x4(r[c], r[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i y = _mm512_shuffle_i32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
        const __m512i z = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i w = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
        _mm512_store_si512(dst + 16 * c, _mm512_shuffle_i32x4(x, z, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_store_si512(dst + 16 * (8 + c), _mm512_shuffle_i32x4(x, z, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm512_store_si512(dst + 16 * (4 + c), _mm512_shuffle_i32x4(y, w, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_store_si512(dst + 16 * (12 + c), _mm512_shuffle_i32x4(y, w, _MM_SHUFFLE(3, 1, 3, 1)));
    }
}

/* The block's rows, gathered, and their value columns interleaved in pairs as value_block interleaves them. */
void gather_block(const Job *job, int64_t i, int64_t k0, int64_t count, int64_t padded, TileScratch *t,
                  int *valid) {
    const int64_t D = job->dim, DP = t->padded_dim, V = job->value_dim;
    for (int64_t r = 0; r < padded; r++) {
        const uint16_t *src = r < count ? row_of(job, i, k0 + r) : NULL;
        valid[r] = src != NULL;
        memcpy(t->rows + r * DP, src ? src : zero_row, D * sizeof(uint16_t));
    }
    for (int64_t j = 0; j < padded / 2; j++) {
        const uint16_t *x = t->rows + 2 * j * DP, *y = x + DP;
        uint16_t *dst = t->values + j * 2 * V;
        for (int64_t d0 = 0; d0 < V; d0 += 32) {
            __m512i a = _mm512_loadu_si512(x + d0), b = _mm512_loadu_si512(y + d0);
            _mm512_storeu_si512(dst + 2 * d0, _mm512_unpacklo_epi16(a, b));
            _mm512_storeu_si512(dst + 2 * d0 + 32, _mm512_unpackhi_epi16(a, b));
        }
    }
}

/* scores[g][r][h] = scale · rows[r] · q[16g + h] for 64 rows at a time: accumulators 0-3 are 4 tiles of 16 rows
 * × 16 heads, tile 4 the heads' column pairs, tiles 5-7 the rows' columns in turn. */
template <class Tiles>
void score_tiles(const Job *job, int64_t padded, TileScratch *t) {
    const int64_t DP = t->padded_dim, steps = DP / 32, stride = DP * 2;
    for (int64_t g = 0; g < job->heads / 16; g++) {
        float *scores = t->scores + g * AMX_BLOCK * 16;
        for (int64_t r0 = 0; r0 < padded; r0 += 64) {
            Tiles::template zero<0>();
            Tiles::template zero<1>();
            Tiles::template zero<2>();
            Tiles::template zero<3>();
            const uint16_t *rows = t->rows + r0 * DP;
            for (int64_t step = 0; step < steps; step++) {
                Tiles::template load<4>(t->q_pairs + (g * DP / 2 + step * 16) * 16, 64);
                Tiles::template load<5>(rows + step * 32, stride);
                Tiles::template dot_bf16<0, 5, 4>();
                Tiles::template load<6>(rows + 16 * DP + step * 32, stride);
                Tiles::template dot_bf16<1, 6, 4>();
                Tiles::template load<7>(rows + 32 * DP + step * 32, stride);
                Tiles::template dot_bf16<2, 7, 4>();
                Tiles::template load<5>(rows + 48 * DP + step * 32, stride);
                Tiles::template dot_bf16<3, 5, 4>();
            }
            Tiles::template store<0>(scores + r0 * 16, 64);
            Tiles::template store<1>(scores + (r0 + 16) * 16, 64);
            Tiles::template store<2>(scores + (r0 + 32) * 16, 64);
            Tiles::template store<3>(scores + (r0 + 48) * 16, 64);
        }
        const __m512 scale = _mm512_set1_ps(job->scale);
        for (int64_t r = 0; r < padded; r++)
            _mm512_store_ps(scores + r * 16, _mm512_mul_ps(_mm512_load_ps(scores + r * 16), scale));
    }
}

/* acc[16g + h] = acc[16g + h] · rescale[h] + Σ_r p[h][r] · rows[r][:V]: accumulators 0-3 are 4 tiles of 16 heads
 * × 16 value columns (loaded from and stored back to acc), tile 4 the probabilities of 32 rows, tiles 5-7 the
 * rows' interleaved value columns in turn. */
template <class Tiles>
void value_tiles(const Job *job, int64_t g, int64_t padded, TileScratch *t) {
    const int64_t V = job->value_dim, stride = V * 4;
    float *acc = t->s.acc + g * 16 * V;
    bool rescaled = false;
    for (int h = 0; h < 16; h++) rescaled |= t->s.rescale[h] != 1.f;
    if (rescaled)
        for (int64_t h = 0; h < 16; h++) {
            const __m512 r = _mm512_set1_ps(t->s.rescale[h]);
            for (int64_t d = 0; d < V; d += 16)
                _mm512_store_ps(acc + h * V + d, _mm512_mul_ps(_mm512_load_ps(acc + h * V + d), r));
        }
    for (int64_t c0 = 0; c0 < V / 16; c0 += 4) { /* tiles of 16 columns, in unpack order (see finish_bf16) */
        Tiles::template load<0>(acc + c0 * 16, stride);
        Tiles::template load<1>(acc + (c0 + 1) * 16, stride);
        Tiles::template load<2>(acc + (c0 + 2) * 16, stride);
        Tiles::template load<3>(acc + (c0 + 3) * 16, stride);
        for (int64_t k = 0; k < padded / 32; k++) {
            const uint16_t *values = t->values + k * 16 * 2 * V + c0 * 32;
            Tiles::template load<4>(t->p_tiles + k * 256, 64);
            Tiles::template load<5>(values, stride);
            Tiles::template dot_bf16<0, 4, 5>();
            Tiles::template load<6>(values + 32, stride);
            Tiles::template dot_bf16<1, 4, 6>();
            Tiles::template load<7>(values + 64, stride);
            Tiles::template dot_bf16<2, 4, 7>();
            Tiles::template load<5>(values + 96, stride);
            Tiles::template dot_bf16<3, 4, 5>();
        }
        Tiles::template store<0>(acc + c0 * 16, stride);
        Tiles::template store<1>(acc + (c0 + 1) * 16, stride);
        Tiles::template store<2>(acc + (c0 + 2) * 16, stride);
        Tiles::template store<3>(acc + (c0 + 3) * 16, stride);
    }
}

/* attend_range with tiles: query i over its selected rows [k_begin, k_end), AMX_BLOCK rows a step. */
template <class Tiles>
void attend_range_tiles(const Job *job, int64_t i, int64_t k_begin, int64_t k_end, TileScratch *t) {
    const int64_t H = job->heads, D = job->dim, DP = t->padded_dim, V = job->value_dim;
    const uint16_t *q = job->q + i * job->q_stride;
    for (int64_t h = 0; h < H; h++)
        for (int64_t p = 0; p < D / 2; p++)
            t->q_pairs[((h / 16) * (DP / 2) + p) * 16 + h % 16] = ((const uint32_t *)(q + h * D))[p];
    for (int64_t h = 0; h < H; h++) {
        t->s.maximum[h] = -INFINITY;
        t->s.total[h] = 0.f;
    }
    memset(t->s.acc, 0, H * V * sizeof(float));
    int valid[AMX_BLOCK];
    for (int64_t k0 = k_begin; k0 < k_end; k0 += AMX_BLOCK) {
        const int64_t count = std::min<int64_t>(k_end - k0, AMX_BLOCK), padded = (count + 63) & ~(int64_t)63;
        gather_block(job, i, k0, count, padded, t, valid);
        for (int64_t r = 0; r < count && k0 + AMX_BLOCK + r < k_end; r++) { /* the next block's rows, ahead */
            const char *next = (const char *)row_of(job, i, k0 + AMX_BLOCK + r);
            if (next)
                for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(next + b, _MM_HINT_T1);
        }
        score_tiles<Tiles>(job, padded, t);
        for (int64_t g = 0; g < H / 16; g++) {
            softmax_block(t->scores + g * AMX_BLOCK * 16, valid, padded, t->s.maximum + g * 16, t->s.total + g * 16,
                          t->s.pairs, t->s.rescale);
            for (int64_t k = 0; k < padded / 32; k++) /* probabilities as heads × row pairs */
                transpose_16x16(t->s.pairs + k * 256, t->p_tiles + k * 256);
            value_tiles<Tiles>(job, g, padded, t);
        }
    }
}

template <class Tiles>
bool worker_tiles(Job *job) {
    TileScratch t = {};
    t.padded_dim = (job->dim + 31) / 32 * 32;
    const int64_t H = job->heads, V = job->value_dim;
    const size_t sizes[9] = {(size_t)H * V * 4, (size_t)H * 4, (size_t)H * 4, (size_t)AMX_BLOCK / 2 * 16 * 4, 64,
                             (size_t)AMX_BLOCK * t.padded_dim * 2, (size_t)AMX_BLOCK * V * 2,
                             (size_t)(H / 16) * (t.padded_dim / 2) * 64, (size_t)(H / 16) * AMX_BLOCK * 16 * 4};
    AlignedBuffers<10> mem;
    bool ok = true;
    for (int k = 0; k < 9; k++) ok = ok && !posix_memalign(&mem[k], 64, sizes[k]);
    ok = ok && !posix_memalign(&mem[9], 64, AMX_BLOCK / 32 * 256 * 4);
    if (ok) {
        t.s.acc = (float *)mem[0], t.s.maximum = (float *)mem[1], t.s.total = (float *)mem[2];
        t.s.pairs = (uint32_t *)mem[3], t.s.rescale = (float *)mem[4];
        t.rows = (uint16_t *)mem[5], t.values = (uint16_t *)mem[6], t.q_pairs = (uint32_t *)mem[7];
        t.scores = (float *)mem[8], t.p_tiles = (uint32_t *)mem[9];
        if (t.padded_dim != job->dim) { /* the columns past dim: zero once, never written after */
            memset(t.rows, 0, sizes[5]);
            memset(t.q_pairs, 0, sizes[7]);
        }
        const dsaserve::TileSession<Tiles> session;
        const int64_t items = job->n * job->parts;
        for (int64_t item; (item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < items;)
            attend_item(job, item, &t.s, [&](int64_t i, int64_t a, int64_t b) { attend_range_tiles<Tiles>(job, i, a, b, &t); });
    }
    return ok;
}
#pragma GCC pop_options
#endif

/* Shapes the kernel takes: whole groups of 16 heads, value columns in 32s, row pairs (the AVX2 body's: groups of 8
 * heads, value columns in 8s). */
bool fits(int64_t heads, int64_t dim, int64_t value_dim) {
    if (dsaserve::use_avx2()) return dsaserve::selected_rows_avx2_fits(heads, dim, value_dim);
    return dsaserve::use_avx512_bf16() && heads % 16 == 0 && value_dim % 32 == 0 && value_dim <= dim &&
           dim % 2 == 0 && dim <= MAX_DIM;
}

// out[i, h, :V] = softmax(scale · q[i, h] · rows[slots[i]]ᵀ) · rows[slots[i], :V]; V = out.size(2). bf16; the AVX2
// body also fp32.
void attend_selected_rows(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& slots, double scale,
                          at::Tensor& out) {
    const auto dtype = q.scalar_type();
    const bool fp32 = dsaserve::use_avx2() && dtype == at::kFloat;
    TORCH_CHECK(q.dim() == 3 && (dtype == at::kBFloat16 || fp32) && q.is_contiguous(),
                "attend_selected_rows: q must be contiguous bf16 (or fp32 on the AVX2 body) [n, heads, dim]");
    const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), value_dim = out.size(2);
    TORCH_CHECK(fits(heads, dim, value_dim), "attend_selected_rows: this shape or CPU is not the kernel's");
    TORCH_CHECK(rows.dim() == 2 && rows.size(1) == dim && rows.scalar_type() == dtype && rows.is_contiguous(),
                "attend_selected_rows: rows must be contiguous [N, dim] of q's dtype");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 2 && slots.size(0) == n,
                "attend_selected_rows: slots must be contiguous int64 [n, width]");
    TORCH_CHECK(out.scalar_type() == dtype && out.size(0) == n && out.size(1) == heads && out.stride(2) == 1,
                "attend_selected_rows: out must be [n, heads, V] of q's dtype with unit column stride");
    if (dsaserve::use_avx2()) {
        dsaserve::attend_selected_rows_avx2(q, rows, slots, scale, out);
        return;
    }
#if DSASERVE_X86
    const int64_t width = slots.size(1), threads = at::get_num_threads();
    // Fewer queries than threads: each query's rows in equal parts (of 16 rows at least), one per thread.
    const int64_t wanted = n >= threads ? 1 : std::min<int64_t>((threads + n - 1) / n, (width + 15) / 16);
    const int64_t part_rows = std::max<int64_t>(1, ((width + wanted - 1) / wanted + 15) / 16) * 16;
    const int64_t parts = std::max<int64_t>(1, (width + part_rows - 1) / part_rows);
    at::Tensor partial;
    if (parts > 1) partial = at::empty({n * parts * heads * (value_dim + 2)}, at::kFloat);
    Job job = {static_cast<const uint16_t *>(q.data_ptr()), static_cast<const uint16_t *>(rows.data_ptr()),
               slots.data_ptr<int64_t>(), static_cast<uint16_t *>(out.data_ptr()), n, heads, dim, width,
               value_dim, heads * dim, dim, out.stride(0), out.stride(1), static_cast<float>(scale), parts,
               part_rows, parts > 1 ? partial.data_ptr<float>() : nullptr, 0};
    std::atomic<bool> failed{false};
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, n * parts));
    const auto form = dsaserve::tile_form(value_dim % 64 == 0);
    at::parallel_for(0, workers, 1, [&](int64_t a, int64_t b) {
        for (int64_t w = a; w < b; ++w)
            if (!dsaserve::by_form(form, [&](auto tiles) { return worker_tiles<decltype(tiles)>(&job); },
                                   [&] { return worker(&job); }))
                failed = true;
    });
    TORCH_CHECK(!failed, "attend_selected_rows: could not allocate scratch memory");
    if (parts > 1)
        for (int64_t i = 0; i < n; ++i) merge_parts(&job, i);
#endif
}

}  // namespace

// For decode_plan.cpp (layer_pieces.h).
void dsaserve::attend_selected_rows(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& slots,
                                    double scale, at::Tensor& out) {
    ::attend_selected_rows(q, rows, slots, scale, out);
}
bool dsaserve::selected_rows_fits(int64_t heads, int64_t dim, int64_t value_dim) { return fits(heads, dim, value_dim); }

namespace {
// Meta kernel: it writes only into `out`, so nothing to shape (meta tensors, tracing).
void attend_selected_rows_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, at::Tensor&) {}
}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
    m.def("selected_rows_fits(int heads, int dim, int value_dim) -> bool", &fits);
    m.def("attend_selected_rows(Tensor q, Tensor rows, Tensor slots, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) { m.impl("attend_selected_rows", &attend_selected_rows); }

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) { m.impl("attend_selected_rows", &attend_selected_rows_meta); }
