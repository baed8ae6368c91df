// Decode attention straight from a quantized paged KV cache: the codes are read in place through
// the block table and turned into float32 in registers, never written back out dequantized.
//
// Formats (kvbank/cache/quant.py):
// - bfloat16, dense: the model's own cache [blocks, block_size, heads, dim], no scales (used for
//   decodes on CPUs without the AVX-512 BF16 kernel of dense_attention.cpp).
// - int8, fp8 e4m3 / e5m2: codes [blocks, block_size, heads, dim] with one float16 scale per
//   token and KV head; the key scale multiplies the token's score.
// - int4 / int2 (KIVI): keys per channel over one block, folded into the query once per block:
//   q.k = (q * scale) . codes + q . minimum. The channel's scale and minimum are two-level: a
//   range byte [blocks, heads, dim] indexes (low nibble) 16 scales top * 2^(-i/3) and (high
//   nibble) 16 minimums start + i * step, from the block's float16 grid (top, start, step)
//   [blocks, heads, 3] (kivi_key_ranges8/16). Values per token in groups of channels: a float16
//   scale and an int8 zero point [blocks, block_size, heads, groups], value (code + zero) * scale.
//   A row's own block (the one holding its newest tokens) is read in full precision from the
//   step's scratch blocks, as the reference path does.
//
// Vectors are 8 float32 lanes (AVX2, FMA, F16C), so the kernel runs on AVX-512 CPUs and on AVX2
// ones alike. A block's codes are decoded once into float32 rows that every query head of the KV
// head then reads; scores of 8 tokens are summed across lanes together, not one by one. Work
// items and their merge are the dense kernel's (Partials), so a row's result depends on its own
// sequence alone.
//
// quant_attention.cpp holds the scalar and 8-lane kernels and the job that runs them,
// quant_attention_avx512.cpp the 16-lane ones; quant_kernels.h the helpers both inline.
#pragma once

#include "partials.h"

namespace kvbank {

enum QuantFormat : int64_t { kBf16 = 0, kInt8 = 1, kFp8E4M3 = 2, kFp8E5M2 = 3, kInt4 = 4, kInt2 = 5 };
// The columns of a KIVI write plan's rows (see KiviWrite).
// A KIVI write plan's columns per scratch row (KiviWrite). kPlanEarly: 1 when a later row of the
// same step attends this row's block from the pool (a prefill chunk over several blocks), so the
// fused stack quantizes it before attention; the other rows are finished after attention.
enum KiviPlanField : int64_t {
  kPlanBlock = 0,
  kPlanSlot = 1,
  kPlanHeld = 2,
  kPlanUpto = 3,
  kPlanEarly = 4,
  kPlanFields = 5
};

// One layer's quantized K and V, and the step's full-precision scratch blocks (KIVI).
struct QuantLayer {
  int64_t format;
  const uint8_t* k_codes;
  const uint16_t* k_scale;   // int8, fp8: float16 per token and head
  const uint8_t* k_ranges;   // KIVI: a range byte per block, head and channel
  const uint16_t* k_grid;    // KIVI: float16 (top scale, first minimum, minimum step) per block and head
  const uint8_t* v_codes;
  const uint16_t* v_scale;   // int8, fp8: per token and head; KIVI: per token, head and group
  const int8_t* v_zero;      // KIVI: the groups' zero points
  int64_t heads, dim, block_size, code_bytes, value_groups;
  const void* scratch_k;  // [rows, block_size, heads, dim] in the query's dtype, or null
  const void* scratch_v;
  const int64_t* own_rows;  // per batch row: its scratch row, or -1
};

// The (query type, head dim) pairs the quantized kernels are built for: X(T, D) for each.
#define KVBANK_QUANT_SHAPES(X) \
  X(float, 64) X(float, 128) X(float, 256) X(c10::BFloat16, 64) X(c10::BFloat16, 128) X(c10::BFloat16, 256)

template <typename T, int D>
using QuantRange = void (*)(const QuantLayer&, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                            float, float*, float*, float*);

// The kernel versions (the quant_attention family's variants in isa.h), each run where the CPU has
// what it needs: scalar, 8 lanes (avx2), 16 lanes (avx512), and 16 lanes with int8/fp8/int4 codes as
// bfloat16 words (avx512_bf16). The version for a level: the family's best at or below it.
inline kvbank::Isa quant_variant_at(kvbank::Isa level) {
  kvbank::Isa variant = kvbank::Isa::Scalar;
  kvbank::family_variant_at(kvbank::Family::QuantAttention, level, &variant);
  return variant;
}

inline kvbank::Isa best_quant_variant() { return quant_variant_at(kvbank::active_isa()); }

// Query rows of one sequence attended together (quant_rows): as many as keep their queries,
// accumulators and scores (2 x G x D + G x 64 floats each) within about 20 KB of stack.
constexpr int quant_tile_rows(int group, int dim) { return std::max(1, std::min(8, 2048 / (group * dim))); }

// Several rows of one sequence at once (quant_rows): the AVX2 version, where decoding each block
// into float32 rows costs as much as attending one row over it; null elsewhere.
template <typename T, int D>
using QuantTile = void (*)(const QuantLayer&, const T* const*, const int64_t*, int64_t, const int64_t*, int, int64_t,
                           int64_t, int64_t, float, float* const*, float* const*, float* const*);

// The attention of `group` query heads per KV head, in the given version; null for no kernel.
template <typename T, int D>
QuantRange<T, D> quant_range_for(int64_t group, kvbank::Isa isa);
template <typename T, int D>
QuantTile<T, D> quant_tile_for(int64_t group, kvbank::Isa isa);
#ifdef KVBANK_X86
// The 16-lane versions (quant_attention_avx512.cpp); `tables`: int8/fp8/int4 codes as bfloat16 words.
template <typename T, int D>
QuantRange<T, D> quant_range512_for(int64_t group, bool tables);
#endif

// One quantized decode attention over raw pointers, as Partials work items: the tensor entry
// point and the fused decoder stack (stack.cpp) run the same items and merges, so both give the
// same bits. A layer's caches come with each item, so one job serves every layer of a step.
template <typename T>
struct QuantJob {
  const T* q_p;
  const int64_t *t_p, *lens_p;
  T* o_p;
  int64_t heads, group, dim, block_size, width;
  float s;
  QuantRange<T, 64> range64 = nullptr;
  QuantRange<T, 128> range128 = nullptr;
  QuantRange<T, 256> range256 = nullptr;
  QuantTile<T, 64> tile64 = nullptr;
  QuantTile<T, 128> tile128 = nullptr;
  QuantTile<T, 256> tile256 = nullptr;
  int tile_rows = 1;
  Partials partials;

