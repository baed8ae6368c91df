// Decode attention straight from a quantized paged KV cache: the codes are read in place through
// the block table and turned into float32 in registers, never written back out dequantized.
//
// Formats (kvbank/cache/quant.py):
// - bfloat16, dense: the model's own cache [blocks, block_size, heads, dim], no scales (used for
//   decodes on CPUs without the AVX-512 BF16 kernel of paged_decode.cpp).
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
#pragma once

#include "native.h"
#include "paged_decode.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

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

// Attention of G query heads of one KV head over tokens [begin, end), one token at a time
// (the QuantRange signature, so QuantJob runs it like the vector variants).
template <typename T, int G, int D>
void quant_range_scalar(const QuantLayer& L, const T* q, const int64_t* table, int64_t begin, int64_t end,
                        int64_t head, int64_t own_block, int64_t own_row, float scale, float* acc_out, float* max_out,
                        float* sum_out) {
  const int64_t bs = L.block_size, token_codes = L.heads * L.code_bytes;
  const bool kivi = L.format == kInt4 || L.format == kInt2;
  const bool scaled = !kivi && L.format != kBf16;
  const float unit = L.format == kFp8E4M3 ? kFp8E4M3Unit : 1.0f;
  const int64_t group_size = kivi ? D / L.value_groups : D;
  float qs[G][D], ks[D], km[D], key[D], value[D];
  for (int g = 0; g < G; ++g) {
    for (int d = 0; d < D; ++d) qs[g][d] = load(q, g * D + d) * scale;
    for (int d = 0; d < D; ++d) acc_out[g * D + d] = 0.0f;
    max_out[g] = -std::numeric_limits<float>::infinity();
    sum_out[g] = 0.0f;
  }
  for (int64_t start = begin; start < end; start += bs - start % bs) {
    const BlockSpan<T> b(L, table, start, end, head, own_block, own_row);
    if (kivi && !b.own) {
      const uint16_t* grid = L.k_grid + (b.block * L.heads + head) * 3;
      float scales[16], mins[16];
      kivi_key_grids(half_value(grid[0]), half_value(grid[1]), half_value(grid[2]), scales, mins);
      const uint8_t* ranges = L.k_ranges + (b.block * L.heads + head) * D;
      for (int d = 0; d < D; ++d) {
        ks[d] = scales[ranges[d] & 15];
        km[d] = mins[ranges[d] >> 4];
      }
    }
    for (int t = 0; t < b.count; ++t) {
      const int64_t at = (b.block * bs + b.first + t) * L.heads + head;
      float key_scale = 1.0f, value_scale = 1.0f;
      if (scaled && !b.own) {
        key_scale = half_value(L.k_scale[at]) * unit;
        value_scale = half_value(L.v_scale[at]) * unit;
      }
      for (int d = 0; d < D; ++d) {
        if (b.own) {
          key[d] = load(b.sk, t * L.heads * D + d);
          value[d] = load(b.sv, t * L.heads * D + d);
        } else if (kivi) {
          key[d] = code_value(L.format, b.kc + t * token_codes, d, D) * ks[d] + km[d];
          const int64_t c = at * L.value_groups + d / group_size;
          value[d] = (code_value(L.format, b.vc + t * token_codes, d, D) + L.v_zero[c]) * half_value(L.v_scale[c]);
        } else {
          key[d] = code_value(L.format, b.kc + t * token_codes, d, D) * key_scale;
          value[d] = code_value(L.format, b.vc + t * token_codes, d, D) * value_scale;
        }
      }
      for (int g = 0; g < G; ++g) {
        float s = 0.0f;
        for (int d = 0; d < D; ++d) s += qs[g][d] * key[d];
        float* acc = acc_out + g * D;
        if (s > max_out[g]) {
          const float c = exp_neg(max_out[g] - s);
          for (int d = 0; d < D; ++d) acc[d] *= c;
          sum_out[g] *= c;
          max_out[g] = s;
        }
        const float p = exp_neg(s - max_out[g]);
        sum_out[g] += p;
        for (int d = 0; d < D; ++d) acc[d] += p * value[d];
      }
    }
  }
}

// One head of one token quantized per token (int8, fp8): a float16 scale of amax / top (never
// zero, rounded up when rounding to nearest went down, so no code clips), codes x / scale rounded
// to nearest even (int8) or converted to fp8 as PyTorch does (round to nearest even, subnormals).
template <typename T>
void quantize_head_scalar(int64_t format, const T* x, int64_t dim, uint8_t* codes, uint16_t* scale_out) {
  const float top = format == kInt8 ? 127.0f : format == kFp8E4M3 ? 448.0f : 57344.0f;
  float peak = 0.0f;
  for (int64_t c = 0; c < dim; ++c) peak = std::max(peak, std::fabs(load(x, c)));
  const float wanted = std::max(peak / top, kTinyScale);
  uint16_t h = c10::Half(wanted).x;
  if (half_value(h) < wanted) ++h;  // the next float16 up (wanted is positive)
  *scale_out = h;
  const float exact = half_value(h);
  for (int64_t c = 0; c < dim; ++c) {
    const float y = std::min(std::max(load(x, c) / exact, -top), top);
    if (format == kInt8) {
      codes[c] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
    } else if (format == kFp8E4M3) {
      codes[c] = c10::Float8_e4m3fn(y).x;
    } else {
      codes[c] = c10::Float8_e5m2(y).x;
    }
  }
}

// A KIVI block's keys of one head (KiviKeys.quantize): x is token 0's row, `stride` apart per
// token. The grid (top scale, first minimum, minimum step) and each channel's range byte: the
// largest grid minimum at or below the channel's smallest key, the smallest grid scale that spans
// its keys from there; codes (x - minimum) / scale rounded to nearest even and clamped.
template <typename T>
void kivi_keys_scalar(int bits, const T* x, int64_t tokens, int64_t stride, int64_t dim, uint8_t* codes,
                      int64_t code_stride, uint8_t* ranges, uint16_t* grid) {
  uint8_t q[128];
  float lo[128], hi[128], low[128], scale[128];
  const float top_code = static_cast<float>((1 << bits) - 1);
  for (int64_t c = 0; c < dim; ++c) {
    lo[c] = std::numeric_limits<float>::infinity();
    hi[c] = -lo[c];
    for (int64_t t = 0; t < tokens; ++t) {
      lo[c] = std::min(lo[c], load(x, t * stride + c));
      hi[c] = std::max(hi[c], load(x, t * stride + c));
    }
  }
  const float lo_min = *std::min_element(lo, lo + dim), lo_max = *std::max_element(lo, lo + dim);
  const uint16_t start16 = half_toward(lo_min, false);
  const float start = half_value(start16);
  const uint16_t step16 = half_toward((lo_max - start) / 15.0f, true);
  float scales[16], mins[16];
  kivi_key_grids(0.0f, start, half_value(step16), scales, mins);
  uint8_t min_index[128];
  float widest = 0.0f;
  for (int64_t c = 0; c < dim; ++c) {
    int i = 0;
    for (int j = 1; j < 16; ++j) i += mins[j] <= lo[c];  // the grid ascends
    min_index[c] = static_cast<uint8_t>(i);
    low[c] = mins[i];
    hi[c] -= low[c];
    widest = std::max(widest, hi[c]);
  }
  const uint16_t top16 = half_toward(std::max(widest / top_code, kTinyScale), true);
  kivi_key_grids(half_value(top16), start, half_value(step16), scales, mins);
  for (int64_t c = 0; c < dim; ++c) {
    int i = 0;
    for (int j = 1; j < 16; ++j) i += scales[j] * top_code >= hi[c];  // the grid descends
    scale[c] = scales[i];
    ranges[c] = static_cast<uint8_t>(i | (min_index[c] << 4));
  }
  grid[0] = top16;
  grid[1] = start16;
  grid[2] = step16;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < dim; ++c) {
      const float y = std::nearbyint((load(x, t * stride + c) - low[c]) / scale[c]);
      q[c] = static_cast<uint8_t>(std::min(std::max(y, 0.0f), top_code));
    }
    pack_planar(bits, q, dim, codes + t * code_stride);
  }
}

// One head of one token's values (KiviValues.quantize): per group of channels a float16 scale
// (the group's width / top, at least |minimum| / 127, rounded up) and an int8 zero point
// (minimum / scale, rounded); codes x / scale - zero, rounded and clamped.
template <typename T>
void kivi_values_scalar(int bits, const T* x, int64_t dim, int64_t group, uint8_t* codes, uint16_t* scale,
                        int8_t* zero) {
  uint8_t q[128];
  const float top = static_cast<float>((1 << bits) - 1);
  for (int64_t g = 0; g * group < dim; ++g) {
    float lo = load(x, g * group), hi = lo;
    for (int64_t c = 1; c < group; ++c) {
      lo = std::min(lo, load(x, g * group + c));
      hi = std::max(hi, load(x, g * group + c));
    }
    const float want = std::max(std::max((hi - lo) / top, std::fabs(lo) / 127.0f), kTinyScale);
    const uint16_t s16 = half_toward(want, true);
    const float sf = half_value(s16);
    const float z = std::min(std::max(std::nearbyint(lo / sf), -128.0f), 127.0f);
    scale[g] = s16;
    zero[g] = static_cast<int8_t>(z);
    for (int64_t c = 0; c < group; ++c) {
      const float y = std::nearbyint(load(x, g * group + c) / sf - z);
      q[g * group + c] = static_cast<uint8_t>(std::min(std::max(y, 0.0f), top));
    }
  }
  pack_planar(bits, q, dim, codes);
}

// Whether the quant_write family runs its scalar variant now.
inline bool scalar_writes() {
  kvbank::Isa variant = kvbank::Isa::Scalar;
  kvbank::family_variant(kvbank::Family::QuantWrite, &variant);
  return variant == kvbank::Isa::Scalar;
}

#ifdef KVBANK_X86
// AVX2 with FMA and F16C: every x86 CPU kvbank's fast paths target has them, AVX-512 ones too.
#define KVBANK_AVX2_F16C __attribute__((target("avx2,fma,f16c")))

// The block's grids of one head as vectors: 16 scales (top * step, exact) and 16 minimums
// (start + i * step; the product is exact, so a fused multiply-add rounds the same).
struct KeyGrids8 {
  __m256 scales[2], mins[2];
};

KVBANK_AVX2_F16C inline KeyGrids8 key_grids8(const QuantLayer& L, int64_t block, int64_t head) {
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
KVBANK_AVX2_F16C inline __m256 lookup16(const __m256* table, __m256i index) {
  const __m256 high = _mm256_castsi256_ps(_mm256_slli_epi32(index, 28));
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(table[0], index), _mm256_permutevar8x32_ps(table[1], index), high);
}

