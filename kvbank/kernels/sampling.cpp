// Greedy sampling: the index of each row's largest logit, as torch.argmax picks it (the first of
// equal maxima; a row holding NaN gives its first NaN), in one pass over rows the LM head has
// just written. torch's argmax is a serial index-tracking reduction, over a millisecond for 32
// rows of a 49k vocabulary; a vector pass is a tenth of that.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "native.h"

namespace {

using kvbank::Isa;

// Continues a scan that found no NaN before `begin`, with the best value and index so far: the
// first NaN from `begin` on, or the first index of the maximum.
int64_t argmax_tail(const float* x, int64_t begin, int64_t n, float best, int64_t at) {
  for (int64_t i = begin; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > best) {
      best = x[i];
      at = i;
    }
  }
  return at;
}

int64_t argmax_scalar(const float* x, int64_t n) { return std::isnan(x[0]) ? 0 : argmax_tail(x, 1, n, x[0], 0); }

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

#ifdef KVBANK_X86
// Each lane keeps the largest value it has seen and where (a strictly larger value replaces it,
// so a lane keeps its first maximum); the lanes then agree on the largest value and, among the
// lanes holding it, the smallest index. A NaN anywhere sends the row to the scalar pass.
KVBANK_AVX2 int64_t argmax_avx2(const float* x, int64_t n) {
  if (n < 8) return argmax_scalar(x, n);
  __m256 best = _mm256_loadu_ps(x);
  __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i index = at;
  __m256 unordered = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
  int64_t i = 8;
  for (; i + 8 <= n; i += 8) {
    index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 larger = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, larger);
    at = _mm256_blendv_epi8(at, index, _mm256_castps_si256(larger));
  }
  if (_mm256_movemask_ps(unordered)) return first_nan(x, n);
  alignas(32) float values[8];
  alignas(32) int32_t where[8];
  _mm256_store_ps(values, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(where), at);
  float top = values[0];
  int64_t pick = where[0];
  for (int l = 1; l < 8; ++l) {
    if (values[l] > top || (values[l] == top && where[l] < pick)) {
      top = values[l];
      pick = where[l];
    }
  }
  return argmax_tail(x, i, n, top, pick);
}

KVBANK_AVX512 int64_t argmax_avx512(const float* x, int64_t n) {
  if (n < 16) return argmax_scalar(x, n);
  __m512 best = _mm512_loadu_ps(x);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i index = at;
  __mmask16 unordered = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) {
    index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 larger = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, larger, v);
    at = _mm512_mask_mov_epi32(at, larger, index);
  }
  if (unordered) return first_nan(x, n);
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  const int64_t pick = _mm512_mask_reduce_min_epi32(holders, at);
  return argmax_tail(x, i, n, top, pick);
}
#endif

}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits, std::string isa_name) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.stride(1) == 1 &&
                  logits.size(1) >= 1 && logits.size(1) <= std::numeric_limits<int32_t>::max(),
              "logits must be float32 [rows, vocab] with contiguous rows and 1 <= vocab < 2^31, got ",
              logits.scalar_type(), " ", logits.sizes());
  Isa isa = Isa::Scalar;
  if (isa_name == "auto") {
    kvbank::family_variant(kvbank::Family::Sampling, &isa);
  } else {
    TORCH_CHECK(kvbank::isa_from_name(isa_name, &isa) &&
                    (isa == Isa::Scalar || isa == Isa::Avx2 || isa == Isa::Avx512),
                "isa must be auto, avx512, avx2 or scalar, not ", isa_name);
    TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(kvbank::active_isa()), "this CPU (capped at ",
                kvbank::isa_name(kvbank::active_isa()), ") cannot run the ", isa_name, " path");
  }
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * stride;
#ifdef KVBANK_X86
      if (isa == Isa::Avx512) {
        o[r] = argmax_avx512(row, n);
        continue;
      }
      if (isa == Isa::Avx2) {
        o[r] = argmax_avx2(row, n);
        continue;
      }
#endif
      o[r] = argmax_scalar(row, n);
    }
  });
  return out;
}
