// A decode step's decoder layers as one list of native pieces, run back to back without Python between them.
//
// model/decode_plan.py builds the list once from the layers' own forward (traced) and each module's typed binding
// of its native arguments, so the order of operations is the modules' and every piece is the function the module
// itself calls for a few tokens (layer_pieces.h): the same bits. A piece reads and writes numbered registers (the
// plan's tensors of the step; register 0 is the residual stream a layer reads and the next layer gets). Per step,
// Python runs [start, stop) ranges of pieces, and does itself what a piece cannot here: a selection that needs the
// indexer's scores in Python, or attention whose rows are not one kernel call's. A plan is an object Python holds
// (torch.classes.dsaserve.DecodePlan): its weights' references go with it, nothing outlives the model.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <variant>
#include <vector>

#include "cpu_features.h"
#include "layer_pieces.h"

namespace {

// A packed weight: its bytes, its scales and the operators' (kind, group, col_offset, N, K).
struct Packed {
  at::Tensor q, s;
  std::vector<int64_t> args;
};

at::Tensor product(const at::Tensor& x, const Packed& w) {
  return dsaserve::packed_product(x, w.q, w.s, w.args[0], w.args[1], w.args[2], w.args[3], w.args[4]);
}

struct RmsNorm {  // h = norm(x)
  at::Tensor weight;
  double eps;
};
struct AddRmsNorm {  // (norm(a + b), a + b)
  at::Tensor weight;
  double eps;
};
struct MlaQuery {  // (query [T, heads, rank + rope], q_resid) of h
  Packed q_a;
  at::Tensor q_norm;
  double q_eps;
  Packed q_b, w_uk;
  bool interleaved;
  int64_t heads, nope, rope;
};
struct LatentRows {  // the step's latent cache rows, written at their slots
  Packed kv;
  at::Tensor norm;
  double eps;
  bool interleaved;
};
struct IndexKeys {  // the step's indexer keys, written to the layer's packed key cache (where the step has one)
  Packed wk;
  at::Tensor norm_weight, norm_bias;
  double eps;
  bool interleaved;
};
struct Queries {  // a full layer's indexer queries, for a selection made here
  Packed wq;
  at::Tensor weights_proj;  // fp32 [heads, hidden]
  double weight_scale;
  int64_t heads, head_dim;
  bool interleaved;
};
struct Select {  // the layer's selection: made here where the step asks for it, else the slots Python gave
  std::optional<Queries> queries;
};
struct Attend {  // latent [T, heads, value_dim] of the query over the step's slots
  double scale;
  int64_t value_dim;
};
struct MlaOutput {  // o_proj(latent · W_UVᵀ)
  Packed w_uv, o;
};
struct Moe {  // routed experts (and shared ones) of h
  at::Tensor router_weight, router_bias;
  int64_t top_k, n_group, topk_group;
  bool normalize;
  double scaling;
  Packed gate_up, down;
  std::optional<Packed> shared_gate_up, shared_down;
};
struct GatedMlp {  // down(silu(gate) · up) of h
  Packed gate_up, down;
};
struct Add {};  // a + b, rounded as torch rounds it

using Op = std::variant<RmsNorm, AddRmsNorm, MlaQuery, LatentRows, IndexKeys, Select, Attend, MlaOutput, Moe, GatedMlp,
                        Add>;

struct Piece {
  Op op;
  int64_t layer;  // which of the plan's layers (its caches)
  std::vector<int64_t> reads, writes;
};

Packed packed(const at::Tensor& q, const at::Tensor& s, const std::vector<int64_t>& args, const char* name) {
  TORCH_CHECK(args.size() == 5, "dsaserve DecodePlan: ", name, "'s args are (kind, group, col_offset, N, K)");
  return Packed{q, s, args};
}

// The attention kernel's heads per register: heads are padded with zero queries to a multiple of it.
int64_t head_lanes() { return dsaserve::use_avx2() ? 8 : 16; }

int64_t padded_heads(int64_t heads) { return (heads + head_lanes() - 1) / head_lanes() * head_lanes(); }

// out [T, heads, value_dim] (a view of whole-row products, as attention/sparse.py writes them) of each row's
// attention over its slots; heads short of the kernel's lanes are padded as native/selected_rows.py pads them.
at::Tensor attend(const at::Tensor& query, const at::Tensor& rows, const at::Tensor& slots, double scale,
                  int64_t value_dim) {
  const int64_t T = query.size(0), heads = query.size(1), dim = rows.size(1), padded = padded_heads(heads);
  const at::Tensor s = slots.to(at::kLong).contiguous();
  if (padded == heads) {
    at::Tensor out = at::empty({T, heads, dim}, query.options()).narrow(2, 0, value_dim);
    dsaserve::attend_selected_rows(query.contiguous(), rows, s, scale, out);
    return out;
  }
  at::Tensor out = at::empty({T, heads, value_dim}, query.options());
  at::Tensor wide = at::zeros({T, padded, query.size(2)}, query.options());
  wide.narrow(1, 0, heads).copy_(query);
  at::Tensor result = at::empty({T, padded, value_dim}, query.options());
  dsaserve::attend_selected_rows(wide, rows, s, scale, result);
  out.copy_(result.narrow(1, 0, heads));
  return out;
}

class DecodePlan : public torch::CustomClassHolder {
 public:
  // ---- building: one call per piece, in the order the pieces run (model/decode_plan.py) ----

