// KDA's gated delta rule (attention/delta_rule.py) over one request's rows, token by token, every head's state
// [dk, dv] updated in place:
//   S <- diag(exp(g_t)) S;  d = beta_t (v_t - S^T k_t);  S <- S + k_t d^T;  o_t = S^T q_t
// Two passes over S per token: decay fused with the prediction, then the update fused with the output. A head's
// state (64 KiB at 128 x 128) stays in cache for all its tokens, so the work is arithmetic, not memory: the same
// multiply-adds per token as the chunked form's matrix products (at 16-token chunks), without its per-chunk
// operator calls. Heads are shared over torch's threads.
// q, k, g [T, H, dk], v [T, H, dv], beta [T, H], state [H, dk, dv]: fp32, contiguous; returns o [T, H, dv] fp32.
// One portable body, compiled three times: for the AVX-512 family, for AVX2 and for neither (cpu_features.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_features.h"

namespace {

struct DeltaProblem {
    const float *q, *k, *v, *g, *beta;
    float *state, *out;
    int64_t T, H, dk, dv;
};

__attribute__((always_inline)) inline void one_head(const DeltaProblem& p, int64_t h, float* scratch) {
    const int64_t dk = p.dk, dv = p.dv;
    float* __restrict S = p.state + h * dk * dv;
    float* __restrict d = scratch;  // dv: the prediction, then delta
    float* __restrict decay = scratch + dv;  // dk
    for (int64_t t = 0; t < p.T; ++t) {
        const int64_t row = t * p.H + h;
        const float* __restrict q = p.q + row * dk;
        const float* __restrict k = p.k + row * dk;
        const float* __restrict g = p.g + row * dk;
        const float* __restrict v = p.v + row * dv;
        float* __restrict o = p.out + row * dv;
        for (int64_t c = 0; c < dk; ++c) decay[c] = std::exp(g[c]);
        for (int64_t j = 0; j < dv; ++j) d[j] = 0.0f;
        for (int64_t c = 0; c < dk; ++c) {
            float* __restrict s = S + c * dv;
            const float e = decay[c], kc = k[c];
            for (int64_t j = 0; j < dv; ++j) {
                s[j] *= e;
                d[j] += kc * s[j];
            }
        }
        const float b = p.beta[row];
        for (int64_t j = 0; j < dv; ++j) {
            d[j] = b * (v[j] - d[j]);
            o[j] = 0.0f;
        }
        for (int64_t c = 0; c < dk; ++c) {
            float* __restrict s = S + c * dv;
            const float kc = k[c], qc = q[c];
            for (int64_t j = 0; j < dv; ++j) {
                s[j] += kc * d[j];
                o[j] += qc * s[j];
            }
        }
    }
}

// The heads [h0, h1): one_head inlined into a function compiled for each family, so its loops take that width.
using HeadsBody = void (*)(const DeltaProblem&, int64_t, int64_t, float*);
#if DSASERVE_X86
__attribute__((target("avx512f,fma"))) void heads_avx512(const DeltaProblem& p, int64_t h0, int64_t h1, float* s) {
    for (int64_t h = h0; h < h1; ++h) one_head(p, h, s);
}
__attribute__((target("avx2,fma"))) void heads_avx2(const DeltaProblem& p, int64_t h0, int64_t h1, float* s) {
    for (int64_t h = h0; h < h1; ++h) one_head(p, h, s);
}
#endif
void heads_portable(const DeltaProblem& p, int64_t h0, int64_t h1, float* s) {
    for (int64_t h = h0; h < h1; ++h) one_head(p, h, s);
}

HeadsBody chosen_body() {
#if DSASERVE_X86
    if (dsaserve::use_avx512_bf16()) return heads_avx512;
    if (dsaserve::use_avx2()) return heads_avx2;
#endif
    return heads_portable;
}

void check_fp32(const at::Tensor& t, int64_t dims, const char* name) {
    TORCH_CHECK(t.dim() == dims && t.scalar_type() == at::kFloat && t.is_contiguous(), "dsaserve kda_delta: ", name,
                " must be a contiguous fp32 tensor of ", dims, " dims");
}

at::Tensor kda_delta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                     const at::Tensor& beta, at::Tensor state) {
    check_fp32(q, 3, "q");
    check_fp32(k, 3, "k");
    check_fp32(v, 3, "v");
    check_fp32(g, 3, "g");
    check_fp32(beta, 2, "beta");
    check_fp32(state, 3, "state");
    const int64_t T = q.size(0), H = q.size(1), dk = q.size(2), dv = v.size(2);
    TORCH_CHECK(k.sizes() == q.sizes() && g.sizes() == q.sizes() && v.size(0) == T && v.size(1) == H &&
                    beta.size(0) == T && beta.size(1) == H && state.size(0) == H && state.size(1) == dk &&
                    state.size(2) == dv,
                "dsaserve kda_delta: shapes must be q, k, g [T, H, dk], v [T, H, dv], beta [T, H], state [H, dk, dv]");
    at::Tensor out = at::empty({T, H, dv}, q.options());
    const DeltaProblem p{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                         beta.data_ptr<float>(), state.data_ptr<float>(), out.data_ptr<float>(), T, H, dk, dv};
    const HeadsBody body = chosen_body();
    at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
        std::vector<float> scratch(dv + dk);
        body(p, h0, h1, scratch.data());
    });
    return out;
}

at::Tensor kda_delta_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor& v, const at::Tensor&,
                          const at::Tensor&, at::Tensor) {
    return at::empty({q.size(0), q.size(1), v.size(2)}, q.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
    m.def("kda_delta(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) { m.impl("kda_delta", &kda_delta); }

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) { m.impl("kda_delta", &kda_delta_meta); }