// Every channel's key scale and minimum (float32) of one block and head, from the range bytes.
KVBANK_AVX2_F16C inline void kivi_key_ranges8(const QuantLayer& L, int64_t block, int64_t head, int64_t dim,
                                              float* scale, float* low) {
  const KeyGrids8 g = key_grids8(L, block, head);
  const uint8_t* ranges = L.k_ranges + (block * L.heads + head) * dim;
  for (int64_t c = 0; c < dim; c += 8) {
    const __m256i r = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ranges + c)));
    _mm256_store_ps(scale + c, lookup16(g.scales, _mm256_and_si256(r, _mm256_set1_epi32(15))));
    _mm256_store_ps(low + c, lookup16(g.mins, _mm256_srli_epi32(r, 4)));
  }
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

// All-ones in the first n lanes.
KVBANK_AVX2_F16C inline __m256 first_lanes(int n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

KVBANK_AVX2_F16C inline float hsum8(__m256 v) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}

KVBANK_AVX2_F16C inline float hmax8(__m256 v) {
  const __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(y, _mm_movehdup_ps(y)));
}

// 8 float16 values to float32.
KVBANK_AVX2_F16C inline __m256 halves(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

KVBANK_AVX2_F16C inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// 8 fp8 codes to float32 through float16, exactly. e5m2 is float16's top byte; e4m3's exponent
// and mantissa bits, moved into a float16, read its value times 2^-8 (subnormals included: both
// formats' subnormals land on float16 numbers), which the token's scale undoes (kFp8E4M3Unit).
template <bool E4M3>
KVBANK_AVX2_F16C inline __m256 fp8_to_f32(const uint8_t* p) {
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
KVBANK_AVX2_F16C inline __m256 row_sums(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <typename T>
KVBANK_AVX2_F16C inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
}

// One head of token t as V float32 vectors of codes (scales applied by the caller).
template <int V>
KVBANK_AVX2_F16C inline void decode_codes(int64_t format, const uint8_t* p, __m256* out) {
  switch (format) {
    case kBf16:
      for (int v = 0; v < V; ++v) out[v] = load8(reinterpret_cast<const c10::BFloat16*>(p) + v * 8);
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

// Query rows of one sequence attended together (quant_rows): as many as keep their queries,
// accumulators and scores (2 x G x D + G x 64 floats each) within about 20 KB of stack.
constexpr int quant_tile_rows(int group, int dim) { return std::max(1, std::min(8, 2048 / (group * dim))); }

// Attention of G query heads of one KV head over tokens [begin, ends[r]) of a quantized sequence,
// for R <= quant_tile_rows(G, D) query rows q[r] that read the same blocks (`table`): consecutive
// rows of a prefill. Each block is decoded once into float32 rows (L1-resident), then every row's
// query heads run over them with the query and accumulator in registers. A row's arithmetic is
// that of the row alone (R = 1, quant_range): the same operations on the same values in the same
// order, its own tokens counted, so tiling never changes a bit. With R > 1 no row reads a block
// from the step's scratch rows (own_row < 0).
template <typename T, int G, int D>
KVBANK_AVX2_F16C void quant_rows(const QuantLayer& L, const T* const* q, const int64_t* table, int64_t begin,
                                 const int64_t* ends, int R, int64_t head, int64_t own_block, int64_t own_row,
                                 float scale, float* const* acc_out, float* const* max_out, float* const* sum_out) {
  constexpr int V = D / 8;
  constexpr int kMaxBlockTokens = 64;
  constexpr int RT = quant_tile_rows(G, D);
  const int64_t bs = L.block_size;
  const bool kivi = L.format == kInt4 || L.format == kInt2;
  const bool scaled = !kivi && L.format != kBf16;  // one scale per token and head
  const __m256 unit = _mm256_set1_ps(L.format == kFp8E4M3 ? kFp8E4M3Unit : 1.0f);  // exact: a power of two
  alignas(32) float qs[RT][G][D];
  alignas(32) float acc[RT][G][D];
  float m[RT][G], l[RT][G];
  alignas(32) float scores[RT][G][kMaxBlockTokens];
  alignas(32) float rows[kMaxBlockTokens][D];
  int64_t end = begin;
  for (int r = 0; r < R; ++r) {
    end = std::max(end, ends[r]);
    for (int g = 0; g < G; ++g) {
      for (int v = 0; v < V; ++v) {
        _mm256_store_ps(qs[r][g] + v * 8, _mm256_mul_ps(load8(q[r] + g * D + v * 8), _mm256_set1_ps(scale)));
        _mm256_store_ps(acc[r][g] + v * 8, _mm256_setzero_ps());
      }
      m[r][g] = -std::numeric_limits<float>::infinity();
      l[r][g] = 0.0f;
    }
  }
  const int64_t group_size = kivi ? D / L.value_groups : D;
  int group_of[V];  // KIVI: the value group of each 8-channel vector
  for (int v = 0; v < V; ++v) group_of[v] = static_cast<int>(v * 8 / group_size);
  const int64_t token_codes = L.heads * L.code_bytes;
  for (int64_t start = begin; start < end; start += bs - start % bs) {
    const BlockSpan<T> b(L, table, start, end, head, own_block, own_row);
    const int64_t block = b.block, first = b.first;
    const int count = b.count;
    // each row's tokens of this block (its own end), none once it has ended
    int counts[RT];
    for (int r = 0; r < R; ++r) counts[r] = static_cast<int>(std::clamp<int64_t>(ends[r] - start, 0, count));
    const bool own = b.own;
    const T *sk = b.sk, *sv = b.sv;
    const uint8_t *kc = b.kc, *vc = b.vc;
    prefetch_ahead(L.k_codes, L.v_codes, table, bs, begin, start, end, token_codes, head * L.code_bytes, L.code_bytes);
    // Keys as float32 rows: codes (int8, fp8: the token's scale comes after the dot product;
    // KIVI: the block's per-channel scale and minimum are folded into the query below).
    for (int t = 0; t < count; ++t) {
      __m256 x[V];
      if (own) {
        for (int v = 0; v < V; ++v) x[v] = load8(sk + t * L.heads * D + v * 8);
      } else {
        decode_codes<V>(L.format, kc + t * token_codes, x);
      }
      for (int v = 0; v < V; ++v) _mm256_store_ps(rows[t] + v * 8, x[v]);
    }
    alignas(32) float token_scale[kMaxBlockTokens + 8];
    if (!own && scaled) {
      for (int t = 0; t < count; t += 8) {
        alignas(16) uint16_t sc[8] = {};
        for (int i = 0; i < std::min(8, count - t); ++i) sc[i] = L.k_scale[(block * bs + first + t + i) * L.heads + head];
        _mm256_store_ps(token_scale + t, _mm256_mul_ps(halves(sc), unit));
      }
    }
    const bool folded = kivi && !own;
    alignas(32) float ks[D], km[D];
    if (folded) kivi_key_ranges8(L, block, head, D, ks, km);
    for (int r = 0; r < R; ++r) {
      const int n_r = counts[r];
      for (int g = 0; g < G && n_r > 0; ++g) {
        __m256 qv[V];
        float bias = 0.0f;
        if (folded) {
          __m256 b = _mm256_setzero_ps();
          for (int v = 0; v < V; ++v) {
            const __m256 x = _mm256_load_ps(qs[r][g] + v * 8);
            qv[v] = _mm256_mul_ps(x, _mm256_load_ps(ks + v * 8));
            b = _mm256_fmadd_ps(x, _mm256_load_ps(km + v * 8), b);
          }
          bias = hsum8(b);
        } else {
          for (int v = 0; v < V; ++v) qv[v] = _mm256_load_ps(qs[r][g] + v * 8);
        }
        // Scores, 8 tokens at a time, summed across lanes together.
        for (int t0 = 0; t0 < n_r; t0 += 8) {
          __m256 part[8];
          const int n = std::min(8, n_r - t0);
          for (int t = 0; t < 8; ++t) {
            if (t >= n) {
              part[t] = _mm256_setzero_ps();
              continue;
            }
            const float* row = rows[t0 + t];
            __m256 s0 = _mm256_mul_ps(qv[0], _mm256_load_ps(row));
            __m256 s1 = _mm256_mul_ps(qv[1], _mm256_load_ps(row + 8));
            for (int v = 2; v < V; v += 2) {
              s0 = _mm256_fmadd_ps(qv[v], _mm256_load_ps(row + v * 8), s0);
              s1 = _mm256_fmadd_ps(qv[v + 1], _mm256_load_ps(row + v * 8 + 8), s1);
            }
            part[t] = _mm256_add_ps(s0, s1);
          }
          __m256 s = row_sums(part);
          if (!own && scaled) s = _mm256_mul_ps(s, _mm256_load_ps(token_scale + t0));
          _mm256_store_ps(scores[r][g] + t0, _mm256_add_ps(s, _mm256_set1_ps(bias)));
        }
      }
    }
    // Values as float32 rows, dequantized: codes times the token's scale (int8, fp8), or times
    // each group's scale plus its minimum (KIVI).
    for (int t = 0; t < count; ++t) {
      __m256 x[V];
      if (own) {
        for (int v = 0; v < V; ++v) x[v] = load8(sv + t * L.heads * D + v * 8);
      } else {
        decode_codes<V>(L.format, vc + t * token_codes, x);
        if (scaled) {
          const __m256 sc =
              _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(L.v_scale[(block * bs + first + t) * L.heads + head])), unit);
          for (int v = 0; v < V; ++v) x[v] = _mm256_mul_ps(x[v], sc);
        } else if (kivi) {
          // each group's scale and zero point read once, for its vectors
          const int64_t meta = ((block * bs + first + t) * L.heads + head) * L.value_groups;
          float sc = 0.0f, shift = 0.0f;
          for (int v = 0, last = -1; v < V; ++v) {
            if (group_of[v] != last) {
              last = group_of[v];
              sc = _cvtsh_ss(L.v_scale[meta + last]);
              shift = static_cast<float>(L.v_zero[meta + last]) * sc;  // exact
            }
            x[v] = _mm256_fmadd_ps(x[v], _mm256_set1_ps(sc), _mm256_set1_ps(shift));
          }
        }
      }
      for (int v = 0; v < V; ++v) _mm256_store_ps(rows[t] + v * 8, x[v]);
    }
    // Online softmax over the block, then the value sum; lanes past the row's count are masked out.
    for (int r = 0; r < R; ++r) {
      const int n_r = counts[r];
      for (int g = 0; g < G && n_r > 0; ++g) {
        __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        for (int t = 0; t < n_r; t += 8) {
          const __m256 live = first_lanes(n_r - t);
          top8 = _mm256_max_ps(top8, _mm256_blendv_ps(top8, _mm256_load_ps(scores[r][g] + t), live));
        }
        const float best = std::max(m[r][g], hmax8(top8));
        __m256 a[V];
        for (int v = 0; v < V; ++v) a[v] = _mm256_load_ps(acc[r][g] + v * 8);
        if (best > m[r][g]) {
          const float c = exp_neg(m[r][g] - best);
          const __m256 correction = _mm256_set1_ps(c);
          for (int v = 0; v < V; ++v) a[v] = _mm256_mul_ps(a[v], correction);
          l[r][g] *= c;
          m[r][g] = best;
        }
        const __m256 top = _mm256_set1_ps(best);
        __m256 total = _mm256_setzero_ps();
        for (int t = 0; t < n_r; t += 8) {
          const __m256 p =
              _mm256_and_ps(exp_neg8(_mm256_sub_ps(_mm256_load_ps(scores[r][g] + t), top)), first_lanes(n_r - t));
          _mm256_store_ps(scores[r][g] + t, p);
          total = _mm256_add_ps(total, p);
        }
        l[r][g] += hsum8(total);
        for (int t = 0; t < n_r; ++t) {
          const __m256 p = _mm256_set1_ps(scores[r][g][t]);
          const float* row = rows[t];
          for (int v = 0; v < V; ++v) a[v] = _mm256_fmadd_ps(p, _mm256_load_ps(row + v * 8), a[v]);
        }
        for (int v = 0; v < V; ++v) _mm256_store_ps(acc[r][g] + v * 8, a[v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) {
      for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc_out[r] + g * D + v * 8, _mm256_load_ps(acc[r][g] + v * 8));
      max_out[r][g] = m[r][g];
      sum_out[r][g] = l[r][g];
    }
  }
}

// One row (the QuantRange signature): quant_rows with R = 1.
template <typename T, int G, int D>
KVBANK_AVX2_F16C void quant_range(const QuantLayer& L, const T* q, const int64_t* table, int64_t begin, int64_t end,
                                  int64_t head, int64_t own_block, int64_t own_row, float scale, float* acc_out,
                                  float* max_out, float* sum_out) {
  quant_rows<T, G, D>(L, &q, table, begin, &end, 1, head, own_block, own_row, scale, &acc_out, &max_out, &sum_out);
}

template <typename T, int D>
using QuantRange = void (*)(const QuantLayer&, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                            float, float*, float*, float*);


// --- The same attention with 16 float32 lanes (AVX-512F/BW/DQ/VL), where the CPU has them. ---
// Keys are decoded once per block into float32 rows in L1; each query head's scores for 16
// tokens are 16 vectors of partial sums reduced together by one transpose tree; values are
// decoded in registers and summed into accumulators that stay in registers, with the token's
// value scale folded into its softmax weight. One instantiation per format, so no format test
// runs per token.
#define KVBANK_AVX512_Q __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))

template <typename T>
KVBANK_AVX512_Q inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
}

// One head of one token as D / 16 float32 vectors of codes, channels in order.
template <int F, int D>
KVBANK_AVX512_Q inline void decode16(const uint8_t* p, __m512* out) {
  constexpr int V = D / 16;
  auto bytes16 = [&](int offset) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + offset)); };
  if constexpr (F == kBf16) {
    for (int v = 0; v < V; ++v) out[v] = load16(reinterpret_cast<const c10::BFloat16*>(p) + v * 16);
  } else if constexpr (F == kInt8) {
    for (int v = 0; v < V; ++v) out[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(v * 16)));
  } else if constexpr (F == kFp8E4M3) {
    // as fp8_to_f32: e4m3 moved into a float16 reads its value times 2^-8
    for (int v = 0; v < V; ++v) {
      const __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes16(v * 16)), 7);
      out[v] = _mm512_cvtph_ps(_mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000))));
    }
  } else if constexpr (F == kFp8E5M2) {
    for (int v = 0; v < V; ++v) out[v] = _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes16(v * 16)), 8));
  } else if constexpr (F == kInt4) {
    // byte i: channel i (low nibble), channel i + D/2 (high)
    for (int v = 0; v < V / 2; ++v) {
      const __m512i c = _mm512_cvtepu8_epi32(bytes16(v * 16));
      out[v] = _mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(0x0F)));
      out[v + V / 2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4));
    }
  } else {
    // int2, byte i: channels i, i + D/4, i + D/2, i + 3D/4
    for (int v = 0; v < V / 4; ++v) {
      const __m512i c = _mm512_cvtepu8_epi32(bytes16(v * 16));
      for (int s = 0; s < 4; ++s)
        out[v + s * V / 4] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(c, 2 * s), _mm512_set1_epi32(3)));
    }
  }
}