  void add_rms_norm(int64_t layer, std::vector<int64_t> reads, std::vector<int64_t> writes, at::Tensor weight,
                    double eps) {
    add(RmsNorm{weight, eps}, layer, reads, writes, 1, 1);
  }
  void add_add_rms_norm(int64_t layer, std::vector<int64_t> reads, std::vector<int64_t> writes, at::Tensor weight,
                        double eps) {
    add(AddRmsNorm{weight, eps}, layer, reads, writes, 2, 2);
  }
  void add_mla_query(int64_t layer, std::vector<int64_t> reads, std::vector<int64_t> writes, at::Tensor q_a_q,
                     at::Tensor q_a_s, std::vector<int64_t> q_a_args, at::Tensor q_norm, double q_eps,
                     at::Tensor q_b_q, at::Tensor q_b_s, std::vector<int64_t> q_b_args, at::Tensor w_uk_q,
                     at::Tensor w_uk_s, std::vector<int64_t> w_uk_args, bool interleaved, int64_t heads, int64_t nope,
                     int64_t rope) {
    add(MlaQuery{packed(q_a_q, q_a_s, q_a_args, "q_a"), q_norm, q_eps, packed(q_b_q, q_b_s, q_b_args, "q_b"),
                 packed(w_uk_q, w_uk_s, w_uk_args, "w_uk"), interleaved, heads, nope, rope},
        layer, reads, writes, 1, 2);
  }
  void add_latent_rows(int64_t layer, std::vector<int64_t> reads, std::vector<int64_t> writes, at::Tensor kv_q,
                       at::Tensor kv_s, std::vector<int64_t> kv_args, at::Tensor norm, double eps, bool interleaved) {
    add(LatentRows{packed(kv_q, kv_s, kv_args, "kv"), norm, eps, interleaved}, layer, reads, writes, 1, 0);
  }
  void add_index_keys(int64_t layer, std::vector<int64_t> reads, std::vector<int64_t> writes, at::Tensor wk_q,
                      at::Tensor wk_s, std::vector<int64_t> wk_args, at::Tensor norm_weight, at::Tensor norm_bias,
                      double eps, bool interleaved) {
    add(IndexKeys{packed(wk_q, wk_s, wk_args, "wk"), norm_weight, norm_bias, eps, interleaved}, layer, reads, writes,
        1, 0);
  }
  // A selection whose queries are bound (it may be made here) or not (queries absent: the slots come from Python).
  void add_select(int64_t layer, std::vector<int64_t> reads, std::vector<int64_t> writes,
                  std::optional<at::Tensor> wq_q, std::optional<at::Tensor> wq_s, std::vector<int64_t> wq_args,
                  std::optional<at::Tensor> weights_proj, double weight_scale, int64_t heads, int64_t head_dim,
                  bool interleaved) {
    Select select;
    if (wq_q.has_value()) {
      TORCH_CHECK(wq_s && weights_proj && weights_proj->scalar_type() == at::kFloat && weights_proj->dim() == 2 &&
                      weights_proj->size(0) == heads,
                  "dsaserve DecodePlan: a selection's queries need wq (q, s) and weights_proj fp32 [heads, hidden]");
      select.queries = Queries{packed(*wq_q, *wq_s, wq_args, "wq"), *weights_proj, weight_scale, heads, head_dim,
                               interleaved};
    }
    add(select, layer, reads, writes, 2, 0);
  }
  void add_attend(int64_t layer, std::vector<int64_t> reads, std::vector<int64_t> writes, double scale,
                  int64_t value_dim) {
    add(Attend{scale, value_dim}, layer, reads, writes, 1, 1);
  }
  void add_mla_output(int64_t layer, std::vector<int64_t> reads, std::vector<int64_t> writes, at::Tensor w_uv_q,
                      at::Tensor w_uv_s, std::vector<int64_t> w_uv_args, at::Tensor o_q, at::Tensor o_s,
                      std::vector<int64_t> o_args) {
    add(MlaOutput{packed(w_uv_q, w_uv_s, w_uv_args, "w_uv"), packed(o_q, o_s, o_args, "o_proj")}, layer, reads,
        writes, 1, 1);
  }
  void add_moe(int64_t layer, std::vector<int64_t> reads, std::vector<int64_t> writes, at::Tensor router_weight,
               at::Tensor router_bias, int64_t top_k, int64_t n_group, int64_t topk_group, bool normalize,
               double scaling, at::Tensor gate_up_q, at::Tensor gate_up_s, std::vector<int64_t> gate_up_args,
               at::Tensor down_q, at::Tensor down_s, std::vector<int64_t> down_args,
               std::optional<at::Tensor> shared_gate_up_q, std::optional<at::Tensor> shared_gate_up_s,
               std::vector<int64_t> shared_gate_up_args, std::optional<at::Tensor> shared_down_q,
               std::optional<at::Tensor> shared_down_s, std::vector<int64_t> shared_down_args) {
    Moe moe{router_weight, router_bias, top_k, n_group, topk_group, normalize, scaling,
            packed(gate_up_q, gate_up_s, gate_up_args, "experts' gate_up"), packed(down_q, down_s, down_args,
                                                                                   "experts' down"),
            std::nullopt, std::nullopt};
    if (shared_gate_up_q.has_value()) {
      TORCH_CHECK(shared_gate_up_s && shared_down_q && shared_down_s, "dsaserve DecodePlan: shared experts need "
                  "gate_up and down (q, s)");
      moe.shared_gate_up = packed(*shared_gate_up_q, *shared_gate_up_s, shared_gate_up_args, "shared gate_up");
      moe.shared_down = packed(*shared_down_q, *shared_down_s, shared_down_args, "shared down");
    }
    add(moe, layer, reads, writes, 1, 1);
  }
  void add_gated_mlp(int64_t layer, std::vector<int64_t> reads, std::vector<int64_t> writes, at::Tensor gate_up_q,
                     at::Tensor gate_up_s, std::vector<int64_t> gate_up_args, at::Tensor down_q, at::Tensor down_s,
                     std::vector<int64_t> down_args) {
    add(GatedMlp{packed(gate_up_q, gate_up_s, gate_up_args, "gate_up"), packed(down_q, down_s, down_args, "down")},
        layer, reads, writes, 1, 1);
  }
  void add_add(int64_t layer, std::vector<int64_t> reads, std::vector<int64_t> writes) {
    add(Add{}, layer, reads, writes, 2, 1);
  }

