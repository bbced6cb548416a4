// A decoder layer's few-token step in two halves, each the chain of the layer's own operators (layer_pieces.h)
// called in C++: the functions the layer's modules call, in their order, so the same bits, without a Python
// call, an argument conversion and a dispatch per piece (model/decode_calls.py decides when a layer may).
//   in:  h = rms_norm(x); (query, q_resid) = mla_query(h); the step's latent rows written to the cache from
//        kv_a_proj_with_mqa(h); in a full layer whose key cache is kept packed, the indexer's keys
//        rope(LayerNorm(wk(h))) written to it too. Gives (h, query, q_resid): the indexer's selection reads h
//        and q_resid, which is why a layer is cut here.
//   out: each row's attention over its cache slots (the backend's choice, made once per step), mla_output, the
//        residual addition and post-attention norm, then the MLP: the router and the routed and shared experts
//        (MoE layers, 10 tensors) or the gated MLP (dense layers, 4 tensors), and the second residual addition.
//        Gives the layer's output.
// A layer's weights and constants are bound once (decode_layer_bind, decode_layer_bind_out: a handle, released
// by decode_layer_release), and one decode_layers call runs a run of layers' halves back to back, up to the next
// layer whose selection Python makes: a step's Python and argument conversion paid per run, not per half. Where
// a full layer's indexer queries are bound too (decode_layer_bind_selection) and every request of a decode step is
// past index_topk, the call selects between a full layer's halves itself, and a step is one call.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

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
    const std::optional<at::Tensor>& key_groups, const std::optional<at::Tensor>& key_scales) {
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
    const at::Tensor rotated = dsaserve::apply_rope(normed, cos, sin, index_interleaved).to(at::kBFloat16).contiguous();
    if (key_scales.has_value()) {  // int8 keys (index_scores_int8.cpp's layout), rounded as indexer_cache.py rounds
      at::Tensor scales = *key_scales;
      dsaserve::write_int8_keys(groups, scales, slot_mapping.to(at::kLong).contiguous(), rotated);
    } else {
      dsaserve::write_packed_keys(groups, slot_mapping.to(at::kLong).contiguous(), rotated);
    }
  }
  return {h, query, q_resid};
}

// y = x + y, elementwise, rounded to their dtype as torch's addition rounds it (x, y contiguous, alike).
void add_into(const at::Tensor& x, at::Tensor& y) {
  const int64_t n = y.numel();
  if (y.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* a = x.data_ptr<c10::BFloat16>();
    c10::BFloat16* b = y.data_ptr<c10::BFloat16>();
    for (int64_t k = 0; k < n; ++k)
      b[k] = static_cast<c10::BFloat16>(static_cast<float>(a[k]) + static_cast<float>(b[k]));
  } else {
    const float* a = x.data_ptr<float>();
    float* b = y.data_ptr<float>();
    for (int64_t k = 0; k < n; ++k) b[k] = a[k] + b[k];
  }
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
  add_into(residual, out);
  return out;
}

// decode_layer_in's arguments but the step's (x, cos, sin, rows, slot_mapping, key groups).
struct LayerIn {
  at::Tensor norm_weight;
  double norm_eps;
  at::Tensor q_a_q, q_a_s;
  std::vector<int64_t> q_a_args;
  at::Tensor q_norm_weight;
  double q_norm_eps;
  at::Tensor q_b_q, q_b_s;
  std::vector<int64_t> q_b_args;
  at::Tensor w_uk_q, w_uk_s;
  std::vector<int64_t> w_uk_args;
  bool interleaved;
  int64_t heads, nope, rope;
  at::Tensor kv_q, kv_s;
  std::vector<int64_t> kv_args;
  at::Tensor latent_norm_weight;
  double latent_eps;
  bool latent_interleaved;
  std::optional<at::Tensor> wk_q, wk_s;
  std::vector<int64_t> wk_args;
  std::optional<at::Tensor> k_norm_weight, k_norm_bias;
  double k_norm_eps;
  bool index_interleaved;
};

// decode_layer_out's arguments but the step's (query, rows, slots, x).
struct LayerOut {
  double scale;
  int64_t value_dim;
  at::Tensor w_uv_q, w_uv_s;
  std::vector<int64_t> w_uv_args;
  at::Tensor o_q, o_s;
  std::vector<int64_t> o_args;
  at::Tensor post_weight;
  double post_eps;
  std::vector<at::Tensor> mlp;
  std::vector<int64_t> mlp_args;
  double routed_scaling;
};

// A full layer's indexer queries (model/indexer.py Indexer.queries: wq_b packed, weights_proj in fp32, the rotary
// on the first dims), bound where decode_layers may select in the call.
struct LayerSelection {
  at::Tensor wq_q, wq_s;
  std::vector<int64_t> wq_args;  // (kind, group, col_offset, N, K)
  at::Tensor weights_proj;       // fp32 [heads, hidden]
  double weight_scale;
  int64_t heads, head_dim;
  bool interleaved;
};

