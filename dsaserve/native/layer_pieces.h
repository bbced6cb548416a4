// The operators' functions that decode_plan.cpp chains into a decode step's pieces, called without
// the dispatcher (each is the registered operator's own function: the same checks, the same bits).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "packed_product.h"

namespace dsaserve {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> mla_query(const at::Tensor& x, const at::Tensor& q_a_q, const at::Tensor& q_a_s,
                                             at::IntArrayRef q_a_args, const at::Tensor& norm_weight, double eps,
                                             const at::Tensor& q_b_q, const at::Tensor& q_b_s, at::IntArrayRef q_b_args,
                                             const at::Tensor& w_uk_q, const at::Tensor& w_uk_s,
                                             at::IntArrayRef w_uk_args, const at::Tensor& cos, const at::Tensor& sin,
                                             bool interleaved, int64_t heads, int64_t nope, int64_t rope);
at::Tensor mla_output(const at::Tensor& latent, const at::Tensor& w_uv_q, const at::Tensor& w_uv_s,
                      at::IntArrayRef w_uv_args, const at::Tensor& o_q, const at::Tensor& o_s, at::IntArrayRef o_args);
void write_latent_rows(const at::Tensor& kv, const at::Tensor& weight, double eps, const at::Tensor& cos,
                       const at::Tensor& sin, bool interleaved, at::Tensor rows, const at::Tensor& slots);
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved);
void write_packed_keys(at::Tensor& cache, const at::Tensor& slots, const at::Tensor& keys);
void index_scores_of_blocks(const c10::BFloat16* q, const float* weights, int64_t heads, int64_t dim,
                            const at::Tensor& cache, const int64_t* blocks, int64_t count, int64_t keys, float* out);
bool index_scores_fits(int64_t heads, int64_t dim);
void check_block_list(const at::Tensor& blocks, int64_t keys, const at::Tensor& cache, const char* op);
void index_scores_int8_of_blocks(const void* q, bool f32, const float* weights, int64_t heads, int64_t dim,
                                 const at::Tensor& cache, const at::Tensor& scales, const int64_t* blocks,
                                 int64_t count, int64_t keys, float* out);
bool index_scores_int8_fits(int64_t heads, int64_t dim);
void index_scores_f32_of_blocks(const float* q, const float* weights, int64_t heads, int64_t dim,
                                const at::Tensor& cache, const int64_t* blocks, int64_t keys, float* out);
bool index_scores_f32_fits(int64_t heads, int64_t dim);  // the AVX2 body's fp32 keys (index_scores_f32_avx2.cpp)
void write_int8_keys(at::Tensor& cache, at::Tensor& scales, const at::Tensor& slots, const at::Tensor& keys);
at::Tensor decode_selection(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                            const at::Tensor& block_tables, at::IntArrayRef seq_lens, int64_t width,
                            int64_t chunk_blocks, int64_t window_blocks, const std::optional<at::Tensor>& scales);
at::Tensor position_slots(const at::Tensor& block_tables, const at::Tensor& positions, int64_t block_size);
void topk_row(const float* x, int64_t n, int64_t k, uint32_t* scratch, float* values, int64_t* indices);
void attend_selected_rows(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& slots, double scale,
                          at::Tensor& out);
bool selected_rows_fits(int64_t heads, int64_t dim, int64_t value_dim);
void attend_selected_rows_avx2(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& slots, double scale,
                               at::Tensor& out);  // fp32 or bf16 (selected_rows_avx2.cpp)
bool selected_rows_avx2_fits(int64_t heads, int64_t dim, int64_t value_dim);
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                             int64_t top_k, int64_t n_group, int64_t topk_group, bool normalize,
                                             double scaling);
void moe_experts(const at::Tensor& x, const at::Tensor& gate_up_q, const at::Tensor& gate_up_s,
                 const at::Tensor& down_q, const at::Tensor& down_s, const at::Tensor& ids, const at::Tensor& weights,
                 at::Tensor out, int64_t kind, int64_t inter, int64_t gate_up_group, int64_t down_group,
                 int64_t down_col_offset, const std::optional<at::Tensor>& shared_gate_up_q,
                 const std::optional<at::Tensor>& shared_gate_up_s, const std::optional<at::Tensor>& shared_down_q,
                 const std::optional<at::Tensor>& shared_down_s, int64_t shared_inter, int64_t shared_gate_up_group,
                 int64_t shared_down_group, int64_t shared_down_col_offset);
at::Tensor gated_mlp(const at::Tensor& x, const at::Tensor& gate_up_q, const at::Tensor& gate_up_s,
                     const at::Tensor& down_q, const at::Tensor& down_s, int64_t kind, int64_t inter,
                     int64_t gate_up_group, int64_t down_group, int64_t down_col_offset);

}  // namespace dsaserve
