// What kvbank's x86 kernels share below the kernels themselves: the target attributes each kernel is
// compiled for (one definition each, by the features they name) and the vector layer several
// families inline: per width a set of helpers with the same names (w1: float, w8: __m256 at avx2,
// w16: __m512 at avx512), and the math written once against those names (simd_ops.inc).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVBANK_X86 1
#include <immintrin.h>

// One feature string per level of isa.h (every level holds the ones below it), which both the
// target attributes and the pragma regions of the width namespaces name, so a kernel says which
// level it is compiled for and nothing else. Every level from avx2 up has FMA, and GCC contracts a
// multiply and an add into one FMA where the target has it (-ffp-contract=fast): a kernel's bits are
// those of its level's features, fixed here.
#define KVBANK_FEATURES_AVX2 "avx2,fma,f16c"
#define KVBANK_FEATURES_AVX512 "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl"
#define KVBANK_FEATURES_AVX512_VNNI "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"
#define KVBANK_FEATURES_AVX512_BF16 "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16,avx512vbmi"
#define KVBANK_AVX2 __attribute__((target(KVBANK_FEATURES_AVX2)))
#define KVBANK_AVX512 __attribute__((target(KVBANK_FEATURES_AVX512)))
#define KVBANK_INLINE512 KVBANK_AVX512 inline __attribute__((always_inline))
#define KVBANK_AVX512_VNNI __attribute__((target(KVBANK_FEATURES_AVX512_VNNI)))
#define KVBANK_AVX512_BF16 __attribute__((target(KVBANK_FEATURES_AVX512_BF16)))
#if defined(KVBANK_AMX_BUILD)
#define KVBANK_FEATURES_AMX \
  "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16,avx512vbmi,amx-tile,amx-int8"
#define KVBANK_AMX __attribute__((target(KVBANK_FEATURES_AMX)))
#define KVBANK_HAS_AMX 1
#endif

// Code between these is compiled for `features` (a KVBANK_FEATURES_* string): GCC inlines a
// target-attributed helper only into code of the same or a wider target, so generic code written
// against a width's helpers is included inside that width's region rather than made a template.
// Only what the region's code needs may be included inside it: std, torch and intrinsics headers
// come before.
#define KVBANK_PRAGMA(text) _Pragma(#text)
#define KVBANK_BEGIN_TARGET(features) _Pragma("GCC push_options") KVBANK_PRAGMA(GCC target(features))
#define KVBANK_END_TARGET _Pragma("GCC pop_options")
#endif

