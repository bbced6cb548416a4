/* Lightning-indexer scores of a query tile against a chunk of keys, without a per-head score tensor:
 *
 * out[i, s] = Σ_h weights[i, h] · relu(q[i, h] · key[s])
 *
 * bf16 q and keys, fp32 weights, accumulation and output. Keys come packed by the caller as pairs of
 * columns for 16 keys at a time (`packed[g][p][lane] = key[16g + lane][2p .. 2p+1]`, zero rows up to
 * a multiple of 64 keys), so one vdpbf16ps multiplies a broadcast pair of one head's q columns into
 * 16 keys' running dot products: the relu and the weighted head sum then act on whole registers and
 * no horizontal sum is needed. Work items are 64 keys (4 registers) × 4 heads at a time, shared
 * out over torch's intra-op threads (at::parallel_for), each pulling items from one counter.
 *
 * index_scores_blocks reads the same layout in place from a paged key cache kept in it
 * (`cache[block][g][p][lane] = key[block_size·block + 16g + lane][2p .. 2p+1]`, attention/indexer_cache.py),
 * following a request's block table: no gathered copy of the keys and no repacking per step.
 *
 * With AMX tiles (amx_tiles.h; the mode amx.py chose), a pass takes one query's 16 heads against the item's 64
 * keys, 32 columns per tile product: the query tile is read in place from q and the key tiles in place from the
 * packed layout, whose 16 keys × pairs of columns is already a tile's layout. Shapes with heads not in 16s or
 * dims not in 32s keep the AVX-512 body.
 *
 * Registered as torch.ops.dsaserve.index_scores(_blocks); the AVX-512 BF16 body and the AVX2 one (the same
 * layout, keys widened in registers) are each compiled for their ISA alone (target pragmas) and run only under
 * the family chosen for the process (cpu_features.h; the caller checks index_scores_fits).
 */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "cpu_features.h"
#include "layer_pieces.h"

#if DSASERVE_X86
#include <immintrin.h>
#endif

