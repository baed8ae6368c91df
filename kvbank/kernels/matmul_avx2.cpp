// The integer matmuls' avx2 kernels (matmul.h has the record layouts).
#include "matmul.h"

#ifdef KVBANK_X86
namespace kvbank {

// The same arithmetic 8 lanes at a time; packing interleaves the 128-bit halves, which the
// final permute puts back in order.
KVBANK_AVX2 void QuantRows::quantize_row_avx2(int64_t r, const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4];
    __m256 top = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(x + b * QK + 8 * k);
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[k]));
    }
    const __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    const __m128 quarter = _mm_max_ps(half, _mm_movehl_ps(half, half));
    const float amax = _mm_cvtss_f32(_mm_max_ss(quarter, _mm_movehdup_ps(quarter)));
    const float scale = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
    __m256i qi[4];
    for (int k = 0; k < 4; ++k) qi[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    int8_t* qb = q.data() + r * cols + b * QK;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_permutevar8x32_epi32(packed, order));
    const __m256i both = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    const __m128i pair = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
    const __m128i two = _mm_add_epi32(pair, _mm_shuffle_epi32(pair, 0x4E));
    const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 0xB1)));
    d[r * blocks + b] = scale;
    sum[r * blocks + b] = total;
    s[r * blocks + b] = scale * static_cast<float>(total);
  }
}

namespace {

// AVX2: each record is two halves of 8 rows (bytes 32h.. of every 64-byte chunk); maddubs + madd
// give the same exact integer dot products (no pair can saturate: |u8 x s8 x 2| < 2^15 here).
KVBANK_AVX2 inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// 32 mask bits as 32 bytes: 16 where the bit is set, else 0.
KVBANK_AVX2 inline __m256i fifth_bits(uint32_t mask) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(mask)),
      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// 8 lanes' scales (or minimums) of half h at `offset`: fp16 or float32 (F32).
template <bool F32>
KVBANK_AVX2 inline __m256 record_values8(const uint8_t* rec, int64_t offset, int h) {
  if (F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(rec + offset + 32 * h));
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + offset + 16 * h)));
}

// Half h of a block's weights as maddubs' unsigned operands, u[c] for the inputs 4c..4c+3: the
// nibbles with Q5's fifth bits (u[j] the low ones of chunk j, u[4 + j] its high ones), or the 8-bit
// weights' magnitudes with the weights themselves in w8[c] (w + 128 flipped back to signed: no offset
// is left to take off).
template <Rec K>
KVBANK_AVX2 inline void decode8(const uint8_t* rec, int h, __m256i* u, __m256i* w8) {
  if constexpr (Record<K>::nibbles) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * j + 32 * h));
      u[j] = _mm256_and_si256(v, low);
      u[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      if (Record<K>::fifth) {
        const uint64_t low_bits = load_u64(rec + 256 + 8 * j), high_bits = load_u64(rec + 288 + 8 * j);
        u[j] = _mm256_or_si256(u[j], fifth_bits(static_cast<uint32_t>(low_bits >> (32 * h))));
        u[4 + j] = _mm256_or_si256(u[4 + j], fifth_bits(static_cast<uint32_t>(high_bits >> (32 * h))));
      }
    }
  } else {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int c = 0; c < 8; ++c) {
      w8[c] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * c + 32 * h)), flip);
      u[c] = _mm256_abs_epi8(w8[c]);
    }
  }
}

// A row's exact dot product with a block's nibbles. A maddubs pair sum is at most 2 x max_nibble x
// 127: with 4-bit weights all eight of a block add up in 16 bits (|sum| <= 30,480) and widen once,
// the same exact integer as widening each; 5-bit ones (2 x 31 x 127 each) widen the low and high
// halves' four apart (each at most 31,496).
template <Rec K>
KVBANK_AVX2 inline __m256i nibble_dot8(const __m256i* u, const int8_t* qa) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p0 = _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(load_i32(qa)));
  __m256i p1 = _mm256_maddubs_epi16(u[4], _mm256_set1_epi32(load_i32(qa + 16)));
  for (int j = 1; j < 4; ++j) {
    p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(u[j], _mm256_set1_epi32(load_i32(qa + 4 * j))));
    p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(u[4 + j], _mm256_set1_epi32(load_i32(qa + 16 + 4 * j))));
  }
  if (8 * 2 * Record<K>::max_nibble * 127 <= INT16_MAX) return _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones);
  return _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
}

// A row's exact dot products with a block's 8-bit weights, the first and last 16 inputs apart: the
// magnitudes as the unsigned operand, the activations taking the weights' signs.
KVBANK_AVX2 inline void q8_dots8(const __m256i* u, const __m256i* w8, const int8_t* qa, __m256i& lo, __m256i& hi) {
  lo = dot_u8s8(u[0], _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qa)), w8[0]));
  hi = dot_u8s8(u[4], _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qa + 16)), w8[4]));
  for (int c = 1; c < 4; ++c) {
    const __m256i x_lo = _mm256_set1_epi32(load_i32(qa + 4 * c)), x_hi = _mm256_set1_epi32(load_i32(qa + 16 + 4 * c));
    lo = _mm256_add_epi32(lo, dot_u8s8(u[c], _mm256_sign_epi8(x_lo, w8[c])));
    hi = _mm256_add_epi32(hi, dot_u8s8(u[c + 4], _mm256_sign_epi8(x_hi, w8[c + 4])));
  }
}

// A block's weights are decoded once and meet every row of the tile; per row and lane the
// float sums run in block order as in the scalar version, so the bits do not depend on the tile.
template <int R, Rec K>
KVBANK_AVX2 void group_avx2(const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
  using T = Record<K>;
  const int8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = a.q.data() + (r0 + i) * a.cols;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* rec = w + b * T::bytes;
      if (h == 0) {
        prefetch_record(rec, T::bytes);
      }
      __m256i u[8], w8[8];
      decode8<K>(rec, h, u, w8);
      const __m256 dw = record_values8<T::f32>(rec, T::scale_at, h);
      const __m256 d_hi = T::halves ? record_values8<true>(rec, T::scale_hi_at, h) : dw;
      const __m256 mw = T::minimum ? record_values8<T::f32>(rec, T::min_at, h) : _mm256_setzero_ps();
      for (int i = 0; i < R; ++i) {
        const int8_t* qa = rows[i] + b * QK;
        const int64_t ab = (r0 + i) * a.blocks + b;
        const __m256 d = _mm256_set1_ps(a.d[ab]);
        if constexpr (T::halves) {
          __m256i lo, hi;
          q8_dots8(u, w8, qa, lo, hi);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(dw, d), acc[i]);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(d_hi, d), acc[i]);
        } else {
          __m256i dot;
          if constexpr (T::nibbles) {
            dot = nibble_dot8<K>(u, qa);
            if (T::offset) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(T::offset * a.sum[ab]));
          } else {
            __m256i lo, hi;
            q8_dots8(u, w8, qa, lo, hi);
            dot = _mm256_add_epi32(lo, hi);
          }
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, d), acc[i]);
          if (T::minimum) acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[ab]), acc[i]);
        }
      }
    }
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + i * GROUP_ROWS + 8 * h, acc[i]);
  }
}

}  // namespace

void avx2_group(Rec kind, int64_t tile, const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
  with_tile_kind(tile, kind,
                 [&](auto r, auto k) { group_avx2<decltype(r)::value, decltype(k)::value>(w, a, r0, out); });
}

}  // namespace kvbank
#endif
