// A MoE layer's router as one operator, with model/moe.py Router's arithmetic: scores = sigmoid(x · Wᵀ) in
// fp32 (x converted to fp32), experts chosen by scores + correction bias (with groups: only the topk_group
// groups whose two best choices sum highest compete), the chosen experts' plain scores as weights, divided by
// their sum (+ 1e-20) when normalized, times the scaling factor. Only the order of the fp32 sums differs from
// the torch operators. A decode step routes a token per MoE layer; the dozen torch operators this replaces
// cost more there than the arithmetic. Experts are shared out over torch's threads (GLM-5.2's router reads
// 256 x 6144 fp32 weights per token); the AVX-512 dot product is taken where the CPU has it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "cpu_features.h"
#include "layer_pieces.h"

#if DSASERVE_X86
#include <immintrin.h>
#endif

namespace {

float dot_portable(const float* a, const float* b, int64_t n) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) part[j] += a[k + j] * b[k + j];
  float sum = 0.f;
  for (int j = 0; j < 8; ++j) sum += part[j];
  for (; k < n; ++k) sum += a[k] * b[k];
  return sum;
}

#if DSASERVE_X86
__attribute__((target("avx512f"))) float dot_avx512(const float* a, const float* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(b + k + 16), acc1);
  }
  for (; k < n; k += 16) {
    const __mmask16 m = n - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - k)) - 1);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + k), _mm512_maskz_loadu_ps(m, b + k), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

// The AVX-512 dot product only where the process runs the AVX-512 family (cpu_isa avx2 on an AVX-512 CPU runs what
// an AVX2 server runs: the portable loop here).
float dot(const float* a, const float* b, int64_t n) {
#if DSASERVE_X86
  if (dsaserve::use_avx512_bf16()) return dot_avx512(a, b, n);
#endif
  return dot_portable(a, b, n);
}

// Orders candidates as torch.topk does for distinct values (largest first, NaN above every number), the lower
// index first among equals, so the order is strict and weak and the sort well defined.
bool ranks_before(const float* v, int64_t a, int64_t b) {
  const bool na = std::isnan(v[a]), nb = std::isnan(v[b]);
  if (na != nb) return na;
  if (!na && v[a] != v[b]) return v[a] > v[b];
  return a < b;
}

// The k best of v[candidates] (in rank order) written to out.
void best(const float* v, std::vector<int64_t>& candidates, int64_t k, int64_t* out) {
  std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(),
                    [v](int64_t a, int64_t b) { return ranks_before(v, a, b); });
  std::copy(candidates.begin(), candidates.begin() + k, out);
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                             int64_t top_k, int64_t n_group, int64_t topk_group, bool normalize,
                                             double scaling) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "dsaserve moe_route: x must be bf16 or fp32 [T, hidden]");
  const int64_t T = x.size(0), H = x.size(1), E = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == H && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "dsaserve moe_route: weight must be contiguous fp32 [experts, hidden]");
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == E && bias.scalar_type() == at::kFloat && bias.is_contiguous(),
              "dsaserve moe_route: bias must be contiguous fp32 [experts]");
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group,
              "dsaserve moe_route: n_group must divide the experts and topk_group lie in 1 … n_group");
  TORCH_CHECK(top_k >= 1 && top_k <= E / n_group * topk_group, "dsaserve moe_route: top_k larger than the experts kept");
  TORCH_CHECK(n_group == 1 || E / n_group >= 2, "dsaserve moe_route: groups need two experts each");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor scores = at::empty({T, E}, weight.options());
  const float* xp = xf.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = scores.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1));  // 64 KiB of weights per task
  at::parallel_for(0, E, grain, [&](int64_t e0, int64_t e1) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = e0; e < e1; ++e) sp[t * E + e] = 1.f / (1.f + std::exp(-dot(xp + t * H, wp + e * H, H)));
  });
  at::Tensor weights = at::empty({T, top_k}, weight.options());
  at::Tensor ids = at::empty({T, top_k}, weight.options().dtype(at::kLong));
  const float* b = bias.data_ptr<float>();
  const int64_t per_group = E / n_group;
  std::vector<float> choice(E), group_score(n_group);
  std::vector<int64_t> candidates, groups(n_group), kept(topk_group);
  for (int64_t t = 0; t < T; ++t) {
    const float* s = sp + t * E;
    for (int64_t e = 0; e < E; ++e) choice[e] = s[e] + b[e];
    candidates.clear();
    if (n_group > 1) {
      for (int64_t g = 0; g < n_group; ++g) {
        std::vector<int64_t> members(per_group);
        std::iota(members.begin(), members.end(), g * per_group);
        int64_t two[2];
        best(choice.data(), members, 2, two);
        group_score[g] = choice[two[0]] + choice[two[1]];
      }
      std::iota(groups.begin(), groups.end(), 0);
      best(group_score.data(), groups, topk_group, kept.data());
      std::sort(kept.begin(), kept.end());
      for (int64_t g : kept)
        for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) candidates.push_back(e);
    } else {
      candidates.resize(E);
      std::iota(candidates.begin(), candidates.end(), 0);
    }
    int64_t* id = ids.data_ptr<int64_t>() + t * top_k;
    float* w = weights.data_ptr<float>() + t * top_k;
    best(choice.data(), candidates, top_k, id);
    float sum = 0.f;
    for (int64_t j = 0; j < top_k; ++j) sum += (w[j] = s[id[j]]);
    for (int64_t j = 0; j < top_k; ++j) {
      if (normalize) w[j] = w[j] / (sum + 1e-20f);
      w[j] = w[j] * static_cast<float>(scaling);
    }
  }
  return {weights, ids};
}

}  // namespace

// For decode_plan.cpp (layer_pieces.h).
std::tuple<at::Tensor, at::Tensor> dsaserve::moe_route(const at::Tensor& x, const at::Tensor& weight,
                                                       const at::Tensor& bias, int64_t top_k, int64_t n_group,
                                                       int64_t topk_group, bool normalize, double scaling) {
  return ::moe_route(x, weight, bias, top_k, n_group, topk_group, normalize, scaling);
}

namespace {
// Meta kernel: the output shapes without computing (meta tensors, tracing).
std::tuple<at::Tensor, at::Tensor> moe_route_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor&,
                                                  int64_t top_k, int64_t, int64_t, bool, double) {
  return {at::empty({x.size(0), top_k}, weight.options()), at::empty({x.size(0), top_k}, weight.options().dtype(at::kLong))};
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
  m.def("moe_route(Tensor x, Tensor weight, Tensor bias, int top_k, int n_group, int topk_group, bool normalize, "
        "float scaling) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) { m.impl("moe_route", &moe_route); }

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) { m.impl("moe_route", &moe_route_meta); }