constexpr int kMaxQuantBlock = 64;  // tokens per block the kernels take

KVBANK_AVX512_Q inline __mmask16 first16(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// State of one work item: G query heads' accumulators (registers once inlined), maxima and sums.
template <int G, int D>
struct Heads512 {
  __m512 acc[G][D / 16];
  float m[G], l[G];
};

#define KVBANK_INLINE512 KVBANK_AVX512_Q inline __attribute__((always_inline))

// Every channel's key scale and minimum (float32) of one block and head: the range bytes index
// the block's grids (16 scales top * step, 16 minimums start + i * step) held in one vector each.
KVBANK_INLINE512 void kivi_key_ranges16(const QuantLayer& L, int64_t block, int64_t head, int64_t dim, float* scale,
                                        float* low) {
  const uint16_t* grid = L.k_grid + (block * L.heads + head) * 3;
  const __m512 scales = _mm512_mul_ps(_mm512_set1_ps(half_value(grid[0])), _mm512_load_ps(kKeyScaleSteps));
  const __m512 index = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 mins =
      _mm512_add_ps(_mm512_set1_ps(half_value(grid[1])), _mm512_mul_ps(index, _mm512_set1_ps(half_value(grid[2]))));
  const uint8_t* ranges = L.k_ranges + (block * L.heads + head) * dim;
  for (int64_t c = 0; c < dim; c += 16) {
    const __m512i r = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ranges + c)));
    _mm512_store_ps(scale + c, _mm512_permutexvar_ps(_mm512_and_si512(r, _mm512_set1_epi32(15)), scales));
    _mm512_store_ps(low + c, _mm512_permutexvar_ps(_mm512_srli_epi32(r, 4), mins));
  }
}

// Online softmax of head g over a block's `count` scores (lanes past it masked out); the scores
// become the weights, times the tokens' value scales when given (the value rows are codes), and
// the lanes past `count` up to the next multiple of 16 become exactly zero.
template <int G, int D>
KVBANK_INLINE512 void softmax_block(Heads512<G, D>& H, int g, float* scores, int count, const float* v_scales) {
  __m512 top16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int t = 0; t < count; t += 16)
    top16 = _mm512_mask_max_ps(top16, first16(count - t), top16, _mm512_load_ps(scores + t));
  const float best = std::max(H.m[g], _mm512_reduce_max_ps(top16));
  if (best > H.m[g]) {
    const float c = exp_neg(H.m[g] - best);
    for (int v = 0; v < D / 16; ++v) H.acc[g][v] = _mm512_mul_ps(H.acc[g][v], _mm512_set1_ps(c));
    H.l[g] *= c;
    H.m[g] = best;
  }
  __m512 total = _mm512_setzero_ps();
  for (int t = 0; t < count; t += 16) {
    const __mmask16 live = first16(count - t);
    __m512 p = _mm512_maskz_mov_ps(live, exp_neg_v(_mm512_sub_ps(_mm512_load_ps(scores + t), _mm512_set1_ps(best))));
    total = _mm512_add_ps(total, p);
    // lanes past `count` stay exactly zero: their value scales were never written (0 * NaN)
    if (v_scales != nullptr) p = _mm512_maskz_mul_ps(live, p, _mm512_load_ps(v_scales + t));
    _mm512_store_ps(scores + t, p);
  }
  H.l[g] += _mm512_reduce_add_ps(total);
}

// Values of a block's `count` tokens, decoded in registers and summed with each head's weights
// (KIVI: each 16-channel vector dequantized with its group's scale and zero point, read once per
// token and group).
template <typename T, int G, int D, int F>
KVBANK_INLINE512 void values_block(Heads512<G, D>& H, const QuantLayer& L, const float (*scores)[kMaxQuantBlock],
                                   int count, const uint8_t* vc, const T* sv, int64_t meta_first, int64_t head) {
  constexpr int V = D / 16;
  constexpr bool kivi = F == kInt4 || F == kInt2;
  const int64_t token_codes = L.heads * L.code_bytes;
  int group_of[V];
  for (int v = 0; v < V; ++v) group_of[v] = kivi ? static_cast<int>(v * L.value_groups / V) : 0;
  for (int t = 0; t < count; ++t) {
    __m512 x[V];
    if (sv != nullptr) {
      for (int v = 0; v < V; ++v) x[v] = load16(sv + t * L.heads * D + v * 16);
    } else {
      decode16<F, D>(vc + t * token_codes, x);
      if constexpr (kivi) {
        const int64_t meta = ((meta_first + t) * L.heads + head) * L.value_groups;
        __m512 scale = _mm512_setzero_ps(), shift = _mm512_setzero_ps();
        for (int v = 0, last = -1; v < V; ++v) {
          if (group_of[v] != last) {
            last = group_of[v];
            const float sc = _cvtsh_ss(L.v_scale[meta + last]);
            scale = _mm512_set1_ps(sc);
            shift = _mm512_set1_ps(static_cast<float>(L.v_zero[meta + last]) * sc);  // exact
          }
          x[v] = _mm512_fmadd_ps(x[v], scale, shift);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g][t]);
      for (int v = 0; v < V; ++v) H.acc[g][v] = _mm512_fmadd_ps(p, x[v], H.acc[g][v]);
    }
  }
}

template <int G, int D>
KVBANK_INLINE512 void start_heads(Heads512<G, D>& H) {
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < D / 16; ++v) H.acc[g][v] = _mm512_setzero_ps();
    H.m[g] = -std::numeric_limits<float>::infinity();
    H.l[g] = 0.0f;
  }
}

template <int G, int D>
KVBANK_INLINE512 void finish_heads(const Heads512<G, D>& H, float* acc_out, float* max_out, float* sum_out) {
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < D / 16; ++v) _mm512_storeu_ps(acc_out + g * D + v * 16, H.acc[g][v]);
    max_out[g] = H.m[g];
    sum_out[g] = H.l[g];
  }
}

