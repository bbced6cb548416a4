// The selected-rows attention's AVX2 body (AVX2 with FMA: every x86-64 server CPU since 2013), for CPUs without
// AVX-512 BF16 or where cpu_isa='avx2' asks for it. The contract of selected_rows.cpp:
//
//   out[i, h, :V] = softmax_k(scale · q[i, h] · rows[slot[i, k]]) · rows[slot[i, k], :V]
//
// in fp32 or bf16 (q, rows and out of one dtype; fp32 is what dtype auto computes in on such CPUs), fp32 arithmetic.
// A query's valid rows are taken 64 at a time (bf16 rows widened into an fp32 buffer first, once per block; a block
// stays in L2 for both passes): scores for 16 heads in two registers (the query transposed and scaled once, a
// broadcast row element per column, four rows per sweep), an online softmax across heads in registers (a running
// maximum and sum per head, the accumulator rescaled when the maximum grows), then the values accumulated for two
// heads and 32 columns at a time. With fewer queries than threads (batch-1 decode) a query's rows are split into
// parts whose running maximum, sum and accumulator are merged at the end, as in the AVX-512 body.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "heads_dot_avx2.h"

#if DSASERVE_X86
#include <immintrin.h>
#endif

namespace dsaserve {

bool selected_rows_avx2_fits(int64_t heads, int64_t dim, int64_t value_dim) {
    return use_avx2() && heads % 8 == 0 && heads <= 256 && value_dim % 8 == 0 && value_dim <= dim && dim <= 4096;
}

#if DSASERVE_X86
#define AVX2 __attribute__((target("avx2,fma")))

namespace {

constexpr int64_t kBlock = 64;  // rows per online-softmax step (64 rows of 576 fp32: 144 KiB, in L2)

// e^x for x <= 0 (scores minus their running maximum), to fp32's precision: 2^n · e^r, |r| <= ln2 / 2.
AVX2 inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float bf16_to_float(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (no NaN here)
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_to_float(v); }

AVX2 inline void widen_row(const uint16_t* src, float* dst, int64_t dim) {
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d)));
        _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    for (; d < dim; ++d) dst[d] = bf16_to_float(src[d]);
}

template <typename T>
struct Job {
    const T* q;          // [n, heads, dim]
    const T* rows;       // [*, dim]
    const int64_t* slots;  // [n, width], -1 = empty
    T* out;              // out[i * out_q_stride + h * out_h_stride + v]
    int64_t n, heads, dim, width, value_dim, out_q_stride, out_h_stride;
    float scale;
    int64_t parts, part_rows;
    float* partial;  // parts > 1: per item, [heads * value_dim] accumulator, [heads] maximum, [heads] sum
};

// A worker's buffers, sized once for the job.
struct Scratch {
    std::vector<float> q_t, scores, acc, maximum, total, widened;
    std::vector<const float*> block;
    Scratch(int64_t heads, int64_t dim, int64_t value_dim)
        : q_t(heads * dim), scores(kBlock * heads), acc(heads * value_dim), maximum(heads), total(heads),
          widened(kBlock * dim), block(kBlock) {}
};

// scores[r * heads + h] = q_t[:, h] · block[r] for the block's rows (padded to fours with its first row): 8 · G heads
// per pass (G registers), so a broadcast row element feeds G products.
template <int G>
AVX2 void score_heads(const float* q_t, const float* const* block, int64_t count, int64_t heads, int64_t dim,
                      int64_t g, float* scores) {
    for (int64_t r = 0; r < count; r += 4) {
        const float* row[4];
        for (int j = 0; j < 4; ++j) row[j] = block[r + j < count ? r + j : 0];
        __m256 acc[4][G];
        dot_heads<G>(q_t, row, heads, dim, g, acc);
        for (int j = 0; j < 4 && r + j < count; ++j)
            for (int c = 0; c < G; ++c) _mm256_storeu_ps(scores + (r + j) * heads + g + 8 * c, acc[j][c]);
    }
}

AVX2 void score_block(const float* q_t, const float* const* block, int64_t count, int64_t heads, int64_t dim,
                      float* scores) {
    int64_t g = 0;
    for (; g + 16 <= heads; g += 16) score_heads<2>(q_t, block, count, heads, dim, g, scores);
    if (g < heads) score_heads<1>(q_t, block, count, heads, dim, g, scores);
}