  // ---- the caches: set when the engine's caches are first seen (they live as long as the engine) ----

  // Per layer: its latent cache as rows [slots, width], and its packed indexer keys (None: this layer's keys are
  // not written here) with their scales where int8 (None: bf16 keys).
  void set_caches(std::vector<at::Tensor> rows, std::vector<std::optional<at::Tensor>> key_groups,
                  std::vector<std::optional<at::Tensor>> key_scales) {
    TORCH_CHECK(rows.size() == key_groups.size() && rows.size() == key_scales.size(),
                "dsaserve DecodePlan.set_caches: one rows, key-group and key-scale entry per layer; got ", rows.size(),
                ", ", key_groups.size(), ", ", key_scales.size());
    for (const Piece& piece : pieces_)
      TORCH_CHECK(piece.layer < static_cast<int64_t>(rows.size()), "dsaserve DecodePlan.set_caches: a piece of layer ",
                  piece.layer, " but caches for ", rows.size(), " layers");
    rows_ = std::move(rows);
    key_groups_ = std::move(key_groups);
    key_scales_ = std::move(key_scales);
  }

  // ---- per step ----

  // Runs pieces [start, stop). x starts the step (start 0); slots: the rows each attention reads until a selection
  // made here replaces them; write_keys: whether the indexer's keys are written (off: a layer attending with an
  // earlier selection); with block_tables the step's selections are made here (every request past the selection's
  // width; `selection` = width, chunk_blocks, window_blocks, block_size). Returns the registers the piece at `stop`
  // reads (what Python needs to do it), or [x] once every piece has run.
  std::vector<at::Tensor> run(int64_t start, int64_t stop, std::optional<at::Tensor> x, at::Tensor cos,
                              at::Tensor sin, at::Tensor slot_mapping, std::optional<at::Tensor> slots,
                              bool write_keys, std::optional<at::Tensor> block_tables, std::vector<int64_t> seq_lens,
                              std::vector<int64_t> selection) {
    const int64_t n = static_cast<int64_t>(pieces_.size());
    TORCH_CHECK(0 <= start && start <= stop && stop <= n, "dsaserve DecodePlan.run: pieces [", start, ", ", stop,
                ") of ", n);
    TORCH_CHECK(!rows_.empty(), "dsaserve DecodePlan.run: set_caches first");
    TORCH_CHECK(!block_tables.has_value() || selection.size() == 4, "dsaserve DecodePlan.run: a step that selects "
                "here takes selection = (width, chunk_blocks, window_blocks, block_size)");
    if (start == 0) {
      TORCH_CHECK(x.has_value(), "dsaserve DecodePlan.run: a step starts with x");
      registers_.assign(registers_.size(), at::Tensor());
      registers_[0] = *x;
    }
    Step step{cos, sin, slot_mapping, slots.has_value() ? *slots : at::Tensor(), write_keys, block_tables, seq_lens,
              selection};
    for (int64_t i = start; i < stop; ++i) std::visit([&](const auto& op) { run_piece(op, pieces_[i], step); },
                                                     pieces_[i].op);
    if (stop == n) return {registers_[0]};
    std::vector<at::Tensor> reads;
    for (const int64_t r : pieces_[stop].reads) reads.push_back(registers_[r]);
    return reads;
  }