namespace {

#define KEYS_PER_ITEM 64 /* keys per work item: 4 registers of 16 */

typedef struct {
    const uint16_t *q;      /* [n, heads, dim] */
    const float *weights;   /* [n, heads] */
    const uint32_t *packed; /* groups of 16 keys, [dim / 2][16] each: one run of them, or a block cache */
    const int64_t *blocks;  /* NULL: group j is packed's j-th; else the j-th of the listed blocks' groups */
    int64_t groups_per_block;
    int64_t groups;         /* groups that exist; items reaching past them read `zero` */
    const uint32_t *zero;   /* one group of zero keys */
    float *out;             /* [n, out_stride], columns < keys written */
    int64_t n, heads, dim, keys, out_stride;
    int64_t next; /* next work item, shared by the workers */
    const float *q32; /* the AVX2 body's q widened to fp32 [n, heads, dim] (run() makes it) */
} Job;

const uint32_t *group_of(const Job *job, int64_t j) {
    const int64_t size = job->dim / 2 * 16;
    if (j >= job->groups) return job->zero;
    if (!job->blocks) return job->packed + j * size;
    const int64_t per = job->groups_per_block;
    return job->packed + (job->blocks[j / per] * per + j % per) * size;
}

#if DSASERVE_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma")
/* Query i's head sums for the item's 64 keys into out (columns < keys). */
void store_scores(const Job *job, int64_t i, int64_t k0, const __m512 *score) {
    float *o = job->out + i * job->out_stride + k0;
    for (int g = 0; g < 4; g++) {
        int64_t left = job->keys - (k0 + 16 * g);
        if (left <= 0) break;
        __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        _mm512_mask_storeu_ps(o + 16 * g, mask, score[g]);
    }
}

void score_item(const Job *job, int64_t item) {
    const int64_t pairs = job->dim / 2, k0 = item * KEYS_PER_ITEM;
    const __m512i *groups[4];
    for (int g = 0; g < 4; g++) groups[g] = (const __m512i *)group_of(job, item * 4 + g);
    const __m512 zero = _mm512_setzero_ps();
    __m512 score[4]; /* in memory between head groups: all 32 registers go to the products */
    for (int64_t i = 0; i < job->n; i++) {
        score[0] = score[1] = score[2] = score[3] = zero;
        for (int64_t h0 = 0; h0 < job->heads; h0 += 4) {
            const int32_t *q = (const int32_t *)(job->q + (i * job->heads + h0) * job->dim);
            __m512 a[4][4];
            for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = a[j][2] = a[j][3] = zero;
            for (int64_t p = 0; p < pairs; p++) {
                __m512bh k[4];
                for (int g = 0; g < 4; g++) k[g] = (__m512bh)_mm512_load_si512(groups[g] + p);
                for (int j = 0; j < 4; j++) {
                    __m512bh b = (__m512bh)_mm512_set1_epi32(q[j * pairs + p]);
                    for (int g = 0; g < 4; g++) a[j][g] = _mm512_dpbf16_ps(a[j][g], k[g], b);
                }
            }
            for (int j = 0; j < 4; j++) {
                __m512 w = _mm512_set1_ps(job->weights[i * job->heads + h0 + j]);
                for (int g = 0; g < 4; g++) score[g] = _mm512_fmadd_ps(_mm512_max_ps(a[j][g], zero), w, score[g]);
            }
        }
        store_scores(job, i, k0, score);
    }
}

void worker(Job *job) {
    int64_t items = (job->keys + KEYS_PER_ITEM - 1) / KEYS_PER_ITEM;
    for (int64_t item; (item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < items;) score_item(job, item);
}

#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
/* The AVX2 body (no bf16 products): a 16-key group's column pairs are widened to fp32 in registers (the low bf16
 * of a pair is column 2p: shifted up; the high one 2p + 1: masked) and multiplied by the query's two columns
 * broadcast, by FMAs. One group at a time, 4 heads at a time: 8 accumulators of 8 keys. */
void score_item_avx2(const Job *job, int64_t item) {
    const int64_t pairs = job->dim / 2, k0 = item * KEYS_PER_ITEM;
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t i = 0; i < job->n; i++) {
        for (int g = 0; g < 4 && k0 + 16 * g < job->keys; g++) {
            const uint32_t *group = group_of(job, item * 4 + g);
            __m256 score[2] = {zero, zero};
            for (int64_t h0 = 0; h0 < job->heads; h0 += 4) {
                const float *q = job->q32 + (i * job->heads + h0) * job->dim;
                __m256 a[4][2];
                for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = zero;
                for (int64_t p = 0; p < pairs; p++) {
                    const __m256i raw[2] = {_mm256_loadu_si256((const __m256i *)(group + p * 16)),
                                            _mm256_loadu_si256((const __m256i *)(group + p * 16 + 8))};
                    __m256 even[2], odd[2];
                    for (int half = 0; half < 2; half++) {
                        even[half] = _mm256_castsi256_ps(_mm256_slli_epi32(raw[half], 16));
                        odd[half] = _mm256_castsi256_ps(_mm256_and_si256(raw[half], high));
                    }
                    for (int j = 0; j < 4; j++) {  // (broadcasts from memory: the load ports, not the shuffle one)
                        const __m256 qe = _mm256_broadcast_ss(q + j * job->dim + 2 * p);
                        const __m256 qo = _mm256_broadcast_ss(q + j * job->dim + 2 * p + 1);
                        for (int half = 0; half < 2; half++)
                            a[j][half] = _mm256_fmadd_ps(odd[half], qo, _mm256_fmadd_ps(even[half], qe, a[j][half]));
                    }
                }
                for (int j = 0; j < 4; j++) {
                    const __m256 w = _mm256_set1_ps(job->weights[i * job->heads + h0 + j]);
                    for (int half = 0; half < 2; half++)
                        score[half] = _mm256_fmadd_ps(_mm256_max_ps(a[j][half], zero), w, score[half]);
                }
            }
            alignas(32) float lanes[16];
            _mm256_store_ps(lanes, score[0]);
            _mm256_store_ps(lanes + 8, score[1]);
            const int64_t left = std::min<int64_t>(16, job->keys - (k0 + 16 * g));
            std::copy(lanes, lanes + left, job->out + i * job->out_stride + k0 + 16 * g);
        }
    }
}

void worker_avx2(Job *job) {
    int64_t items = (job->keys + KEYS_PER_ITEM - 1) / KEYS_PER_ITEM;
    for (int64_t item; (item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < items;)
        score_item_avx2(job, item);
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma,amx-tile,amx-bf16,amx-int8")
/* The item's scores with tiles: accumulators 0-3 hold 16 heads × the 4 groups of 16 keys, tile 4 the query's
 * 16 heads × 32 columns, tiles 5-7 the key groups' 16 column pairs in turn. */
template <class Tiles>
void score_item_tiles(const Job *job, int64_t item, float *products /* [4][16 heads][16 keys] */) {
    const int64_t k0 = item * KEYS_PER_ITEM, steps = job->dim / 32, H = job->heads;
    const uint8_t *groups[4];
    for (int g = 0; g < 4; g++) groups[g] = (const uint8_t *)group_of(job, item * 4 + g);
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < job->n; i++) {
        __m512 score[4] = {zero, zero, zero, zero};
        for (int64_t h0 = 0; h0 < H; h0 += 16) {
            const uint16_t *q = job->q + (i * H + h0) * job->dim;
            dsaserve::products_of_four_groups<Tiles, false>((const uint8_t *)q, job->dim * 2, groups, steps, products);
            for (int64_t h = 0; h < 16; h++) {
                __m512 w = _mm512_set1_ps(job->weights[i * H + h0 + h]);
                for (int g = 0; g < 4; g++)
                    score[g] = _mm512_fmadd_ps(_mm512_max_ps(_mm512_load_ps(products + g * 256 + h * 16), zero), w,
                                               score[g]);
            }
        }
        store_scores(job, i, k0, score);
    }
}

template <class Tiles>
void worker_tiles(Job *job) {
    alignas(64) float products[4 * 256];
    const dsaserve::TileSession<Tiles> session;
    int64_t items = (job->keys + KEYS_PER_ITEM - 1) / KEYS_PER_ITEM;
    for (int64_t item; (item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < items;)
        score_item_tiles<Tiles>(job, item, products);
}
#pragma GCC pop_options
#endif

// Shapes the tile body takes: whole tiles of heads (16) and of columns (32).
bool tiles_fit(int64_t heads, int64_t dim) { return heads % 16 == 0 && dim % 32 == 0; }

bool fits(int64_t heads, int64_t dim) {
    return (dsaserve::use_avx512_bf16() || dsaserve::use_avx2()) && heads % 4 == 0 && dim % 2 == 0;
}

void check_scores(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& out, int64_t keys) {
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.is_contiguous(), "index_scores: q must be "
                "contiguous bf16 [t, heads, dim]");
    const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
    TORCH_CHECK(fits(heads, dim), "index_scores: this shape or CPU is not the kernel's (see index_scores_fits)");
    TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.size(0) == n &&
                weights.size(1) == heads, "index_scores: weights must be contiguous fp32 [t, heads]");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == n && out.size(1) >= keys &&
                out.stride(1) == 1, "index_scores: out must be fp32 [t, >= keys] with unit column stride");
}

