// Attention over a bfloat16 paged cache, one query row at a time, in the variant the ISA registry
// (isa.h) picks for the dense_attention family:
//   avx512_bf16  bfloat16 pair dot products (paged_decode.cpp, attend_range_bf16)
//   avx512       16 float32 lanes, keys widened by shifts (quant_decode.cpp, format 0)
//   avx2         8 float32 lanes, the same (quant_decode.cpp, format 0)
//   scalar       plain C++ (paged_decode.cpp, attend_range): the reference the others are tested against
// Every variant runs the same work items and log-sum-exp merge (Partials), so within a variant a
// row's result depends on its own sequence alone: batch invariance holds on every CPU.
#pragma once

#include "native.h"
#include "paged_decode.h"
#include "quant_decode.h"

#include <ATen/Parallel.h>

#include <memory>

namespace {

using Bf16 = c10::BFloat16;

// The dense attention of one step, as Partials work items over any layer's caches of one shape.
class DenseJob {
 public:
  DenseJob(const Bf16* q, const Bf16* k, const Bf16* v, const int64_t* tables, const int64_t* lens, Bf16* out,
           int64_t n, int64_t heads, int64_t group, int64_t dim, int64_t block_size, int64_t width, double scale,
           int64_t partition)
      : heads_(heads), dim_(dim), block_size_(block_size) {
    kvbank::Isa variant = kvbank::Isa::Scalar;
    kvbank::family_variant(kvbank::Family::DenseAttention, &variant);
    const bool lanes = variant == kvbank::Isa::Avx2 || variant == kvbank::Isa::Avx512;
    if (lanes && (dim == 64 || dim == 128 || dim == 256) && group <= 8) {
      const int isa = variant == kvbank::Isa::Avx512 ? kQuantAvx512 : kQuantAvx2;
      quant_.reset(new QuantJob<Bf16>(q, tables, lens, out, n, heads, group, dim, block_size, width, scale, partition,
                                      isa));
    } else if (dim == 64) {
      d64_.reset(new DecodeJob<Bf16, 64>(q, k, v, tables, lens, out, n, heads, group, dim, block_size, width, scale,
                                         partition));
    } else if (dim == 128) {
      d128_.reset(new DecodeJob<Bf16, 128>(q, k, v, tables, lens, out, n, heads, group, dim, block_size, width, scale,
                                           partition));
    } else if (dim == 256) {
      d256_.reset(new DecodeJob<Bf16, 256>(q, k, v, tables, lens, out, n, heads, group, dim, block_size, width, scale,
                                           partition));
    } else {
      any_.reset(new DecodeJob<Bf16, 0>(q, k, v, tables, lens, out, n, heads, group, dim, block_size, width, scale,
                                        partition));
    }
  }

  // `f` on the one DecodeJob this job holds (when it holds no QuantJob).
  template <typename F>
  decltype(auto) visit(F&& f) const {
    if (d64_) return f(*d64_);
    if (d128_) return f(*d128_);
    if (d256_) return f(*d256_);
    return f(*any_);
  }

  // The work items' schedule and results (Partials).
  const Partials& partials() const {
    return quant_ ? quant_->partials : visit([](auto& job) -> const Partials& { return job.partials; });
  }

  // Rows read from starts[i] on (a sliding window; see Partials::starts).
  void set_starts(const int64_t* starts) {
    if (quant_) {
      quant_->partials.starts = starts;
    } else {
      visit([&](auto& job) { job.partials.starts = starts; });
    }
  }

  int64_t items() const { return quant_ ? quant_->items() : visit([](auto& job) { return job.items(); }); }
  int64_t pairs() const { return quant_ ? quant_->pairs() : visit([](auto& job) { return job.pairs(); }); }

  // Work item `i` over the caches `k`, `v` ([blocks, block_size, heads, dim]).
  void item(int64_t i, const Bf16* k, const Bf16* v) {
    if (quant_) return quant_->item(i, layer(k, v));
    visit([&](auto& job) { job.item(i, k, v); });
  }

  // A run of items (ItemQueue::drain): the quantized kernel's version attends a prefill's
  // rows together (QuantJob::run); the others take them one at a time.
  void run(const int64_t* items, int count, const Bf16* k, const Bf16* v) {
    if (quant_) return quant_->run(items, count, layer(k, v));
    for (int j = 0; j < count; ++j) item(items[j], k, v);
  }

  void merge(int64_t pair) {
    if (quant_) return quant_->merge(pair);
    visit([&](auto& job) { job.merge(pair); });
  }

 private:
  // The caches as the quantized kernel's format 0 (bfloat16 codes, no scales).
  QuantLayer layer(const Bf16* k, const Bf16* v) const {
    return QuantLayer{kBf16,    reinterpret_cast<const uint8_t*>(k), nullptr, nullptr, nullptr,
                      reinterpret_cast<const uint8_t*>(v), nullptr, nullptr, heads_, dim_, block_size_,
                      2 * dim_, 1,       nullptr,  nullptr, nullptr};
  }

  int64_t heads_, dim_, block_size_;
  std::unique_ptr<QuantJob<Bf16>> quant_;
  std::unique_ptr<DecodeJob<Bf16, 64>> d64_;
  std::unique_ptr<DecodeJob<Bf16, 128>> d128_;
  std::unique_ptr<DecodeJob<Bf16, 256>> d256_;
  std::unique_ptr<DecodeJob<Bf16, 0>> any_;
};

}  // namespace
