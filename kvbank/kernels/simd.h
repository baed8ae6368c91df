// What kvbank's x86 kernels share below the kernels themselves: the target attributes each kernel is
// compiled for (one definition each, by the features they name) and the vector helpers several
// families inline.
#pragma once

#include "isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVBANK_X86 1
#include <immintrin.h>

// One target attribute per level of isa.h, each naming that level's features (every level holds the
// ones below it), so a kernel says which level it is compiled for and nothing else. Every level
// from avx2 up has FMA, and GCC contracts a multiply and an add into one FMA where the target has
// it (-ffp-contract=fast): a kernel's bits are those of its level's features, fixed here.
#define KVBANK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVBANK_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")))
#define KVBANK_INLINE512 KVBANK_AVX512 inline __attribute__((always_inline))
#define KVBANK_AVX512_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define KVBANK_AVX512_BF16 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16,avx512vbmi")))
#if defined(KVBANK_AMX_BUILD)
#define KVBANK_AMX                                                                                     \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16,avx512vbmi," \
                        "amx-tile,amx-int8")))
#define KVBANK_HAS_AMX 1
#endif

// e^x for x <= 0, 16 lanes, at the avx512 level so that every AVX-512 kernel can inline it; its
// power-of-two scaling is exact, so it gives the 8-lane and scalar versions' bits.
KVBANK_AVX512 inline __m512 exp_neg_v(__m512 x) {
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
KVBANK_AVX2 inline __m256 exp_neg8(__m256 x) {
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
