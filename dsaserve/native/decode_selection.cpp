// The indexer's selection for a batch of decode queries (one new token per request), in one call: what
// attention/indexer_selection.py's select() computes for them through its Python loop, tile by tile, with the same pieces in
// the same order, so the same positions in the same order:
//   a query that sees at most `width` tokens selects all of them (0 .. seq_len - 1, then -1);
//   otherwise its visible blocks are scored `chunk_blocks` at a time in place in the key cache (index_scores.cpp
//   for packed bf16 keys; index_scores_int8.cpp where `scales` come with int8 keys, for bf16 or fp32 queries;
//   index_scores_f32_avx2.cpp for fp32 queries against an fp32 cache [num_blocks, block_size, dim]), keys past its
//   position set to -inf, and a running top-k (topk.cpp) is merged after every window of `window_blocks` (the
//   first window ranked alone when it holds at least `width` keys; one chunk holding the whole context is ranked
//   directly); positions whose score is -inf become -1.
// Scratch is one chunk window and one top-k per thread: bounded by the window, never by the context. Where the
// batch has at least as many queries as threads, each thread takes whole queries; otherwise each query's scoring
// is shared out. AVX-512 BF16 or AVX2 (index_scores_fits, index_scores_f32_fits) or VNNI (index_scores_int8_fits)
// only; the caller keeps its torch path elsewhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "layer_pieces.h"

namespace {

constexpr float kNone = -std::numeric_limits<float>::infinity();

// The key cache's form: bf16 keys packed for index_scores.cpp, int8 keys (index_scores_int8.cpp), or an fp32 model's
// plain fp32 rows (index_scores_f32_avx2.cpp).
enum class Keys { packed_bf16, int8, f32 };

struct Selector {
  const void* q;           // [T, heads, dim], bf16, or fp32 where q_f32
  bool q_f32;
  const float* weights;    // [T, heads]
  const at::Tensor& cache;
  const at::Tensor* scales;  // int8 keys' scales; null for the others
  Keys keys_form;
  const int64_t* tables;   // [T, table_width]
  int64_t table_width, heads, dim, block_size, width, chunk_blocks, window_blocks;

  // Scratch of one thread: a window's candidates after the running best, the top-k's outputs and keys.
  struct Scratch {
    std::vector<float> merged, values;
    std::vector<int64_t> ids, order;
    std::vector<uint32_t> keys;
  };

  Scratch scratch() const {
    const int64_t window = window_blocks * block_size;
    return {std::vector<float>(width + window), std::vector<float>(width), std::vector<int64_t>(width),
            std::vector<int64_t>(width), std::vector<uint32_t>(width + window + 1)};
  }

  const void* query(int64_t i) const {
    return static_cast<const char*>(q) + i * heads * dim * (q_f32 ? 4 : 2);
  }

  // Scores of query i against blocks [b0, b1) into `out`, the keys past `position` at -inf.
  void score(int64_t i, int64_t b0, int64_t b1, int64_t position, float* out) const {
    const int64_t keys = (b1 - b0) * block_size;
    const int64_t* listed = tables + i * table_width + b0;
    const float* w = weights + i * heads;
    switch (keys_form) {
      case Keys::f32:
        dsaserve::index_scores_f32_of_blocks(static_cast<const float*>(query(i)), w, heads, dim, cache, listed, keys,
                                             out);
        break;
      case Keys::int8:
        dsaserve::index_scores_int8_of_blocks(query(i), q_f32, w, heads, dim, cache, *scales, listed, b1 - b0, keys,
                                              out);
        break;
      case Keys::packed_bf16:
        dsaserve::index_scores_of_blocks(static_cast<const c10::BFloat16*>(query(i)), w, heads, dim, cache, listed,
                                         b1 - b0, keys, out);
    }
    std::fill(out + std::clamp<int64_t>(position + 1 - b0 * block_size, 0, keys), out + keys, kNone);
  }

