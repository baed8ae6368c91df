// What kvbank's x86 kernels share below the kernels themselves: the target attributes each kernel is
// compiled for (one definition each, by the features they name) and the vector helpers several
// families inline.
#pragma once

#include "isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVBANK_X86 1
#include <immintrin.h>

// avx2 level: AVX2, FMA, F16C.
#define KVBANK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVBANK_AVX2_F16C KVBANK_AVX2
// avx512 level (F/BW/DQ/VL) with FMA: the fused layer ops' elementwise loops.
#define KVBANK_AVX512_F __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))
// avx512 level with FMA and F16C: the quantized attention's 16-lane kernels.
#define KVBANK_AVX512_Q __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))
#define KVBANK_INLINE512 KVBANK_AVX512_Q inline __attribute__((always_inline))
// avx512_vnni level: the integer matmuls.
#define KVBANK_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")))
// avx512_bf16 level: bfloat16 pair dot products (the dense attention).
#define KVBANK_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
// avx512_bf16 level with VBMI: the quantized attention's bfloat16 tables.
#define KVBANK_AVX512_LUT __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi,fma,f16c")))
#if defined(KVBANK_AMX_BUILD)
// amx level: int8 tiles.
#define KVBANK_AMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma,amx-tile,amx-int8")))
#define KVBANK_HAS_AMX 1
#endif

// e^x for x <= 0, 16 lanes. AVX-512F alone, so that every AVX-512 kernel can inline it; its
// power-of-two scaling is exact, so it gives the 8-lane and scalar versions' bits.
__attribute__((target("avx512f"))) inline __m512 exp_neg_v(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

KVBANK_AVX512 inline __m512 bf16_to_f32(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// e^x for x <= 0, 8 lanes: the scalar exp_neg's polynomial and rounding.
KVBANK_AVX2_F16C inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_floor_ps(t);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f));
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif
