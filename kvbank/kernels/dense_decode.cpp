// The bfloat16 paged attention as a torch operator (its job type: dense_decode.h).
#include "dense_decode.h"

#include <ATen/Parallel.h>

namespace {

void dense_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& tables,
                  const torch::Tensor& lens, double scale, int64_t partition, torch::Tensor& out,
                  const int64_t* starts) {
  DenseJob job(q.data_ptr<Bf16>(), k.data_ptr<Bf16>(), v.data_ptr<Bf16>(), tables.data_ptr<int64_t>(),
               lens.data_ptr<int64_t>(), out.data_ptr<Bf16>(), q.size(0), q.size(1), q.size(2), q.size(3), k.size(1),
               tables.size(1), scale, partition);
  job.set_starts(starts);
  const Bf16* k_p = k.data_ptr<Bf16>();
  const Bf16* v_p = v.data_ptr<Bf16>();
  run_items(job.partials(), [&](const int64_t* items, int count) { job.run(items, count, k_p, v_p); });
  at::parallel_for(0, job.pairs(), 1, [&](int64_t from, int64_t to) {
    for (int64_t pair = from; pair < to; ++pair) job.merge(pair);
  });
}

}  // namespace

std::string dense_attention_isa() {
  kvbank::Isa variant = kvbank::Isa::Scalar;
  kvbank::family_variant(kvbank::Family::DenseAttention, &variant);
  return kvbank::isa_name(variant);
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t partition, std::optional<torch::Tensor> starts) {
  TORCH_CHECK(q.dim() == 4, "q must be [batch, kv_heads, group, dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and caches must share a dtype");
  TORCH_CHECK(q.size(1) == k_cache.size(2) && q.size(3) == k_cache.size(3), "q heads/dim do not match the cache");
  TORCH_CHECK(q.size(2) <= kMaxGroup && q.size(3) <= kMaxDim && k_cache.size(1) <= kMaxBlock,
              "group <= ", kMaxGroup, ", head dim <= ", kMaxDim, ", block size <= ", kMaxBlock);
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block tables and lengths must be int64");
  TORCH_CHECK(partition > 0 && partition % k_cache.size(1) == 0, "partition must be a multiple of the block size");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && context_lens.dim() == 1 &&
                  context_lens.size(0) == q.size(0),
              "one block table row and one context length per row of q");
  torch::Tensor first;
  const int64_t* s = row_starts(starts, q.size(0), first);
  check_block_tables(block_tables, context_lens, s, k_cache.size(1), k_cache.size(0));
  auto out = torch::empty_like(q);
  switch (q.scalar_type()) {
    case torch::kFloat: decode_dim<float>(q, k_cache, v_cache, block_tables, context_lens, scale, partition, out, s); break;
    case torch::kBFloat16: dense_decode(q, k_cache, v_cache, block_tables, context_lens, scale, partition, out, s); break;
    case torch::kHalf: decode_dim<c10::Half>(q, k_cache, v_cache, block_tables, context_lens, scale, partition, out, s); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}
