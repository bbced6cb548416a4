// Each request's whole context as physical cache slots, in one call: slots[r, p] = block_tables[r, p / block_size] *
// block_size + p % block_size for p < lens[r], and -1 past it (the width is the longest length). What
// attention/dense.py causal_rows otherwise derives with a dozen torch operators at every decode step, whose
// per-call cost, not the arithmetic, is what a step pays. Portable C++.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) { m.def("context_slots(Tensor block_tables, int[] lens, int block_size) -> Tensor"); }

TORCH_LIBRARY_IMPL(dsaserve, CPU, m) { m.impl("context_slots", &context_slots); }