  void select(int64_t i, int64_t seq_len, int32_t* row, Scratch& s) const {
    if (seq_len <= width) {
      for (int64_t c = 0; c < width; ++c) row[c] = c < seq_len ? static_cast<int32_t>(c) : -1;
      return;
    }
    const int64_t position = seq_len - 1, visible = position / block_size + 1;
    float* merged = s.merged.data();
    if (visible <= chunk_blocks) {  // one chunk holds every visible key: ranked directly
      score(i, 0, visible, position, merged);
      dsaserve::topk_row(merged, visible * block_size, width, s.keys.data(), s.values.data(), s.ids.data());
    } else {
      std::fill(merged, merged + width, kNone);
      std::fill(s.ids.begin(), s.ids.end(), int64_t(-1));
      for (int64_t w0 = 0; w0 < visible; w0 += window_blocks) {
        const int64_t w1 = std::min(w0 + window_blocks, visible), candidates = (w1 - w0) * block_size;
        for (int64_t b0 = w0; b0 < w1; b0 += chunk_blocks)
          score(i, b0, std::min(b0 + chunk_blocks, w1), position, merged + width + (b0 - w0) * block_size);
        if (w0 == 0 && candidates >= width) {  // nothing kept yet: the first window alone
          dsaserve::topk_row(merged + width, candidates, width, s.keys.data(), s.values.data(), s.ids.data());
        } else {  // columns below width are the running best, later ones count candidates from w0 on
          dsaserve::topk_row(merged, width + candidates, width, s.keys.data(), s.values.data(), s.order.data());
          for (int64_t c = 0; c < width; ++c) {
            const int64_t o = s.order[c];
            s.order[c] = o < width ? s.ids[o] : o - width + w0 * block_size;
          }
          std::swap(s.ids, s.order);
        }
        std::copy(s.values.begin(), s.values.end(), merged);
      }
    }
    for (int64_t c = 0; c < width; ++c) row[c] = s.values[c] == kNone ? -1 : static_cast<int32_t>(s.ids[c]);
  }
};

at::Tensor decode_selection(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                            const at::Tensor& block_tables, at::IntArrayRef seq_lens, int64_t width,
                            int64_t chunk_blocks, int64_t window_blocks, const std::optional<at::Tensor>& scales) {
  const bool q_f32 = q.scalar_type() == at::kFloat;
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == at::kBFloat16 || q_f32) && q.is_contiguous() && q.is_cpu(),
              "dsaserve decode_selection: q must be contiguous bf16 or fp32 [T, heads, dim] on the CPU");
  const int64_t T = q.size(0), heads = q.size(1), dim = q.size(2);
  const bool int8 = scales.has_value();
  const Keys form = int8 ? Keys::int8 : cache.scalar_type() == at::kFloat ? Keys::f32 : Keys::packed_bf16;
  TORCH_CHECK(form == Keys::int8 || q_f32 == (form == Keys::f32), "dsaserve decode_selection: ",
              q_f32 ? "fp32 queries take fp32 or int8 keys" : "bf16 queries take packed bf16 or int8 keys");
  TORCH_CHECK(form == Keys::f32    ? dsaserve::index_scores_f32_fits(heads, dim)
              : form == Keys::int8 ? dsaserve::index_scores_int8_fits(heads, dim)
                                   : dsaserve::index_scores_fits(heads, dim),
              "dsaserve decode_selection: the scoring kernel does not take ", heads, " heads of ", dim, " dims ",
              form == Keys::f32 ? "in fp32 " : int8 ? "with int8 keys " : "", "on this CPU (index_scores",
              form == Keys::f32 ? "_f32" : int8 ? "_int8" : "", "_fits)");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2 &&
                  weights.size(0) == T && weights.size(1) == heads,
              "dsaserve decode_selection: weights must be contiguous fp32 [T, heads]");
  if (form == Keys::f32) {
    TORCH_CHECK(cache.is_contiguous() && cache.dim() == 3 && cache.size(2) == dim,
                "dsaserve decode_selection: fp32 keys come as a contiguous cache [num_blocks, block_size, ", dim, "]");
  } else {
    const int64_t lanes_per_key = int8 ? 4 : 2;  // values of a key in one int32
    TORCH_CHECK(cache.scalar_type() == at::kInt && cache.is_contiguous() && cache.dim() == 4 &&
                    cache.size(2) == dim / lanes_per_key && cache.size(3) == 16,
                "dsaserve decode_selection: the key cache must be contiguous int32 [num_blocks, block_size / 16, ",
                dim / lanes_per_key, ", 16]");
  }
  TORCH_CHECK(!int8 || (scales->scalar_type() == at::kHalf && scales->is_contiguous() && scales->dim() == 2 &&
                        scales->size(0) == cache.size(0) && scales->size(1) == cache.size(1) * 16),
              "dsaserve decode_selection: scales must be contiguous fp16 [num_blocks, block_size]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_cpu() &&
                  block_tables.size(0) == T && static_cast<int64_t>(seq_lens.size()) == T,
              "dsaserve decode_selection: block_tables must be int64 [T, blocks] on the CPU, one row and one length "
              "per query");
  TORCH_CHECK(width >= 1 && chunk_blocks >= 1 && window_blocks >= chunk_blocks && window_blocks % chunk_blocks == 0,
              "dsaserve decode_selection: width ", width, ", chunk_blocks ", chunk_blocks, ", window_blocks ",
              window_blocks, ": the window must be whole chunks");
  const at::Tensor tables = block_tables.contiguous();
  const int64_t block_size = form == Keys::f32 ? cache.size(1) : cache.size(1) * 16;
  const int64_t table_width = tables.size(1), num_blocks = cache.size(0);
  const int64_t* table = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i) {
    TORCH_CHECK(seq_lens[i] >= 1 && seq_lens[i] <= table_width * block_size, "dsaserve decode_selection: length ",
                seq_lens[i], " of query ", i, " is not within its block table's ", table_width * block_size,
                " positions");
    if (seq_lens[i] <= width) continue;
    for (int64_t b = 0; b < (seq_lens[i] - 1) / block_size + 1; ++b)
      TORCH_CHECK(table[i * table_width + b] >= 0 && table[i * table_width + b] < num_blocks,
                  "dsaserve decode_selection: block id ", table[i * table_width + b], " of query ", i,
                  " is not in the cache's ", num_blocks, " blocks");
  }
  at::Tensor out = at::empty({T, width}, q.options().dtype(at::kInt));
  const Selector selector{q.data_ptr(), q_f32, weights.data_ptr<float>(), cache, int8 ? &*scales : nullptr, form,
                          table, table_width, heads, dim, block_size, width, chunk_blocks, window_blocks};
  int32_t* rows = out.data_ptr<int32_t>();
  auto select_rows = [&](int64_t i0, int64_t i1) {
    Selector::Scratch s = selector.scratch();
    for (int64_t i = i0; i < i1; ++i) selector.select(i, seq_lens[i], rows + i * width, s);
  };
  if (T >= at::get_num_threads())
    at::parallel_for(0, T, 1, select_rows);
  else
    select_rows(0, T);
  return out;
}

}  // namespace

// For decode_plan.cpp (layer_pieces.h).
at::Tensor dsaserve::decode_selection(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                                      const at::Tensor& block_tables, at::IntArrayRef seq_lens, int64_t width,
                                      int64_t chunk_blocks, int64_t window_blocks,
                                      const std::optional<at::Tensor>& scales) {
  return ::decode_selection(q, weights, cache, block_tables, seq_lens, width, chunk_blocks, window_blocks, scales);
}

namespace {
// Meta kernel: the output shape without computing (meta tensors, tracing).
at::Tensor decode_selection_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 at::IntArrayRef, int64_t width, int64_t, int64_t, const std::optional<at::Tensor>&) {
  return at::empty({q.size(0), width}, q.options().dtype(at::kInt));
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
  m.def("decode_selection(Tensor q, Tensor weights, Tensor cache, Tensor block_tables, int[] seq_lens, int width, "
        "int chunk_blocks, int window_blocks, Tensor? scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) { m.impl("decode_selection", &decode_selection); }

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) { m.impl("decode_selection", &decode_selection_meta); }
