// The decoder stack run for a whole step in one call (stack.cpp).
#pragma once

#include "native.h"

// One step of the stack beyond its rows: every layer's caches and the rows' attention, filled by the
// KV layers (kvbank/cache/layers: stack_caches, row_attention) and the model (rotary, groups).
struct StackStep {
  // Every layer's K and V caches: format 0 bfloat16 [blocks, block_size, kv_heads, dim]; 1 int8,
  // 2 fp8_e4m3, 3 fp8_e5m2: one-byte codes with float16 scales (k_scales, v_scales) per token and
  // head; 4 int4, 5 int2 (KIVI): codes, key range bytes (k_scales), key grids, value scales and zero
  // points, and the residual slots of open blocks.
  int64_t format = 0;
  std::vector<torch::Tensor> k_caches, v_caches, k_scales, v_scales, k_grids, v_zeros, residual_ks, residual_vs;
  // Each new token's slot [tokens], block table [tokens, width], context length and (if given) where
  // its keys begin (else 0) [tokens], all int64.
  torch::Tensor slot_mapping, block_tables, context_lens;
  std::optional<torch::Tensor> starts;
  // KIVI: the write plan and scratch slots (kivi_write), and each row's own scratch row.
  std::optional<torch::Tensor> kivi_plan, scratch_slots, own_rows;
  double scale = 0.0;
  int64_t partition = 0;  // tokens per attention work item, a multiple of the block size
  // Layers rotated by cos_local/sin_local where local_layers says 1.
  std::optional<torch::Tensor> cos_local, sin_local;
  std::vector<int64_t> local_layers;
  // Attention groups (bfloat16 caches): layer l attends through group layer_groups[l], 0 being the
  // slots, tables, lengths and starts above and g > 0 group_slots/tables/lens/starts[g - 1] (a
  // sliding window is a group whose starts trail by the window).
  std::vector<int64_t> layer_groups;
  std::vector<torch::Tensor> group_slots, group_tables, group_lens, group_starts;
};

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
  // Every layer for a step whose tokens all attend by rows: the last layer's output plus the residual.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const StackStep& step);

 private:
  std::vector<std::vector<torch::Tensor>> weights_;
  std::vector<std::vector<int64_t>> kinds_;
  std::vector<torch::Tensor> norms_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  bool gemma_;
};
