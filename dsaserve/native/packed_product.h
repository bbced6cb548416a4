// The packed-weight product of quant_linear.cpp for other operators that chain it with their own arithmetic
// (mla_projections.cpp): the `quant_linear` operator's function, called without the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace dsaserve {

// x [M <= 16, K] by one packed weight, or x [B, M, K] by B stacked ones: [M, N] or [B, M, N] in x's dtype.
at::Tensor packed_product(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale, int64_t kind,
                          int64_t group, int64_t col_offset, int64_t N, int64_t K);

}  // namespace dsaserve