  // A register's tensor set from Python: what a piece it did (attention over rows of its own) writes.
  void set_register(int64_t index, at::Tensor value) {
    TORCH_CHECK(0 <= index && index < static_cast<int64_t>(registers_.size()), "dsaserve DecodePlan: no register ",
                index);
    registers_[index] = value;
  }

  int64_t size() const { return static_cast<int64_t>(pieces_.size()); }

 private:
  struct Step {
    at::Tensor cos, sin, slot_mapping, slots;
    bool write_keys;
    std::optional<at::Tensor> block_tables;
    std::vector<int64_t> seq_lens, selection;
  };

  void add(Op op, int64_t layer, const std::vector<int64_t>& reads, const std::vector<int64_t>& writes,
           size_t n_reads, size_t n_writes) {
    TORCH_CHECK(reads.size() == n_reads && writes.size() == n_writes, "dsaserve DecodePlan: a piece reads ", n_reads,
                " and writes ", n_writes, " registers; got ", reads.size(), " and ", writes.size());
    TORCH_CHECK(layer >= 0, "dsaserve DecodePlan: layer ", layer);
    int64_t highest = 0;
    for (const int64_t r : reads) highest = std::max(highest, r);
    for (const int64_t r : writes) highest = std::max(highest, r);
    if (highest >= static_cast<int64_t>(registers_.size())) registers_.resize(highest + 1);
    pieces_.push_back(Piece{std::move(op), layer, reads, writes});
  }

  at::Tensor& in(const Piece& p, size_t k) {
    at::Tensor& t = registers_[p.reads[k]];
    TORCH_CHECK(t.defined(), "dsaserve DecodePlan: register ", p.reads[k], " is read before it is written");
    return t;
  }
  void out(const Piece& p, size_t k, at::Tensor value) { registers_[p.writes[k]] = std::move(value); }

