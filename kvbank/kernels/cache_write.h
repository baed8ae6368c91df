// Cache writes at a step's slots, bit for bit the codecs (kvbank/cache/quant.py): per-token int8 and
// fp8 codes with float16 scales, and KIVI (int4, int2) blocks quantized whole when they fill
// (cache_write.cpp).
#pragma once

#include "quant_attention.h"

namespace kvbank {

// Whether the quant_write family runs its scalar variant now.
inline bool scalar_writes() {
  kvbank::Isa variant = kvbank::Isa::Scalar;
  kvbank::family_variant(kvbank::Family::QuantWrite, &variant);
  return variant == kvbank::Isa::Scalar;
}

// One head of one token quantized per token (int8, fp8) in the quant_write family's variant.
template <typename T>
void quantize_head(int64_t format, const T* x, int64_t dim, uint8_t* codes, uint16_t* scale_out);

// Keys of one head of a KIVI block (see kivi_keys8): x is token 0's row of the head, `stride` apart
// per token; the variant the quant_write family runs now.
template <typename T>
using KiviKeys = void (*)(int bits, const T* x, int64_t tokens, int64_t stride, int64_t dim, uint8_t* codes,
                          int64_t code_stride, uint8_t* ranges, uint16_t* grid);
template <typename T>
KiviKeys<T> kivi_keys_variant();


// The plan's rows and scratch slots against the residual slots they name; returns the row count.
int64_t check_kivi_plan(const torch::Tensor& plan, const torch::Tensor& scratch_slots, int64_t tokens, int64_t blocks,
                        int64_t block_size, int64_t residual_slots);
// One KIVI layer's pool tensors and residual slots; names the shapes it expected.
void check_kivi_layer(int64_t format, int64_t heads, int64_t dim, const torch::Tensor& k_codes, const torch::Tensor& k_ranges,
                      const torch::Tensor& k_grid, const torch::Tensor& v_codes, const torch::Tensor& v_scale,
                      const torch::Tensor& v_zero, const torch::Tensor& residual_k, const torch::Tensor& residual_v,
                      torch::ScalarType dtype);

#ifdef KVBANK_X86
// One KIVI layer's writes for one step, over raw pointers (checked by check_kivi_*).
template <typename T>
struct KiviWrite {
  int bits;
  int64_t heads, dim, block_size, code_bytes, group;
  uint8_t *k_codes, *v_codes, *k_ranges;
  uint16_t *k_grid, *v_scale;
  int8_t* v_zero;
  T *res_k, *res_v;          // residual slots [slots, block_size, heads, dim]
  T *scratch_k, *scratch_v;  // this step's rows [rows, block_size, heads, dim]
  const int64_t* plan;       // [rows, kPlanFields]
  const int64_t* scratch_slots;  // per token: row * block_size + its offset in the block

  int64_t block_elems() const { return block_size * heads * dim; }

  // Phase 1: row r's tokens from before the step.
  void preload(int64_t r) const {
    const int64_t* p = plan + r * kPlanFields;
    const int64_t n = p[kPlanHeld] * heads * dim;
    if (n == 0) return;
    std::memcpy(scratch_k + r * block_elems(), res_k + p[kPlanSlot] * block_elems(), n * sizeof(T));
    std::memcpy(scratch_v + r * block_elems(), res_v + p[kPlanSlot] * block_elems(), n * sizeof(T));
  }

  // Phase 2: token t's K and V ([heads, dim] each), placed in its scratch row.
  void place(int64_t t, const T* k, const T* v) const {
    std::memcpy(scratch_k + scratch_slots[t] * heads * dim, k, heads * dim * sizeof(T));
    std::memcpy(scratch_v + scratch_slots[t] * heads * dim, v, heads * dim * sizeof(T));
  }

  // Whether row r's block is read from the pool by a later row of this step (kPlanEarly).
  bool early(int64_t r) const { return plan[r * kPlanFields + kPlanEarly] != 0; }

  void finish(int64_t r) const;
};

// A checked KIVI layer's writes for one step (scratch rows scratch_k, scratch_v).
template <typename T>
KiviWrite<T> kivi_pointers(int64_t format, const torch::Tensor& k_codes, const torch::Tensor& k_ranges,
                           const torch::Tensor& k_grid, const torch::Tensor& v_codes, const torch::Tensor& v_scale,
                           const torch::Tensor& v_zero, const torch::Tensor& residual_k, const torch::Tensor& residual_v,
                           T* scratch_k, T* scratch_v, const torch::Tensor& plan, const torch::Tensor& scratch_slots);
#endif

}  // namespace kvbank
