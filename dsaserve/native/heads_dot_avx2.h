// The AVX2 bodies' query-heads product (selected_rows_avx2.cpp, index_scores_f32_avx2.cpp): a query transposed to
// [dim, heads] against four fp32 rows, 8 · G heads per pass (G registers), so a broadcast row element feeds G fused
// multiply-adds. G is a template argument so that the 4 · G accumulators stay in registers.
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>

namespace dsaserve {

// acc[j][c] = Σ_d q_t[d, g + 8c .. g + 8c + 8) · row[j][d], for j < 4 and c < G.
template <int G>
__attribute__((target("avx2,fma"))) inline void dot_heads(const float* q_t, const float* const* row, int64_t heads,
                                                         int64_t dim, int64_t g, __m256 (&acc)[4][G]) {
    for (int j = 0; j < 4; ++j)
        for (int c = 0; c < G; ++c) acc[j][c] = _mm256_setzero_ps();
    const float* q = q_t + g;
    for (int64_t d = 0; d < dim; ++d, q += heads) {
        __m256 qv[G];
        for (int c = 0; c < G; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
        for (int j = 0; j < 4; ++j) {
            const __m256 x = _mm256_broadcast_ss(row[j] + d);
            for (int c = 0; c < G; ++c) acc[j][c] = _mm256_fmadd_ps(qv[c], x, acc[j][c]);
        }
    }
}

}  // namespace dsaserve

#endif
