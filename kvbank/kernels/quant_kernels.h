// Helpers the quantized attention's kernels and the cache writes inline: block spans, the KIVI key
// grid, code decoding, and the 8-lane loads (quant_attention.h has the formats).
#pragma once

#include "quant_attention.h"

namespace kvbank {

// The part of one block that a range's loop step reads: which block, from which token, how many,
// and where its codes (or, for a row's own block, its full-precision scratch rows) lie.
template <typename T>
struct BlockSpan {
  int64_t block, first;
  int count;
  bool own;
  const T *sk = nullptr, *sv = nullptr;
  const uint8_t *kc, *vc;

  BlockSpan(const QuantLayer& L, const int64_t* table, int64_t start, int64_t end, int64_t head, int64_t own_block,
            int64_t own_row) {
    const int64_t bs = L.block_size, j = start / bs, token_codes = L.heads * L.code_bytes;
    block = table[j];
    first = start % bs;
    count = static_cast<int>(std::min(end - start, bs - first));
    own = own_row >= 0 && j == own_block;
    if (own) {
      sk = static_cast<const T*>(L.scratch_k) + ((own_row * bs + first) * L.heads + head) * L.dim;
      sv = static_cast<const T*>(L.scratch_v) + ((own_row * bs + first) * L.heads + head) * L.dim;
    }
    kc = L.k_codes + (block * bs + first) * token_codes + head * L.code_bytes;
    vc = L.v_codes + (block * bs + first) * token_codes + head * L.code_bytes;
  }
};

// The key scale grid's steps 2^(-i/3), i = 0..15, each 2^(-i/3 rounded down) times 1, 2^(-1/3) or
// 2^(-2/3) rounded to a float16 number, so a float16 scale times one is exact in float32 (the
// grid of KiviKeys in kvbank/cache/quant.py, which these products match bit for bit).
alignas(64) constexpr float kKeyScaleSteps[16] = {
    1.0f,          1625.0f / 2048,  1290.0f / 2048,  1.0f / 2,        1625.0f / 4096,   1290.0f / 4096,
    1.0f / 4,      1625.0f / 8192,  1290.0f / 8192,  1.0f / 8,        1625.0f / 16384,  1290.0f / 16384,
    1.0f / 16,     1625.0f / 32768, 1290.0f / 32768, 1.0f / 32};

inline float half_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// A KIVI block's 16 key scales (largest first) and 16 key minimums (smallest first), from its grid.
inline void kivi_key_grids(float top, float start, float step, float* scales, float* mins) {
  for (int i = 0; i < 16; ++i) {
    scales[i] = top * kKeyScaleSteps[i];
    mins[i] = start + static_cast<float>(i) * step;  // the product is exact: no fused rounding differs
  }
}

// --- The scalar reference: plain C++ for every format, on any CPU. ---
// The quant_attention and quant_write families' scalar variants (isa.h): what KVBANK_ISA=scalar
// runs, and what the tests hold the vector variants to. The writes give the vector writes' bits
// (both are the codecs' arithmetic, operation for operation); the attention sums in its own
// order, so it agrees with the vector variants to rounding.

// codes [dim] < 2^bits -> dim * bits / 8 bytes: byte i holds codes i, i + n, i + 2n, ... lowest first
inline void pack_planar(int bits, const uint8_t* codes, int64_t dim, uint8_t* out) {
  const int per = 8 / bits;
  const int64_t n = dim / per;
  for (int64_t i = 0; i < n; ++i) {
    uint8_t b = 0;
    for (int s = 0; s < per; ++s) b |= static_cast<uint8_t>(codes[i + s * n] << (bits * s));
    out[i] = b;
  }
}

// x as float16 bits, rounded toward +inf (up) or -inf, as torch.nextafter after rounding to nearest.
inline uint16_t half_toward(float x, bool up) {
  const uint16_t h = c10::Half(x).x;
  const float y = half_value(h);
  if (up ? !(y < x) : !(y > x)) return h;
  if ((h & 0x7fff) == 0) return up ? 0x0001 : 0x8001;
  const bool negative = h & 0x8000;
  return static_cast<uint16_t>(up != negative ? h + 1 : h - 1);
}

constexpr float kTinyScale = 0x1p-24f;
constexpr float kFp8E4M3Unit = 256.0f;  // e4m3 codes read as float16 are their value times 2^-8

// Channel c (of dim) of one head of one token, as float32 before any scale.
inline float code_value(int64_t format, const uint8_t* p, int64_t c, int64_t dim) {
  switch (format) {
    case kBf16: return load(reinterpret_cast<const c10::BFloat16*>(p), c);
    case kInt8: return static_cast<float>(static_cast<int8_t>(p[c]));
    case kFp8E4M3: {
      // the sign, shifted to bit 14 with the rest, carried to bit 15 by adding it to itself
      const uint16_t t = static_cast<uint16_t>(p[c] << 7);
      return half_value(static_cast<uint16_t>(t + (t & 0x4000)));
    }
    case kFp8E5M2: return half_value(static_cast<uint16_t>(p[c] << 8));
    case kInt4: return static_cast<float>(c < dim / 2 ? p[c] & 15 : p[c - dim / 2] >> 4);
    default: return static_cast<float>((p[c % (dim / 4)] >> (2 * (c / (dim / 4)))) & 3);  // kInt2
  }
}


#ifdef KVBANK_X86
// The block's grids of one head as vectors: 16 scales (top * step, exact) and 16 minimums
// (start + i * step; the product is exact, so a fused multiply-add rounds the same).
struct KeyGrids8 {
  __m256 scales[2], mins[2];
};

KVBANK_AVX2 inline KeyGrids8 key_grids8(const QuantLayer& L, int64_t block, int64_t head) {
  const uint16_t* grid = L.k_grid + (block * L.heads + head) * 3;
  const __m256 top = _mm256_set1_ps(half_value(grid[0])), start = _mm256_set1_ps(half_value(grid[1]));
  const __m256 step = _mm256_set1_ps(half_value(grid[2]));
  KeyGrids8 g;
  for (int h = 0; h < 2; ++h) {
    g.scales[h] = _mm256_mul_ps(top, _mm256_load_ps(kKeyScaleSteps + 8 * h));
    const __m256 i = _mm256_setr_ps(8 * h, 8 * h + 1, 8 * h + 2, 8 * h + 3, 8 * h + 4, 8 * h + 5, 8 * h + 6, 8 * h + 7);
    g.mins[h] = _mm256_add_ps(start, _mm256_mul_ps(i, step));
  }
  return g;
}

// 8 lanes of a 16-entry table: indices 0..15 (bit 3 picks the half).
KVBANK_AVX2 inline __m256 lookup16(const __m256* table, __m256i index) {
  const __m256 high = _mm256_castsi256_ps(_mm256_slli_epi32(index, 28));
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(table[0], index), _mm256_permutevar8x32_ps(table[1], index), high);
}

