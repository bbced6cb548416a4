// The indexer's scores of fp32 queries against fp32 keys read in place from a paged key cache, on the AVX2 body:
//
//   out[i, s] = Σ_h weights[i, h] · relu(q[i, h] · key(s))
//
// what an fp32 model scores under cpu_isa avx2 (dtype auto computes in fp32 on CPUs without AVX-512 BF16), where
// torch's path gathers the keys, writes every head's score and reads it back for the relu and the head sum. Here the
// query is transposed and scaled by nothing (weights apply after the relu), 16 heads per pass in two registers
// against four keys at a time (a broadcast key element per column); each pass's relu'd scores are weighted and
// added in registers, and a key's lanes summed once at the end. Work items are a query and 64 keys, over torch's
// intra-op threads. Registered as torch.ops.dsaserve.index_scores_f32_blocks (index_scores_f32_fits first).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_features.h"
#include "heads_dot_avx2.h"
#include "layer_pieces.h"

#if DSASERVE_X86
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kKeysPerItem = 64;

bool fits(int64_t heads, int64_t dim) { return dsaserve::use_avx2() && heads % 8 == 0 && heads <= 256 && dim <= 4096; }

#if DSASERVE_X86
#define AVX2 __attribute__((target("avx2,fma")))

struct Job {
    const float* q_t;      // [n, dim, heads]: each query transposed
    const float* weights;  // [n, heads]
    const float* cache;    // [blocks, block_size, dim]
    const int64_t* blocks; // the blocks holding keys 0, block_size, 2 · block_size, …
    float* out;            // [n, out_stride]
    int64_t n, heads, dim, block_size, keys, out_stride;
};

AVX2 inline float horizontal_sum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// sums[j] += Σ over heads g .. g + 8G of weights · relu(q · key j), for four keys.
template <int G>
AVX2 inline void score_heads(const float* q_t, const float* weights, const float* const* key, int64_t heads,
                             int64_t dim, int64_t g, __m256* sums) {
    __m256 acc[4][G];
    dsaserve::dot_heads<G>(q_t, key, heads, dim, g, acc);
    for (int c = 0; c < G; ++c) {
        const __m256 w = _mm256_loadu_ps(weights + g + 8 * c);
        for (int j = 0; j < 4; ++j)
            sums[j] = _mm256_fmadd_ps(w, _mm256_max_ps(acc[j][c], _mm256_setzero_ps()), sums[j]);
    }
}

AVX2 void score_item(const Job* job, int64_t i, int64_t k0, int64_t k1) {
    const float* q_t = job->q_t + i * job->dim * job->heads;
    const float* weights = job->weights + i * job->heads;
    for (int64_t k = k0; k < k1; k += 4) {
        const float* key[4];
        for (int j = 0; j < 4; ++j) {
            const int64_t s = std::min(k + j, k1 - 1);  // past the range: the last key again, not written
            key[j] = job->cache + (job->blocks[s / job->block_size] * job->block_size + s % job->block_size) * job->dim;
        }
        __m256 sums[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        int64_t g = 0;
        for (; g + 16 <= job->heads; g += 16) score_heads<2>(q_t, weights, key, job->heads, job->dim, g, sums);
        if (g < job->heads) score_heads<1>(q_t, weights, key, job->heads, job->dim, g, sums);
        for (int j = 0; j < 4 && k + j < k1; ++j) job->out[i * job->out_stride + k + j] = horizontal_sum(sums[j]);
    }
}
#endif

// out[:, :keys] = the scores of q [n, heads, dim] fp32 (weights [n, heads] fp32) against keys 0 .. keys - 1 of the
// listed blocks of cache [blocks, block_size, dim] fp32.
void index_scores_f32_blocks(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                             const at::Tensor& blocks, int64_t keys, at::Tensor& out) {
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "index_scores_f32_blocks: q must be fp32 [n, heads, dim]");
    const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
    TORCH_CHECK(fits(heads, dim), "index_scores_f32_blocks: this shape or CPU is not the kernel's");
    TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.size(0) == n &&
                weights.size(1) == heads, "index_scores_f32_blocks: weights must be contiguous fp32 [n, heads]");
    TORCH_CHECK(cache.dim() == 3 && cache.scalar_type() == at::kFloat && cache.is_contiguous() && cache.size(2) == dim,
                "index_scores_f32_blocks: cache must be contiguous fp32 [blocks, block_size, dim]");
    TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.is_contiguous() &&
                blocks.numel() * cache.size(1) >= keys, "index_scores_f32_blocks: blocks must be int64 and hold keys");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.size(0) == n && out.size(1) >= keys && out.stride(1) == 1,
                "index_scores_f32_blocks: out must be fp32 [n, >= keys] with unit column stride");
#if DSASERVE_X86
    const at::Tensor q_t = q.transpose(1, 2).contiguous();  // [n, dim, heads]
    Job job{q_t.data_ptr<float>(), weights.data_ptr<float>(), cache.data_ptr<float>(), blocks.data_ptr<int64_t>(),
            out.data_ptr<float>(), n, heads, dim, cache.size(1), keys, out.stride(0)};
    const int64_t per_query = (keys + kKeysPerItem - 1) / kKeysPerItem;
    at::parallel_for(0, n * per_query, 1, [&](int64_t a, int64_t b) {
        for (int64_t item = a; item < b; ++item) {
            const int64_t i = item / per_query, k0 = item % per_query * kKeysPerItem;
            score_item(&job, i, k0, std::min(keys, k0 + kKeysPerItem));
        }
    });
#endif
}

}  // namespace

// For decode_selection.cpp (layer_pieces.h): one query's scores (q fp32 [heads, dim], weights fp32 [heads]) against the
// first `keys` keys of the listed blocks of an fp32 key cache [num_blocks, block_size, dim], ids checked by the
// caller, into out[0, keys): the operator's arithmetic, per key the same sums.
void dsaserve::index_scores_f32_of_blocks(const float* q, const float* weights, int64_t heads, int64_t dim,
                                          const at::Tensor& cache, const int64_t* blocks, int64_t keys, float* out) {
#if DSASERVE_X86
    thread_local std::vector<float> q_t;
    q_t.resize(dim * heads);
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < dim; ++d) q_t[d * heads + h] = q[h * dim + d];
    Job job{q_t.data(), weights, cache.data_ptr<float>(), blocks, out, 1, heads, dim, cache.size(1), keys, keys};
    const int64_t items = (keys + kKeysPerItem - 1) / kKeysPerItem;
    at::parallel_for(0, items, 1, [&](int64_t a, int64_t b) {
        for (int64_t item = a; item < b; ++item)
            score_item(&job, 0, item * kKeysPerItem, std::min(keys, (item + 1) * kKeysPerItem));
    });
#endif
}

bool dsaserve::index_scores_f32_fits(int64_t heads, int64_t dim) { return fits(heads, dim); }

namespace {

// Meta kernel: it writes only into `out`, so nothing to shape (meta tensors, tracing).
void index_scores_f32_blocks_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                  at::Tensor&) {}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
    m.def("index_scores_f32_fits(int heads, int dim) -> bool", &fits);
    m.def("index_scores_f32_blocks(Tensor q, Tensor weights, Tensor cache, Tensor blocks, int keys, Tensor(a!) out) "
          "-> ()");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) { m.impl("index_scores_f32_blocks", &index_scores_f32_blocks); }

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) { m.impl("index_scores_f32_blocks", &index_scores_f32_blocks_meta); }
