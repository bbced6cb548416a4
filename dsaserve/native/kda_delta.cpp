// KDA's gated delta rule (attention/delta_rule.py) over one request's rows, token by token, every head's state
// [dk, dv] updated in place:
//   S <- diag(exp(g_t)) S;  d = beta_t (v_t - S^T k_t);  S <- S + k_t d^T;  o_t = S^T q_t
// Each column j of S evolves on its own (its delta and output read only column j), so a head's state is taken in
// blocks of 16 columns: a block's [dk, 16] slice (8 KiB at dk 128) stays in L1 while a tile of rows passes, and per
// row it takes two sweeps over the slice: decay fused with the prediction, then the update fused with the output,
// 16 lanes at a time in GCC vector types (one AVX-512 register, two AVX2 ones, four SSE ones). The state is copied
// into aligned slices once per call and back at the end. Heads are shared over torch's threads. exp(g) is taken
// once per call (torch's vectorised exp), not per block.
// q, k, g [T, H, dk], v [T, H, dv], beta [T, H], state [H, dk, dv]: fp32, contiguous; returns o [T, H, dv] fp32.
// One portable body, compiled three times: for the AVX-512 family, for AVX2 and for neither (cpu_features.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"

namespace {

constexpr int64_t kLanes = 16;  // columns per block
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

struct DeltaProblem {
    const float *q, *k, *v, *decay, *beta;  // decay = exp(g), computed once for all blocks
    float *state, *out;
    int64_t T, H, dk, dv;
};

// The two sweeps over a slice's rows c (each row one Lanes), with four partial sums so the reductions over dk
// are not one chain of dependent multiply-adds (eight, written as an array, ran slower: not kept in registers).

// S[c] <- S[c] · e[c], and Σ_c k[c] S[c] (the prediction).
__attribute__((always_inline)) inline Lanes decay_and_predict(Lanes* S, const float* e, const float* k, int64_t dk) {
    Lanes p0 = {}, p1 = {}, p2 = {}, p3 = {};
    int64_t c = 0;
    for (; c + 4 <= dk; c += 4) {
        S[c] *= e[c];
        p0 += k[c] * S[c];
        S[c + 1] *= e[c + 1];
        p1 += k[c + 1] * S[c + 1];
        S[c + 2] *= e[c + 2];
        p2 += k[c + 2] * S[c + 2];
        S[c + 3] *= e[c + 3];
        p3 += k[c + 3] * S[c + 3];
    }
    for (; c < dk; ++c) {
        S[c] *= e[c];
        p0 += k[c] * S[c];
    }
    return (p0 + p1) + (p2 + p3);
}

// S[c] <- S[c] + k[c] · d, and Σ_c q[c] S[c] (the output).
__attribute__((always_inline)) inline Lanes update_and_output(Lanes* S, const float* k, const float* q, Lanes d,
                                                              int64_t dk) {
    Lanes o0 = {}, o1 = {}, o2 = {}, o3 = {};
    int64_t c = 0;
    for (; c + 4 <= dk; c += 4) {
        S[c] += k[c] * d;
        o0 += q[c] * S[c];
        S[c + 1] += k[c + 1] * d;
        o1 += q[c + 1] * S[c + 1];
        S[c + 2] += k[c + 2] * d;
        o2 += q[c + 2] * S[c + 2];
        S[c + 3] += k[c + 3] * d;
        o3 += q[c + 3] * S[c + 3];
    }
    for (; c < dk; ++c) {
        S[c] += k[c] * d;
        o0 += q[c] * S[c];
    }
    return (o0 + o1) + (o2 + o3);
}

// Rows [t0, t1) of head h for its columns [j0, j0 + width) (width <= kLanes; the lanes past it hold zeros and stay
// zero), the columns' state slice in `block` (dk aligned Lanes).
__attribute__((always_inline)) inline void block_rows(const DeltaProblem& p, int64_t h, int64_t j0, int64_t t0,
                                                      int64_t t1, Lanes* block) {
    const int64_t dk = p.dk, dv = p.dv, width = std::min(kLanes, dv - j0);
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t row = t * p.H + h;
        Lanes v = {};  // (memcpy: rows are not 64-byte aligned; at a constant size it is one unaligned load)
        if (width == kLanes)
            std::memcpy(&v, p.v + row * dv + j0, sizeof(Lanes));
        else
            std::memcpy(&v, p.v + row * dv + j0, width * sizeof(float));
        const Lanes predicted = decay_and_predict(block, p.decay + row * dk, p.k + row * dk, dk);
        const Lanes d = p.beta[row] * (v - predicted);
        const Lanes o = update_and_output(block, p.k + row * dk, p.q + row * dk, d, dk);
        if (width == kLanes)
            std::memcpy(p.out + row * dv + j0, &o, sizeof(Lanes));
        else
            std::memcpy(p.out + row * dv + j0, &o, width * sizeof(float));
    }
}