// The block's scores into probabilities against each head's new running maximum; the sums and the accumulator
// rescaled where the maximum grew.
AVX2 void softmax_block(float* scores, int64_t count, int64_t heads, int64_t value_dim, Scratch* s) {
    for (int64_t g = 0; g < heads; g += 8) {
        __m256 best = _mm256_loadu_ps(s->maximum.data() + g);
        const __m256 old = best;
        for (int64_t r = 0; r < count; ++r) best = _mm256_max_ps(best, _mm256_loadu_ps(scores + r * heads + g));
        const __m256 alpha = exp_nonpositive(_mm256_sub_ps(old, best));  // the first block: e^-inf·… = 0
        __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(s->total.data() + g), alpha);
        for (int64_t r = 0; r < count; ++r) {
            const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + r * heads + g), best));
            _mm256_storeu_ps(scores + r * heads + g, p);
            sum = _mm256_add_ps(sum, p);
        }
        _mm256_storeu_ps(s->maximum.data() + g, best);
        _mm256_storeu_ps(s->total.data() + g, sum);
        alignas(32) float a[8];
        _mm256_store_ps(a, alpha);
        for (int j = 0; j < 8; ++j) {
            if (a[j] == 1.0f) continue;
            float* acc = s->acc.data() + (g + j) * value_dim;
            const __m256 f = _mm256_set1_ps(a[j]);
            for (int64_t v = 0; v < value_dim; v += 8)
                _mm256_storeu_ps(acc + v, _mm256_mul_ps(f, _mm256_loadu_ps(acc + v)));
        }
    }
}

// acc[h, v .. v + 8N) += Σ_r p[r, h] · block[r][v .. v + 8N) for heads h, h + 1 (2N accumulators in registers: N
// is a template argument so that they stay there).
template <int N>
AVX2 inline void value_columns(const float* probs, const float* const* block, int64_t count, int64_t heads,
                               int64_t h, int64_t v, float* acc0, float* acc1) {
    __m256 a[2][N];
    for (int c = 0; c < N; ++c) {
        a[0][c] = _mm256_loadu_ps(acc0 + v + 8 * c);
        a[1][c] = _mm256_loadu_ps(acc1 + v + 8 * c);
    }
    for (int64_t r = 0; r < count; ++r) {
        const __m256 p0 = _mm256_broadcast_ss(probs + r * heads + h);
        const __m256 p1 = _mm256_broadcast_ss(probs + r * heads + h + 1);
        const float* row = block[r] + v;
        for (int c = 0; c < N; ++c) {
            const __m256 x = _mm256_loadu_ps(row + 8 * c);
            a[0][c] = _mm256_fmadd_ps(p0, x, a[0][c]);
            a[1][c] = _mm256_fmadd_ps(p1, x, a[1][c]);
        }
    }
    for (int c = 0; c < N; ++c) {
        _mm256_storeu_ps(acc0 + v + 8 * c, a[0][c]);
        _mm256_storeu_ps(acc1 + v + 8 * c, a[1][c]);
    }
}

// acc[h, :V] += Σ_r p[r, h] · block[r][:V]: two heads and 32 columns (eight registers) at a time, so each loaded
// row register feeds two products.
AVX2 void value_block(const float* probs, const float* const* block, int64_t count, int64_t heads,
                      int64_t value_dim, float* acc_all) {
    for (int64_t h = 0; h < heads; h += 2) {
        float* acc0 = acc_all + h * value_dim;
        float* acc1 = acc0 + value_dim;
        int64_t v = 0;
        for (; v + 32 <= value_dim; v += 32) value_columns<4>(probs, block, count, heads, h, v, acc0, acc1);
        for (; v < value_dim; v += 8) value_columns<1>(probs, block, count, heads, h, v, acc0, acc1);
    }
}

template <typename T>
const float* row_as_float(const Job<T>* job, int64_t slot, float* widened) {
    const T* row = job->rows + slot * job->dim;
    if constexpr (std::is_same_v<T, float>) {
        return row;
    } else {
        widen_row(row, widened, job->dim);
        return widened;
    }
}

// Rows [k_begin, k_end) of query i into the running maximum, sum and accumulator of `s`.
template <typename T>
AVX2 void attend_range(const Job<T>* job, int64_t i, int64_t k_begin, int64_t k_end, Scratch* s) {
    const int64_t heads = job->heads, dim = job->dim;
    const T* q = job->q + i * heads * dim;
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < dim; ++d) s->q_t[d * heads + h] = to_float(q[h * dim + d]) * job->scale;
    std::fill(s->maximum.begin(), s->maximum.end(), -INFINITY);
    std::fill(s->total.begin(), s->total.end(), 0.0f);
    std::fill(s->acc.begin(), s->acc.end(), 0.0f);
    const int64_t* slots = job->slots + i * job->width;
    int64_t k = k_begin;
    while (k < k_end) {
        int64_t count = 0;
        for (; k < k_end && count < kBlock; ++k)
            if (slots[k] >= 0) {
                s->block[count] = row_as_float(job, slots[k], s->widened.data() + count * dim);
                ++count;
            }
        if (count == 0) break;
        score_block(s->q_t.data(), s->block.data(), count, heads, dim, s->scores.data());
        softmax_block(s->scores.data(), count, heads, job->value_dim, s);
        value_block(s->scores.data(), s->block.data(), count, heads, job->value_dim, s->acc.data());
    }
}

