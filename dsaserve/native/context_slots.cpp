// Logical positions to physical cache slots, in one call: slot(r, p) = block_tables[r, p / block_size] * block_size +
// p % block_size.
//   context_slots: each request's whole context, slots[r, p] for p < lens[r] and -1 past it (the width is the
//                  longest length), what attention/dense.py causal_rows derives at every decode step;
//   position_slots: the slots of given positions [R, W] (int32, -1 = none, which stays -1), what
//                  attention/sparse.py selected_rows derives for each full layer's selection.
// Otherwise a dozen torch operators each, whose per-call cost, not the arithmetic, is what a step pays.
// Portable C++.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "layer_pieces.h"

namespace {

at::Tensor context_slots(const at::Tensor& block_tables, at::IntArrayRef lens, int64_t block_size) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_cpu() &&
                  static_cast<int64_t>(lens.size()) == block_tables.size(0) && block_size >= 1,
              "dsaserve context_slots: block_tables must be int64 [R, blocks] on the CPU, with one length per row");
  const at::Tensor tables = block_tables.contiguous();
  const int64_t R = tables.size(0), blocks = tables.size(1);
  int64_t width = 1;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= blocks * block_size, "dsaserve context_slots: length ", lens[r],
                " of row ", r, " is not within its block table's ", blocks * block_size, " positions");
    width = std::max(width, lens[r]);
  }
  at::Tensor slots = at::empty({R, width}, tables.options());
  const int64_t* table = tables.data_ptr<int64_t>();
  int64_t* out = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    int64_t* row = out + r * width;
    for (int64_t p = 0; p < lens[r]; ++p) row[p] = table[r * blocks + p / block_size] * block_size + p % block_size;
    std::fill(row + lens[r], row + width, int64_t(-1));
  }
  return slots;
}

at::Tensor position_slots(const at::Tensor& block_tables, const at::Tensor& positions, int64_t block_size) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_cpu() &&
                  positions.dim() == 2 && positions.scalar_type() == at::kInt && positions.is_cpu() &&
                  positions.size(0) == block_tables.size(0) && block_size >= 1,
              "dsaserve position_slots: block_tables must be int64 [R, blocks] and positions int32 [R, W] on the CPU");
  const at::Tensor tables = block_tables.contiguous(), pos = positions.contiguous();
  const int64_t R = pos.size(0), W = pos.size(1), blocks = tables.size(1);
  at::Tensor slots = at::empty({R, W}, tables.options());
  const int64_t* table = tables.data_ptr<int64_t>();
  const int32_t* in = pos.data_ptr<int32_t>();
  int64_t* out = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t w = 0; w < W; ++w) {
      const int64_t p = in[r * W + w];
      TORCH_CHECK(p < blocks * block_size, "dsaserve position_slots: position ", p, " of row ", r,
                  " is past its block table's ", blocks * block_size, " positions");
      out[r * W + w] = p < 0 ? -1 : table[r * blocks + p / block_size] * block_size + p % block_size;
    }
  return slots;
}

}  // namespace

// For decode_plan.cpp (layer_pieces.h).
at::Tensor dsaserve::position_slots(const at::Tensor& block_tables, const at::Tensor& positions, int64_t block_size) {
  return ::position_slots(block_tables, positions, block_size);
}

namespace {
// Meta kernels: the output shapes without computing (meta tensors, tracing).
at::Tensor context_slots_meta(const at::Tensor& block_tables, at::IntArrayRef lens, int64_t) {
  const int64_t longest = lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end());
  return at::empty({static_cast<int64_t>(lens.size()), longest}, block_tables.options().dtype(at::kLong));
}
at::Tensor position_slots_meta(const at::Tensor& block_tables, const at::Tensor& positions, int64_t) {
  return at::empty(positions.sizes(), block_tables.options().dtype(at::kLong));
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
  m.def("context_slots(Tensor block_tables, int[] lens, int block_size) -> Tensor");
  m.def("position_slots(Tensor block_tables, Tensor positions, int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) {
  m.impl("context_slots", &context_slots);
  m.impl("position_slots", &position_slots);
}

TORCH_LIBRARY_IMPL(dsaserve, Meta, m) {
  m.impl("context_slots", &context_slots_meta);
  m.impl("position_slots", &position_slots_meta);
}