void run(Job& job) {
#if DSASERVE_X86
    const int64_t items = (job.keys + KEYS_PER_ITEM - 1) / KEYS_PER_ITEM;
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
    if (!dsaserve::use_avx512_bf16()) {  // the AVX2 body (fits() checked one of the two), q widened once
        std::vector<float> q32(job.n * job.heads * job.dim);
        for (size_t e = 0; e < q32.size(); ++e) {
            const uint32_t bits = static_cast<uint32_t>(job.q[e]) << 16;
            std::memcpy(&q32[e], &bits, 4);
        }
        job.q32 = q32.data();
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

Job job_of(const at::Tensor& q, const at::Tensor& weights, const uint32_t* packed, int64_t keys, at::Tensor& out) {
    return Job{static_cast<const uint16_t *>(q.data_ptr()), weights.data_ptr<float>(), packed, nullptr, 1, 0, nullptr,
               out.data_ptr<float>(), q.size(0), q.size(1), q.size(2), keys, out.stride(0), 0};
}

void index_scores(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& packed, int64_t keys,
                  at::Tensor& out) {
    check_scores(q, weights, out, keys);
    const int64_t padded = (keys + KEYS_PER_ITEM - 1) / KEYS_PER_ITEM * KEYS_PER_ITEM;
    TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.numel() >= padded * q.size(2) / 2,
                "index_scores: packed keys too short");
    Job job = job_of(q, weights, static_cast<const uint32_t *>(packed.data_ptr()), keys, out);
    job.groups = padded / 16;
    run(job);
}

// The keys of `blocks` (ids into cache [num_blocks, block_size / 16, dim / 2, 16]), in that order.
void index_scores_blocks(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                         const at::Tensor& blocks, int64_t keys, at::Tensor& out) {
    check_scores(q, weights, out, keys);
    TORCH_CHECK(cache.scalar_type() == at::kInt && cache.is_contiguous() && cache.dim() == 4 &&
                cache.size(2) == q.size(2) / 2 && cache.size(3) == 16,
                "index_scores_blocks: the cache must be contiguous int32 [num_blocks, block_size / 16, dim / 2, 16]");
    dsaserve::check_block_list(blocks, keys, cache, "index_scores_blocks");
    const int64_t per = cache.size(1), count = blocks.numel();
    const int64_t* ids = blocks.data_ptr<int64_t>();
    const at::Tensor zero = at::zeros({q.size(2) / 2 * 16}, cache.options());
    Job job = job_of(q, weights, static_cast<const uint32_t *>(cache.data_ptr()), keys, out);
    job.blocks = ids;
    job.groups_per_block = per;
    job.groups = count * per;
    job.zero = static_cast<const uint32_t *>(zero.data_ptr());
    run(job);
}

// keys bf16 [n, dim] into a packed key cache int32 [num_blocks, block_size / 16, dim / 2, 16] at slots [n].
void write_packed_keys(at::Tensor& cache, const at::Tensor& slots, const at::Tensor& keys) {
    TORCH_CHECK(cache.scalar_type() == at::kInt && cache.is_contiguous() && cache.dim() == 4 && cache.size(3) == 16,
                "write_packed_keys: the cache must be contiguous int32 [num_blocks, block_size / 16, dim / 2, 16]");
    TORCH_CHECK(keys.scalar_type() == at::kBFloat16 && keys.dim() == 2 && keys.is_contiguous() &&
                keys.size(1) == 2 * cache.size(2), "write_packed_keys: keys must be contiguous bf16 [n, ",
                2 * cache.size(2), "]");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                slots.size(0) == keys.size(0), "write_packed_keys: slots must be int64 [n], one per key");
    const int64_t pairs = cache.size(2), block_size = cache.size(1) * 16, capacity = cache.size(0) * block_size;
    const int64_t* slot = slots.data_ptr<int64_t>();
    const auto* source = static_cast<const uint32_t *>(keys.data_ptr());
    auto* groups = static_cast<uint32_t *>(cache.data_ptr());
    for (int64_t i = 0; i < keys.size(0); ++i)
        TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "write_packed_keys: slot ", slot[i], " is not in the cache's ",
                    capacity);
    // A prefill chunk's keys over the threads (a decode token's alone): a column-pair store each, 64 bytes apart.
    at::parallel_for(0, keys.size(0), 256, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t token = slot[i] % block_size;
            uint32_t *group = groups + ((slot[i] / block_size) * (block_size / 16) + token / 16) * pairs * 16 + token % 16;
            for (int64_t p = 0; p < pairs; ++p) group[p * 16] = source[i * pairs + p];
        }
    });
}

}  // namespace