// Head h over all rows. Its state goes into `slices` (blocks × dk aligned Lanes, column block b at b × dk) and
// back; rows go kTileRows at a time, each column block taking the whole tile in turn, so a tile's q, k and decay
// rows are read from memory once (they are H rows apart) and its slice stays in L1 while it does.
constexpr int64_t kTileRows = 32;
__attribute__((always_inline)) inline void one_head(const DeltaProblem& p, int64_t h, Lanes* slices) {
    const int64_t dk = p.dk, dv = p.dv, blocks = (dv + kLanes - 1) / kLanes;
    float* S = p.state + h * dk * dv;
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t width = std::min(kLanes, dv - b * kLanes);
        for (int64_t c = 0; c < dk; ++c) {
            slices[b * dk + c] = Lanes{};
            std::memcpy(&slices[b * dk + c], S + c * dv + b * kLanes, width * sizeof(float));
        }
    }
    for (int64_t t0 = 0; t0 < p.T; t0 += kTileRows)
        for (int64_t b = 0; b < blocks; ++b)
            block_rows(p, h, b * kLanes, t0, std::min(p.T, t0 + kTileRows), slices + b * dk);
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t width = std::min(kLanes, dv - b * kLanes);
        for (int64_t c = 0; c < dk; ++c)
            std::memcpy(S + c * dv + b * kLanes, &slices[b * dk + c], width * sizeof(float));
    }
}

// Heads [h0, h1): one_head inlined into a function compiled for each family, so its vector types take that
// family's registers.
using HeadsBody = void (*)(const DeltaProblem&, int64_t, int64_t, Lanes*);
#if DSASERVE_X86
__attribute__((target("avx512f,fma"))) void heads_avx512(const DeltaProblem& p, int64_t h0, int64_t h1, Lanes* s) {
    for (int64_t h = h0; h < h1; ++h) one_head(p, h, s);
}
__attribute__((target("avx2,fma"))) void heads_avx2(const DeltaProblem& p, int64_t h0, int64_t h1, Lanes* s) {
    for (int64_t h = h0; h < h1; ++h) one_head(p, h, s);
}
#endif
void heads_portable(const DeltaProblem& p, int64_t h0, int64_t h1, Lanes* s) {
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
    const at::Tensor decay = g.exp();
    const DeltaProblem p{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), decay.data_ptr<float>(),
                         beta.data_ptr<float>(), state.data_ptr<float>(), out.data_ptr<float>(), T, H, dk, dv};
    const HeadsBody body = chosen_body();
    const int64_t blocks = (dv + kLanes - 1) / kLanes;
    at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
        // blocks × dk Lanes at 64 bytes, aligned by hand: alignof(Lanes) here is the default target's (16), not the
        // AVX-512 body's, so neither a vector of Lanes nor alignof gives what that body's aligned stores need.
        std::vector<float> raw((blocks * dk + 1) * kLanes);
        const auto aligned = (reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t{63};
        body(p, h0, h1, reinterpret_cast<Lanes*>(aligned));
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