// Keys decoded to float32 rows and dotted with float32 queries: every format, either dtype.
template <typename T, int G, int D, int F>
KVBANK_AVX512_Q void quant_range512_f(const QuantLayer& L, const T* q, const int64_t* table, int64_t begin, int64_t end,
                                      int64_t head, int64_t own_block, int64_t own_row, float scale, float* acc_out,
                                      float* max_out, float* sum_out) {
  constexpr int V = D / 16;
  constexpr bool kivi = F == kInt4 || F == kInt2;
  constexpr bool scaled = F == kInt8 || F == kFp8E4M3 || F == kFp8E5M2;  // one scale per token and head
  const float unit = F == kFp8E4M3 ? kFp8E4M3Unit : 1.0f;  // exact: a power of two
  const int64_t bs = L.block_size;
  alignas(64) float qs[G][D];
  Heads512<G, D> H;
  start_heads(H);
  alignas(64) float scores[G][kMaxQuantBlock];
  alignas(64) float rows[kMaxQuantBlock][D];
  alignas(64) float k_scales[kMaxQuantBlock], v_scales[kMaxQuantBlock];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v)
      _mm512_store_ps(qs[g] + v * 16, _mm512_mul_ps(load16(q + g * D + v * 16), _mm512_set1_ps(scale)));
  const int64_t token_codes = L.heads * L.code_bytes;
  for (int64_t start = begin; start < end; start += bs - start % bs) {
    const BlockSpan<T> b(L, table, start, end, head, own_block, own_row);
    const int64_t block = b.block, first = b.first;
    const int count = b.count;
    const bool own = b.own;
    const T *sk = b.sk, *sv = b.sv;
    const uint8_t *kc = b.kc, *vc = b.vc;
    prefetch_ahead(L.k_codes, L.v_codes, table, L.block_size, begin, start, end, token_codes, head * L.code_bytes, L.code_bytes);
    // Keys as float32 rows of codes (int8, fp8: the token's scale comes after the dot product;
    // KIVI: the block's per-channel scale and minimum are folded into the query below).
    for (int t = 0; t < count; ++t) {
      __m512 x[V];
      if (own) {
        for (int v = 0; v < V; ++v) x[v] = load16(sk + t * L.heads * D + v * 16);
      } else {
        decode16<F, D>(kc + t * token_codes, x);
      }
      for (int v = 0; v < V; ++v) _mm512_store_ps(rows[t] + v * 16, x[v]);
    }
    const bool token_scaled = scaled && !own;
    if (token_scaled) {
      for (int t = 0; t < count; ++t) {
        const int64_t at = (block * bs + first + t) * L.heads + head;
        k_scales[t] = _cvtsh_ss(L.k_scale[at]) * unit;
        v_scales[t] = _cvtsh_ss(L.v_scale[at]) * unit;
      }
    }
    const bool folded = kivi && !own;
    alignas(64) float ks[D], km[D];
    if (folded) kivi_key_ranges16(L, block, head, D, ks, km);
    for (int g = 0; g < G; ++g) {
      __m512 qv[V];
      float bias = 0.0f;
      if (folded) {
        __m512 b = _mm512_setzero_ps();
        for (int v = 0; v < V; ++v) {
          const __m512 x = _mm512_load_ps(qs[g] + v * 16);
          qv[v] = _mm512_mul_ps(x, _mm512_load_ps(ks + v * 16));
          b = _mm512_fmadd_ps(x, _mm512_load_ps(km + v * 16), b);
        }
        bias = _mm512_reduce_add_ps(b);
      } else {
        for (int v = 0; v < V; ++v) qv[v] = _mm512_load_ps(qs[g] + v * 16);
      }
      for (int t0 = 0; t0 < count; t0 += 16) {
        __m512 part[16];
        for (int t = 0; t < 16; ++t) {
          if (t0 + t >= count) {
            part[t] = _mm512_setzero_ps();
            continue;
          }
          const float* r = rows[t0 + t];
          __m512 s = _mm512_mul_ps(qv[0], _mm512_load_ps(r));
          for (int v = 1; v < V; ++v) s = _mm512_fmadd_ps(qv[v], _mm512_load_ps(r + v * 16), s);
          part[t] = s;
        }
        __m512 s = transpose_sums16(part);
        if (token_scaled) s = _mm512_mul_ps(s, _mm512_load_ps(k_scales + t0));
        _mm512_store_ps(scores[g] + t0, _mm512_add_ps(s, _mm512_set1_ps(bias)));
      }
      softmax_block(H, g, scores[g], count, token_scaled ? v_scales : nullptr);
    }
    values_block<T, G, D, F>(H, L, scores, count, vc, sv, block * bs + first, head);
  }
  finish_heads(H, acc_out, max_out, sum_out);
}

// --- int8 and fp8 keys with bfloat16 queries: codes to bfloat16 by table, bfloat16 dot products. ---
// Every int8 and fp8 code is a bfloat16 number, so the pair dot products of bfloat16 queries and
// keys are exact products summed in float32. A code's bfloat16 bytes come from two 128-entry
// byte tables (indexed by its low 7 bits; int8 by its magnitude) and its sign bit; interleaving
// low and high bytes leaves the channels in a fixed order, which the query takes too.
#define KVBANK_AVX512_LUT __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi,fma,f16c")))

struct CodeTables {
  alignas(64) uint8_t hi[3][128];  // int8, e4m3, e5m2: the bfloat16's high byte (sign clear)
  alignas(64) uint8_t lo[3][128];
};

inline const CodeTables& code_tables() {
  static const CodeTables tables = [] {
    CodeTables t{};
    for (int i = 0; i < 128; ++i) {
      const int e4 = i >> 3, m4 = i & 7, e5 = i >> 2, m5 = i & 3;
      const float values[3] = {
          static_cast<float>(i),
          i == 0x7F ? std::numeric_limits<float>::quiet_NaN()
                    : (e4 == 0 ? std::ldexp(static_cast<float>(m4), -9) : std::ldexp(1.0f + m4 / 8.0f, e4 - 7)),
          e5 == 31 ? (m5 == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN())
                   : (e5 == 0 ? std::ldexp(static_cast<float>(m5), -16) : std::ldexp(1.0f + m5 / 4.0f, e5 - 15))};
      for (int f = 0; f < 3; ++f) {
        uint32_t bits;
        std::memcpy(&bits, &values[f], 4);
        t.hi[f][i] = static_cast<uint8_t>(bits >> 24);
        t.lo[f][i] = static_cast<uint8_t>(bits >> 16);
      }
    }
    return t;
  }();
  return tables;
}

// The channel order of one 64-channel chunk after the byte interleave: word w of the first vector
// holds channel 16 (w / 8) + w % 8, of the second that plus 8.
inline int lut_channel(int vector, int word) { return 16 * (word / 8) + 8 * vector + word % 8; }

// 64 codes as bfloat16 words in the tables' channel order (two vectors); luts: high bytes
// (two halves), then low bytes.
template <int F>
KVBANK_AVX512_LUT inline __attribute__((always_inline)) void codes_to_bf16(const __m512i* luts, const uint8_t* p, __m512i* out) {
  const __m512i c = _mm512_loadu_si512(p);
  const __m512i index = F == kInt8 ? _mm512_abs_epi8(c) : c;
  // high | (c & sign)
  const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(luts[0], index, luts[1]), c,
                                                 _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  const __m512i low = _mm512_permutex2var_epi8(luts[2], index, luts[3]);
  out[0] = _mm512_unpacklo_epi8(low, high);
  out[1] = _mm512_unpackhi_epi8(low, high);
}

template <int G, int D, int F>
KVBANK_AVX512_LUT void quant_range512_lut(const QuantLayer& L, const c10::BFloat16* q, const int64_t* table,
                                          int64_t begin, int64_t end, int64_t head, int64_t own_block, int64_t own_row,
                                          float scale, float* acc_out, float* max_out, float* sum_out) {
  static_assert(F == kInt8 || F == kFp8E4M3 || F == kFp8E5M2, "per-token codes only");
  constexpr int C = D / 32;  // bfloat16 vectors per head
  const int64_t bs = L.block_size;
  const int tf = F == kInt8 ? 0 : F == kFp8E4M3 ? 1 : 2;
  const CodeTables& tables = code_tables();
  const __m512i luts[4] = {_mm512_load_si512(tables.hi[tf]), _mm512_load_si512(tables.hi[tf] + 64),
                           _mm512_load_si512(tables.lo[tf]), _mm512_load_si512(tables.lo[tf] + 64)};
  alignas(64) uint16_t qp[G][D];  // the queries in the tables' channel order
  const uint16_t* qbits = reinterpret_cast<const uint16_t*>(q);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      for (int w = 0; w < 32; ++w) qp[g][c * 32 + w] = qbits[g * D + (c / 2) * 64 + lut_channel(c % 2, w)];
  Heads512<G, D> H;
  start_heads(H);
  alignas(64) float scores[G][kMaxQuantBlock];
  alignas(64) uint16_t rows[kMaxQuantBlock][D];
  alignas(64) float k_scales[kMaxQuantBlock], v_scales[kMaxQuantBlock];
  const int64_t token_codes = L.heads * L.code_bytes;
  for (int64_t start = begin; start < end; start += bs - start % bs) {
    const BlockSpan<c10::BFloat16> b(L, table, start, end, head, own_block, -1);  // per-token codes: no own rows
    const int64_t block = b.block, first = b.first;
    const int count = b.count;
    const uint8_t *kc = b.kc, *vc = b.vc;
    prefetch_ahead(L.k_codes, L.v_codes, table, L.block_size, begin, start, end, token_codes, head * L.code_bytes, L.code_bytes);
    for (int t = 0; t < count; ++t) {
      for (int h = 0; h < D / 64; ++h) {
        __m512i k[2];
        codes_to_bf16<F>(luts, kc + t * token_codes + h * 64, k);
        _mm512_store_si512(rows[t] + h * 64, k[0]);
        _mm512_store_si512(rows[t] + h * 64 + 32, k[1]);
      }
      const int64_t at = (block * bs + first + t) * L.heads + head;
      k_scales[t] = _cvtsh_ss(L.k_scale[at]) * scale;
      v_scales[t] = _cvtsh_ss(L.v_scale[at]);  // the tables give every value code exactly
    }
    for (int g = 0; g < G; ++g) {
      __m512bh qv[C];
      for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_load_si512(qp[g] + c * 32);
      for (int t0 = 0; t0 < count; t0 += 16) {
        __m512 part[16];
        for (int t = 0; t < 16; ++t) {
          __m512 s = _mm512_setzero_ps();
          if (t0 + t < count)
            for (int c = 0; c < C; ++c)
              s = _mm512_dpbf16_ps(s, qv[c], (__m512bh)_mm512_load_si512(rows[t0 + t] + c * 32));
          part[t] = s;
        }
        _mm512_store_ps(scores[g] + t0, _mm512_mul_ps(transpose_sums16(part), _mm512_load_ps(k_scales + t0)));
      }
      softmax_block(H, g, scores[g], count, v_scales);
    }
    // Values two tokens at a time: their bfloat16 words interleaved per channel meet the pair of
    // weights (bfloat16, the value scale folded in) in one pair dot product per 16 channels.
    alignas(64) uint32_t pairs[G][kMaxQuantBlock / 2];
    for (int g = 0; g < G; ++g)
      for (int t0 = 0; t0 < count; t0 += 32) {
        // a token past `count` pairs with weight zero (softmax_block zeroed its lane; its codes are zero too)
        const __m512 lo = _mm512_load_ps(scores[g] + t0);
        const __m512 hi = t0 + 16 < count ? _mm512_load_ps(scores[g] + t0 + 16) : _mm512_setzero_ps();
        _mm512_store_si512(pairs[g] + t0 / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    for (int t = 0; t < count; t += 2) {
      __m512i w[D / 16];  // interleaved (token t, token t + 1) words: channel pairs
      for (int h = 0; h < D / 64; ++h) {
        __m512i a[2], b[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        codes_to_bf16<F>(luts, vc + t * token_codes + h * 64, a);
        if (t + 1 < count) codes_to_bf16<F>(luts, vc + (t + 1) * token_codes + h * 64, b);
        for (int i = 0; i < 2; ++i) {
          w[4 * h + 2 * i] = _mm512_unpacklo_epi16(a[i], b[i]);
          w[4 * h + 2 * i + 1] = _mm512_unpackhi_epi16(a[i], b[i]);
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g][t / 2]));
        for (int v = 0; v < D / 16; ++v) H.acc[g][v] = _mm512_dpbf16_ps(H.acc[g][v], p, (__m512bh)w[v]);
      }
    }
  }
  // accumulator 4h + 2i + high, lane j: channel 64h + lut_channel(i, 8 (j / 4) + 4 high + j % 4)
  for (int g = 0; g < G; ++g) {
    alignas(64) float lanes[D];
    for (int v = 0; v < D / 16; ++v) _mm512_store_ps(lanes + v * 16, H.acc[g][v]);
    for (int v = 0; v < D / 16; ++v)
      for (int j = 0; j < 16; ++j)
        acc_out[g * D + 64 * (v / 4) + lut_channel(v / 2 % 2, 8 * (j / 4) + 4 * (v % 2) + j % 4)] = lanes[v * 16 + j];
    max_out[g] = H.m[g];
    sum_out[g] = H.l[g];
  }
}

// --- int4 (KIVI) with bfloat16 queries: codes to bfloat16 by one word permute, pair dot products. ---
// The codes 0..15 are bfloat16 numbers, so every product below is exact and summed in float32.
// Keys: the block-folded query x = q * scale * (channel scale) is rounded to bfloat16 once per
// block and head (2^-9 of itself: the rounding the PyTorch path gives the dequantized keys, far
// below a 4-bit code's step) and dotted with the codes in pairs; q . minimum is added in float32,
// as the float32 kernel folds it. Values: two tokens' codes interleaved per channel meet the pair
// of weights (bfloat16, the group's scale folded in) as int8's do; the zero points' share, the
// sum of weight * zero per group with the same rounded weights, is added at the end, so every
// term is the weight rounded once times (code + zero). The residual block (full-precision scratch
// rows) goes through the same dot products with the query and the weights alone.
// Scores are computed for up to 256 tokens (a whole decode partition) before their softmax, so
// the maximum and the sum are reduced once per partition and head, not once per block.
// Value groups must be whole 32-channel vectors (group size a multiple of 32); others run the
// float32 kernel. On Zen 4 (double-pumped 512-bit units) it is 1.4x as fast as the float32 kernel
// (bench/quant_attention.py).
alignas(64) constexpr uint16_t kNibbleBf16[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                                  0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

// One head of one token's int4 codes as D / 32 vectors of bfloat16 words, channels in order
// (byte i: channel i low nibble, i + D/2 high).
template <int D>
KVBANK_AVX512_LUT inline __attribute__((always_inline)) void nibbles_to_bf16(__m512i values, const uint8_t* p,
                                                                             __m512i* out) {
  for (int j = 0; j < D / 64; ++j) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j)));
    out[j] = _mm512_permutexvar_epi16(_mm512_and_si512(w, _mm512_set1_epi16(15)), values);
    out[j + D / 64] = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), values);
  }
}

// 16 floats rounded to bfloat16 (to nearest even) and back.
KVBANK_AVX512_LUT inline __m512 bf16_round(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

template <int G, int D>
KVBANK_AVX512_LUT void kivi4_range512_bf16(const QuantLayer& L, const c10::BFloat16* q, const int64_t* table,
                                           int64_t begin, int64_t end, int64_t head, int64_t own_block,
                                           int64_t own_row, float scale, float* acc_out, float* max_out,
                                           float* sum_out) {
  constexpr int C = D / 32;  // bfloat16 vectors per head
  constexpr int V = D / 16;
  constexpr int kChunk = 256;  // tokens whose scores are all computed before their softmax
  const int64_t bs = L.block_size, groups = L.value_groups;
  const int group_vectors = static_cast<int>(C / groups);  // 32-channel vectors per value group
  const int64_t token_codes = L.heads * L.code_bytes, stride = L.heads * D;
  const __m512i values = _mm512_load_si512(kNibbleBf16);
  const uint16_t* qbits = reinterpret_cast<const uint16_t*>(q);
  alignas(64) float qs[G][D];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v)
      _mm512_store_ps(qs[g] + v * 16, _mm512_mul_ps(load16(q + g * D + v * 16), _mm512_set1_ps(scale)));
  Heads512<G, D> H;
  start_heads(H);
  __m512 zero_share[G][C];  // per head and value group: weights times zero points, by lane
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) zero_share[g][c] = _mm512_setzero_ps();
  alignas(64) float scores[G][kChunk + 16];
  alignas(64) uint16_t rows[kMaxQuantBlock][D];
  alignas(64) uint32_t pairs[G][C][kMaxQuantBlock / 2];  // per head, value group, token pair
  alignas(64) float v_scales[kMaxQuantBlock], v_zeros[kMaxQuantBlock];
  for (int64_t from = begin; from < end;) {
    // a chunk of whole block spans: at most kChunk tokens, at least one span
    int64_t to = from;
    while (to < end) {
      const int64_t next = std::min(end, to + bs - to % bs);
      if (next - from > kChunk && to > from) break;
      to = next;
    }
    // Pass 1: every score of the chunk.
    for (int64_t start = from; start < to; start += bs - start % bs) {
      const BlockSpan<c10::BFloat16> b(L, table, start, to, head, own_block, own_row);
      const int count = b.count, u0 = static_cast<int>(start - from);
      prefetch_ahead(L.k_codes, L.v_codes, table, bs, begin, start, end, token_codes, head * L.code_bytes,
                     L.code_bytes);
      alignas(64) float ks[D], km[D];
      if (b.own) {
        const uint16_t* sk = reinterpret_cast<const uint16_t*>(b.sk);
        for (int t = 0; t < count; ++t)
          for (int c = 0; c < C; ++c) _mm512_store_si512(rows[t] + c * 32, _mm512_loadu_si512(sk + t * stride + c * 32));
      } else {
        for (int t = 0; t < count; ++t) {
          __m512i k[C];
          nibbles_to_bf16<D>(values, b.kc + t * token_codes, k);
          for (int c = 0; c < C; ++c) _mm512_store_si512(rows[t] + c * 32, k[c]);
        }
        kivi_key_ranges16(L, b.block, head, D, ks, km);
      }
      for (int g = 0; g < G; ++g) {
        __m512bh qv[C];
        float bias = 0.0f, after = scale;
        if (b.own) {
          for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qbits + g * D + c * 32);
        } else {
          __m512 sum = _mm512_setzero_ps();
          for (int c = 0; c < C; ++c) {
            __m512 x[2];
            for (int h = 0; h < 2; ++h) {
              const __m512 s = _mm512_load_ps(qs[g] + c * 32 + h * 16);
              x[h] = _mm512_mul_ps(s, _mm512_load_ps(ks + c * 32 + h * 16));
              sum = _mm512_fmadd_ps(s, _mm512_load_ps(km + c * 32 + h * 16), sum);
            }
            qv[c] = _mm512_cvtne2ps_pbh(x[1], x[0]);
          }
          bias = _mm512_reduce_add_ps(sum);
          after = 1.0f;
        }
        for (int t0 = 0; t0 < count; t0 += 16) {
          __m512 part[16];
          for (int t = 0; t < 16; ++t) {
            __m512 s = _mm512_setzero_ps();
            if (t0 + t < count)
              for (int c = 0; c < C; ++c) s = _mm512_dpbf16_ps(s, qv[c], (__m512bh)_mm512_load_si512(rows[t0 + t] + c * 32));
            part[t] = s;
          }
          _mm512_storeu_ps(scores[g] + u0 + t0,
                           _mm512_fmadd_ps(transpose_sums16(part), _mm512_set1_ps(after), _mm512_set1_ps(bias)));
        }
      }
    }
    // The chunk's softmax: one maximum and one sum per head.
    const int n = static_cast<int>(to - from);
    for (int g = 0; g < G; ++g) {
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int t = 0; t < n; t += 16) top = _mm512_mask_max_ps(top, first16(n - t), top, _mm512_load_ps(scores[g] + t));
      const float best = std::max(H.m[g], _mm512_reduce_max_ps(top));
      if (best > H.m[g]) {
        const float shrink = exp_neg(H.m[g] - best);
        const __m512 c = _mm512_set1_ps(shrink);
        for (int v = 0; v < V; ++v) H.acc[g][v] = _mm512_mul_ps(H.acc[g][v], c);
        for (int v = 0; v < C; ++v) zero_share[g][v] = _mm512_mul_ps(zero_share[g][v], c);
        H.l[g] *= shrink;
        H.m[g] = best;
      }
      __m512 total = _mm512_setzero_ps();
      for (int t = 0; t < n; t += 16) {
        const __m512 p = _mm512_maskz_mov_ps(first16(n - t), exp_neg_v(_mm512_sub_ps(_mm512_load_ps(scores[g] + t), _mm512_set1_ps(best))));
        total = _mm512_add_ps(total, p);
        _mm512_store_ps(scores[g] + t, p);
      }
      H.l[g] += _mm512_reduce_add_ps(total);
    }
    // Pass 2: the values, block by block.
    for (int64_t start = from; start < to; start += bs - start % bs) {
      const BlockSpan<c10::BFloat16> b(L, table, start, to, head, own_block, own_row);
      const int count = b.count, u0 = static_cast<int>(start - from);
      const int64_t meta_first = b.block * bs + b.first;
      // Each head's weights as bfloat16 pairs per value group (the group's scales folded in), and
      // the zero points' share with the same rounded weights.
      const int64_t weight_groups = b.own ? 1 : groups;
      for (int64_t grp = 0; grp < weight_groups; ++grp) {
        if (!b.own)
          for (int t = 0; t < count; ++t) {
            const int64_t meta = ((meta_first + t) * L.heads + head) * groups + grp;
            v_scales[t] = _cvtsh_ss(L.v_scale[meta]);
            v_zeros[t] = static_cast<float>(L.v_zero[meta]);
          }
        for (int g = 0; g < G; ++g)
          for (int t0 = 0; t0 < count; t0 += 32) {
            __m512 w[2];
            for (int h = 0; h < 2; ++h) {
              const int t = t0 + 16 * h;
              const __mmask16 live = t < count ? first16(count - t) : 0;
              w[h] = _mm512_maskz_loadu_ps(live, scores[g] + u0 + t);
              if (!b.own) {
                w[h] = _mm512_mul_ps(w[h], _mm512_maskz_load_ps(live, v_scales + t));
                zero_share[g][grp] =
                    _mm512_fmadd_ps(bf16_round(w[h]), _mm512_maskz_load_ps(live, v_zeros + t), zero_share[g][grp]);
              }
            }
            _mm512_store_si512(pairs[g][grp] + t0 / 2, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
          }
      }
      // Two tokens at a time: their words interleaved per channel meet each head's pair of weights.
      for (int t = 0; t < count; t += 2) {
        __m512i a[C], z[C];
        if (b.own) {
          const uint16_t* sv = reinterpret_cast<const uint16_t*>(b.sv);
          for (int c = 0; c < C; ++c) {
            a[c] = _mm512_loadu_si512(sv + t * stride + c * 32);
            z[c] = t + 1 < count ? _mm512_loadu_si512(sv + (t + 1) * stride + c * 32) : _mm512_setzero_si512();
          }
        } else {
          nibbles_to_bf16<D>(values, b.vc + t * token_codes, a);
          if (t + 1 < count) {
            nibbles_to_bf16<D>(values, b.vc + (t + 1) * token_codes, z);
          } else {
            for (int c = 0; c < C; ++c) z[c] = _mm512_setzero_si512();
          }
        }
        for (int c = 0; c < C; ++c) {
          const int grp = b.own ? 0 : c / group_vectors;
          const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a[c], z[c]);
          const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a[c], z[c]);
          for (int g = 0; g < G; ++g) {
            const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g][grp][t / 2]));
            H.acc[g][2 * c] = _mm512_dpbf16_ps(H.acc[g][2 * c], p, lo);
            H.acc[g][2 * c + 1] = _mm512_dpbf16_ps(H.acc[g][2 * c + 1], p, hi);
          }
        }
      }
    }
    from = to;
  }
  // accumulator 2c + high, lane j: channel 32c + 8 (j / 4) + 4 high + j % 4; plus its group's zero share
  for (int g = 0; g < G; ++g) {
    alignas(64) float lanes[D];
    for (int v = 0; v < V; ++v) {
      const float share = _mm512_reduce_add_ps(zero_share[g][v / 2 / group_vectors]);
      _mm512_store_ps(lanes + v * 16, _mm512_add_ps(H.acc[g][v], _mm512_set1_ps(share)));
    }
    for (int v = 0; v < V; ++v)
      for (int j = 0; j < 16; ++j) acc_out[g * D + 32 * (v / 2) + 8 * (j / 4) + 4 * (v % 2) + j % 4] = lanes[v * 16 + j];
    max_out[g] = H.m[g];
    sum_out[g] = H.l[g];
  }
}