// For decode_selection.cpp (layer_pieces.h): one query's scores (q bf16 [heads, dim], weights fp32 [heads]) against the
// first `keys` keys of `count` blocks of a packed key cache, ids checked by the caller, into out[0, keys).
void dsaserve::index_scores_of_blocks(const c10::BFloat16* q, const float* weights, int64_t heads, int64_t dim,
                                      const at::Tensor& cache, const int64_t* blocks, int64_t count, int64_t keys,
                                      float* out) {
    // One group of zero keys, for an item reaching past the last block; 64-byte aligned, as the kernel loads it.
    thread_local std::vector<uint32_t> zero;
    if (static_cast<int64_t>(zero.size()) < dim / 2 * 16 + 16) zero.assign(dim / 2 * 16 + 16, 0u);
    const uintptr_t address = (reinterpret_cast<uintptr_t>(zero.data()) + 63) & ~uintptr_t(63);
    const auto* aligned = reinterpret_cast<const uint32_t *>(address);
    Job job{reinterpret_cast<const uint16_t *>(q), weights, static_cast<const uint32_t *>(cache.data_ptr()), blocks,
            cache.size(1), count * cache.size(1), aligned, out, 1, heads, dim, keys, keys, 0};
    run(job);
}

bool dsaserve::index_scores_fits(int64_t heads, int64_t dim) { return fits(heads, dim); }