// Every channel's key scale and minimum (float32) of one block and head, from the range bytes.
KVBANK_AVX2 inline void kivi_key_ranges8(const QuantLayer& L, int64_t block, int64_t head, int64_t dim,
                                              float* scale, float* low) {
  const KeyGrids8 g = key_grids8(L, block, head);
  const uint8_t* ranges = L.k_ranges + (block * L.heads + head) * dim;
  for (int64_t c = 0; c < dim; c += 8) {
    const __m256i r = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ranges + c)));
    _mm256_store_ps(scale + c, lookup16(g.scales, _mm256_and_si256(r, _mm256_set1_epi32(15))));
    _mm256_store_ps(low + c, lookup16(g.mins, _mm256_srli_epi32(r, 4)));
  }
}
// All-ones in the first n lanes.
KVBANK_AVX2 inline __m256 first_lanes(int n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// 8 float16 values to float32.
KVBANK_AVX2 inline __m256 halves(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

KVBANK_AVX2 inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// 8 fp8 codes to float32 through float16, exactly. e5m2 is float16's top byte; e4m3's exponent
// and mantissa bits, moved into a float16, read its value times 2^-8 (subnormals included: both
// formats' subnormals land on float16 numbers), which the token's scale undoes (kFp8E4M3Unit).
template <bool E4M3>
KVBANK_AVX2 inline __m256 fp8_to_f32(const uint8_t* p) {
  const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if constexpr (E4M3) {
    // shifted by 7 the sign lands on bit 14; adding that bit to itself carries it to bit 15
    const __m128i t = _mm_slli_epi16(c, 7);
    return _mm256_cvtph_ps(_mm_add_epi16(t, _mm_and_si128(t, _mm_set1_epi16(0x4000))));
  } else {
    return _mm256_cvtph_ps(_mm_slli_epi16(c, 8));
  }
}

// Row sums of 8 vectors: lane t of the result is the sum of v[t]'s lanes.
KVBANK_AVX2 inline __m256 row_sums(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// One head of token t as V float32 vectors of codes (scales applied by the caller).
template <int V>
KVBANK_AVX2 inline void decode_codes(int64_t format, const uint8_t* p, __m256* out) {
  switch (format) {
    case kBf16:
      for (int v = 0; v < V; ++v) out[v] = w8::load_f32(reinterpret_cast<const c10::BFloat16*>(p) + v * 8);
      break;
    case kInt8:
      for (int v = 0; v < V; ++v)
        out[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + v * 8))));
      break;
    case kFp8E4M3:
      for (int v = 0; v < V; ++v) out[v] = fp8_to_f32<true>(p + v * 8);
      break;
    case kFp8E5M2:
      for (int v = 0; v < V; ++v) out[v] = fp8_to_f32<false>(p + v * 8);
      break;
    case kInt4: {
      // planar: byte i holds channel i (low nibble) and channel i + D/2 (high nibble)
      const __m256i low = _mm256_set1_epi32(0x0F);
      for (int v = 0; v < V / 2; ++v) {
        const __m256i c = bytes8(p + v * 8);
        out[v] = _mm256_cvtepi32_ps(_mm256_and_si256(c, low));
        out[v + V / 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
      }
      break;
    }
    default: {  // kInt2: byte i holds channels i, i + D/4, i + D/2, i + 3D/4
      const __m256i low = _mm256_set1_epi32(0x03);
      for (int v = 0; v < V / 4; ++v) {
        const __m256i c = bytes8(p + v * 8);
        for (int s = 0; s < 4; ++s)
          out[v + s * V / 4] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(c, 2 * s), low));
      }
      break;
    }
  }
}
#endif

}  // namespace kvbank