template <typename T, int G, int D, int F, bool Tables>
void quant_range512_any(const QuantLayer& L, const T* q, const int64_t* table, int64_t begin, int64_t end, int64_t head,
                        int64_t own_block, int64_t own_row, float scale, float* acc_out, float* max_out,
                        float* sum_out) {
  if constexpr (Tables && std::is_same_v<T, c10::BFloat16> && (F == kInt8 || F == kFp8E4M3 || F == kFp8E5M2)) {
    quant_range512_lut<G, D, F>(L, q, table, begin, end, head, own_block, own_row, scale, acc_out, max_out, sum_out);
  } else if constexpr (Tables && std::is_same_v<T, c10::BFloat16> && F == kInt4) {
    if ((D / L.value_groups) % 32 == 0) {
      kivi4_range512_bf16<G, D>(L, q, table, begin, end, head, own_block, own_row, scale, acc_out, max_out, sum_out);
    } else {
      quant_range512_f<T, G, D, F>(L, q, table, begin, end, head, own_block, own_row, scale, acc_out, max_out, sum_out);
    }
  } else {
    quant_range512_f<T, G, D, F>(L, q, table, begin, end, head, own_block, own_row, scale, acc_out, max_out, sum_out);
  }
}

// The format is fixed per layer: one switch per work item, none per token.
template <typename T, int G, int D, bool Tables>
void quant_range512(const QuantLayer& L, const T* q, const int64_t* table, int64_t begin, int64_t end, int64_t head,
                    int64_t own_block, int64_t own_row, float scale, float* acc_out, float* max_out, float* sum_out) {
  auto run = [&](auto format) {
    quant_range512_any<T, G, D, decltype(format)::value, Tables>(L, q, table, begin, end, head, own_block, own_row,
                                                                  scale, acc_out, max_out, sum_out);
  };
  switch (L.format) {
    case kBf16: return run(std::integral_constant<int, kBf16>());
    case kInt8: return run(std::integral_constant<int, kInt8>());
    case kFp8E4M3: return run(std::integral_constant<int, kFp8E4M3>());
    case kFp8E5M2: return run(std::integral_constant<int, kFp8E5M2>());
    case kInt4: return run(std::integral_constant<int, kInt4>());
    default: return run(std::integral_constant<int, kInt2>());
  }
}

// The kernel versions, each run where the CPU has what it needs: 8 lanes (AVX2, FMA, F16C), 16
// lanes (AVX-512 F/BW/DQ/VL), and 16 lanes with int8/fp8/int4 codes as bfloat16 words (+ VBMI, BF16).
enum QuantIsa : int { kQuantAvx2 = 0, kQuantAvx512 = 1, kQuantTables = 2, kQuantScalar = 3 };

// The version for a registry level (isa.h): the quant_attention family's variant at that level.
inline int quant_isa_at(kvbank::Isa level) {
  kvbank::Isa variant = kvbank::Isa::Scalar;
  kvbank::family_variant_at(kvbank::Family::QuantAttention, level, &variant);
  switch (variant) {
    case kvbank::Isa::Avx512Bf16: return kQuantTables;
    case kvbank::Isa::Avx512:
    case kvbank::Isa::Avx512Vnni: return kQuantAvx512;
    case kvbank::Isa::Avx2: return kQuantAvx2;
    default: return kQuantScalar;
  }
}

inline int best_quant_isa() { return quant_isa_at(kvbank::active_isa()); }

template <typename T, int D, int G>
QuantRange<T, D> quant_range_of(int isa) {
  return isa == kQuantTables   ? quant_range512<T, G, D, true>
         : isa == kQuantAvx512 ? quant_range512<T, G, D, false>
         : isa == kQuantAvx2   ? quant_range<T, G, D>
                               : quant_range_scalar<T, G, D>;
}

// Several rows of one sequence at once (quant_rows): the AVX2 version, where decoding each block
// into float32 rows costs as much as attending one row over it; null elsewhere.
template <typename T, int D>
using QuantTile = void (*)(const QuantLayer&, const T* const*, const int64_t*, int64_t, const int64_t*, int, int64_t,
                           int64_t, int64_t, float, float* const*, float* const*, float* const*);

template <typename T, int D>
QuantTile<T, D> quant_tile_for(int64_t group, int isa) {
  if (isa != kQuantAvx2 || quant_tile_rows(static_cast<int>(group), D) < 2) return nullptr;
  switch (group) {
    case 1: return quant_rows<T, 1, D>;
    case 2: return quant_rows<T, 2, D>;
    case 3: return quant_rows<T, 3, D>;
    case 4: return quant_rows<T, 4, D>;
    case 5: return quant_rows<T, 5, D>;
    case 6: return quant_rows<T, 6, D>;
    case 7: return quant_rows<T, 7, D>;
    case 8: return quant_rows<T, 8, D>;
    default: return nullptr;
  }
}

// The attention of `group` query heads per KV head, in the given version.
template <typename T, int D>
QuantRange<T, D> quant_range_for(int64_t group, int isa) {
  switch (group) {
    case 1: return quant_range_of<T, D, 1>(isa);
    case 2: return quant_range_of<T, D, 2>(isa);
    case 3: return quant_range_of<T, D, 3>(isa);
    case 4: return quant_range_of<T, D, 4>(isa);
    case 5: return quant_range_of<T, D, 5>(isa);
    case 6: return quant_range_of<T, D, 6>(isa);
    case 7: return quant_range_of<T, D, 7>(isa);
    case 8: return quant_range_of<T, D, 8>(isa);
    default: return nullptr;
  }
}

// One quantized decode attention over raw pointers, as Partials work items: the tensor entry
// point and the fused decoder stack (qmatmul.cpp) run the same items and merges, so both give the
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
           int isa = best_quant_isa())
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

  void item(int64_t item, const QuantLayer& L) {
    int64_t i, h, begin, end;
    if (!partials.span(item, i, h, begin, end)) return;
    const int64_t own_row = L.own_rows != nullptr ? L.own_rows[i] : -1;
    const int64_t row = item * group;
    const T* q_i = q_p + (i * heads + h) * group * dim;
    float* acc = partials.acc.get() + row * dim;
    float* maxes = partials.maxes.get() + row;
    float* sums = partials.sums.get() + row;
    const int64_t own_block = (lens_p[i] - 1) / block_size;
    if (range64 != nullptr) {
      range64(L, q_i, t_p + i * width, begin, end, h, own_block, own_row, s, acc, maxes, sums);
    } else if (range128 != nullptr) {
      range128(L, q_i, t_p + i * width, begin, end, h, own_block, own_row, s, acc, maxes, sums);
    } else {
      range256(L, q_i, t_p + i * width, begin, end, h, own_block, own_row, s, acc, maxes, sums);
    }
  }

  // A run of items (ItemQueue::drain): consecutive ones that are rows of one sequence over
  // the same tokens' blocks (a prefill's rows, same KV head and partition) attended together by the
  // tile version, where there is one; the rest one at a time. The same bits either way.
  void run(const int64_t* items, int count, const QuantLayer& L) {
    for (int k = 0; k < count;) {
      const int tile = tile_at(items + k, std::min(count - k, tile_rows), L);
      if (tile < 2) {
        item(items[k++], L);
        continue;
      }
      const T* q[8];
      int64_t ends[8];
      float *acc[8], *maxes[8], *sums[8];
      int64_t i0 = 0, h = 0, begin = 0;
      for (int r = 0; r < tile; ++r) {
        int64_t i, b;
        partials.span(items[k + r], i, h, b, ends[r]);
        if (r == 0) i0 = i, begin = b;
        const int64_t row = items[k + r] * group;
        q[r] = q_p + (i * heads + h) * group * dim;
        acc[r] = partials.acc.get() + row * dim;
        maxes[r] = partials.maxes.get() + row;
        sums[r] = partials.sums.get() + row;
      }
      const int64_t* table = t_p + i0 * width;
      if (tile64 != nullptr) tile64(L, q, table, begin, ends, tile, h, -1, -1, s, acc, maxes, sums);
      if (tile128 != nullptr) tile128(L, q, table, begin, ends, tile, h, -1, -1, s, acc, maxes, sums);
      if (tile256 != nullptr) tile256(L, q, table, begin, ends, tile, h, -1, -1, s, acc, maxes, sums);
      k += tile;
    }
  }

  void merge(int64_t pair) { partials.merge(pair, o_p); }

 private:
  // How many of the first `limit` items (at least the first) can be attended as one tile: same KV
  // head and first token, no scratch rows (int4/int2 steps read their open blocks from those),
  // and every row's blocks the first row's, so the tile reads through the first row's table.
  int tile_at(const int64_t* items, int limit, const QuantLayer& L) {
    if (limit < 2 || L.own_rows != nullptr || L.format == kInt4 || L.format == kInt2) return 1;
    int64_t i0, h0, b0, e0;
    if (!partials.span(items[0], i0, h0, b0, e0)) return 1;
    const int64_t* first = t_p + i0 * width;
    int tile = 1;
    for (; tile < limit; ++tile) {
      int64_t i, h, b, e;
      if (!partials.span(items[tile], i, h, b, e) || h != h0 || b != b0) break;
      const int64_t* own = t_p + i * width;
      const int64_t from = b / block_size, to = (e + block_size - 1) / block_size;
      if (i != i0 && !std::equal(own + from, own + to, first + from)) break;
    }
    return tile;
  }
};

