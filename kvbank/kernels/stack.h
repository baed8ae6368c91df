// The decoder stack run for a whole step in one call (stack.cpp).
#pragma once

#include "native.h"

// A decoder stack on packed GGUF weights, run for a whole step in one call.
class QuantStack {
 public:
  // Per layer four projections (q/k/v, o, gate/up, down), each one records tensor or several side
  // by side with their kinds, and two norms (Llama: before attention and before the MLP) or, with
  // `gemma`, six (before and after attention, before and after the MLP, then q's and k's per head),
  // with GeGLU for SiLU-gated units.
  QuantStack(std::vector<std::vector<torch::Tensor>> weights, std::vector<std::vector<int64_t>> kinds,
             std::vector<torch::Tensor> norms, double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
             bool gemma);
  int64_t num_layers() const;
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> k_caches,
                        std::vector<torch::Tensor> v_caches, torch::Tensor slot_mapping, torch::Tensor block_tables,
                        torch::Tensor context_lens, double scale, int64_t partition, int64_t format,
                        std::vector<torch::Tensor> k_scales, std::vector<torch::Tensor> v_scales,
                        std::vector<torch::Tensor> k_grids, std::vector<torch::Tensor> v_zeros,
                        std::vector<torch::Tensor> residual_ks, std::vector<torch::Tensor> residual_vs,
                        std::optional<torch::Tensor> kivi_plan, std::optional<torch::Tensor> scratch_slots,
                        std::optional<torch::Tensor> own_rows,
                        std::optional<torch::Tensor> starts, std::optional<torch::Tensor> cos_local,
                        std::optional<torch::Tensor> sin_local, std::vector<int64_t> local_layers,
                        std::vector<int64_t> layer_groups, std::vector<torch::Tensor> group_slots,
                        std::vector<torch::Tensor> group_tables, std::vector<torch::Tensor> group_lens,
                        std::vector<torch::Tensor> group_starts);

 private:
  std::vector<std::vector<torch::Tensor>> weights_;
  std::vector<std::vector<int64_t>> kinds_;
  std::vector<torch::Tensor> norms_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  bool gemma_;
};
