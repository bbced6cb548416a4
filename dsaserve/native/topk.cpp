/* Top-k of each row of an fp32 matrix, unsorted, like torch.topk(k, sorted=False): the k largest
 * values of every row and their column indices (ties at the k-th value broken by lowest column).
 *
 * Per row, a radix select finds the k-th largest value: floats map to order-preserving 32-bit keys,
 * a histogram of the top 11 bits finds the bucket holding it, the bucket's keys are set apart and
 * histograms of the next 11 and the last 10 bits pin it down. One more pass collects the columns
 * above it and, up to k, those equal to it. Two passes over the row and no data-dependent branches
 * in them, where torch's selection for large k sorts. Rows are shared out over torch's intra-op
 * threads (at::parallel_for). Portable C++: torch.ops.dsaserve.topk_rows on any CPU.
 */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "layer_pieces.h"

namespace {

/* Order-preserving map of floats to unsigned integers: a > b exactly when key(a) > key(b). */
inline uint32_t key_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* In a histogram of `bins` buckets, the bucket holding the `need`-th largest element (1-based);
 * `need` becomes that element's rank inside the bucket. */
uint32_t bucket_of(const uint32_t *hist, uint32_t bins, int64_t *need) {
    uint32_t b = bins - 1;
    while ((int64_t)hist[b] < *need) *need -= hist[b--];
    return b;
}

void topk_row(const float *x, int64_t n, int64_t k, uint32_t *candidates, float *values, int64_t *indices) {
    /* The first histogram in four, element c counted in the (c % 4)-th: scores crowd into a few buckets, and
     * increments of one counter in a row would each wait for the previous one's store. The keys are kept. */
    uint32_t hists[4][2048];
    int64_t need = k;
    memset(hists, 0, sizeof hists);
    for (int64_t c = 0; c < n; c++) {
        candidates[c] = key_of(x[c]);
        hists[c & 3][candidates[c] >> 21]++;
    }
    uint32_t *hist = hists[0];
    for (int b = 0; b < 2048; b++) hist[b] += hists[1][b] + hists[2][b] + hists[3][b];
    uint32_t top = bucket_of(hist, 2048, &need);
    int64_t m = 0;
    for (int64_t c = 0; c < n; c++) {  /* in place: m <= c */
        uint32_t key = candidates[c];
        candidates[m] = key;
        m += (key >> 21) == top;
    }
    memset(hist, 0, 2048 * sizeof(uint32_t));
    for (int64_t c = 0; c < m; c++) hist[(candidates[c] >> 10) & 2047]++;
    uint32_t middle = bucket_of(hist, 2048, &need);
    memset(hist, 0, 1024 * sizeof(uint32_t));
    for (int64_t c = 0; c < m; c++)
        if (((candidates[c] >> 10) & 2047) == middle) hist[candidates[c] & 1023]++;
    uint32_t threshold = (top << 21) | (middle << 10) | bucket_of(hist, 1024, &need);
    /* Everything above the k-th value (branch-free: always write, advance when taken), then `need`
     * of the values equal to it. */
    int64_t taken = 0;
    for (int64_t c = 0; c < n && taken < k; c++) {
        values[taken] = x[c];
        indices[taken] = c;
        taken += key_of(x[c]) > threshold;
    }
    for (int64_t c = 0; c < n && need > 0; c++) {
        if (key_of(x[c]) == threshold) {
            values[taken] = x[c];
            indices[taken++] = c;
            need--;
        }
    }
}

std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
                "topk_rows: x must be fp32 [rows, n] with unit column stride");
    const int64_t rows = x.size(0), n = x.size(1);
    TORCH_CHECK(k >= 1 && k <= n, "topk_rows: k=", k, " must be in [1, ", n, "]");
    at::Tensor values = at::empty({rows, k}, x.options());
    at::Tensor indices = at::empty({rows, k}, x.options().dtype(at::kLong));
    const float* xp = x.data_ptr<float>();
    float* vp = values.data_ptr<float>();
    int64_t* ip = indices.data_ptr<int64_t>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
        std::vector<uint32_t> scratch(n + 1);
        for (int64_t r = r0; r < r1; r++) topk_row(xp + r * stride, n, k, scratch.data(), vp + r * k, ip + r * k);
    });
    return {values, indices};
}

}  // namespace

// For decode_selection.cpp (layer_pieces.h); scratch holds n + 1 entries.
void dsaserve::topk_row(const float* x, int64_t n, int64_t k, uint32_t* scratch, float* values, int64_t* indices) {
    ::topk_row(x, n, k, scratch, values, indices);
}

namespace {
// Meta kernel: the output shapes without computing (meta tensors, tracing).
std::tuple<at::Tensor, at::Tensor> topk_rows_meta(const at::Tensor& x, int64_t k) {
  return {at::empty({x.size(0), k}, x.options()), at::empty({x.size(0), k}, x.options().dtype(at::kLong))};
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
    m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) { m.impl("topk_rows", &topk_rows); }

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) { m.impl("topk_rows", &topk_rows_meta); }