  QuantJob(const T* q, const int64_t* tables, const int64_t* lens, T* out, int64_t n, int64_t heads_, int64_t group_,
           int64_t dim_, int64_t block_size_, int64_t width_, double scale, int64_t partition,
           kvbank::Isa isa = best_quant_variant())
      : q_p(q), t_p(tables), lens_p(lens), o_p(out), heads(heads_), group(group_), dim(dim_), block_size(block_size_),
        width(width_), s(static_cast<float>(scale)), partials(n, heads_, group_, dim_, lens, partition) {
    if (dim == 64) range64 = quant_range_for<T, 64>(group, isa);
    if (dim == 128) range128 = quant_range_for<T, 128>(group, isa);
    if (dim == 256) range256 = quant_range_for<T, 256>(group, isa);
    if (dim == 64) tile64 = quant_tile_for<T, 64>(group, isa);
    if (dim == 128) tile128 = quant_tile_for<T, 128>(group, isa);
    if (dim == 256) tile256 = quant_tile_for<T, 256>(group, isa);
    if (tile64 != nullptr || tile128 != nullptr || tile256 != nullptr)
      tile_rows = quant_tile_rows(static_cast<int>(group), static_cast<int>(dim));
  }

  int64_t items() const { return partials.items(); }
  int64_t pairs() const { return partials.pairs(); }

  void item(int64_t item, const QuantLayer& L);
  // A run of items (ItemQueue::drain): consecutive ones that are rows of one sequence over
  // the same tokens' blocks (a prefill's rows, same KV head and partition) attended together by the
  // tile version, where there is one; the rest one at a time. The same bits either way.
  void run(const int64_t* items, int count, const QuantLayer& L);
  void merge(int64_t pair) { partials.merge(pair, o_p); }

 private:
  // How many of the first `limit` items (at least the first) can be attended as one tile: same KV
  // head and first token, no scratch rows (int4/int2 steps read their open blocks from those),
  // and every row's blocks the first row's, so the tile reads through the first row's table.
  int tile_at(const int64_t* items, int limit, const QuantLayer& L);
};

}  // namespace kvbank