// For index_scores_int8.cpp (layer_pieces.h): blocks a contiguous int64 list of ids in the cache [num_blocks,
// block_size / 16, ...] whose blocks hold at least `keys` keys.
void dsaserve::check_block_list(const at::Tensor& blocks, int64_t keys, const at::Tensor& cache, const char* op) {
    TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 1 && blocks.is_contiguous(), op,
                ": blocks must be a contiguous int64 vector");
    const int64_t per = cache.size(1), count = blocks.numel();
    TORCH_CHECK(keys >= 0 && keys <= count * per * 16, op, ": ", keys, " keys, the ", count, " blocks hold ",
                count * per * 16);
    const int64_t* ids = blocks.data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i)
        TORCH_CHECK(ids[i] >= 0 && ids[i] < cache.size(0), op, ": block id ", ids[i], " is not in the cache's ",
                    cache.size(0), " blocks");
}

// For decode_plan.cpp (layer_pieces.h).
void dsaserve::write_packed_keys(at::Tensor& cache, const at::Tensor& slots, const at::Tensor& keys) {
    ::write_packed_keys(cache, slots, keys);
}

namespace {
// Meta kernels: they write only into their outputs, so nothing to shape (meta tensors, tracing).
void index_scores_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, at::Tensor&) {}
void index_scores_blocks_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                              at::Tensor&) {}
void write_packed_keys_meta(at::Tensor&, const at::Tensor&, const at::Tensor&) {}
}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
    m.def("index_scores_fits(int heads, int dim) -> bool", &fits);
    m.def("index_scores(Tensor q, Tensor weights, Tensor packed, int keys, Tensor(a!) out) -> ()");
    m.def("index_scores_blocks(Tensor q, Tensor weights, Tensor cache, Tensor blocks, int keys, Tensor(a!) out) -> ()");
    m.def("write_packed_keys(Tensor(a!) cache, Tensor slots, Tensor keys) -> ()");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) {
    m.impl("index_scores", &index_scores);
    m.impl("index_scores_blocks", &index_scores_blocks);
    m.impl("write_packed_keys", &write_packed_keys);
}

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) {
    m.impl("index_scores", &index_scores_meta);
    m.impl("index_scores_blocks", &index_scores_blocks_meta);
    m.impl("write_packed_keys", &write_packed_keys_meta);
}