struct BoundLayer {
  LayerIn in;
  std::optional<LayerOut> out;
  std::optional<LayerSelection> selection;
};

// Bound layers by handle. They hold their weights (tensor references) until released.
class Bindings {
 public:
  int64_t add(std::shared_ptr<BoundLayer> layer) {
    std::lock_guard<std::mutex> guard(mutex_);
    layers_[next_] = std::move(layer);
    return next_++;
  }
  std::shared_ptr<BoundLayer> get(int64_t handle) {
    std::lock_guard<std::mutex> guard(mutex_);
    const auto found = layers_.find(handle);
    TORCH_CHECK(found != layers_.end(), "dsaserve decode_layers: no bound layer ", handle,
                " (released, or never bound: decode_layer_bind makes handles)");
    return found->second;
  }
  void release(int64_t handle) {
    std::lock_guard<std::mutex> guard(mutex_);
    layers_.erase(handle);
  }

 private:
  std::mutex mutex_;
  std::unordered_map<int64_t, std::shared_ptr<BoundLayer>> layers_;
  int64_t next_ = 1;
};

Bindings& bindings() {
  static Bindings* all = new Bindings();  // never destroyed: handles may be released during interpreter exit
  return *all;
}

std::vector<int64_t> ints(at::IntArrayRef values) { return values.vec(); }

int64_t decode_layer_bind(
    const at::Tensor& norm_weight, double norm_eps, const at::Tensor& q_a_q, const at::Tensor& q_a_s,
    at::IntArrayRef q_a_args, const at::Tensor& q_norm_weight, double q_norm_eps, const at::Tensor& q_b_q,
    const at::Tensor& q_b_s, at::IntArrayRef q_b_args, const at::Tensor& w_uk_q, const at::Tensor& w_uk_s,
    at::IntArrayRef w_uk_args, bool interleaved, int64_t heads, int64_t nope, int64_t rope, const at::Tensor& kv_q,
    const at::Tensor& kv_s, at::IntArrayRef kv_args, const at::Tensor& latent_norm_weight, double latent_eps,
    bool latent_interleaved, const std::optional<at::Tensor>& wk_q, const std::optional<at::Tensor>& wk_s,
    at::IntArrayRef wk_args, const std::optional<at::Tensor>& k_norm_weight,
    const std::optional<at::Tensor>& k_norm_bias, double k_norm_eps, bool index_interleaved) {
  TORCH_CHECK(kv_args.size() == 5, "dsaserve decode_layer_bind: kv_args are (kind, group, col_offset, N, K)");
  auto layer = std::make_shared<BoundLayer>();
  layer->in = LayerIn{norm_weight, norm_eps, q_a_q, q_a_s, ints(q_a_args), q_norm_weight, q_norm_eps, q_b_q, q_b_s,
                      ints(q_b_args), w_uk_q, w_uk_s, ints(w_uk_args), interleaved, heads, nope, rope, kv_q, kv_s,
                      ints(kv_args), latent_norm_weight, latent_eps, latent_interleaved, wk_q, wk_s, ints(wk_args),
                      k_norm_weight, k_norm_bias, k_norm_eps, index_interleaved};
  return bindings().add(std::move(layer));
}

// Adds the second half's weights to a bound layer (before any step runs it).
void decode_layer_bind_out(int64_t handle, double scale, int64_t value_dim, const at::Tensor& w_uv_q,
                           const at::Tensor& w_uv_s, at::IntArrayRef w_uv_args, const at::Tensor& o_q,
                           const at::Tensor& o_s, at::IntArrayRef o_args, const at::Tensor& post_weight,
                           double post_eps, at::TensorList mlp, at::IntArrayRef mlp_args, double routed_scaling) {
  TORCH_CHECK(mlp.size() == 4 || mlp.size() == 10, "dsaserve decode_layer_bind_out: a MoE layer takes 10 tensors, "
              "a dense MLP 4");
  bindings().get(handle)->out = LayerOut{scale, value_dim, w_uv_q, w_uv_s, ints(w_uv_args), o_q, o_s, ints(o_args),
                                         post_weight, post_eps, mlp.vec(), ints(mlp_args), routed_scaling};
}

// Adds a full layer's indexer queries to a bound layer (before any step runs it).
void decode_layer_bind_selection(int64_t handle, const at::Tensor& wq_q, const at::Tensor& wq_s,
                                 at::IntArrayRef wq_args, const at::Tensor& weights_proj, double weight_scale,
                                 int64_t heads, int64_t head_dim, bool interleaved) {
  TORCH_CHECK(wq_args.size() == 5 && weights_proj.scalar_type() == at::kFloat && weights_proj.dim() == 2 &&
                  weights_proj.size(0) == heads,
              "dsaserve decode_layer_bind_selection: wq_args are (kind, group, col_offset, N, K) and weights_proj "
              "fp32 [heads, hidden]");
  bindings().get(handle)->selection = LayerSelection{wq_q, wq_s, ints(wq_args), weights_proj, weight_scale, heads,
                                                     head_dim, interleaved};
}