  void run_piece(const RmsNorm& op, const Piece& p, Step&) { out(p, 0, dsaserve::rms_norm(in(p, 0), op.weight, op.eps)); }

  void run_piece(const AddRmsNorm& op, const Piece& p, Step&) {
    auto [h, total] = dsaserve::add_rms_norm(in(p, 0), in(p, 1), op.weight, op.eps);
    out(p, 0, h);
    out(p, 1, total);
  }

  void run_piece(const MlaQuery& op, const Piece& p, Step& s) {
    auto [query, q_resid] = dsaserve::mla_query(in(p, 0), op.q_a.q, op.q_a.s, op.q_a.args, op.q_norm, op.q_eps,
                                                op.q_b.q, op.q_b.s, op.q_b.args, op.w_uk.q, op.w_uk.s, op.w_uk.args,
                                                s.cos, s.sin, op.interleaved, op.heads, op.nope, op.rope);
    out(p, 0, query);
    out(p, 1, q_resid);
  }

  void run_piece(const LatentRows& op, const Piece& p, Step& s) {
    dsaserve::write_latent_rows(product(in(p, 0), op.kv), op.norm, op.eps, s.cos, s.sin, op.interleaved,
                                rows_[p.layer], s.slot_mapping);
  }

  // model/indexer.py keys() and attention/indexer_cache.py write(): into the packed layout, or an fp32 model's keys
  // (the AVX2 body) into its plain fp32 cache [num_blocks, block_size, dim].
  void run_piece(const IndexKeys& op, const Piece& p, Step& s) {
    if (!s.write_keys || !key_groups_[p.layer].has_value()) return;
    const at::Tensor k = product(in(p, 0), op.wk);
    const at::Tensor normed = at::layer_norm(k, {k.size(-1)}, op.norm_weight, op.norm_bias, op.eps);
    at::Tensor groups = *key_groups_[p.layer];
    const at::Tensor slots = s.slot_mapping.to(at::kLong).contiguous();
    const at::Tensor roped = dsaserve::apply_rope(normed, s.cos, s.sin, op.interleaved);
    if (groups.scalar_type() == at::kFloat) {
      groups.view({-1, groups.size(-1)}).index_copy_(0, slots, roped.to(at::kFloat));
      return;
    }
    if (key_scales_[p.layer].has_value()) {  // int8 keys (index_scores_int8.cpp's layout), from the plan's dtype
      at::Tensor scales = *key_scales_[p.layer];
      dsaserve::write_int8_keys(groups, scales, slots, roped.contiguous());
    } else {
      dsaserve::write_packed_keys(groups, slots, roped.to(at::kBFloat16).contiguous());
    }
  }

  // A decode batch's selection (attention/indexer_selection.py select(), decode_selection.cpp) from the indexer's queries
  // (Indexer.queries), and the slots of the selected positions (attention/sparse.py selected_rows).
  void run_piece(const Select& op, const Piece& p, Step& s) {
    if (!s.block_tables.has_value()) return;  // the slots Python gave stand
    TORCH_CHECK(op.queries.has_value() && key_groups_[p.layer].has_value(), "dsaserve DecodePlan: layer ", p.layer,
                " cannot select here (no bound queries, or no packed keys)");
    const Queries& q = *op.queries;
    const at::Tensor h = in(p, 0), q_resid = in(p, 1);
    const at::Tensor projected = product(q_resid, q.wq);
    const at::Tensor queries = dsaserve::apply_rope(projected.view({-1, q.heads, q.head_dim}), s.cos, s.sin,
                                                    q.interleaved);
    const at::Tensor weights = at::linear(h.to(at::kFloat), q.weights_proj) * q.weight_scale;
    const at::Tensor topk = dsaserve::decode_selection(queries.contiguous(), weights.contiguous(),
                                                       *key_groups_[p.layer], *s.block_tables, s.seq_lens,
                                                       s.selection[0], s.selection[1], s.selection[2],
                                                       key_scales_[p.layer]);
    s.slots = dsaserve::position_slots(*s.block_tables, topk, s.selection[3]);
  }