namespace kvbank {

// One value at a time, in plain arithmetic, so loops over these vectorize. fmadd rounds twice, as
// the scalar references always have.
namespace w1 {
using vf = float;
inline vf set1(float x) { return x; }
inline vf sub(vf a, vf b) { return a - b; }
inline vf mul(vf a, vf b) { return a * b; }
inline vf fmadd(vf a, vf b, vf c) { return a * b + c; }
inline vf max(vf a, vf b) { return std::max(a, b); }
inline vf floor(vf x) { return std::floor(x); }
// p * 2^n for an integral n in the normal range, through the exponent bits: exact.
inline vf scale_pow2(vf p, vf n) {
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
#include "simd_ops.inc"
}  // namespace w1

// w1 with a fused multiply-add that rounds once, as the vector widths' does, for a scalar path
// that must give their bits (std::fma: a library call where the build targets no FMA).
namespace w1_fused {
using w1::floor, w1::max, w1::mul, w1::scale_pow2, w1::set1, w1::sub, w1::vf;
inline vf fmadd(vf a, vf b, vf c) { return std::fma(a, b, c); }
#include "simd_ops.inc"
}  // namespace w1_fused

#ifdef KVBANK_X86
// The helpers every vector width spells alike but for its intrinsics' prefix (_mm256, _mm512);
// after the width's load_bf16.
#define KVBANK_SIMD_COMMON(P)                                         \
  inline vf set1(float x) { return P##_set1_ps(x); }                  \
  inline vi set1_i(int32_t x) { return P##_set1_epi32(x); }           \
  inline vf load(const float* p) { return P##_loadu_ps(p); }          \
  inline vi add(vi a, vi b) { return P##_add_epi32(a, b); }           \
  inline vf sub(vf a, vf b) { return P##_sub_ps(a, b); }              \
  inline vf mul(vf a, vf b) { return P##_mul_ps(a, b); }              \
  inline vf fmadd(vf a, vf b, vf c) { return P##_fmadd_ps(a, b, c); } \
  inline vf max(vf a, vf b) { return P##_max_ps(a, b); }               \
  /* float32 or bfloat16 values to float32 */                         \
  template <typename T>                                               \
  inline vf load_f32(const T* p) {                                    \
    if constexpr (std::is_same_v<T, float>) {                         \
      return load(p);                                                 \
    } else {                                                          \
      return load_bf16(p);                                            \
    }                                                                 \
  }

KVBANK_BEGIN_TARGET(KVBANK_FEATURES_AVX2)
namespace w8 {
constexpr int kLanes = 8;
using vf = __m256;
using vi = __m256i;
using vm = __m256;  // all-ones lanes
inline vi iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
// 8 bfloat16 values (any 16-bit type holding their bits) to float32, exactly.
template <typename T>
inline vf load_bf16(const T* p) {
  static_assert(sizeof(T) == 2);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
KVBANK_SIMD_COMMON(_mm256)
inline vf floor(vf x) { return _mm256_floor_ps(x); }
inline vf scale_pow2(vf p, vf n) {
  const vi bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
// v's lanes folded by op (add, max, min): the halves, then pairs, then the last two.
#define KVBANK_FOLD8(name, op)                                                          \
  inline float name(vf v) {                                                             \
    const __m128 x = _mm_##op##_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); \
    const __m128 y = _mm_##op##_ps(x, _mm_movehl_ps(x, x));                             \
    return _mm_cvtss_f32(_mm_##op##_ss(y, _mm_movehdup_ps(y)));                          \
  }
KVBANK_FOLD8(hsum, add)
KVBANK_FOLD8(hmax, max)
KVBANK_FOLD8(hmin, min)
#undef KVBANK_FOLD8
inline vm is_nan(vf v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }
inline vm greater(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline vm equal(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
inline vm either(vm a, vm b) { return _mm256_or_ps(a, b); }
inline bool any(vm m) { return _mm256_movemask_ps(m) != 0; }
inline vf select(vm m, vf yes, vf no) { return _mm256_blendv_ps(no, yes, m); }
inline vi select(vm m, vi yes, vi no) { return _mm256_blendv_epi8(no, yes, _mm256_castps_si256(m)); }
// The smallest of v's lanes that m holds (at least one).
inline int32_t min_of(vm m, vi v) {
  const vi held = select(m, v, _mm256_set1_epi32(INT32_MAX));
  __m128i x = _mm_min_epi32(_mm256_castsi256_si128(held), _mm256_extracti128_si256(held, 1));
  x = _mm_min_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  return _mm_cvtsi128_si32(_mm_min_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
}
#include "simd_ops.inc"
}  // namespace w8
KVBANK_END_TARGET

KVBANK_BEGIN_TARGET(KVBANK_FEATURES_AVX512)
namespace w16 {
constexpr int kLanes = 16;
using vf = __m512;
using vi = __m512i;
using vm = __mmask16;
inline vi iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
// 16 bfloat16 values (their bits, or any 16-bit type holding them) to float32, exactly.
inline vf from_bf16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
template <typename T>
inline vf load_bf16(const T* p) {
  static_assert(sizeof(T) == 2);
  return from_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
KVBANK_SIMD_COMMON(_mm512)
inline vf floor(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// scalef saturates to inf past the top of the range
inline vf scale_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
inline vm is_nan(vf v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline vm greater(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline vm equal(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline vm either(vm a, vm b) { return a | b; }
inline bool any(vm m) { return m != 0; }
inline vf select(vm m, vf yes, vf no) { return _mm512_mask_mov_ps(no, m, yes); }
inline vi select(vm m, vi yes, vi no) { return _mm512_mask_mov_epi32(no, m, yes); }
inline int32_t min_of(vm m, vi v) { return _mm512_mask_reduce_min_epi32(m, v); }
#include "simd_ops.inc"
}  // namespace w16
KVBANK_END_TARGET
#endif

}  // namespace kvbank