template <typename T>
void quant_decode(const QuantLayer& L, const torch::Tensor& q, const torch::Tensor& tables, const torch::Tensor& lens,
                  double scale, int64_t partition, torch::Tensor& out, int isa, const int64_t* starts = nullptr) {
  QuantJob<T> job(q.data_ptr<T>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<T>(), q.size(0),
                  q.size(1), q.size(2), q.size(3), L.block_size, tables.size(1), scale, partition, isa);
  job.partials.starts = starts;  // rows read from starts[i] on (Partials::starts), or from 0
  run_items(job.partials, [&](const int64_t* items, int count) { job.run(items, count, L); });
  at::parallel_for(0, job.pairs(), 1, [&](int64_t from, int64_t to) {
    for (int64_t pair = from; pair < to; ++pair) job.merge(pair);
  });
}

// --- The write side: per-token quantization at the step's slots (int8, fp8 e4m3 / e5m2). ---
// Bit for bit PerTokenInt8 / PerTokenFP8.quantize: the float16 scale of amax / top (never zero,
// rounded up when rounding to nearest went down, so no code clips), codes x / scale rounded to
// nearest even (int8) or converted to fp8 by round to nearest even with fp8's subnormals, as
// PyTorch's float -> float8 conversion does.

// 8 int32 lanes (each a byte's value) stored as 8 bytes.
template <bool Signed>
KVBANK_AVX2_F16C inline void store_bytes8(__m256i v, uint8_t* out) {
  const __m256i w = Signed ? _mm256_packs_epi32(v, v) : _mm256_packus_epi32(v, v);
  const __m256i b = Signed ? _mm256_packs_epi16(w, w) : _mm256_packus_epi16(w, w);
  const uint32_t lo = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(b)));
  const uint32_t hi = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(b, 1)));
  std::memcpy(out, &lo, 4);
  std::memcpy(out + 4, &hi, 4);
}

// float32 -> fp8 codes, round to nearest even. Normal results: rebias the exponent and round
// the mantissa by adding half an fp8 ulp (minus one when the kept mantissa is even). Below the
// smallest normal: adding 2^(denormal exponent) lets the float adder round at fp8's subnormal
// step. At or past the overflow threshold: e4m3's NaN, e5m2's infinity (or NaN).
template <bool E4M3>
KVBANK_AVX2_F16C inline __m256i f32_to_fp8(__m256 y) {
  constexpr int kMant = E4M3 ? 3 : 2;
  constexpr int kBias = E4M3 ? 7 : 15;
  constexpr int kShift = 23 - kMant;
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i a = _mm256_xor_si256(bits, sign);
  // normal
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, kShift), _mm256_set1_epi32(1));
  __m256i normal = _mm256_add_epi32(a, _mm256_set1_epi32(static_cast<int>((static_cast<uint32_t>(kBias - 127) << 23) +
                                                                          ((1u << (kShift - 1)) - 1))));
  normal = _mm256_srli_epi32(_mm256_add_epi32(normal, odd), kShift);
  // subnormal (and zero)
  const __m256i denorm = _mm256_set1_epi32((151 - kBias - kMant) << 23);  // 2^(23 + smallest subnormal's exponent)
  const __m256 shifted = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(denorm));
  const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(shifted), denorm);
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((128 - kBias) << 23), a);
  __m256i r = _mm256_blendv_epi8(normal, sub, is_sub);
  // overflow, infinities, NaN
  const uint32_t limit = E4M3 ? (1087u << 20) : (143u << 23);
  const __m256i over = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(static_cast<int>(limit - 1)));
  __m256i special = _mm256_set1_epi32(E4M3 ? 0x7F : 0x7C);
  if constexpr (!E4M3) {
    const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
    special = _mm256_blendv_epi8(special, _mm256_set1_epi32(0x7F), nan);
  }
  r = _mm256_blendv_epi8(r, special, over);
  return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

template <typename T>
KVBANK_AVX2_F16C void quantize_head8(int64_t format, const T* x, int64_t dim, uint8_t* codes, uint16_t* scale_out) {
  const float top = format == kInt8 ? 127.0f : format == kFp8E4M3 ? 448.0f : 57344.0f;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 peak = _mm256_setzero_ps();
  for (int64_t c = 0; c < dim; c += 8) peak = _mm256_max_ps(peak, _mm256_and_ps(load8(x + c), magnitude));
  float wanted = hmax8(peak) / top;
  if (wanted < 0x1p-24f) wanted = 0x1p-24f;
  uint16_t h = _cvtss_sh(wanted, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if (_cvtsh_ss(h) < wanted) ++h;  // the next float16 up (wanted is positive)
  *scale_out = h;
  const __m256 exact = _mm256_set1_ps(_cvtsh_ss(h));
  const __m256 hi = _mm256_set1_ps(top), lo = _mm256_set1_ps(-top);
  for (int64_t c = 0; c < dim; c += 8) {
    const __m256 y = _mm256_div_ps(load8(x + c), exact);
    if (format == kInt8) {
      const __m256 r = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      store_bytes8<true>(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi)), codes + c);
    } else {
      const __m256 clamped = _mm256_min_ps(_mm256_max_ps(y, lo), hi);
      store_bytes8<false>(format == kFp8E4M3 ? f32_to_fp8<true>(clamped) : f32_to_fp8<false>(clamped), codes + c);
    }
  }
}

// One head of one token into its codes and scale, in the quant_write family's variant.
template <typename T>
inline void quantize_head(int64_t format, const T* x, int64_t dim, uint8_t* codes, uint16_t* scale_out) {
  if (scalar_writes()) return quantize_head_scalar(format, x, dim, codes, scale_out);
  quantize_head8(format, x, dim, codes, scale_out);
}

template <typename T>
void quant_write(int64_t format, const torch::Tensor& x, torch::Tensor& codes, torch::Tensor& scale,
                 const torch::Tensor& slots) {
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2), stride = x.stride(0);
  const T* x_p = x.data_ptr<T>();
  uint8_t* c_p = reinterpret_cast<uint8_t*>(codes.data_ptr());
  uint16_t* s_p = reinterpret_cast<uint16_t*>(scale.data_ptr());
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  at::parallel_for(0, n * heads, 64, [&](int64_t from, int64_t to) {
    for (int64_t r = from; r < to; ++r) {
      const int64_t i = r / heads, h = r % heads, slot = slot_p[i];
      quantize_head(format, x_p + i * stride + h * dim, dim, c_p + (slot * heads + h) * dim, s_p + slot * heads + h);
    }
  });
}

// --- The KIVI write side (int4, int2): a block is quantized whole, when it fills. ---
// Every block that receives tokens in a step gets a scratch row [block_size, heads, dim] in the
// model's dtype. Per row the plan holds (block id, residual slot or -1, tokens the block held
// before the step, tokens it holds after): the held tokens come from the residual slot, the
// step's tokens go to their scratch slots, then a block that is now full is quantized into the
// pool and any other row's new tokens go back to its residual slot. KiviLayer.write
// (kvbank/cache/layers/kivi.py) runs these three phases through kivi_write, the fused stack
// (qmatmul.cpp) inside its layer loop; the scratch rows are what attention reads a row's own
// block from, so the stack finishes a row after attention unless a later row reads its block
// from the pool (kPlanEarly). Quantization is bit for bit KiviKeys / KiviValues.quantize (kvbank/cache/quant.py):
// the same float32 operations in the same order, float16 roundings toward the side that keeps
// every value inside its range, codes rounded to nearest even and clamped, packed planar.
KVBANK_AVX2_F16C inline float hmin8(__m256 v) {
  const __m128 x = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_min_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_min_ss(y, _mm_movehdup_ps(y)));
}

// 8 codes (x - low) / scale, rounded and clamped to [0, top], as bytes.
KVBANK_AVX2_F16C inline void kivi_codes8(__m256 x, __m256 low, __m256 scale, __m256 top, uint8_t* out) {
  const __m256 y = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(x, low), scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  store_bytes8<false>(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, _mm256_setzero_ps()), top)), out);
}

// Keys of one head of a block: x is token 0's row of the head, `stride` apart per token. The
// block's grid (top scale, first minimum, minimum step) and each channel's range byte: the
// largest grid minimum at or below the channel's smallest key, the smallest grid scale that
// spans its keys from there (KiviKeys.quantize).
template <typename T>
KVBANK_AVX2_F16C void kivi_keys8(int bits, const T* x, int64_t tokens, int64_t stride, int64_t dim, uint8_t* codes,
                                int64_t code_stride, uint8_t* ranges, uint16_t* grid) {
  alignas(32) uint8_t q[64][128];
  alignas(32) float lo[128], hi[128], low[128], scale[128];
  const float top_code = static_cast<float>((1 << bits) - 1);
  for (int64_t c = 0; c < dim; c += 8) {
    __m256 l = _mm256_set1_ps(std::numeric_limits<float>::infinity()), h = _mm256_sub_ps(_mm256_setzero_ps(), l);
    for (int64_t t = 0; t < tokens; ++t) {
      const __m256 v = load8(x + t * stride + c);
      l = _mm256_min_ps(l, v);
      h = _mm256_max_ps(h, v);
    }
    _mm256_store_ps(lo + c, l);
    _mm256_store_ps(hi + c, h);
  }
  const float lo_min = *std::min_element(lo, lo + dim), lo_max = *std::max_element(lo, lo + dim);
  const uint16_t start16 = half_toward(lo_min, false);
  const float start = half_value(start16);
  const uint16_t step16 = half_toward((lo_max - start) / 15.0f, true);
  float scales[16], mins[16];
  kivi_key_grids(0.0f, start, half_value(step16), scales, mins);
  uint8_t min_index[128];
  float widest = 0.0f;
  for (int64_t c = 0; c < dim; ++c) {
    int i = 0;
    for (int j = 1; j < 16; ++j) i += mins[j] <= lo[c];  // the grid ascends
    min_index[c] = static_cast<uint8_t>(i);
    low[c] = mins[i];
    hi[c] -= low[c];  // the channel's width from its minimum
    widest = std::max(widest, hi[c]);
  }
  const uint16_t top16 = half_toward(std::max(widest / top_code, kTinyScale), true);
  kivi_key_grids(half_value(top16), start, half_value(step16), scales, mins);
  for (int64_t c = 0; c < dim; ++c) {
    int i = 0;
    for (int j = 1; j < 16; ++j) i += scales[j] * top_code >= hi[c];  // the grid descends
    scale[c] = scales[i];
    ranges[c] = static_cast<uint8_t>(i | (min_index[c] << 4));
  }
  grid[0] = top16;
  grid[1] = start16;
  grid[2] = step16;
  const __m256 top = _mm256_set1_ps(top_code);
  for (int64_t c = 0; c < dim; c += 8)
    for (int64_t t = 0; t < tokens; ++t)
      kivi_codes8(load8(x + t * stride + c), _mm256_load_ps(low + c), _mm256_load_ps(scale + c), top, q[t] + c);
  for (int64_t t = 0; t < tokens; ++t) pack_planar(bits, q[t], dim, codes + t * code_stride);
}