void decode_layer_release(int64_t handle) { bindings().release(handle); }

// A decode batch's selection in a full layer and the slots its layers attend to: the indexer's queries from the
// in half's (h, q_resid) as Indexer.queries makes them, attention/indexer.py select() (decode_selection.cpp), then
// attention/sparse.py selected_rows' slots. `selection` = (width, chunk_blocks, window_blocks, block_size).
at::Tensor select_slots(const LayerSelection& l, const at::Tensor& h, const at::Tensor& q_resid,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& groups,
                        const std::optional<at::Tensor>& scales, const at::Tensor& block_tables,
                        at::IntArrayRef seq_lens, at::IntArrayRef selection) {
  const at::Tensor projected = dsaserve::packed_product(q_resid, l.wq_q, l.wq_s, l.wq_args[0], l.wq_args[1],
                                                        l.wq_args[2], l.wq_args[3], l.wq_args[4]);
  const at::Tensor q = dsaserve::apply_rope(projected.view({-1, l.heads, l.head_dim}), cos, sin, l.interleaved);
  const at::Tensor weights = at::linear(h.to(at::kFloat), l.weights_proj) * l.weight_scale;
  const at::Tensor topk = dsaserve::decode_selection(q.contiguous(), weights.contiguous(), groups, block_tables,
                                                     seq_lens, selection[0], selection[1], selection[2], scales);
  return dsaserve::position_slots(block_tables, topk, selection[3]);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_in(const LayerIn& l, const at::Tensor& x, const at::Tensor& cos,
                                                      const at::Tensor& sin, const at::Tensor& rows,
                                                      const at::Tensor& slot_mapping,
                                                      const std::optional<at::Tensor>& key_groups,
                                                      const std::optional<at::Tensor>& key_scales) {
  return decode_layer_in(x, l.norm_weight, l.norm_eps, l.q_a_q, l.q_a_s, l.q_a_args, l.q_norm_weight, l.q_norm_eps,
                         l.q_b_q, l.q_b_s, l.q_b_args, l.w_uk_q, l.w_uk_s, l.w_uk_args, cos, sin, l.interleaved,
                         l.heads, l.nope, l.rope, l.kv_q, l.kv_s, l.kv_args, l.latent_norm_weight, l.latent_eps,
                         l.latent_interleaved, rows, slot_mapping, l.wk_q, l.wk_s, l.wk_args, l.k_norm_weight,
                         l.k_norm_bias, l.k_norm_eps, l.index_interleaved, key_groups, key_scales);
}

at::Tensor run_out(const BoundLayer& layer, int64_t handle, const at::Tensor& query, const at::Tensor& rows,
                   const at::Tensor& slots, const at::Tensor& x) {
  TORCH_CHECK(layer.out.has_value(), "dsaserve decode_layers: layer ", handle, " has no second half bound "
              "(decode_layer_bind_out)");
  const LayerOut& l = *layer.out;
  return decode_layer_out(query, rows, slots, l.scale, l.value_dim, x, l.w_uv_q, l.w_uv_s, l.w_uv_args, l.o_q, l.o_s,
                          l.o_args, l.post_weight, l.post_eps, l.mlp, l.mlp_args, l.routed_scaling);
}

// A run of bound layers' halves, back to back: with `query` (the first layer's, from an earlier call), the first
// layer's out with `slots`, then for each later layer its in, and its out (with the same slots) but for the last
// layer, whose in ends the run unless `finish` (then its out follows); without `query`, the first layer's in
// starts the run. Returns (x, h, query, q_resid): the output of the last out (x itself if none), and the last
// in's results (undefined if the run ends with an out). rows and key_groups: each layer's cache rows and indexer
// key groups (None: no keys in the call); key_scales, empty or one per layer: an int8 key cache's scales (its
// groups then in the int8 layout), None for bf16 keys. With block_tables, the run is a whole decode step whose
// every request is past its selection's width: each layer with a bound selection selects after its in (in its key
// groups) and the slots follow from it for its out and the shared layers' after it (select_slots).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> decode_layers(
    at::IntArrayRef layers, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::TensorList rows,
    const at::Tensor& slot_mapping, const c10::List<std::optional<at::Tensor>>& key_groups,
    const c10::List<std::optional<at::Tensor>>& key_scales, const std::optional<at::Tensor>& query,
    const std::optional<at::Tensor>& slots, bool finish, const std::optional<at::Tensor>& block_tables,
    at::IntArrayRef seq_lens, at::IntArrayRef selection) {
  const int64_t n = static_cast<int64_t>(layers.size());
  const bool selects = block_tables.has_value();
  TORCH_CHECK(!selects || (!query.has_value() && !slots.has_value() && finish && selection.size() == 4),
              "dsaserve decode_layers: a run that selects is a whole step (no query, no slots, finish) with "
              "selection = (width, chunk_blocks, window_blocks, block_size)");
  TORCH_CHECK(key_scales.empty() || static_cast<int64_t>(key_scales.size()) == n,
              "dsaserve decode_layers: key_scales are none or one entry per layer; got ", key_scales.size(), " for ", n,
              " layers");
  TORCH_CHECK(n >= 1 && static_cast<int64_t>(rows.size()) == n && static_cast<int64_t>(key_groups.size()) == n,
              "dsaserve decode_layers: one cache (rows) and one key-group entry per layer, and a layer at least; got ",
              n, " layers, ", rows.size(), " caches, ", key_groups.size(), " key groups");
  TORCH_CHECK(slots.has_value() || selects || (!query.has_value() && n == 1 && !finish),
              "dsaserve decode_layers: a run with an out needs the step's slots");
  std::vector<std::shared_ptr<BoundLayer>> bound;
  bound.reserve(n);
  for (const int64_t handle : layers) bound.push_back(bindings().get(handle));
  TORCH_CHECK(!selects || bound[0]->selection.has_value(),
              "dsaserve decode_layers: a run that selects starts with a layer whose selection is bound");
  at::Tensor out = x, h, q, q_resid, step_slots = slots.has_value() ? *slots : at::Tensor();
  int64_t i = 0;
  if (query.has_value()) {
    out = run_out(*bound[0], layers[0], *query, rows[0], step_slots, out);
    i = 1;
  }
  for (; i < n; ++i) {
    const std::optional<at::Tensor> scales = key_scales.empty() ? std::nullopt : key_scales.get(i);
    std::tie(h, q, q_resid) = run_in(bound[i]->in, out, cos, sin, rows[i], slot_mapping, key_groups.get(i), scales);
    if (selects && bound[i]->selection.has_value()) {
      const std::optional<at::Tensor> groups = key_groups.get(i);
      TORCH_CHECK(groups.has_value(), "dsaserve decode_layers: layer ", layers[i], " selects but has no key groups");
      step_slots = select_slots(*bound[i]->selection, h, q_resid, cos, sin, *groups, scales, *block_tables, seq_lens,
                                selection);
    }
    if (i == n - 1 && !finish) return {out, h, q, q_resid};
    out = run_out(*bound[i], layers[i], q, rows[i], step_slots, out);
  }
  return {out, at::Tensor(), at::Tensor(), at::Tensor()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
  m.def("decode_layer_bind(Tensor norm_weight, float norm_eps, Tensor q_a_q, Tensor q_a_s, int[] q_a_args, "
        "Tensor q_norm_weight, float q_norm_eps, Tensor q_b_q, Tensor q_b_s, int[] q_b_args, Tensor w_uk_q, "
        "Tensor w_uk_s, int[] w_uk_args, bool interleaved, int heads, int nope, int rope, Tensor kv_q, Tensor kv_s, "
        "int[] kv_args, Tensor latent_norm_weight, float latent_eps, bool latent_interleaved, Tensor? wk_q=None, "
        "Tensor? wk_s=None, int[] wk_args=[], Tensor? k_norm_weight=None, Tensor? k_norm_bias=None, "
        "float k_norm_eps=0., bool index_interleaved=False) -> int", &decode_layer_bind);
  m.def("decode_layer_bind_out(int layer, float scale, int value_dim, Tensor w_uv_q, Tensor w_uv_s, int[] w_uv_args, "
        "Tensor o_q, Tensor o_s, int[] o_args, Tensor post_weight, float post_eps, Tensor[] mlp, int[] mlp_args, "
        "float routed_scaling) -> ()", &decode_layer_bind_out);
  m.def("decode_layer_bind_selection(int layer, Tensor wq_q, Tensor wq_s, int[] wq_args, Tensor weights_proj, "
        "float weight_scale, int heads, int head_dim, bool interleaved) -> ()", &decode_layer_bind_selection);
  m.def("decode_layer_release(int layer) -> ()", &decode_layer_release);
  m.def("decode_layers(int[] layers, Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] rows, Tensor slot_mapping, "
        "Tensor(b!)?[] key_groups, Tensor(c!)?[] key_scales, Tensor? query=None, Tensor? slots=None, "
        "bool finish=False, Tensor? block_tables=None, int[] seq_lens=[], int[] selection=[]) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) { m.impl("decode_layers", &decode_layers); }
