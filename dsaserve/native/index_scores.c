/* Lightning-indexer scores of a query tile against a chunk of keys, without a per-head score tensor:
 *
 * out[i, s] = Σ_h weights[i, h] · relu(q[i, h] · key[s])
 *
 * bf16 q and keys, fp32 weights, accumulation and output. Keys come packed by the caller as pairs of
 * columns for 16 keys at a time (`packed[g][p][lane] = key[16g + lane][2p .. 2p+1]`, zero rows up to
 * a multiple of 64 keys), so one vdpbf16ps multiplies a broadcast pair of one head's q columns into
 * 16 keys' running dot products: the relu and the weighted head sum then act on whole registers and
 * no horizontal sum is needed. Work items are 64 keys (4 registers) × 4 heads at a time, shared
 * out over OpenMP threads: torch's own pool, since torch's libgomp is the one already loaded.
 */
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_KERNEL 1
#else
#define HAVE_BF16_KERNEL 0
#endif

#define KEYS_PER_ITEM 64 /* keys per work item: 4 registers of 16 */

typedef struct {
    const uint16_t *q;      /* [n, heads, dim] */
    const float *weights;   /* [n, heads] */
    const uint32_t *packed; /* [keys_padded / 16][dim / 2][16] */
    float *out;             /* [n, out_stride], columns < keys written */
    int64_t n, heads, dim, keys, out_stride;
    int64_t next; /* next work item, shared by the workers */
} Job;

#if HAVE_BF16_KERNEL
static void score_item(const Job *job, int64_t item) {
    const int64_t pairs = job->dim / 2, g0 = item * 4, k0 = item * KEYS_PER_ITEM;
    const __m512i *keys = (const __m512i *)job->packed + g0 * pairs;
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
                for (int g = 0; g < 4; g++) k[g] = (__m512bh)_mm512_load_si512(keys + g * pairs + p);
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
        float *o = job->out + i * job->out_stride + k0;
        for (int g = 0; g < 4; g++) {
            int64_t left = job->keys - (k0 + 16 * g);
            if (left <= 0) break;
            __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            _mm512_mask_storeu_ps(o + 16 * g, mask, score[g]);
        }
    }
}

static void *worker(void *arg) {
    Job *job = (Job *)arg;
    int64_t items = (job->keys + KEYS_PER_ITEM - 1) / KEYS_PER_ITEM;
    for (int64_t item; (item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < items;) score_item(job, item);
    return NULL;
}
#endif

/* Shapes the kernel takes: heads in 4s and whole column pairs. */
int dsaserve_index_scores_fits(int64_t heads, int64_t dim) { return HAVE_BF16_KERNEL && heads % 4 == 0 && dim % 2 == 0; }

/* Returns 0 on success, 2 for a shape or CPU it does not handle. */
int dsaserve_index_scores(const uint16_t *q, const float *weights, const uint32_t *packed, int64_t n, int64_t heads,
                          int64_t dim, int64_t keys, float *out, int64_t out_stride, int threads) {
    if (!dsaserve_index_scores_fits(heads, dim)) return 2;
#if HAVE_BF16_KERNEL
    Job job = {q, weights, packed, out, n, heads, dim, keys, out_stride, 0};
    int64_t items = (keys + KEYS_PER_ITEM - 1) / KEYS_PER_ITEM;
    if (threads > items) threads = (int)(items > 0 ? items : 1);
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    worker(&job);
    return 0;
#else
    return 2;
#endif
}