// Values of one head of one token: per group of `group` channels a float16 scale (the group's
// width / top, at least |minimum| / 127, rounded up) and an int8 zero point (minimum / scale,
// rounded); codes x / scale - zero, rounded and clamped (KiviValues.quantize).
template <typename T>
KVBANK_AVX2_F16C void kivi_values8(int bits, const T* x, int64_t dim, int64_t group, uint8_t* codes, uint16_t* scale,
                                  int8_t* zero) {
  alignas(32) uint8_t q[128];
  const float top = static_cast<float>((1 << bits) - 1);
  for (int64_t g = 0; g * group < dim; ++g) {
    const T* xg = x + g * group;
    __m256 lo = load8(xg), hi = lo;
    for (int64_t c = 8; c < group; c += 8) {
      const __m256 v = load8(xg + c);
      lo = _mm256_min_ps(lo, v);
      hi = _mm256_max_ps(hi, v);
    }
    const float lof = hmin8(lo);
    const float want = std::max(std::max((hmax8(hi) - lof) / top, std::fabs(lof) / 127.0f), kTinyScale);
    const uint16_t s16 = half_toward(want, true);
    const float sf = half_value(s16);
    const float z = std::min(std::max(std::nearbyint(lof / sf), -128.0f), 127.0f);
    scale[g] = s16;
    zero[g] = static_cast<int8_t>(z);
    const __m256 sv = _mm256_set1_ps(sf), zv = _mm256_set1_ps(z), topv = _mm256_set1_ps(top);
    for (int64_t c = 0; c < group; c += 8) {
      const __m256 y = _mm256_round_ps(_mm256_sub_ps(_mm256_div_ps(load8(xg + c), sv), zv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      store_bytes8<false>(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, _mm256_setzero_ps()), topv)),
                          q + g * group + c);
    }
  }
  pack_planar(bits, q, dim, codes);
}

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

  // Phase 3: row r quantized into its block when full, else its new tokens back to the residual slot.
  void finish(int64_t r) const {
    const int64_t* p = plan + r * kPlanFields;
    const T* sk = scratch_k + r * block_elems();
    const T* sv = scratch_v + r * block_elems();
    if (p[kPlanUpto] < block_size) {
      const int64_t from = p[kPlanHeld] * heads * dim, n = (p[kPlanUpto] - p[kPlanHeld]) * heads * dim;
      std::memcpy(res_k + p[kPlanSlot] * block_elems() + from, sk + from, n * sizeof(T));
      std::memcpy(res_v + p[kPlanSlot] * block_elems() + from, sv + from, n * sizeof(T));
      return;
    }
    const int64_t b = p[kPlanBlock], groups = dim / group;
    const bool scalar = scalar_writes();
    auto kivi_keys = scalar ? kivi_keys_scalar<T> : kivi_keys8<T>;
    auto kivi_values = scalar ? kivi_values_scalar<T> : kivi_values8<T>;
    for (int64_t h = 0; h < heads; ++h) {
      kivi_keys(bits, sk + h * dim, block_size, heads * dim, dim, k_codes + (b * block_size * heads + h) * code_bytes,
                heads * code_bytes, k_ranges + (b * heads + h) * dim, k_grid + (b * heads + h) * 3);
      for (int64_t t = 0; t < block_size; ++t) {
        const int64_t at = (b * block_size + t) * heads + h;
        kivi_values(bits, sv + (t * heads + h) * dim, dim, group, v_codes + at * code_bytes, v_scale + at * groups,
                    v_zero + at * groups);
      }
    }
  }
};
#endif

// The plan's rows and scratch slots against the residual slots they name; returns the row count.
int64_t check_kivi_plan(const torch::Tensor& plan, const torch::Tensor& scratch_slots, int64_t tokens, int64_t blocks,
                        int64_t block_size, int64_t residual_slots) {
  TORCH_CHECK(plan.scalar_type() == torch::kLong && plan.dim() == 2 && plan.size(1) == kPlanFields && plan.is_contiguous(),
              "the plan must be contiguous int64 [rows, ", kPlanFields, "], got ", plan.sizes());
  TORCH_CHECK(scratch_slots.scalar_type() == torch::kLong && scratch_slots.dim() == 1 &&
                  scratch_slots.size(0) == tokens && scratch_slots.is_contiguous(),
              "scratch slots must be contiguous int64 [", tokens, "], got ", scratch_slots.sizes());
  const int64_t rows = plan.size(0);
  const int64_t* p = plan.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r, p += kPlanFields) {
    TORCH_CHECK(p[kPlanBlock] >= 0 && p[kPlanBlock] < blocks, "plan row ", r, ": block ", p[kPlanBlock],
                " is outside the pool's ", blocks, " blocks");
    TORCH_CHECK(p[kPlanHeld] >= 0 && p[kPlanHeld] < p[kPlanUpto] && p[kPlanUpto] <= block_size, "plan row ", r,
                ": tokens held ", p[kPlanHeld], " -> ", p[kPlanUpto], " do not fit a block of ", block_size);
    TORCH_CHECK(p[kPlanEarly] == 0 || (p[kPlanEarly] == 1 && p[kPlanUpto] == block_size), "plan row ", r,
                ": only a block this step fills can be read early, got early ", p[kPlanEarly], " with ",
                p[kPlanUpto], " of ", block_size, " tokens");
    const bool needs_slot = p[kPlanHeld] > 0 || p[kPlanUpto] < block_size;
    TORCH_CHECK(!needs_slot || (p[kPlanSlot] >= 0 && p[kPlanSlot] < residual_slots), "plan row ", r,
                ": residual slot ", p[kPlanSlot], " is outside the ", residual_slots, " slots");
  }
  const int64_t* s = scratch_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < rows * block_size, "scratch slot ", s[t], " is outside the step's ",
                rows * block_size);
  return rows;
}

// One KIVI layer's pool tensors and residual slots; names the shapes it expected.
void check_kivi_layer(int64_t format, int64_t heads, int64_t dim, const torch::Tensor& k_codes, const torch::Tensor& k_ranges,
                      const torch::Tensor& k_grid, const torch::Tensor& v_codes, const torch::Tensor& v_scale,
                      const torch::Tensor& v_zero, const torch::Tensor& residual_k, const torch::Tensor& residual_v,
                      torch::ScalarType dtype) {
  TORCH_CHECK(format == kInt4 || format == kInt2, "KIVI writes are int4 (4) or int2 (5), got format ", format);
  TORCH_CHECK(dim % 8 == 0 && dim <= 128, "head dim must be a multiple of 8 up to 128, got ", dim);
  const int64_t code_bytes = dim * (format == kInt4 ? 4 : 2) / 8;
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.scalar_type() == torch::kByte && k_codes.size(1) <= 64 &&
                  k_codes.size(2) == heads && k_codes.size(3) == code_bytes && v_codes.sizes() == k_codes.sizes() &&
                  v_codes.scalar_type() == torch::kByte,
              "codes must be uint8 [blocks, block_size <= 64, ", heads, ", ", code_bytes, "], got ", k_codes.sizes());
  const int64_t blocks = k_codes.size(0), block_size = k_codes.size(1);
  TORCH_CHECK(k_ranges.scalar_type() == torch::kByte && k_ranges.dim() == 3 && k_ranges.size(0) == blocks &&
                  k_ranges.size(1) == heads && k_ranges.size(2) == dim,
              "key ranges must be uint8 [", blocks, ", ", heads, ", ", dim, "], got ", k_ranges.sizes());
  TORCH_CHECK(k_grid.scalar_type() == torch::kHalf && k_grid.dim() == 3 && k_grid.size(0) == blocks &&
                  k_grid.size(1) == heads && k_grid.size(2) == 3,
              "key grids must be float16 [", blocks, ", ", heads, ", 3], got ", k_grid.sizes());
  TORCH_CHECK(v_scale.scalar_type() == torch::kHalf && v_scale.dim() == 4 && v_scale.size(0) == blocks &&
                  v_scale.size(1) == block_size && v_scale.size(2) == heads && v_scale.size(3) >= 1 &&
                  dim % v_scale.size(3) == 0 && (dim / v_scale.size(3)) % 8 == 0 && v_zero.sizes() == v_scale.sizes() &&
                  v_zero.scalar_type() == torch::kChar,
              "value scales (float16) and zero points (int8) must be [", blocks, ", ", block_size, ", ", heads,
              ", groups of a multiple of 8 channels], got ", v_scale.sizes(), " and ", v_zero.sizes());
  TORCH_CHECK(residual_k.scalar_type() == dtype && residual_k.dim() == 4 && residual_k.size(1) == block_size &&
                  residual_k.size(2) == heads && residual_k.size(3) == dim && residual_v.sizes() == residual_k.sizes() &&
                  residual_v.scalar_type() == dtype,
              "residual slots must be [slots, ", block_size, ", ", heads, ", ", dim, "] in the model's dtype, got ",
              residual_k.sizes());
  for (const auto* t : {&k_codes, &v_codes, &k_ranges, &k_grid, &v_scale, &v_zero, &residual_k, &residual_v})
    TORCH_CHECK(t->is_contiguous(), "KIVI caches and residual slots must be contiguous");
}

#ifdef KVBANK_X86
template <typename T>
KiviWrite<T> kivi_pointers(int64_t format, const torch::Tensor& k_codes, const torch::Tensor& k_ranges,
                           const torch::Tensor& k_grid, const torch::Tensor& v_codes, const torch::Tensor& v_scale,
                           const torch::Tensor& v_zero, const torch::Tensor& residual_k, const torch::Tensor& residual_v,
                           T* scratch_k, T* scratch_v, const torch::Tensor& plan, const torch::Tensor& scratch_slots) {
  const int64_t heads = k_codes.size(2), dim = k_ranges.size(2);
  return KiviWrite<T>{format == kInt4 ? 4 : 2,
                      heads,
                      dim,
                      k_codes.size(1),
                      k_codes.size(3),
                      dim / v_scale.size(3),
                      reinterpret_cast<uint8_t*>(k_codes.data_ptr()),
                      reinterpret_cast<uint8_t*>(v_codes.data_ptr()),
                      reinterpret_cast<uint8_t*>(k_ranges.data_ptr()),
                      reinterpret_cast<uint16_t*>(k_grid.data_ptr()),
                      reinterpret_cast<uint16_t*>(v_scale.data_ptr()),
                      reinterpret_cast<int8_t*>(v_zero.data_ptr()),
                      residual_k.data_ptr<T>(),
                      residual_v.data_ptr<T>(),
                      scratch_k,
                      scratch_v,
                      plan.data_ptr<int64_t>(),
                      scratch_slots.data_ptr<int64_t>()};
}
#endif


}  // namespace
