// Attention over a bfloat16 paged cache, one query row at a time, in the variant the ISA registry
// (isa.h) picks for the dense_attention family:
//   avx512_bf16  bfloat16 pair dot products (dense_attention.cpp, attend_range_bf16)
//   avx512       16 float32 lanes, keys widened by shifts (quant_attention*.cpp, format 0)
//   avx2         8 float32 lanes, the same (quant_attention*.cpp, format 0)
//   scalar       plain C++ (dense_attention.cpp, attend_range): the reference the others are tested against
// Every variant runs the same work items and log-sum-exp merge (Partials), so within a variant a
// row's result depends on its own sequence alone: batch invariance holds on every CPU.
#pragma once

#include "partials.h"

#include <memory>

namespace kvbank {

using Bf16 = c10::BFloat16;
template <typename T, int D>
struct DecodeJob;
template <typename T>
struct QuantJob;
struct QuantLayer;

// The dense attention of one step, as Partials work items over any layer's caches of one shape.
class DenseJob {
 public:
  DenseJob(const Bf16* q, const Bf16* k, const Bf16* v, const int64_t* tables, const int64_t* lens, Bf16* out,
           int64_t n, int64_t heads, int64_t group, int64_t dim, int64_t block_size, int64_t width, double scale,
           int64_t partition);
  ~DenseJob();

  // The work items' schedule and results (Partials).
  const Partials& partials() const;
  // Rows read from starts[i] on (a sliding window; see Partials::starts).
  void set_starts(const int64_t* starts);
  int64_t items() const;
  int64_t pairs() const;
  // Work item `i` over the caches `k`, `v` ([blocks, block_size, heads, dim]).
  void item(int64_t i, const Bf16* k, const Bf16* v);
  // A run of items (ItemQueue::drain): the quantized kernel's version attends a prefill's
  // rows together (QuantJob::run); the others take them one at a time.
  void run(const int64_t* items, int count, const Bf16* k, const Bf16* v);
  void merge(int64_t pair);

 private:
  // `f` on the one DecodeJob this job holds (when it holds no QuantJob).
  template <typename F>
  decltype(auto) visit(F&& f) const;
  // The caches as the quantized kernel's format 0 (bfloat16 codes, no scales).
  QuantLayer layer(const Bf16* k, const Bf16* v) const;

  int64_t heads_, dim_, block_size_;
  std::unique_ptr<QuantJob<Bf16>> quant_;
  std::unique_ptr<DecodeJob<Bf16, 64>> d64_;
  std::unique_ptr<DecodeJob<Bf16, 128>> d128_;
  std::unique_ptr<DecodeJob<Bf16, 256>> d256_;
  std::unique_ptr<DecodeJob<Bf16, 0>> any_;
};

}  // namespace kvbank