  void run_piece(const Attend& op, const Piece& p, Step& s) {
    const at::Tensor& query = in(p, 0);
    const at::Tensor& rows = rows_[p.layer];
    TORCH_CHECK(s.slots.defined() && s.slots.dim() == 2 && s.slots.size(0) == query.size(0),
                "dsaserve DecodePlan: layer ", p.layer, " attends without the step's slots [T, width]");
    TORCH_CHECK(query.dim() == 3 && query.scalar_type() == rows.scalar_type() && rows.dim() == 2 &&
                    rows.is_contiguous(),
                "dsaserve DecodePlan: attention takes a query [T, heads, dim] of the rows' dtype (bf16; fp32 on the "
                "AVX2 body) and contiguous rows");
    TORCH_CHECK(dsaserve::selected_rows_fits(padded_heads(query.size(1)), rows.size(1), op.value_dim),
                "dsaserve DecodePlan: the attention kernel does not take ", query.size(1), " heads of ", rows.size(1),
                " dims with ", op.value_dim, " value columns on this CPU");
    out(p, 0, attend(query, rows, s.slots, op.scale, op.value_dim));
  }

  void run_piece(const MlaOutput& op, const Piece& p, Step&) {
    out(p, 0, dsaserve::mla_output(in(p, 0), op.w_uv.q, op.w_uv.s, op.w_uv.args, op.o.q, op.o.s, op.o.args));
  }

  void run_piece(const Moe& op, const Piece& p, Step&) {
    const at::Tensor h = in(p, 0).contiguous();
    auto [weights, ids] = dsaserve::moe_route(h, op.router_weight, op.router_bias, op.top_k, op.n_group,
                                              op.topk_group, op.normalize, op.scaling);
    const bool shared = op.shared_gate_up.has_value();
    at::Tensor y = shared ? at::empty_like(h) : at::zeros_like(h);  // shared: written first, in the call
    const auto none = std::optional<at::Tensor>();
    dsaserve::moe_experts(h, op.gate_up.q, op.gate_up.s, op.down.q, op.down.s, ids.contiguous(),
                          weights.to(at::kFloat).contiguous(), y, op.gate_up.args[0], op.down.args[4],
                          op.gate_up.args[1], op.down.args[1], op.down.args[2],
                          shared ? std::optional<at::Tensor>(op.shared_gate_up->q) : none,
                          shared ? std::optional<at::Tensor>(op.shared_gate_up->s) : none,
                          shared ? std::optional<at::Tensor>(op.shared_down->q) : none,
                          shared ? std::optional<at::Tensor>(op.shared_down->s) : none,
                          shared ? op.shared_down->args[4] : 0, shared ? op.shared_gate_up->args[1] : 0,
                          shared ? op.shared_down->args[1] : 0, shared ? op.shared_down->args[2] : 0);
    out(p, 0, y);
  }

  void run_piece(const GatedMlp& op, const Piece& p, Step&) {
    out(p, 0, dsaserve::gated_mlp(in(p, 0), op.gate_up.q, op.gate_up.s, op.down.q, op.down.s, op.gate_up.args[0],
                                  op.down.args[4], op.gate_up.args[1], op.down.args[1], op.down.args[2]));
  }

  void run_piece(const Add&, const Piece& p, Step&) { out(p, 0, at::add(in(p, 0), in(p, 1))); }

  std::vector<Piece> pieces_;
  std::vector<at::Tensor> registers_{1};
  std::vector<at::Tensor> rows_;
  std::vector<std::optional<at::Tensor>> key_groups_, key_scales_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<>())
      .def("add_rms_norm", &DecodePlan::add_rms_norm)
      .def("add_add_rms_norm", &DecodePlan::add_add_rms_norm)
      .def("add_mla_query", &DecodePlan::add_mla_query)
      .def("add_latent_rows", &DecodePlan::add_latent_rows)
      .def("add_index_keys", &DecodePlan::add_index_keys)
      .def("add_select", &DecodePlan::add_select)
      .def("add_attend", &DecodePlan::add_attend)
      .def("add_mla_output", &DecodePlan::add_mla_output)
      .def("add_moe", &DecodePlan::add_moe)
      .def("add_gated_mlp", &DecodePlan::add_gated_mlp)
      .def("add_add", &DecodePlan::add_add)
      .def("set_caches", &DecodePlan::set_caches)
      .def("run", &DecodePlan::run)
      .def("set_register", &DecodePlan::set_register)
      .def("size", &DecodePlan::size);
}
