// A decoder layer's few-token step in two operators, each the chain of the layer's own operators (layer_pieces.h)
// called in C++: the functions the layer's modules call, in their order, so the same bits, without a Python
// call, an argument conversion and a dispatch per piece (model/decode_calls.py decides when a layer may).
//   decode_layer_in:  h = rms_norm(x); (query, q_resid) = mla_query(h); the step's latent rows written to the
//                     cache from kv_a_proj_with_mqa(h); in a full layer whose key cache is kept packed, the
//                     indexer's keys rope(LayerNorm(wk(h))) written to it too. Returns (h, query, q_resid): the
//                     indexer's selection reads h and q_resid, which is why the layer is cut here.
//   decode_layer_out: each row's attention over its cache slots (the backend's choice, made once per step),
//                     mla_output, the residual addition and post-attention norm, then the MLP: the router and
//                     the routed and shared experts (MoE layers, 10 tensors) or the gated MLP (dense layers,
//                     4 tensors), and the second residual addition. Returns the layer's output.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "layer_pieces.h"

namespace {

constexpr int64_t kHeadLanes = 16;  // the attention kernel's heads per register; fewer are padded with zeros

std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_layer_in(
    const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps, const at::Tensor& q_a_q,
    const at::Tensor& q_a_s, at::IntArrayRef q_a_args, const at::Tensor& q_norm_weight, double q_norm_eps,
    const at::Tensor& q_b_q, const at::Tensor& q_b_s, at::IntArrayRef q_b_args, const at::Tensor& w_uk_q,
    const at::Tensor& w_uk_s, at::IntArrayRef w_uk_args, const at::Tensor& cos, const at::Tensor& sin,
    bool interleaved, int64_t heads, int64_t nope, int64_t rope, const at::Tensor& kv_q, const at::Tensor& kv_s,
    at::IntArrayRef kv_args, const at::Tensor& latent_norm_weight, double latent_eps, bool latent_interleaved,
    at::Tensor rows, const at::Tensor& slot_mapping, const std::optional<at::Tensor>& wk_q,
    const std::optional<at::Tensor>& wk_s, at::IntArrayRef wk_args, const std::optional<at::Tensor>& k_norm_weight,
    const std::optional<at::Tensor>& k_norm_bias, double k_norm_eps, bool index_interleaved,
    const std::optional<at::Tensor>& key_groups) {
  TORCH_CHECK(kv_args.size() == 5, "dsaserve decode_layer_in: kv_args are (kind, group, col_offset, N, K)");
  const bool keys = key_groups.has_value();
  TORCH_CHECK(!keys || (wk_q && wk_s && wk_args.size() == 5 && k_norm_weight && k_norm_bias),
              "dsaserve decode_layer_in: the indexer's keys need wk (q, s, 5 args) and k_norm's weight and bias");
  const at::Tensor h = dsaserve::rms_norm(x, norm_weight, norm_eps);
  auto [query, q_resid] = dsaserve::mla_query(h, q_a_q, q_a_s, q_a_args, q_norm_weight, q_norm_eps, q_b_q, q_b_s,
                                              q_b_args, w_uk_q, w_uk_s, w_uk_args, cos, sin, interleaved, heads,
                                              nope, rope);
  const at::Tensor kv = dsaserve::packed_product(h, kv_q, kv_s, kv_args[0], kv_args[1], kv_args[2], kv_args[3],
                                                 kv_args[4]);
  dsaserve::write_latent_rows(kv, latent_norm_weight, latent_eps, cos, sin, latent_interleaved, rows, slot_mapping);
  if (keys) {  // model/indexer.py keys() and attention/indexer_cache.py write(), packed
    const at::Tensor k = dsaserve::packed_product(h, *wk_q, *wk_s, wk_args[0], wk_args[1], wk_args[2], wk_args[3],
                                                  wk_args[4]);
    const at::Tensor normed = at::layer_norm(k, {k.size(-1)}, *k_norm_weight, *k_norm_bias, k_norm_eps);
    at::Tensor groups = *key_groups;
    dsaserve::write_packed_keys(groups, slot_mapping.to(at::kLong).contiguous(),
                                dsaserve::apply_rope(normed, cos, sin, index_interleaved).to(at::kBFloat16).contiguous());
  }
  return {h, query, q_resid};
}

// out [T, heads, value_dim] (a view of whole-row products, as attention/sparse.py writes them) of each row's
// attention over its slots; fewer heads than the kernel's lanes are padded as native/selected_rows.py pads them.
at::Tensor attend(const at::Tensor& query, const at::Tensor& rows, const at::Tensor& slots, double scale,
                  int64_t value_dim) {
  const int64_t T = query.size(0), heads = query.size(1), dim = rows.size(1);
  const at::Tensor s = slots.to(at::kLong).contiguous();
  if (heads >= kHeadLanes) {
    at::Tensor out = at::empty({T, heads, dim}, query.options()).narrow(2, 0, value_dim);
    dsaserve::attend_selected_rows(query.contiguous(), rows, s, scale, out);
    return out;
  }
  at::Tensor out = at::empty({T, heads, value_dim}, query.options());
  at::Tensor wide = at::zeros({T, kHeadLanes, query.size(2)}, query.options());
  wide.narrow(1, 0, heads).copy_(query);
  at::Tensor result = at::empty({T, kHeadLanes, value_dim}, query.options());
  dsaserve::attend_selected_rows(wide, rows, s, scale, result);
  out.copy_(result.narrow(1, 0, heads));
  return out;
}

at::Tensor decode_layer_out(const at::Tensor& query, const at::Tensor& rows, const at::Tensor& slots, double scale,
                            int64_t value_dim, const at::Tensor& x, const at::Tensor& w_uv_q,
                            const at::Tensor& w_uv_s, at::IntArrayRef w_uv_args, const at::Tensor& o_q,
                            const at::Tensor& o_s, at::IntArrayRef o_args, const at::Tensor& post_weight,
                            double post_eps, at::TensorList mlp, at::IntArrayRef mlp_args, double routed_scaling) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kBFloat16 && rows.dim() == 2 &&
                  rows.is_contiguous() && slots.dim() == 2 && slots.size(0) == query.size(0),
              "dsaserve decode_layer_out: query bf16 [T, heads, dim], rows [N, dim] contiguous, slots [T, width]");
  const int64_t heads = query.size(1);
  TORCH_CHECK(dsaserve::selected_rows_fits(std::max(heads, kHeadLanes), rows.size(1), value_dim),
              "dsaserve decode_layer_out: the attention kernel does not take ", heads, " heads of ", rows.size(1),
              " dims with ", value_dim, " value columns on this CPU");
  const at::Tensor latent = attend(query, rows, slots, scale, value_dim);
  const at::Tensor attended = dsaserve::mla_output(latent, w_uv_q, w_uv_s, w_uv_args, o_q, o_s, o_args);
  auto [h, residual] = dsaserve::add_rms_norm(x, attended, post_weight, post_eps);
  if (mlp.size() == 4) {  // dense: (gate|up q, s, down q, s); args (kind, inter, gate_up_group, down_group, col)
    TORCH_CHECK(mlp_args.size() == 5, "dsaserve decode_layer_out: a dense MLP's args are (kind, inter, "
                "gate_up_group, down_group, down_col_offset)");
    return at::add(residual, dsaserve::gated_mlp(h, mlp[0], mlp[1], mlp[2], mlp[3], mlp_args[0], mlp_args[1],
                                                 mlp_args[2], mlp_args[3], mlp_args[4]));
  }
  // MoE: (router weight, bias, experts' gate|up q, s, down q, s, the shared expert's gate|up q, s, down q, s);
  // args (top_k, n_group, topk_group, normalize, kind, inter, gate_up_group, down_group, down_col_offset,
  // shared_inter, shared_gate_up_group, shared_down_group, shared_down_col_offset).
  TORCH_CHECK(mlp.size() == 10 && mlp_args.size() == 13,
              "dsaserve decode_layer_out: a MoE layer takes 10 tensors and 13 args, a dense MLP 4 and 5");
  auto [weights, ids] = dsaserve::moe_route(h, mlp[0], mlp[1], mlp_args[0], mlp_args[1], mlp_args[2],
                                            mlp_args[3] != 0, routed_scaling);
  at::Tensor out = at::empty_like(h);
  dsaserve::moe_experts(h.contiguous(), mlp[2], mlp[3], mlp[4], mlp[5], ids.contiguous(),
                        weights.to(at::kFloat).contiguous(), out, mlp_args[4], mlp_args[5], mlp_args[6], mlp_args[7],
                        mlp_args[8], mlp[6], mlp[7], mlp[8], mlp[9], mlp_args[9], mlp_args[10], mlp_args[11],
                        mlp_args[12]);
  return at::add(residual, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
  m.def("decode_layer_in(Tensor x, Tensor norm_weight, float norm_eps, Tensor q_a_q, Tensor q_a_s, int[] q_a_args, "
        "Tensor q_norm_weight, float q_norm_eps, Tensor q_b_q, Tensor q_b_s, int[] q_b_args, Tensor w_uk_q, "
        "Tensor w_uk_s, int[] w_uk_args, Tensor cos, Tensor sin, bool interleaved, int heads, int nope, int rope, "
        "Tensor kv_q, Tensor kv_s, int[] kv_args, Tensor latent_norm_weight, float latent_eps, "
        "bool latent_interleaved, Tensor(a!) rows, Tensor slot_mapping, Tensor? wk_q=None, Tensor? wk_s=None, "
        "int[] wk_args=[], Tensor? k_norm_weight=None, Tensor? k_norm_bias=None, float k_norm_eps=0., "
        "bool index_interleaved=False, Tensor(b!)? key_groups=None) -> (Tensor, Tensor, Tensor)");
  m.def("decode_layer_out(Tensor query, Tensor rows, Tensor slots, float scale, int value_dim, Tensor x, "
        "Tensor w_uv_q, Tensor w_uv_s, int[] w_uv_args, Tensor o_q, Tensor o_s, int[] o_args, Tensor post_weight, "
        "float post_eps, Tensor[] mlp, int[] mlp_args, float routed_scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) {
  m.impl("decode_layer_in", &decode_layer_in);
  m.impl("decode_layer_out", &decode_layer_out);
}
