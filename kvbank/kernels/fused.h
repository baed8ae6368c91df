// Activations and the fused layer ops (fused.cpp): the elementwise steps of a decoder layer, the
// same bits from every variant of the activation family, shared by the per-layer ops and the stack.
#pragma once

#include "matmul.h"

namespace kvbank {

// out[k] = silu(gate[k]) * up[k] from the projections rounded to T.
template <typename T>
void silu_mul_row(const float* gate, const float* up, float* out, int64_t n);
// out[k] = gelu(gate[k]) * up[k] for bfloat16 rows.
void geglu_row(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out, int64_t n);
// Whether the elementwise loops below run 16 lanes (the activation family's avx512 variant).
bool elementwise16();
// The elementwise loops below (for bfloat16 values) do the whole 16s through `call`, an avx512
// kernel that returns how many it did, where `wide`; the rest one value at a time, the same
// operations, so the same bits. This is where their scalar loops start.
#ifdef KVBANK_X86
#define KVBANK_WIDE16(wide, call) ((wide) ? (call) : int64_t{0})
#else
#define KVBANK_WIDE16(wide, call) int64_t{0}
#endif
// dst[k] = src[k] rounded to bfloat16.
void store_values(const float* src, c10::BFloat16* dst, int64_t n, bool wide);
// residual[k] += x[k], rounded to bfloat16.
void add_values(const c10::BFloat16* x, c10::BFloat16* residual, int64_t n, bool wide);
#ifdef KVBANK_X86
// The whole 16s of out[i] = x[i] + add[i] rounded to bfloat16, as float (no add: x[i]); how many it did.
KVBANK_AVX512 int64_t sum_bf16_avx512(const c10::BFloat16* x, const c10::BFloat16* add, float* out, int64_t n);
// The whole 16s of values[i] = values[i] * inv * weight[i]; how many it did.
KVBANK_AVX512 int64_t scale_bf16_avx512(float* values, float inv, const c10::BFloat16* weight, int64_t n);
#endif

}  // namespace kvbank
