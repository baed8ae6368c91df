// Helpers shared by kvbank's native CPU kernels.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "simd.h"

// Where each of `rows` rows' keys begin (a sliding window, or a stream's sequence after its frames
// left), as the decode kernels take them (Partials::starts): null when `starts` is not given;
// `holder` keeps the checked int64 [rows] tensor alive.
inline const int64_t* row_starts(const std::optional<torch::Tensor>& starts, int64_t rows, torch::Tensor& holder) {
  if (!starts.has_value()) return nullptr;
  holder = starts->contiguous();
  TORCH_CHECK(holder.scalar_type() == torch::kLong && holder.dim() == 1 && holder.size(0) == rows,
              "starts must be int64 [", rows, "]");
  return holder.data_ptr<int64_t>();
}

// Every row's context length fits its row of the block table ([rows, width] int64, contiguous),
// its start (if any) lies inside its context, and every block it reads is one of the cache's
// `num_blocks`: the attention kernels index the cache with these ids unchecked.
inline void check_block_tables(const torch::Tensor& tables, const torch::Tensor& lens, const int64_t* starts,
                               int64_t block_size, int64_t num_blocks) {
  const int64_t rows = tables.size(0), width = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(len[r] >= 1 && len[r] <= width * block_size, "row ", r, ": context length ", len[r],
                " is beyond its block table of ", width, " blocks of ", block_size);
    const int64_t from = starts ? starts[r] : 0;
    TORCH_CHECK(from >= 0 && from < len[r], "row ", r, ": start ", from, " is outside its context of ", len[r]);
    for (int64_t b = from / block_size; b < (len[r] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[r * width + b] >= 0 && table[r * width + b] < num_blocks, "row ", r, ": block ",
                  table[r * width + b], " is outside the cache's ", num_blocks, " blocks");
  }
}

// dense_attention.cpp
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t partition, std::optional<torch::Tensor> starts);
std::string dense_attention_isa();

// quant_attention.cpp
torch::Tensor quant_decode_attention(torch::Tensor q, int64_t format, torch::Tensor k_codes, torch::Tensor k_scale,
                                     std::optional<torch::Tensor> k_grid, torch::Tensor v_codes, torch::Tensor v_scale,
                                     std::optional<torch::Tensor> v_zero, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t partition,
                                     std::optional<torch::Tensor> scratch_k, std::optional<torch::Tensor> scratch_v,
                                     std::optional<torch::Tensor> own_rows, std::string isa,
                                     std::optional<torch::Tensor> starts);
bool has_quant_decode();
std::vector<std::string> quant_decode_isas();

// cache_write.cpp
void quant_write_tokens(torch::Tensor x, int64_t format, torch::Tensor codes, torch::Tensor scale, torch::Tensor slots);
std::vector<torch::Tensor> kivi_write(torch::Tensor k, torch::Tensor v, int64_t format, torch::Tensor k_codes,
                                      torch::Tensor k_ranges, torch::Tensor k_grid, torch::Tensor v_codes,
                                      torch::Tensor v_scale, torch::Tensor v_zero, torch::Tensor residual_k,
                                      torch::Tensor residual_v, torch::Tensor plan, torch::Tensor scratch_slots);

// key_blocks.cpp
void rotate_key_blocks(std::vector<torch::Tensor> codes, int64_t format, std::vector<torch::Tensor> ranges,
                       std::vector<torch::Tensor> grids, torch::Tensor src, torch::Tensor dst, torch::Tensor cos,
                       torch::Tensor sin, bool bf16_keys);
torch::Tensor read_key_blocks(std::vector<torch::Tensor> codes, int64_t format, std::vector<torch::Tensor> ranges,
                              std::vector<torch::Tensor> grids, torch::Tensor ids, bool bf16_keys);
void store_key_blocks(torch::Tensor x, std::vector<torch::Tensor> codes, int64_t format,
                      std::vector<torch::Tensor> ranges, std::vector<torch::Tensor> grids, torch::Tensor ids);
void copy_rows(std::vector<torch::Tensor> tensors, torch::Tensor src, torch::Tensor dst);

// layers.cpp
torch::Tensor add_rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads);

// fused.cpp
std::string qmatmul_isa();
torch::Tensor geglu(torch::Tensor gate_up);
torch::Tensor qlinear(torch::Tensor x, torch::Tensor w, int64_t kind, bool float_out, std::string isa);
torch::Tensor qlayer_attn_in(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor norm_w, double eps,
                             std::vector<torch::Tensor> qkv_w, std::vector<int64_t> kind, torch::Tensor cos,
                             torch::Tensor sin, int64_t rope_heads, std::string isa);
torch::Tensor qlayer_mlp(torch::Tensor attn, torch::Tensor residual, std::vector<torch::Tensor> o_w,
                         std::vector<int64_t> o_kind, torch::Tensor norm_w, double eps,
                         std::vector<torch::Tensor> gate_up_w, std::vector<int64_t> gate_up_kind,
                         std::vector<torch::Tensor> down_w, std::vector<int64_t> down_kind, std::string isa);
torch::Tensor q8_rows(torch::Tensor records, torch::Tensor ids, torch::ScalarType dtype);
torch::Tensor qhead(torch::Tensor hidden, torch::Tensor norm_w, double eps, torch::Tensor head_w, int64_t kind,
                    std::string isa);

// sampling.cpp
torch::Tensor argmax_rows(torch::Tensor logits, std::string isa);