template <typename T>
void write_out(const Job<T>* job, int64_t i, const float* acc, const float* total) {
    for (int64_t h = 0; h < job->heads; ++h) {
        T* out = job->out + i * job->out_q_stride + h * job->out_h_stride;
        const float inv = total[h] > 0.0f ? 1.0f / total[h] : 0.0f;  // no valid row: zeros, not NaN
        for (int64_t v = 0; v < job->value_dim; ++v) {
            const float y = acc[h * job->value_dim + v] * inv;
            if constexpr (std::is_same_v<T, float>) out[v] = y;
            else out[v] = float_to_bf16(y);
        }
    }
}

// The parts of query i (parts > 1), each rescaled to their largest maximum, summed and written.
template <typename T>
void merge_parts(const Job<T>* job, int64_t i) {
    const int64_t heads = job->heads, value_dim = job->value_dim, size = heads * (value_dim + 2);
    std::vector<float> acc(heads * value_dim, 0.0f), total(heads, 0.0f);
    for (int64_t h = 0; h < heads; ++h) {
        float best = -INFINITY;
        for (int64_t p = 0; p < job->parts; ++p)
            best = std::max(best, job->partial[(i * job->parts + p) * size + heads * value_dim + h]);
        if (best == -INFINITY) continue;
        for (int64_t p = 0; p < job->parts; ++p) {
            const float* part = job->partial + (i * job->parts + p) * size;
            const float m = part[heads * value_dim + h];
            if (m == -INFINITY) continue;
            const float f = std::exp(m - best);
            total[h] += f * part[heads * value_dim + heads + h];
            for (int64_t v = 0; v < value_dim; ++v) acc[h * value_dim + v] += f * part[h * value_dim + v];
        }
    }
    write_out(job, i, acc.data(), total.data());
}

template <typename T>
void run(Job<T>* job) {
    const int64_t items = job->n * job->parts;
    at::parallel_for(0, items, 1, [&](int64_t a, int64_t b) {
        Scratch s(job->heads, job->dim, job->value_dim);
        for (int64_t item = a; item < b; ++item) {
            const int64_t i = item / job->parts, p = item % job->parts;
            const int64_t k0 = p * job->part_rows, k1 = std::min(job->width, k0 + job->part_rows);
            attend_range(job, i, k0, k1, &s);
            if (job->parts == 1) {
                write_out(job, i, s.acc.data(), s.total.data());
                continue;
            }
            const int64_t heads = job->heads, value_dim = job->value_dim;
            float* part = job->partial + item * heads * (value_dim + 2);
            std::memcpy(part, s.acc.data(), heads * value_dim * sizeof(float));
            std::memcpy(part + heads * value_dim, s.maximum.data(), heads * sizeof(float));
            std::memcpy(part + heads * value_dim + heads, s.total.data(), heads * sizeof(float));
        }
    });
    if (job->parts > 1)
        at::parallel_for(0, job->n, 1, [&](int64_t a, int64_t b) {
            for (int64_t i = a; i < b; ++i) merge_parts(job, i);
        });
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& slots, double scale, at::Tensor& out) {
    const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), width = slots.size(1);
    const int64_t threads = at::get_num_threads();
    // Fewer queries than threads: each query's rows in equal parts (of 16 rows at least), one per thread.
    const int64_t wanted = n >= threads ? 1 : std::min<int64_t>((threads + n - 1) / n, (width + 15) / 16);
    const int64_t part_rows = std::max<int64_t>(1, ((width + wanted - 1) / wanted + 15) / 16) * 16;
    const int64_t parts = std::max<int64_t>(1, (width + part_rows - 1) / part_rows);
    at::Tensor partial;
    if (parts > 1) partial = at::empty({n * parts * heads * (out.size(2) + 2)}, at::kFloat);
    Job<T> job{static_cast<const T*>(q.data_ptr()), static_cast<const T*>(rows.data_ptr()), slots.data_ptr<int64_t>(),
               static_cast<T*>(out.data_ptr()), n, heads, dim, width, out.size(2), out.stride(0), out.stride(1),
               static_cast<float>(scale), parts, part_rows, parts > 1 ? partial.data_ptr<float>() : nullptr};
    run(&job);
}

}  // namespace

void attend_selected_rows_avx2(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& slots, double scale,
                               at::Tensor& out) {
    if (q.scalar_type() == at::kFloat) attend<float>(q, rows, slots, scale, out);
    else attend<uint16_t>(q, rows, slots, scale, out);
}

#else

void attend_selected_rows_avx2(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, at::Tensor&) {}

#endif

}  // namespace dsaserve
