// Integer matmuls on GGUF weights for CPU decode: 4-bit (Q4_0/Q4_1) and 8-bit (Q8_0) weights times
// activations quantized on the fly to 8 bits in blocks of 32, as llama.cpp does (Q8_1 activations).
//
// Weights are laid out at load (kvbank/models/qweights.py) in groups of 16 output rows: for every
// group and 32-wide block of the input dimension, one record holds the 16 rows' weights
// interleaved four bytes at a time, so one 512-bit VNNI instruction (vpdpbusd) multiplies four
// inputs into all 16 rows, then the rows' fp16 scales (and, for 4-bit, minimums):
//   Q4 record (320 B): 4 x [16 rows][4 bytes] nibble pairs; byte e of row r in chunk j holds the
//                      row's weight 4j+e in its low nibble and 16+4j+e in its high nibble;
//                      then d[16] and m[16] as fp16 (w = d*q + m; Q4_0 has m = -8d).
//   Q8 record (544 B): 8 x [16 rows][4 bytes] of w+128 (unsigned), then d[16] fp16 (w = d*q).
//   Q4F record (384 B, kind 41): a Q4 record with d[16] and m[16] as float32 (Q4_K: d = super-block
//                      scale x 6-bit sub-block scale and m = -(super-block min x 6-bit min), exact).
//   Q8H record (640 B, kind 81): a Q8 record's bytes, then float32 scales per 16 inputs, d_lo[16]
//                      and d_hi[16] (Q6_K: w = d x 8-bit sub-block scale x (q - 32), exact).
//   Q5 record (352 B, kind 5): a Q4 record's nibble pairs, then each nibble's fifth bit: for chunk
//                      j, a 64-bit mask over its 64 bytes for the low nibbles (at 256 + 8j) and one
//                      for the high nibbles (at 288 + 8j), then d[16] fp16 (w = d * (q - 16)). Q5_0
//                      as stored; Q4_0 fits too (q - 8).
//   Q5F record (448 B, kind 51): a Q5 record's nibbles and masks with d[16] and m[16] as float32
//                      (Q5_K: w = d*q + m with q in 0..31, scales as Q4_K's).
// Q5_0 and Q4_0 weights fused with Q8_0 ones are Q8 records (their integers fit 8 bits exactly).
// Per block, a row's integer dot product is exact; it is scaled and added to a float32 sum in block
// order by the same fused multiply-adds on every path (AVX-512 VNNI, AVX2, scalar), so all paths
// give bit-identical results, and a row's result never depends on the other rows of the batch.
#include "native.h"
#include "dense_decode.h"
#include "layers.h"
#include "quant_decode.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int64_t QK = 32;
constexpr int64_t GROUP_ROWS = 16;
constexpr int64_t Q4_RECORD = 320;
constexpr int64_t Q8_RECORD = 544;
constexpr int64_t Q4F_RECORD = 384;
constexpr int64_t Q8H_RECORD = 640;
constexpr int64_t Q5_RECORD = 352;
constexpr int64_t Q5F_RECORD = 448;

// The record kinds (the `kind` argument of every entry point).
enum class Rec : int { Q4 = 4, Q5 = 5, Q8 = 8, Q4F = 41, Q5F = 51, Q8H = 81 };

constexpr int64_t record_bytes(Rec kind) {
  switch (kind) {
    case Rec::Q4: return Q4_RECORD;
    case Rec::Q5: return Q5_RECORD;
    case Rec::Q8: return Q8_RECORD;
    case Rec::Q4F: return Q4F_RECORD;
    case Rec::Q5F: return Q5F_RECORD;
    default: return Q8H_RECORD;
  }
}
constexpr int64_t ROW_TILE = 4;
// Above this many rows the decoder stack splits normalization and quantization among its threads.
constexpr int64_t SPLIT_ROWS = 8;
#ifndef KVBANK_PREFETCH
#define KVBANK_PREFETCH 32768
#endif
// Weights stream from memory once per step. A kernel asks for each record this far ahead, into L2:
// L2 keeps more misses in flight than L1 does, so the stream runs at the memory's speed while the
// cores compute (8 rows of the 262,144-row Q8 head: 8.9 ms with 12 KB into L1, 6.4 with 32 KB into
// L2; one row 7.0 and 5.7, on a Zen 4 VM).
constexpr int64_t PREFETCH_BYTES = KVBANK_PREFETCH;

#ifdef KVBANK_X86
inline void prefetch_record(const uint8_t* rec, int64_t bytes) {
  const char* ahead = reinterpret_cast<const char*>(rec + PREFETCH_BYTES);
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
}
#endif

using kvbank::Isa;

#ifdef KVBANK_X86
#define KVBANK_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")))
#define KVBANK_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

// The matmul family's variant at the active level (isa.h): scalar, avx2, avx512_vnni or amx.
Isa best_isa() {
  Isa variant = Isa::Scalar;
  kvbank::family_variant(kvbank::Family::Matmul, &variant);
  return variant;
}

// Whether `isa` runs the avx512_vnni kernels (amx runs them for what its tiles do not take).
inline bool vnni(Isa isa) { return static_cast<int>(isa) >= static_cast<int>(Isa::Avx512Vnni); }

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Activations in 8-bit blocks of 32: x ~= d * q, with the block sums the 4-bit minimum term needs.
struct QuantRows {
  int64_t rows = 0, cols = 0, blocks = 0;
  std::vector<int8_t> q;       // [rows, cols]
  std::vector<float> d;        // [rows, blocks]
  std::vector<float> s;        // d * sum(q)
  std::vector<int32_t> sum;    // sum(q)
  std::vector<int32_t> sum_lo; // sum of the first 16 q of each block (Q8H weights scale halves)

  void resize(int64_t r, int64_t c) {
    rows = r, cols = c, blocks = c / QK;
    q.resize(r * c);
    d.resize(r * blocks);
    s.resize(r * blocks);
    sum.resize(r * blocks);
    sum_lo.resize(r * blocks);
  }

  // Row `r` from float32 values: amax / 127 scales, round to nearest even.
  void quantize_row(int64_t r, const float* x) {
#ifdef KVBANK_X86
    if (vnni(best_isa())) {
      quantize_row_avx512(r, x);
    } else if (best_isa() == Isa::Avx2) {
      quantize_row_avx2(r, x);
    } else {
      quantize_row_scalar(r, x);
    }
#else
    quantize_row_scalar(r, x);
#endif
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* qb = q.data() + r * cols + b * QK;
      int32_t low = 0;
      for (int64_t k = 0; k < QK / 2; ++k) low += qb[k];
      sum_lo[r * blocks + b] = low;
    }
  }

  void quantize_row_scalar(int64_t r, const float* x) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + b * QK;
      float amax = 0.0f;
      for (int64_t k = 0; k < QK; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float scale = amax / 127.0f;
      const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
      int8_t* qb = q.data() + r * cols + b * QK;
      int32_t total = 0;
      for (int64_t k = 0; k < QK; ++k) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[k] * inv));
        qb[k] = static_cast<int8_t>(v);
        total += v;
      }
      d[r * blocks + b] = scale;
      sum[r * blocks + b] = total;
      s[r * blocks + b] = scale * static_cast<float>(total);
    }
  }

#ifdef KVBANK_X86
  // The same arithmetic 16 lanes at a time (cvtps rounds to nearest even, as nearbyint does).
  KVBANK_VNNI void quantize_row_avx512(int64_t r, const float* x) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 lo = _mm512_loadu_ps(x + b * QK), hi = _mm512_loadu_ps(x + b * QK + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
      const float scale = amax / 127.0f;
      const __m512 inv = _mm512_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      int8_t* qb = q.data() + r * cols + b * QK;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(qhi));
      const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      d[r * blocks + b] = scale;
      sum[r * blocks + b] = total;
      s[r * blocks + b] = scale * static_cast<float>(total);
    }
  }

  // The same arithmetic 8 lanes at a time; packing interleaves the 128-bit halves, which the
  // final permute puts back in order.
  KVBANK_AVX2 void quantize_row_avx2(int64_t r, const float* x) {
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
#endif
};

template <typename T>
void quantize_rows(const T* x, int64_t stride, int64_t rows, int64_t cols, QuantRows& out) {
  out.resize(rows, cols);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(cols);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t k = 0; k < cols; ++k) row[k] = widen(x[r * stride + k]);
      out.quantize_row(r, row.data());
    }
  });
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// --- one group of 16 output rows for `tile` activation rows: out[i * 16 + lane] ------------------

// A record's scale and minimum of `lane`: fp16 in Q4 records, float32 in Q4F records (F32).
template <bool F32>
inline float record_value(const uint8_t* rec, int64_t offset, int64_t lane) {
  if (F32) {
    float v;
    std::memcpy(&v, rec + offset + 4 * lane, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, rec + offset + 2 * lane, 2);
  return half_to_float(h);
}

template <bool F32>
void q4_group_scalar(const uint8_t* w, const QuantRows& a, int64_t r0, int64_t tile, float* out) {
  constexpr int64_t record = F32 ? Q4F_RECORD : Q4_RECORD, min_at = F32 ? 320 : 288;
  for (int64_t i = 0; i < tile; ++i) {
    for (int64_t lane = 0; lane < GROUP_ROWS; ++lane) {
      float acc = 0.0f;
      for (int64_t b = 0; b < a.blocks; ++b) {
        const uint8_t* rec = w + b * record;
        const int8_t* qa = a.q.data() + (r0 + i) * a.cols + b * QK;
        int32_t dot = 0;
        for (int64_t j = 0; j < 4; ++j) {
          for (int64_t e = 0; e < 4; ++e) {
            const uint8_t byte = rec[j * 64 + lane * 4 + e];
            dot += static_cast<int32_t>(byte & 15) * qa[4 * j + e] + static_cast<int32_t>(byte >> 4) * qa[16 + 4 * j + e];
          }
        }
        const int64_t ab = (r0 + i) * a.blocks + b;
        acc = std::fma(static_cast<float>(dot), record_value<F32>(rec, 256, lane) * a.d[ab], acc);
        acc = std::fma(record_value<F32>(rec, min_at, lane), a.s[ab], acc);
      }
      out[i * GROUP_ROWS + lane] = acc;
    }
  }
}

// Q8 (H false: one fp16 scale per block) and Q8H (H: float32 scales per 16 inputs): per row and
// block the first and last 16 inputs' exact dot products; Q8H scales them apart, low half first.
template <bool H>
void q8_group_scalar(const uint8_t* w, const QuantRows& a, int64_t r0, int64_t tile, float* out) {
  constexpr int64_t record = H ? Q8H_RECORD : Q8_RECORD;
  for (int64_t i = 0; i < tile; ++i) {
    for (int64_t lane = 0; lane < GROUP_ROWS; ++lane) {
      float acc = 0.0f;
      for (int64_t b = 0; b < a.blocks; ++b) {
        const uint8_t* rec = w + b * record;
        const int8_t* qa = a.q.data() + (r0 + i) * a.cols + b * QK;
        int32_t dot[2] = {0, 0};
        for (int64_t c = 0; c < 8; ++c) {
          for (int64_t e = 0; e < 4; ++e) dot[c / 4] += static_cast<int32_t>(rec[c * 64 + lane * 4 + e]) * qa[4 * c + e];
        }
        const int64_t ab = (r0 + i) * a.blocks + b;
        dot[0] -= 128 * a.sum_lo[ab];
        dot[1] -= 128 * (a.sum[ab] - a.sum_lo[ab]);
        if (H) {
          acc = std::fma(static_cast<float>(dot[0]), record_value<true>(rec, 512, lane) * a.d[ab], acc);
          acc = std::fma(static_cast<float>(dot[1]), record_value<true>(rec, 576, lane) * a.d[ab], acc);
        } else {
          acc = std::fma(static_cast<float>(dot[0] + dot[1]), record_value<false>(rec, 512, lane) * a.d[ab], acc);
        }
      }
      out[i * GROUP_ROWS + lane] = acc;
    }
  }
}

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Q5: the nibble pairs of a Q4 record with their fifth bits; the integer dot product of q (0..31)
// less 16 x the activations' sum is exact, scaled once per block as Q8.
// K (Q5F records): q in 0..31 with float32 scale and minimum, the minimum term from the
// activation block sums as for Q4 records.
template <bool K>
void q5_group_scalar(const uint8_t* w, const QuantRows& a, int64_t r0, int64_t tile, float* out) {
  constexpr int64_t record = K ? Q5F_RECORD : Q5_RECORD;
  for (int64_t i = 0; i < tile; ++i) {
    for (int64_t lane = 0; lane < GROUP_ROWS; ++lane) {
      float acc = 0.0f;
      for (int64_t b = 0; b < a.blocks; ++b) {
        const uint8_t* rec = w + b * record;
        const int8_t* qa = a.q.data() + (r0 + i) * a.cols + b * QK;
        int32_t dot = 0;
        for (int64_t j = 0; j < 4; ++j) {
          const uint64_t low_bits = load_u64(rec + 256 + 8 * j), high_bits = load_u64(rec + 288 + 8 * j);
          for (int64_t e = 0; e < 4; ++e) {
            const int64_t at = lane * 4 + e;
            const uint8_t byte = rec[j * 64 + at];
            const int32_t lo = (byte & 15) | static_cast<int32_t>(((low_bits >> at) & 1) << 4);
            const int32_t hi = (byte >> 4) | static_cast<int32_t>(((high_bits >> at) & 1) << 4);
            dot += lo * qa[4 * j + e] + hi * qa[16 + 4 * j + e];
          }
        }
        const int64_t ab = (r0 + i) * a.blocks + b;
        if (K) {
          acc = std::fma(static_cast<float>(dot), record_value<true>(rec, 320, lane) * a.d[ab], acc);
          acc = std::fma(record_value<true>(rec, 384, lane), a.s[ab], acc);
        } else {
          dot -= 16 * a.sum[ab];
          acc = std::fma(static_cast<float>(dot), record_value<false>(rec, 320, lane) * a.d[ab], acc);
        }
      }
      out[i * GROUP_ROWS + lane] = acc;
    }
  }
}


#ifdef KVBANK_X86
// 4 activation bytes broadcast to every lane, straight from memory (a load, no shuffle).
KVBANK_VNNI inline __m512i quad(const int8_t* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

// 16 lanes' scales (or minimums) at `offset` of a record: fp16 (Q4, Q8) or float32 (Q4F, Q8H).
template <bool F32>
KVBANK_VNNI inline __m512 record_values16(const uint8_t* rec, int64_t offset) {
  if (F32) return _mm512_loadu_ps(rec + offset);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + offset)));
}

template <int R, bool F32>
KVBANK_VNNI void q4_group_avx512(const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
  constexpr int64_t record = F32 ? Q4F_RECORD : Q4_RECORD, min_at = F32 ? 320 : 288;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = a.q.data() + (r0 + i) * a.cols;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* rec = w + b * record;
    prefetch_record(rec, record);
    __m512i lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(rec + 64 * j);
      lo[j] = _mm512_and_si512(v, low);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 dw = record_values16<F32>(rec, 256), mw = record_values16<F32>(rec, min_at);
    for (int i = 0; i < R; ++i) {
      const int8_t* qa = rows[i] + b * QK;
      // two chains of four: a vpdpbusd's latency is hidden behind the other chain and the other rows
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      s0 = _mm512_dpbusd_epi32(s0, lo[0], quad(qa + 0));
      s1 = _mm512_dpbusd_epi32(s1, lo[1], quad(qa + 4));
      s0 = _mm512_dpbusd_epi32(s0, lo[2], quad(qa + 8));
      s1 = _mm512_dpbusd_epi32(s1, lo[3], quad(qa + 12));
      s0 = _mm512_dpbusd_epi32(s0, hi[0], quad(qa + 16));
      s1 = _mm512_dpbusd_epi32(s1, hi[1], quad(qa + 20));
      s0 = _mm512_dpbusd_epi32(s0, hi[2], quad(qa + 24));
      s1 = _mm512_dpbusd_epi32(s1, hi[3], quad(qa + 28));
      const __m512i sum = _mm512_add_epi32(s0, s1);
      const int64_t ab = (r0 + i) * a.blocks + b;
      const __m512 dot = _mm512_cvtepi32_ps(sum);
      acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(a.d[ab])), acc[i]);
      acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[ab]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * GROUP_ROWS, acc[i]);
}

// Two groups (32 output rows) against R rows: each activation broadcast meets both groups'
// weights, and a weight chunk is decoded once for the R rows. Per row and group the integer dot
// products are exact and the float sums run in block order, as in q4_group_avx512: same bits.
template <int R, bool F32>
KVBANK_VNNI void q4_pair_avx512(const uint8_t* w0, const uint8_t* w1, const QuantRows& a, int64_t r0, float* out0,
                                float* out1) {
  constexpr int64_t record = F32 ? Q4F_RECORD : Q4_RECORD, min_at = F32 ? 320 : 288;
  __m512 acc0[R], acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = a.q.data() + (r0 + i) * a.cols;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* rec0 = w0 + b * record;
    const uint8_t* rec1 = w1 + b * record;
    prefetch_record(rec0, record);
    prefetch_record(rec1, record);
    __m512i s0[R], s1[R];
    for (int i = 0; i < R; ++i) s0[i] = s1[i] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i v0 = _mm512_loadu_si512(rec0 + 64 * j), v1 = _mm512_loadu_si512(rec1 + 64 * j);
      const __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
      const __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
      for (int i = 0; i < R; ++i) {
        const __m512i x_lo = quad(rows[i] + b * QK + 4 * j), x_hi = quad(rows[i] + b * QK + 16 + 4 * j);
        s0[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s0[i], lo0, x_lo), hi0, x_hi);
        s1[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s1[i], lo1, x_lo), hi1, x_hi);
      }
    }
    const __m512 dw0 = record_values16<F32>(rec0, 256), mw0 = record_values16<F32>(rec0, min_at);
    const __m512 dw1 = record_values16<F32>(rec1, 256), mw1 = record_values16<F32>(rec1, min_at);
    for (int i = 0; i < R; ++i) {
      const int64_t ab = (r0 + i) * a.blocks + b;
      const __m512 d = _mm512_set1_ps(a.d[ab]), sums = _mm512_set1_ps(a.s[ab]);
      acc0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[i]), _mm512_mul_ps(dw0, d), acc0[i]);
      acc0[i] = _mm512_fmadd_ps(mw0, sums, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[i]), _mm512_mul_ps(dw1, d), acc1[i]);
      acc1[i] = _mm512_fmadd_ps(mw1, sums, acc1[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(out0 + i * GROUP_ROWS, acc0[i]);
    _mm512_storeu_ps(out1 + i * GROUP_ROWS, acc1[i]);
  }
}

// Q8 and Q8H (H) as q8_group_scalar: the low and high 16 inputs' products summed apart.
template <int R, bool H>
KVBANK_VNNI void q8_group_avx512(const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
  constexpr int64_t record = H ? Q8H_RECORD : Q8_RECORD;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = a.q.data() + (r0 + i) * a.cols;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* rec = w + b * record;
    prefetch_record(rec, record);
    __m512i wv[8];
    for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(rec + 64 * c);
    const __m512 d_lo = record_values16<H>(rec, 512), d_hi = H ? record_values16<true>(rec, 576) : d_lo;
    for (int i = 0; i < R; ++i) {
      const int8_t* qa = rows[i] + b * QK;
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        lo = _mm512_dpbusd_epi32(lo, wv[c], quad(qa + 4 * c));
        hi = _mm512_dpbusd_epi32(hi, wv[c + 4], quad(qa + 16 + 4 * c));
      }
      const int64_t ab = (r0 + i) * a.blocks + b;
      const __m512 d = _mm512_set1_ps(a.d[ab]);
      if (H) {
        lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(128 * a.sum_lo[ab]));
        hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(128 * (a.sum[ab] - a.sum_lo[ab])));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(d_lo, d), acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(d_hi, d), acc[i]);
      } else {
        const __m512i exact = _mm512_sub_epi32(_mm512_add_epi32(lo, hi), _mm512_set1_epi32(128 * a.sum[ab]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(d_lo, d), acc[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * GROUP_ROWS, acc[i]);
}

// q8_group_avx512 for two groups at once, as q4_pair_avx512: same bits.
template <int R>
KVBANK_VNNI void q8_pair_avx512(const uint8_t* w0, const uint8_t* w1, const QuantRows& a, int64_t r0, float* out0,
                                float* out1) {
  __m512 acc0[R], acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  const int8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = a.q.data() + (r0 + i) * a.cols;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* rec0 = w0 + b * Q8_RECORD;
    const uint8_t* rec1 = w1 + b * Q8_RECORD;
    prefetch_record(rec0, Q8_RECORD);
    prefetch_record(rec1, Q8_RECORD);
    __m512i s0[R], s1[R];
    for (int i = 0; i < R; ++i) s0[i] = s1[i] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const __m512i v0 = _mm512_loadu_si512(rec0 + 64 * c), v1 = _mm512_loadu_si512(rec1 + 64 * c);
      for (int i = 0; i < R; ++i) {
        const __m512i x = quad(rows[i] + b * QK + 4 * c);
        s0[i] = _mm512_dpbusd_epi32(s0[i], v0, x);
        s1[i] = _mm512_dpbusd_epi32(s1[i], v1, x);
      }
    }
    const __m512 dw0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec0 + 512)));
    const __m512 dw1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec1 + 512)));
    for (int i = 0; i < R; ++i) {
      const int64_t ab = (r0 + i) * a.blocks + b;
      const __m512i bias = _mm512_set1_epi32(128 * a.sum[ab]);
      const __m512 d = _mm512_set1_ps(a.d[ab]);
      acc0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s0[i], bias)), _mm512_mul_ps(dw0, d), acc0[i]);
      acc1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s1[i], bias)), _mm512_mul_ps(dw1, d), acc1[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(out0 + i * GROUP_ROWS, acc0[i]);
    _mm512_storeu_ps(out1 + i * GROUP_ROWS, acc1[i]);
  }
}

// Q5 on VNNI: a chunk's fifth bits come in as a byte mask that adds 16 where set.
template <int R, bool K>
KVBANK_VNNI void q5_group_avx512(const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
  constexpr int64_t record = K ? Q5F_RECORD : Q5_RECORD;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), five = _mm512_set1_epi8(0x10);
  const int8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = a.q.data() + (r0 + i) * a.cols;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* rec = w + b * record;
    prefetch_record(rec, record);
    __m512i lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(rec + 64 * j);
      const __m512i l = _mm512_and_si512(v, low), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      lo[j] = _mm512_mask_add_epi8(l, static_cast<__mmask64>(load_u64(rec + 256 + 8 * j)), l, five);
      hi[j] = _mm512_mask_add_epi8(h, static_cast<__mmask64>(load_u64(rec + 288 + 8 * j)), h, five);
    }
    const __m512 dw = record_values16<K>(rec, 320);
    const __m512 mw = K ? record_values16<true>(rec, 384) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const int8_t* qa = rows[i] + b * QK;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, lo[j], quad(qa + 4 * j));
        s1 = _mm512_dpbusd_epi32(s1, lo[j + 1], quad(qa + 4 * j + 4));
        s0 = _mm512_dpbusd_epi32(s0, hi[j], quad(qa + 16 + 4 * j));
        s1 = _mm512_dpbusd_epi32(s1, hi[j + 1], quad(qa + 16 + 4 * j + 4));
      }
      const int64_t ab = (r0 + i) * a.blocks + b;
      __m512i exact = _mm512_add_epi32(s0, s1);
      if (!K) exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(16 * a.sum[ab]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[ab])), acc[i]);
      if (K) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[ab]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * GROUP_ROWS, acc[i]);
}


// --- AMX: int8 tiles (the amx level) ---------------------------------------------------------------
// One tile product multiplies 16 activation rows by one block (32 inputs) of a group's 16 output
// rows: tdpbsud takes the activations (signed) as A, 16 rows x 32 bytes straight from the
// quantized rows, and the weights (unsigned) as B, 8 rows of [16 outputs][4 inputs] bytes, which is
// a record's own chunk layout (Q8: the record's first 512 bytes; 4- and 5-bit records are widened
// to bytes once per group). Each block's 16 x 16 int32 products are exact, stored and scaled into
// the float32 sums by the avx512_vnni kernels' own fused multiply-adds in block order: the same
// bits. Tiles are used for whole 16-row tiles of Q4, Q4F, Q5, Q5F and Q8 records; other rows and
// kinds run the avx512_vnni kernels.
#if defined(KVBANK_X86) && defined(KVBANK_AMX_BUILD)
#define KVBANK_AMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma,amx-tile,amx-int8")))
#define KVBANK_HAS_AMX 1

constexpr int64_t AMX_ROWS = 16;
// Tile products issued ahead of the float sums that read them: this many blocks per stage.
constexpr int64_t AMX_CHUNK = 6;
constexpr int64_t AMX_B_BYTES = 512;

bool amx_kind(Rec kind) { return kind == Rec::Q4 || kind == Rec::Q4F || kind == Rec::Q5 || kind == Rec::Q5F || kind == Rec::Q8; }

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0, tmm1: activations (16 rows x 32 bytes); tmm2, tmm3: weights (8 x 64 bytes); tmm4, tmm5:
// products (16 x 16 int32).
constexpr TileConfig amx_config() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 2; ++t) config.rows[t] = AMX_ROWS, config.colsb[t] = QK;
  for (int t = 2; t < 4; ++t) config.rows[t] = QK / 4, config.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) config.rows[t] = AMX_ROWS, config.colsb[t] = 64;
  return config;
}

// A constant in the binary, not a stack object: GCC 12 dropped the stores that filled a stack
// configuration before ldtilecfg (it does not see the instruction read them) wherever it did not
// inline this function, leaving every tile unconfigured and the first tile load an invalid opcode.
alignas(64) constexpr TileConfig kAmxConfig = amx_config();

// Loaded at every call: tile configuration is per thread, and other libraries in the process
// (oneDNN) configure tiles of their own.
KVBANK_AMX void amx_configure() { _tile_loadconfig(&kAmxConfig); }

// A 4- or 5-bit record's weights as bytes in B's layout: rows 0-3 the low nibbles (inputs 4k..4k+3),
// rows 4-7 the high ones (inputs 16 + 4k..), each plus 16 where its fifth bit is set (Q5, Q5F).
template <Rec K>
KVBANK_AMX inline void amx_widen(const uint8_t* rec, uint8_t* dst) {
  const __m512i low = _mm512_set1_epi8(0x0F), five = _mm512_set1_epi8(0x10);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(rec + 64 * j);
    __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if (K == Rec::Q5 || K == Rec::Q5F) {
      lo = _mm512_mask_add_epi8(lo, static_cast<__mmask64>(load_u64(rec + 256 + 8 * j)), lo, five);
      hi = _mm512_mask_add_epi8(hi, static_cast<__mmask64>(load_u64(rec + 288 + 8 * j)), hi, five);
    }
    _mm512_store_si512(dst + 64 * j, lo);
    _mm512_store_si512(dst + 256 + 64 * j, hi);
  }
}

// Blocks [b0, b0 + n) of 16 activation rows (`x`, row stride `cols`) times weights whose block b is
// B at `w + b * step`: products[k] = block b0 + k's 16 x 16 int32 dot products.
KVBANK_AMX void amx_products(const int8_t* x, int64_t cols, const uint8_t* w, int64_t step, int64_t b0, int64_t n,
                             int32_t (*products)[AMX_ROWS * GROUP_ROWS]) {
  int64_t k = 0;
  for (; k + 1 < n; k += 2) {
    _tile_loadd(0, x + (b0 + k) * QK, cols);
    _tile_loadd(2, w + (b0 + k) * step, 64);
    _tile_zero(4);
    _tile_dpbsud(4, 0, 2);
    _tile_loadd(1, x + (b0 + k + 1) * QK, cols);
    _tile_loadd(3, w + (b0 + k + 1) * step, 64);
    _tile_zero(5);
    _tile_dpbsud(5, 1, 3);
    _tile_stored(4, products[k], 64);
    _tile_stored(5, products[k + 1], 64);
  }
  if (k < n) {
    _tile_loadd(0, x + (b0 + k) * QK, cols);
    _tile_loadd(2, w + (b0 + k) * step, 64);
    _tile_zero(4);
    _tile_dpbsud(4, 0, 2);
    _tile_stored(4, products[k], 64);
  }
}

// Block b's products added to the 16 rows' sums as the avx512_vnni kernels add them.
template <Rec K>
KVBANK_AMX inline void amx_scale(const int32_t* products, const uint8_t* rec, const QuantRows& a, int64_t r0, int64_t b,
                                 __m512* acc) {
  constexpr bool F32 = K == Rec::Q4F || K == Rec::Q5F;
  constexpr int64_t d_at = K == Rec::Q8 ? 512 : (K == Rec::Q5 || K == Rec::Q5F) ? 320 : 256;
  constexpr int64_t m_at = K == Rec::Q4F ? 320 : K == Rec::Q5F ? 384 : 288;
  constexpr bool minimum = K == Rec::Q4 || K == Rec::Q4F || K == Rec::Q5F;
  const __m512 dw = record_values16<F32>(rec, d_at);
  const __m512 mw = minimum ? record_values16<F32>(rec, m_at) : _mm512_setzero_ps();
  for (int64_t i = 0; i < AMX_ROWS; ++i) {
    const int64_t ab = (r0 + i) * a.blocks + b;
    __m512i dot = _mm512_load_si512(products + GROUP_ROWS * i);
    if (K == Rec::Q8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * a.sum[ab]));
    if (K == Rec::Q5) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(16 * a.sum[ab]));
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[ab])), acc[i]);
    if (minimum) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[ab]), acc[i]);
  }
}

// One group's outputs for activation rows [r0, r0 + 16): out[i * out_stride + lane]. The products of
// the next stage's blocks are issued before the sums of this stage's, so tiles and vectors overlap;
// the `ahead_bytes` at `ahead` are prefetched along the way.
template <Rec K>
KVBANK_AMX void amx_group_rows(const uint8_t* rec0, const uint8_t* w, int64_t step, const QuantRows& a, int64_t r0,
                               float* out, int64_t out_stride, const uint8_t* ahead, int64_t ahead_bytes) {
  constexpr int64_t record = record_bytes(K);
  alignas(64) int32_t products[2][AMX_CHUNK][AMX_ROWS * GROUP_ROWS];
  __m512 acc[AMX_ROWS];
  for (int64_t i = 0; i < AMX_ROWS; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* x = a.q.data() + r0 * a.cols;
  const int64_t blocks = a.blocks;
  amx_products(x, a.cols, w, step, 0, std::min(AMX_CHUNK, blocks), products[0]);
  for (int64_t b0 = 0, stage = 0; b0 < blocks; b0 += AMX_CHUNK, stage ^= 1) {
    if (b0 + AMX_CHUNK < blocks)
      amx_products(x, a.cols, w, step, b0 + AMX_CHUNK, std::min(AMX_CHUNK, blocks - b0 - AMX_CHUNK), products[stage ^ 1]);
    const int64_t n = std::min(AMX_CHUNK, blocks - b0);
    const int64_t lo = ahead_bytes * b0 / blocks, hi = ahead_bytes * (b0 + n) / blocks;
    for (int64_t line = lo & ~int64_t{63}; line < hi; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    for (int64_t k = 0; k < n; ++k) amx_scale<K>(products[stage][k], rec0 + (b0 + k) * record, a, r0, b0 + k, acc);
  }
  for (int64_t i = 0; i < AMX_ROWS; ++i) _mm512_storeu_ps(out + i * out_stride, acc[i]);
}

// Groups [begin, end) for the activation rows [0, rows) (a multiple of 16).
template <Rec K>
KVBANK_AMX void amx_groups(const uint8_t* weights, int64_t begin, int64_t end, const QuantRows& a, int64_t rows,
                           float* out, int64_t out_stride) {
  constexpr int64_t record = record_bytes(K);
  const int64_t group_bytes = a.blocks * record;
  thread_local std::vector<uint8_t> storage;
  uint8_t* widened = nullptr;
  if (K != Rec::Q8) {
    storage.resize(a.blocks * AMX_B_BYTES + 64);
    widened = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  }
  amx_configure();
  for (int64_t g = begin; g < end; ++g) {
    const uint8_t* w = weights + g * group_bytes;
    const uint8_t* b_data = w;
    int64_t step = record;
    if (K != Rec::Q8) {
      for (int64_t b = 0; b < a.blocks; ++b) amx_widen<K>(w + b * record, widened + b * AMX_B_BYTES);
      b_data = widened, step = AMX_B_BYTES;
    }
    // the weights stream from memory once: the next group's are asked for a share per row tile,
    // spread over its blocks, while this group's are multiplied
    const int64_t tiles = rows / AMX_ROWS, share = (group_bytes + tiles - 1) / tiles;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t from = std::min(group_bytes, t * share), to = g + 1 < end ? std::min(group_bytes, from + share) : from;
      amx_group_rows<K>(w, b_data, step, a, t * AMX_ROWS, out + t * AMX_ROWS * out_stride + g * GROUP_ROWS, out_stride,
                        w + group_bytes + from, to - from);
    }
  }
  _tile_release();
}

void amx_dispatch(Rec kind, const uint8_t* weights, int64_t begin, int64_t end, const QuantRows& a, int64_t rows,
                  float* out, int64_t out_stride) {
  switch (kind) {
    case Rec::Q4: return amx_groups<Rec::Q4>(weights, begin, end, a, rows, out, out_stride);
    case Rec::Q4F: return amx_groups<Rec::Q4F>(weights, begin, end, a, rows, out, out_stride);
    case Rec::Q5: return amx_groups<Rec::Q5>(weights, begin, end, a, rows, out, out_stride);
    case Rec::Q5F: return amx_groups<Rec::Q5F>(weights, begin, end, a, rows, out, out_stride);
    default: return amx_groups<Rec::Q8>(weights, begin, end, a, rows, out, out_stride);
  }
}
#endif

// AVX2: each record is two halves of 8 rows (bytes 32h.. of every 64-byte chunk); maddubs + madd
// give the same exact integer dot products (no pair can saturate: |u8 x s8 x 2| < 2^15 here).
KVBANK_AVX2 inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// A block's weights are decoded once and meet every row of the tile; per row and lane the
// float sums run in block order as in the scalar version, so the bits do not depend on the tile.
// 8 lanes' scales (or minimums) of half h at `offset`: fp16 or float32 (F32).
template <bool F32>
KVBANK_AVX2 inline __m256 record_values8(const uint8_t* rec, int64_t offset, int h) {
  if (F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(rec + offset + 32 * h));
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + offset + 16 * h)));
}

template <int R, bool F32>
KVBANK_AVX2 void q4_group_avx2(const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
  constexpr int64_t record = F32 ? Q4F_RECORD : Q4_RECORD, min_at = F32 ? 320 : 288;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = a.q.data() + (r0 + i) * a.cols;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* rec = w + b * record;
      if (h == 0) {
        prefetch_record(rec, record);
      }
      __m256i lo[4], hi[4];
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * j + 32 * h));
        lo[j] = _mm256_and_si256(v, low);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const __m256 dw = record_values8<F32>(rec, 256, h), mw = record_values8<F32>(rec, min_at, h);
      for (int i = 0; i < R; ++i) {
        const int8_t* qa = rows[i] + b * QK;
        // 4-bit weights (0..15) times activations (|q| <= 127): a maddubs pair sum is at most
        // 2 * 15 * 127, so all eight of a block add up in 16 bits (|sum| <= 30,480) and widen
        // once: the same exact integer as widening each.
        __m256i p0 = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(load_i32(qa)));
        __m256i p1 = _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(load_i32(qa + 16)));
        for (int j = 1; j < 4; ++j) {
          p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(lo[j], _mm256_set1_epi32(load_i32(qa + 4 * j))));
          p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(hi[j], _mm256_set1_epi32(load_i32(qa + 16 + 4 * j))));
        }
        const __m256i sum = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1));
        const int64_t ab = (r0 + i) * a.blocks + b;
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[ab])), acc[i]);
        acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[ab]), acc[i]);
      }
    }
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + i * GROUP_ROWS + 8 * h, acc[i]);
  }
}

// Q8 and Q8H (H) on AVX2: signed weights, |w| as the unsigned operand and the activation taking
// w's sign; the low and high 16 inputs summed apart, as q8_group_scalar.
template <int R, bool H>
KVBANK_AVX2 void q8_group_avx2(const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
  constexpr int64_t record = H ? Q8H_RECORD : Q8_RECORD;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const int8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = a.q.data() + (r0 + i) * a.cols;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* rec = w + b * record;
      if (h == 0) {
        prefetch_record(rec, record);
      }
      __m256i ws[8], mag[8];
      for (int c = 0; c < 8; ++c) {
        ws[c] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * c + 32 * h)), flip);
        mag[c] = _mm256_abs_epi8(ws[c]);
      }
      const __m256 d_lo = record_values8<H>(rec, 512, h), d_hi = H ? record_values8<true>(rec, 576, h) : d_lo;
      for (int i = 0; i < R; ++i) {
        const int8_t* qa = rows[i] + b * QK;
        __m256i lo = dot_u8s8(mag[0], _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qa)), ws[0]));
        __m256i hi = dot_u8s8(mag[4], _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qa + 16)), ws[4]));
        for (int c = 1; c < 4; ++c) {
          lo = _mm256_add_epi32(lo, dot_u8s8(mag[c], _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qa + 4 * c)), ws[c])));
          hi = _mm256_add_epi32(
              hi, dot_u8s8(mag[c + 4], _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qa + 16 + 4 * c)), ws[c + 4])));
        }
        const __m256 d = _mm256_set1_ps(a.d[(r0 + i) * a.blocks + b]);
        if (H) {
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(d_lo, d), acc[i]);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(d_hi, d), acc[i]);
        } else {
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_mul_ps(d_lo, d), acc[i]);
        }
      }
    }
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + i * GROUP_ROWS + 8 * h, acc[i]);
  }
}
// 32 mask bits as 32 bytes: 16 where the bit is set, else 0.
KVBANK_AVX2 inline __m256i fifth_bits(uint32_t mask) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(mask)),
      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// Q5 on AVX2: as q4_group_avx2 with the fifth bits added; weights up to 31 make a maddubs pair
// sum up to 2 x 31 x 127, so the low and high halves widen apart (each of four at most 31,496).
template <int R, bool K>
KVBANK_AVX2 void q5_group_avx2(const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
  constexpr int64_t record = K ? Q5F_RECORD : Q5_RECORD;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = a.q.data() + (r0 + i) * a.cols;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* rec = w + b * record;
      if (h == 0) {
        prefetch_record(rec, record);
      }
      __m256i lo[4], hi[4];
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * j + 32 * h));
        const uint64_t low_bits = load_u64(rec + 256 + 8 * j), high_bits = load_u64(rec + 288 + 8 * j);
        lo[j] = _mm256_or_si256(_mm256_and_si256(v, low), fifth_bits(static_cast<uint32_t>(low_bits >> (32 * h))));
        hi[j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                fifth_bits(static_cast<uint32_t>(high_bits >> (32 * h))));
      }
      const __m256 dw = record_values8<K>(rec, 320, h);
      const __m256 mw = K ? record_values8<true>(rec, 384, h) : _mm256_setzero_ps();
      for (int i = 0; i < R; ++i) {
        const int8_t* qa = rows[i] + b * QK;
        __m256i p0 = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(load_i32(qa)));
        __m256i p1 = _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(load_i32(qa + 16)));
        for (int j = 1; j < 4; ++j) {
          p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(lo[j], _mm256_set1_epi32(load_i32(qa + 4 * j))));
          p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(hi[j], _mm256_set1_epi32(load_i32(qa + 16 + 4 * j))));
        }
        const int64_t ab = (r0 + i) * a.blocks + b;
        const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
        const __m256i exact = K ? sum : _mm256_sub_epi32(sum, _mm256_set1_epi32(16 * a.sum[ab]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[ab])), acc[i]);
        if (K) acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[ab]), acc[i]);
      }
    }
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + i * GROUP_ROWS + 8 * h, acc[i]);
  }
}

#endif

template <int R>
void group_tile(Rec kind, Isa isa, const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
#ifdef KVBANK_X86
  if (vnni(isa)) {
    switch (kind) {
      case Rec::Q4: return q4_group_avx512<R, false>(w, a, r0, out);
      case Rec::Q4F: return q4_group_avx512<R, true>(w, a, r0, out);
      case Rec::Q8: return q8_group_avx512<R, false>(w, a, r0, out);
      case Rec::Q8H: return q8_group_avx512<R, true>(w, a, r0, out);
      case Rec::Q5: return q5_group_avx512<R, false>(w, a, r0, out);
      case Rec::Q5F: return q5_group_avx512<R, true>(w, a, r0, out);
    }
  }
  if (isa == Isa::Avx2) {
    switch (kind) {
      case Rec::Q4: return q4_group_avx2<R, false>(w, a, r0, out);
      case Rec::Q4F: return q4_group_avx2<R, true>(w, a, r0, out);
      case Rec::Q8: return q8_group_avx2<R, false>(w, a, r0, out);
      case Rec::Q8H: return q8_group_avx2<R, true>(w, a, r0, out);
      case Rec::Q5: return q5_group_avx2<R, false>(w, a, r0, out);
      case Rec::Q5F: return q5_group_avx2<R, true>(w, a, r0, out);
    }
  }
#endif
  switch (kind) {
    case Rec::Q4: return q4_group_scalar<false>(w, a, r0, R, out);
    case Rec::Q4F: return q4_group_scalar<true>(w, a, r0, R, out);
    case Rec::Q8: return q8_group_scalar<false>(w, a, r0, R, out);
    case Rec::Q8H: return q8_group_scalar<true>(w, a, r0, R, out);
    case Rec::Q5: return q5_group_scalar<false>(w, a, r0, R, out);
    case Rec::Q5F: return q5_group_scalar<true>(w, a, r0, R, out);
  }
}

void group_kernel(Rec kind, Isa isa, const uint8_t* w, const QuantRows& a, int64_t r0, int64_t tile, float* out) {
  switch (tile) {
    case 4: return group_tile<4>(kind, isa, w, a, r0, out);
    case 3: return group_tile<3>(kind, isa, w, a, r0, out);
    case 2: return group_tile<2>(kind, isa, w, a, r0, out);
    default: return group_tile<1>(kind, isa, w, a, r0, out);
  }
}

#ifdef KVBANK_X86
// Two groups at once on VNNI (Q5, Q5F and Q8H records have no pair kernel; they go one group at a time).
template <int R>
void pair_tile(Rec kind, const uint8_t* w0, const uint8_t* w1, const QuantRows& a, int64_t r0, float* out0, float* out1) {
  switch (kind) {
    case Rec::Q4: return q4_pair_avx512<R, false>(w0, w1, a, r0, out0, out1);
    case Rec::Q4F: return q4_pair_avx512<R, true>(w0, w1, a, r0, out0, out1);
    default: return q8_pair_avx512<R>(w0, w1, a, r0, out0, out1);
  }
}
#endif

// Groups [begin, end) of out[r, n] (float32, row stride `out_stride`) = the quantized rows of `a`
// times the packed weights.
void qmatmul_groups(Rec kind, Isa isa, const uint8_t* weights, int64_t begin, int64_t end, const QuantRows& a, float* out,
                    int64_t out_stride) {
  const int64_t group_bytes = a.blocks * record_bytes(kind);
  alignas(64) float tile_out[ROW_TILE * GROUP_ROWS];
  int64_t first = 0;  // the rows the kernels below start at
#ifdef KVBANK_HAS_AMX
  if (isa == Isa::Amx && amx_kind(kind) && a.rows >= AMX_ROWS) {
    first = a.rows / AMX_ROWS * AMX_ROWS;
    amx_dispatch(kind, weights, begin, end, a, first, out, out_stride);
    if (first == a.rows) return;
  }
#endif
#ifdef KVBANK_X86
  if (vnni(isa) && (kind == Rec::Q4 || kind == Rec::Q4F || kind == Rec::Q8)) {
    // on VNNI: groups two at a time (q4_pair_avx512, q8_pair_avx512), the odd one below
    alignas(64) float pair_out[2][ROW_TILE * GROUP_ROWS];
    for (; begin + 1 < end; begin += 2) {
      const uint8_t* w = weights + begin * group_bytes;
      for (int64_t r0 = first; r0 < a.rows; r0 += ROW_TILE) {
        const int64_t tile = std::min(ROW_TILE, a.rows - r0);
        switch (tile) {
          case 4: pair_tile<4>(kind, w, w + group_bytes, a, r0, pair_out[0], pair_out[1]); break;
          case 3: pair_tile<3>(kind, w, w + group_bytes, a, r0, pair_out[0], pair_out[1]); break;
          case 2: pair_tile<2>(kind, w, w + group_bytes, a, r0, pair_out[0], pair_out[1]); break;
          default: pair_tile<1>(kind, w, w + group_bytes, a, r0, pair_out[0], pair_out[1]); break;
        }
        for (int64_t i = 0; i < tile; ++i) {
          for (int h = 0; h < 2; ++h)
            std::memcpy(out + (r0 + i) * out_stride + (begin + h) * GROUP_ROWS, pair_out[h] + i * GROUP_ROWS,
                        GROUP_ROWS * sizeof(float));
        }
      }
    }
  }
#endif
  for (int64_t g = begin; g < end; ++g) {
    const uint8_t* w = weights + g * group_bytes;
    for (int64_t r0 = first; r0 < a.rows; r0 += ROW_TILE) {
      const int64_t tile = std::min(ROW_TILE, a.rows - r0);
      group_kernel(kind, isa, w, a, r0, tile, tile_out);
      for (int64_t i = 0; i < tile; ++i) {
        std::memcpy(out + (r0 + i) * out_stride + g * GROUP_ROWS, tile_out + i * GROUP_ROWS, GROUP_ROWS * sizeof(float));
      }
    }
  }
}

// The matmul variant called `name` (auto: the active one); refused above the active level.
Isa parse_isa(const std::string& name) {
  if (name == "auto") return best_isa();
  Isa wanted = Isa::Scalar;
  TORCH_CHECK(kvbank::isa_from_name(name, &wanted) &&
                  (wanted == Isa::Scalar || wanted == Isa::Avx2 || wanted == Isa::Avx512Vnni || wanted == Isa::Amx),
              "isa must be auto, amx, avx512_vnni, avx2 or scalar, not ", name);
  TORCH_CHECK(static_cast<int>(wanted) <= static_cast<int>(best_isa()), "this CPU (capped at ",
              kvbank::isa_name(kvbank::active_isa()), ") cannot run the ", name, " path");
  return wanted;
}

// One tensor of records of one kind: `groups` groups of 16 output rows.
struct Segment {
  const uint8_t* data;
  int64_t groups;
  Rec kind;
};

// A projection's records: one segment, or several side by side (a fused projection whose tensors
// share no record kind, e.g. Q4_K q/k with a Q6_K v): their output rows follow one another.
struct PackedWeight {
  const uint8_t* data;
  int64_t groups, blocks, out_features, in_features;
  Rec kind;
  std::vector<Segment> segments;
};

PackedWeight check_weight(const torch::Tensor& w, int64_t kind) {
  TORCH_CHECK(kind == 4 || kind == 5 || kind == 8 || kind == 41 || kind == 51 || kind == 81,
              "kind must be 4 (Q4 records), 5 (Q5), 8 (Q8), 41 (Q4 with float32 scales), 51 (Q5 with float32 "
              "scales) or 81 (Q8 with float32 half-block scales), not ",
              kind);
  const Rec rec = static_cast<Rec>(kind);
  const int64_t record = record_bytes(rec);
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(2) == record,
              "packed weights must be contiguous uint8 [groups, blocks, ", record, "], got ", w.sizes());
  return {w.data_ptr<uint8_t>(), w.size(0), w.size(1), w.size(0) * GROUP_ROWS, w.size(1) * QK, rec,
          {{w.data_ptr<uint8_t>(), w.size(0), rec}}};
}

// The segments `ws` (kinds `kinds`) of one projection, side by side.
PackedWeight check_weights(const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& kinds) {
  TORCH_CHECK(!ws.empty() && ws.size() == kinds.size(), "a projection takes one kind per records tensor, got ",
              ws.size(), " tensors and ", kinds.size(), " kinds");
  PackedWeight whole = check_weight(ws[0], kinds[0]);
  for (size_t i = 1; i < ws.size(); ++i) {
    const PackedWeight part = check_weight(ws[i], kinds[i]);
    TORCH_CHECK(part.in_features == whole.in_features, "records ", i, " take ", part.in_features, " inputs, not ",
                whole.in_features);
    whole.groups += part.groups;
    whole.out_features += part.out_features;
    whole.segments.push_back(part.segments[0]);
  }
  return whole;
}

// Groups [g0, g1) of a projection (counted over its segments), into out's columns.
void qmatmul_span(const PackedWeight& w, Isa isa, int64_t g0, int64_t g1, const QuantRows& a, float* out,
                  int64_t out_stride) {
  int64_t base = 0;
  for (const Segment& seg : w.segments) {
    const int64_t lo = std::max(g0, base), hi = std::min(g1, base + seg.groups);
    if (lo < hi) qmatmul_groups(seg.kind, isa, seg.data, lo - base, hi - base, a, out + base * GROUP_ROWS, out_stride);
    base += seg.groups;
  }
}

void qmatmul_rows(const PackedWeight& w, Isa isa, const QuantRows& a, float* out, int64_t out_stride) {
  at::parallel_for(0, w.groups, 1, [&](int64_t begin, int64_t end) { qmatmul_span(w, isa, begin, end, a, out, out_stride); });
}

template <typename T>
void store_rows(const float* src, T* dst, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = narrow_to(src[i], static_cast<T*>(nullptr));
}

// --- fused decode steps ---------------------------------------------------------------------------

// silu(g) * u rounds to T after each op, as the unfused layer's ops do, and takes e^-g from the
// attention kernels' polynomial (exp_neg, clamped to [-87, 89]: beyond 88.7 it is inf and silu -0)
// with fused multiply-adds, so the scalar, 8-lane and 16-lane variants give the same bits.
inline float silu_exp(float x) {
  x = std::min(std::max(x, -87.0f), 89.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t);
  const float f = (t - n) * 0.69314718055994531f;
  float p = 1.0f / 5040;
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = std::fma(p, f, c);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <typename T>
inline float silu_mul_one(float gate, float up) {
  const float g = round_as<T>(gate), u = round_as<T>(up);
  return round_as<T>(round_as<T>(g / (1.0f + silu_exp(-g))) * u);
}

#ifdef KVBANK_X86
#define KVBANK_AVX512_F __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))
KVBANK_AVX512_F inline __m512 round_bf16_v(__m512 x) {
  // Round to nearest even at bfloat16 (finite values), as narrow_to does.
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The whole 16s of silu_mul_row for bfloat16; returns how many it did.
KVBANK_AVX512_F int64_t silu_mul_bf16_avx512(const float* gate, const float* up, float* out, int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 g = round_bf16_v(_mm512_loadu_ps(gate + k)), u = round_bf16_v(_mm512_loadu_ps(up + k));
    // scalef saturates to inf past the top of the range, as silu_exp's clamp to 89 does
    const __m512 e = exp_neg_v(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = round_bf16_v(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    _mm512_storeu_ps(out + k, round_bf16_v(_mm512_mul_ps(silu, u)));
  }
  return k;
}

KVBANK_AVX2 inline __m256 round_bf16_8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// bfloat16 bits of 16 floats as narrow_to gives them: round to nearest even, NaN to 0x7FC0.
KVBANK_AVX512_F inline __m256i narrow16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

KVBANK_AVX512_F inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The whole 16s of the stack's elementwise loops for bfloat16 (the scalar loops do the rest, the
// same operations one value at a time); each returns how many it did.
// dst[i] = src[i] rounded to bfloat16
KVBANK_AVX512_F int64_t store_bf16_avx512(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), narrow16(_mm512_loadu_ps(src + k)));
  return k;
}

// residual[i] = residual[i] + x[i], rounded to bfloat16
KVBANK_AVX512_F int64_t add_bf16_avx512(const c10::BFloat16* x, c10::BFloat16* residual, int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(residual + k),
                        narrow16(_mm512_add_ps(widen16(x + k), widen16(residual + k))));
  return k;
}

// out[i] = x[i] + add[i] rounded to bfloat16, as float (no add: x[i])
KVBANK_AVX512_F int64_t sum_bf16_avx512(const c10::BFloat16* x, const c10::BFloat16* add, float* out, int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 v = add ? _mm512_castsi512_ps(_mm512_slli_epi32(
                               _mm512_cvtepu16_epi32(narrow16(_mm512_add_ps(widen16(x + k), widen16(add + k)))), 16))
                         : widen16(x + k);
    _mm512_storeu_ps(out + k, v);
  }
  return k;
}

// values[i] = values[i] * inv * weight[i]
KVBANK_AVX512_F int64_t scale_bf16_avx512(float* values, float inv, const c10::BFloat16* weight, int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16)
    _mm512_storeu_ps(values + k, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(values + k), _mm512_set1_ps(inv)),
                                               widen16(weight + k)));
  return k;
}

// The whole 8s of silu_mul_row for bfloat16; returns how many it did.
KVBANK_AVX2 int64_t silu_mul_bf16_avx2(const float* gate, const float* up, float* out, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256 g = round_bf16_8(_mm256_loadu_ps(gate + k)), u = round_bf16_8(_mm256_loadu_ps(up + k));
    const __m256 e = exp_neg8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(89.0f)));
    const __m256 silu = round_bf16_8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    _mm256_storeu_ps(out + k, round_bf16_8(_mm256_mul_ps(silu, u)));
  }
  return k;
}
#endif

// out[k] = silu(gate[k]) * up[k] from the projections rounded to T; the same bits from every
// variant of the activation family, and the same function in every fused path.
template <typename T>
void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t k = 0;
#ifdef KVBANK_X86
  Isa variant = Isa::Scalar;
  kvbank::family_variant(kvbank::Family::Activation, &variant);
  if (std::is_same_v<T, c10::BFloat16> && variant == Isa::Avx512) k = silu_mul_bf16_avx512(gate, up, out, n);
  if (std::is_same_v<T, c10::BFloat16> && variant == Isa::Avx2) k = silu_mul_bf16_avx2(gate, up, out, n);
#endif
  for (; k < n; ++k) out[k] = silu_mul_one<T>(gate[k], up[k]);
}

// GeGLU (Gemma): gelu(gate) * up with gelu's tanh approximation, as torch's approximate="tanh",
// 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + e^-2y) (the same
// function; 1 + tanh(y) itself would cancel to nothing for gates below about -4) through
// silu_exp's polynomial; gelu rounds to bfloat16, then the product, as the unfused ops do. Plain
// multiplies and adds in a fixed order in every variant (no fused multiply-add outside the
// polynomial), so the scalar, 8-lane and 16-lane variants give the same bits.
inline float gelu_tanh(float g) {
  const float y = 0.7978845608028654f * (g + 0.044715f * ((g * g) * g));
  return g / (1.0f + silu_exp(-2.0f * y));
}

inline c10::BFloat16 geglu_one(c10::BFloat16 gate, c10::BFloat16 up) {
  return c10::BFloat16(round_as<c10::BFloat16>(gelu_tanh(static_cast<float>(gate))) * static_cast<float>(up));
}

#ifdef KVBANK_X86
KVBANK_AVX512_F int64_t geglu_bf16_avx512(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out,
                                          int64_t n) {
  int64_t k = 0;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; k + 16 <= n; k += 16) {
    const __m512 g = widen16(gate + k);
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                   _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), cube)));
    // scalef saturates to inf past the top of the range, as silu_exp's clamp to 89 does
    const __m512 e = exp_neg_v(_mm512_mul_ps(_mm512_set1_ps(-2.0f), y));
    const __m512 gelu = round_bf16_v(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), narrow16(_mm512_mul_ps(gelu, widen16(up + k))));
  }
  return k;
}

KVBANK_AVX2 inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

KVBANK_AVX2 int64_t geglu_bf16_avx2(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out,
                                    int64_t n) {
  int64_t k = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  alignas(32) float product[8];
  for (; k + 8 <= n; k += 8) {
    const __m256 g = widen8(gate + k);
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                   _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
    const __m256 e = exp_neg8(_mm256_min_ps(_mm256_mul_ps(_mm256_set1_ps(-2.0f), y), _mm256_set1_ps(89.0f)));
    const __m256 gelu = round_bf16_8(_mm256_div_ps(g, _mm256_add_ps(one, e)));
    _mm256_store_ps(product, _mm256_mul_ps(gelu, widen8(up + k)));
    for (int i = 0; i < 8; ++i) out[k + i] = c10::BFloat16(product[i]);
  }
  return k;
}
#endif

// out[k] = gelu(gate[k]) * up[k] for bfloat16 rows; the same bits from every variant.
void geglu_row(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out, int64_t n) {
  int64_t k = 0;
#ifdef KVBANK_X86
  Isa variant = Isa::Scalar;
  kvbank::family_variant(kvbank::Family::Activation, &variant);
  if (variant == Isa::Avx512) k = geglu_bf16_avx512(gate, up, out, n);
  if (variant == Isa::Avx2) k = geglu_bf16_avx2(gate, up, out, n);
#endif
  for (; k < n; ++k) out[k] = geglu_one(gate[k], up[k]);
}

// The stack's elementwise loops: 16 lanes where the activation family runs its avx512 variant,
// else one value at a time; the same operations in the same order, so the same bits.
inline bool elementwise16() {
  Isa variant = Isa::Scalar;
  kvbank::family_variant(kvbank::Family::Activation, &variant);
  return variant == Isa::Avx512;
}

template <typename T>
void store_values(const float* src, T* dst, int64_t n, bool wide) {
  int64_t k = 0;
#ifdef KVBANK_X86
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (wide) k = store_bf16_avx512(src, dst, n);
  }
#endif
  for (; k < n; ++k) dst[k] = narrow_to(src[k], static_cast<T*>(nullptr));
}

template <typename T>
void add_values(const T* x, T* residual, int64_t n, bool wide) {
  int64_t k = 0;
#ifdef KVBANK_X86
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (wide) k = add_bf16_avx512(x, residual, n);
  }
#endif
  for (; k < n; ++k) residual[k] = narrow_to(widen(x[k]) + widen(residual[k]), static_cast<T*>(nullptr));
}

// residual (+)= x, rounded to T as an add of two T tensors is; returns the rows RMS-normed in float32.
template <typename T>
void add_norm_quantize(T* x, T* residual, const T* weight, int64_t rows, int64_t dim, double eps, QuantRows& out) {
  out.resize(rows, dim);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(dim);
    for (int64_t r = begin; r < end; ++r) {
      T* src = x + r * dim;
      if (residual != nullptr) {
        T* res = residual + r * dim;
        for (int64_t d = 0; d < dim; ++d) res[d] = narrow_to(widen(src[d]) + widen(res[d]), static_cast<T*>(nullptr));
        src = res;
      }
      float squares = 0.0f;
      for (int64_t d = 0; d < dim; ++d) squares += widen(src[d]) * widen(src[d]);
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(dim) + static_cast<float>(eps));
      for (int64_t d = 0; d < dim; ++d) normed[d] = widen(src[d]) * inv * widen(weight[d]);
      out.quantize_row(r, normed.data());
    }
  });
}

template <typename T>
torch::Tensor attn_in_impl(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor norm_w, double eps,
                           const PackedWeight& qkv, torch::Tensor cos, torch::Tensor sin, int64_t rope_heads, Isa isa) {
  const int64_t rows = x.size(0), dim = x.size(1);
  QuantRows a;
  add_norm_quantize(x.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr, norm_w.data_ptr<T>(), rows, dim, eps,
                    a);
  std::vector<float> acc(rows * qkv.out_features);
  qmatmul_rows(qkv, isa, a, acc.data(), qkv.out_features);
  auto out = torch::empty({rows, qkv.out_features}, x.options());
  store_rows(acc.data(), out.data_ptr<T>(), acc.size());
  rope_rows(out.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), rows, rope_heads, cos.size(1), qkv.out_features);
  return out;
}

template <typename T>
torch::Tensor mlp_impl(torch::Tensor attn, torch::Tensor residual, const PackedWeight& o, torch::Tensor norm_w,
                       double eps, const PackedWeight& gate_up, const PackedWeight& down, Isa isa) {
  const int64_t rows = attn.size(0), hidden = residual.size(1), inter = gate_up.out_features / 2;
  QuantRows a;
  quantize_rows(attn.data_ptr<T>(), attn.stride(0), rows, attn.size(1), a);
  std::vector<float> acc(rows * std::max(hidden, gate_up.out_features));
  qmatmul_rows(o, isa, a, acc.data(), hidden);
  std::vector<T> projected(rows * hidden);
  store_rows(acc.data(), projected.data(), rows * hidden);
  add_norm_quantize(projected.data(), residual.data_ptr<T>(), norm_w.data_ptr<T>(), rows, hidden, eps, a);
  qmatmul_rows(gate_up, isa, a, acc.data(), gate_up.out_features);
  // silu(gate) * up from the projections rounded to T, as the unfused layer computes them.
  a.resize(rows, inter);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(inter);
    for (int64_t r = begin; r < end; ++r) {
      const float* g = acc.data() + r * gate_up.out_features;
      silu_mul_row<T>(g, g + inter, h.data(), inter);
      a.quantize_row(r, h.data());
    }
  });
  qmatmul_rows(down, isa, a, acc.data(), hidden);
  auto out = torch::empty({rows, hidden}, residual.options());
  store_rows(acc.data(), out.data_ptr<T>(), rows * hidden);
  return out;
}

void check_rows(const torch::Tensor& x, int64_t cols, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == cols, what, " must be contiguous [rows, ", cols, "], got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat, what,
              " must be bfloat16 or float32, not ", x.scalar_type());
}

}  // namespace

std::string qmatmul_isa() { return kvbank::isa_name(best_isa()); }

torch::Tensor geglu(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() == 2 && gate_up.device().is_cpu(),
              "geglu takes a bfloat16 CPU matrix [rows, 2 * n]");
  TORCH_CHECK(gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1, "geglu: rows of gate then up, contiguous");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({rows, n}, gate_up.options());
  const auto* x = gate_up.data_ptr<at::BFloat16>();
  auto* y = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) geglu_row(x + r * stride, x + r * stride + n, y + r * n, n);
  });
  return out;
}

torch::Tensor qlinear(torch::Tensor x, torch::Tensor w, int64_t kind, bool float_out, std::string isa_name) {
  const PackedWeight pw = check_weight(w, kind);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == pw.in_features, "x must be [rows, ", pw.in_features,
              "] with contiguous rows, got ", x.sizes());
  const Isa isa = parse_isa(isa_name);
  QuantRows a;
  const int64_t rows = x.size(0);
  if (x.scalar_type() == torch::kBFloat16) {
    quantize_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), rows, pw.in_features, a);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "qlinear supports bfloat16 and float32 x, not ", x.scalar_type());
    quantize_rows(x.data_ptr<float>(), x.stride(0), rows, pw.in_features, a);
  }
  if (float_out || x.scalar_type() == torch::kFloat) {
    auto out = torch::empty({rows, pw.out_features}, x.options().dtype(torch::kFloat));
    qmatmul_rows(pw, isa, a, out.data_ptr<float>(), pw.out_features);
    return out;
  }
  std::vector<float> acc(rows * pw.out_features);
  qmatmul_rows(pw, isa, a, acc.data(), pw.out_features);
  auto out = torch::empty({rows, pw.out_features}, x.options());
  store_rows(acc.data(), out.data_ptr<c10::BFloat16>(), acc.size());
  return out;
}

torch::Tensor qlayer_attn_in(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor norm_w, double eps,
                             std::vector<torch::Tensor> qkv_w, std::vector<int64_t> kind, torch::Tensor cos,
                             torch::Tensor sin, int64_t rope_heads, std::string isa_name) {
  const PackedWeight qkv = check_weights(qkv_w, kind);
  check_rows(x, qkv.in_features, "x");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() && residual->scalar_type() == x.scalar_type(),
                "residual must be a contiguous tensor shaped and typed like x");
  }
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == x.size(1) && norm_w.scalar_type() == x.scalar_type() &&
                  norm_w.is_contiguous(),
              "the norm weight must be [", x.size(1), "] of x's dtype");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must be contiguous [rows, dim] of x's dtype");
  TORCH_CHECK(cos.size(1) % 2 == 0 && cos.size(1) <= 512 && rope_heads * cos.size(1) <= qkv.out_features,
              "rotary dim ", cos.size(1), " x ", rope_heads, " heads does not fit rows of ", qkv.out_features);
  const Isa isa = parse_isa(isa_name);
  if (x.scalar_type() == torch::kBFloat16)
    return attn_in_impl<c10::BFloat16>(x, residual, norm_w, eps, qkv, cos, sin, rope_heads, isa);
  return attn_in_impl<float>(x, residual, norm_w, eps, qkv, cos, sin, rope_heads, isa);
}

torch::Tensor qlayer_mlp(torch::Tensor attn, torch::Tensor residual, std::vector<torch::Tensor> o_w,
                         std::vector<int64_t> o_kind, torch::Tensor norm_w, double eps,
                         std::vector<torch::Tensor> gate_up_w, std::vector<int64_t> gate_up_kind,
                         std::vector<torch::Tensor> down_w, std::vector<int64_t> down_kind, std::string isa_name) {
  const PackedWeight o = check_weights(o_w, o_kind), gate_up = check_weights(gate_up_w, gate_up_kind),
                     down = check_weights(down_w, down_kind);
  check_rows(residual, o.out_features, "residual");
  TORCH_CHECK(attn.dim() == 2 && attn.stride(1) == 1 && attn.size(1) == o.in_features && attn.size(0) == residual.size(0) &&
                  attn.scalar_type() == residual.scalar_type(),
              "attn must be [", residual.size(0), ", ", o.in_features, "] with contiguous rows of the residual's dtype");
  TORCH_CHECK(gate_up.in_features == o.out_features && gate_up.out_features % 2 == 0 &&
                  down.in_features == gate_up.out_features / 2 && down.out_features == o.out_features,
              "o ", o.out_features, "x", o.in_features, ", gate_up ", gate_up.out_features, "x", gate_up.in_features,
              " and down ", down.out_features, "x", down.in_features, " do not chain");
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == o.out_features && norm_w.scalar_type() == residual.scalar_type() &&
                  norm_w.is_contiguous(),
              "the norm weight must be [", o.out_features, "] of the residual's dtype");
  const Isa isa = parse_isa(isa_name);
  if (residual.scalar_type() == torch::kBFloat16)
    return mlp_impl<c10::BFloat16>(attn, residual, o, norm_w, eps, gate_up, down, isa);
  return mlp_impl<float>(attn, residual, o, norm_w, eps, gate_up, down, isa);
}

// Rows `ids` of a Q8 record table (an embedding lookup), dequantized in float32 and rounded to
// `dtype` once: what the dense table, built the same way, would give.
torch::Tensor q8_rows(torch::Tensor records, torch::Tensor ids, torch::ScalarType dtype) {
  const PackedWeight table = check_weight(records, 8);
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, "ids must be int64 [n]");
  TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kFloat, "rows come as bfloat16 or float32, not ", dtype);
  auto index = ids.contiguous();
  const int64_t n = index.size(0), cols = table.in_features;
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < table.out_features, "token id ", id[i], " is outside the table's ", table.out_features, " rows");
  }
  auto out = torch::empty({n, cols}, torch::TensorOptions().dtype(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t group = id[i] / GROUP_ROWS, lane = id[i] % GROUP_ROWS;
    const uint8_t* base = table.data + group * table.blocks * Q8_RECORD;
    for (int64_t b = 0; b < table.blocks; ++b) {
      const uint8_t* rec = base + b * Q8_RECORD;
      uint16_t dh;
      std::memcpy(&dh, rec + 512 + 2 * lane, 2);
      const float d = half_to_float(dh);
      for (int64_t k = 0; k < QK; ++k) {
        const float v = static_cast<float>(static_cast<int32_t>(rec[(k / 4) * 64 + lane * 4 + k % 4]) - 128) * d;
        if (dtype == torch::kBFloat16) {
          out.data_ptr<c10::BFloat16>()[i * cols + b * QK + k] = narrow_to(v, static_cast<c10::BFloat16*>(nullptr));
        } else {
          out.data_ptr<float>()[i * cols + b * QK + k] = v;
        }
      }
    }
  }
  return out;
}

torch::Tensor qhead(torch::Tensor hidden, torch::Tensor norm_w, double eps, torch::Tensor head_w, int64_t kind,
                    std::string isa_name) {
  const PackedWeight head = check_weight(head_w, kind);
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == head.in_features, "hidden must be [rows, ", head.in_features, "]");
  auto x = hidden.contiguous();
  check_rows(x, head.in_features, "hidden");
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == x.size(1) && norm_w.scalar_type() == x.scalar_type() &&
                  norm_w.is_contiguous(),
              "the norm weight must be [", x.size(1), "] of hidden's dtype");
  const Isa isa = parse_isa(isa_name);
  QuantRows a;
  const int64_t rows = x.size(0);
  if (x.scalar_type() == torch::kBFloat16) {
    add_norm_quantize<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), nullptr, norm_w.data_ptr<c10::BFloat16>(), rows,
                                     x.size(1), eps, a);
  } else {
    add_norm_quantize<float>(x.data_ptr<float>(), nullptr, norm_w.data_ptr<float>(), rows, x.size(1), eps, a);
  }
  auto out = torch::empty({rows, head.out_features}, x.options().dtype(torch::kFloat));
  qmatmul_rows(head, isa, a, out.data_ptr<float>(), head.out_features);
  return out;
}

// --- a whole decoder stack per call ---------------------------------------------------------------

QuantStack::QuantStack(std::vector<std::vector<torch::Tensor>> weights, std::vector<std::vector<int64_t>> kinds,
                       std::vector<torch::Tensor> norms, double eps, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, bool gemma)
    : weights_(std::move(weights)), kinds_(std::move(kinds)), norms_(std::move(norms)), eps_(eps),
      num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), gemma_(gemma) {
  const size_t per_layer = gemma ? 6 : 2;
  TORCH_CHECK(weights_.size() % 4 == 0 && weights_.size() == kinds_.size() && norms_.size() * 4 == weights_.size() * per_layer,
              "a stack takes 4 packed weights (qkv, o, gate_up, down) and ", per_layer, " norms per layer");
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  for (size_t i = 0; i < weights_.size(); i += 4) {
    const PackedWeight qkv = check_weights(weights_[i], kinds_[i]), o = check_weights(weights_[i + 1], kinds_[i + 1]);
    TORCH_CHECK(qkv.out_features == q_size + 2 * kv_size && o.in_features == q_size,
                "layer ", i / 4, ": q/k/v has ", qkv.out_features, " rows and o ", o.in_features, " inputs; the heads need ",
                q_size + 2 * kv_size, " and ", q_size);
    const int64_t hidden = qkv.in_features;
    for (size_t n = 0; n < per_layer; ++n) {
      const torch::Tensor& norm = norms_[i / 4 * per_layer + n];
      const int64_t dim = n < 4 ? hidden : head_dim;
      TORCH_CHECK(norm.dim() == 1 && norm.size(0) == dim && norm.is_contiguous() && norm.scalar_type() == torch::kBFloat16,
                  "layer ", i / 4, ": norm ", n, " must be contiguous bfloat16 [", dim, "]");
    }
  }
}

int64_t QuantStack::num_layers() const { return static_cast<int64_t>(weights_.size() / 4); }

namespace {

// The share [begin, end) of `count` items that thread `tid` of `threads` takes.
inline std::pair<int64_t, int64_t> share(int64_t count, int tid, int threads) {
  return {count * tid / threads, count * (tid + 1) / threads};
}

// A matmul's weight groups handed out in chunks to whichever thread asks next. With fixed shares,
// a thread the OS preempts (the server's HTTP thread, a client, another process) leaves the others
// waiting at the next barrier for its whole share; taken on demand, they take the rest of its work
// and wait only for the chunk it holds. Each group's outputs are its own, so who computes it
// changes no bit.
class GroupChunks {
 public:
  // Calls run(g0, g1) on chunks of [0, groups) until none are left; every thread of the region
  // calls it once (the counter is this matmul's alone). Chunks hold an even number of groups, so
  // VNNI's two-group kernels keep their pairs.
  template <typename F>
  void drain(int64_t groups, int threads, F&& run) {
    ranges_.drain(groups, std::max<int64_t>(2, (groups / (4 * std::max(threads, 1))) & ~int64_t{1}), run);
  }

 private:
  OnDemand ranges_;
};

// The decoder stack's barrier: a waiting thread spins, then yields its core until the others
// arrive. libgomp's barrier spins only 100 times before it sleeps on a futex once the process has
// more OpenMP threads than CPUs (GOMP_SPINCOUNT's documented throttling), as a server's
// does: its engine thread leads a team of its own beside the pools of other threads. Measured in
// the server under 8 chat clients (sched_switch events): both stack threads went to sleep ~120
// times per step, a sleep and a wake-up for a partner a few microseconds late, and the two cores
// were idle 6.6 s of a 33 s run; with this barrier, 3.5 s, and 8-row decode steps 6-12% faster.
class SpinBarrier {
 public:
  explicit SpinBarrier(int threads) : threads_(threads) {}

  void wait() {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    for (int64_t spin = 0; generation_.load(std::memory_order_acquire) == generation; ++spin) {
      if (spin < kSpins) {
#ifdef KVBANK_X86
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  // pauses (a fraction of a millisecond) before a waiting thread starts yielding its core
  static constexpr int64_t kSpins = 20000;
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> generation_{0};
  const int threads_;
};

}  // namespace

// Every layer in one parallel region whose threads stay in it from the first layer to the last,
// meeting at a barrier after each matmul (as llama.cpp's threads do); each thread normalizes and
// quantizes the rows it needs itself. Every row attends its own sequence's cached keys through
// the decode kernel's items after the rows' new keys and values are written at their slots. The
// arithmetic per token is the layer-by-layer path's (qlayer_attn_in, paged attention by rows,
// qlayer_mlp), so the two give the same bits.
torch::Tensor QuantStack::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> k_caches,
                                  std::vector<torch::Tensor> v_caches, torch::Tensor slot_mapping,
                                  torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t partition,
                                  int64_t format, std::vector<torch::Tensor> k_scales, std::vector<torch::Tensor> v_scales,
                                  std::vector<torch::Tensor> k_grids, std::vector<torch::Tensor> v_zeros,
                                  std::vector<torch::Tensor> residual_ks, std::vector<torch::Tensor> residual_vs,
                                  std::optional<torch::Tensor> kivi_plan, std::optional<torch::Tensor> scratch_slots,
                                  std::optional<torch::Tensor> own_rows,
                                  std::optional<torch::Tensor> starts, std::optional<torch::Tensor> cos_local,
                                  std::optional<torch::Tensor> sin_local, std::vector<int64_t> local_layers,
                                  std::vector<int64_t> layer_groups, std::vector<torch::Tensor> group_slots,
                                  std::vector<torch::Tensor> group_tables, std::vector<torch::Tensor> group_lens,
                                  std::vector<torch::Tensor> group_starts) {
  using T = c10::BFloat16;
  const int64_t layers = num_layers();
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers && static_cast<int64_t>(v_caches.size()) == layers,
              "one K and one V cache per layer: ", layers);
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_, group = num_heads_ / num_kv_heads_;
  const int64_t rows = x.size(0), hidden = x.size(1), tokens = slot_mapping.size(0);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous bfloat16 [rows, hidden], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == rows && cos.size(1) == head_dim_ &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kBFloat16 &&
                  sin.scalar_type() == torch::kBFloat16,
              "cos and sin must be contiguous bfloat16 [", rows, ", ", head_dim_, "]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.is_contiguous() && tokens <= rows,
              "the slot mapping must be int64 for the first tokens of x");
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong &&
                  block_tables.dim() == 2 && block_tables.size(0) == tokens && context_lens.size(0) == tokens,
              "block tables [tokens, width] and context lengths [tokens] must be int64");
  TORCH_CHECK(group <= kMaxGroup && head_dim_ <= kMaxDim && partition > 0, "group ", group, " or head dim ", head_dim_,
              " is beyond the decode kernel");
  // Attention groups: group 0 is the arguments above; each further one its own slots, block tables,
  // context lengths and starts for the same tokens (a hybrid cache's window tables, a sliding window).
  const int64_t groups = 1 + static_cast<int64_t>(group_slots.size());
  TORCH_CHECK(group_tables.size() == group_slots.size() && group_lens.size() == group_slots.size() &&
                  group_starts.size() == group_slots.size(),
              "each further attention group needs its slots, block tables, context lengths and starts");
  TORCH_CHECK(layer_groups.empty() || static_cast<int64_t>(layer_groups.size()) == layers,
              "layer_groups names one group per layer: ", layers);
  for (int64_t l = 0; l < static_cast<int64_t>(layer_groups.size()); ++l)
    TORCH_CHECK(layer_groups[l] >= 0 && layer_groups[l] < groups, "layer ", l, "'s group ", layer_groups[l],
                " is not one of the ", groups, " groups");
  for (auto& t : group_tables) t = t.contiguous();
  for (auto& t : group_lens) t = t.contiguous();
  for (int64_t g = 1; g < groups; ++g) {
    const auto &gs = group_slots[g - 1], &gt = group_tables[g - 1], &gl = group_lens[g - 1], &st = group_starts[g - 1];
    TORCH_CHECK(gs.scalar_type() == torch::kLong && gs.is_contiguous() && gs.dim() == 1 && gs.size(0) == tokens &&
                    gt.scalar_type() == torch::kLong && gt.dim() == 2 && gt.size(0) == tokens &&
                    gl.scalar_type() == torch::kLong && gl.dim() == 1 && gl.size(0) == tokens &&
                    st.scalar_type() == torch::kLong && st.is_contiguous() && st.dim() == 1 && st.size(0) == tokens,
                "group ", g, ": slots [", tokens, "], block tables [", tokens, ", width], context lengths and starts [",
                tokens, "], all int64");
  }
  TORCH_CHECK(groups == 1 || format == 0, "attention groups need bfloat16 caches (format 0), got format ", format);
  // Rows read from starts[t] on (a stream's sequence after evictions, a sliding window;
  // Partials::starts), or from 0.
  torch::Tensor first_slots;
  const int64_t* from = row_starts(starts, tokens, first_slots);
  struct Group {
    const int64_t *slots, *table, *lens, *starts;
    int64_t width;
  };
  std::vector<Group> attention_groups{{slot_mapping.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(),
                                       context_lens.data_ptr<int64_t>(), from, block_tables.size(1)}};
  for (int64_t g = 1; g < groups; ++g)
    attention_groups.push_back({group_slots[g - 1].data_ptr<int64_t>(), group_tables[g - 1].data_ptr<int64_t>(),
                                group_lens[g - 1].data_ptr<int64_t>(), group_starts[g - 1].data_ptr<int64_t>(),
                                group_tables[g - 1].size(1)});
  auto group_of = [&](int64_t l) { return layer_groups.empty() ? int64_t{0} : layer_groups[l]; };
  const bool any_local = std::find(local_layers.begin(), local_layers.end(), int64_t{1}) != local_layers.end();
  TORCH_CHECK(local_layers.empty() || static_cast<int64_t>(local_layers.size()) == layers,
              "local_layers says 0 or 1 for each of the ", layers, " layers");
  TORCH_CHECK(!any_local || (cos_local && sin_local && cos_local->sizes() == cos.sizes() &&
                             sin_local->sizes() == cos.sizes() && cos_local->is_contiguous() &&
                             sin_local->is_contiguous() && cos_local->scalar_type() == torch::kBFloat16 &&
                             sin_local->scalar_type() == torch::kBFloat16),
              "local layers need cos_local and sin_local shaped and typed as cos");
  std::vector<PackedWeight> w;
  for (int64_t i = 0; i < 4 * layers; ++i) w.push_back(check_weights(weights_[i], kinds_[i]));
  const int64_t inter = w[2].out_features / 2;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  // format 0: bfloat16 caches; 1 int8, 2 fp8_e4m3, 3 fp8_e5m2: per-token codes and float16 scales
  // (quant_decode.cpp), quantized as they are written and attended in place; 4 int4, 5 int2: KIVI
  // blocks, written through the step's scratch rows and residual slots (KiviWrite).
  const bool quantized = format != 0;
  const bool kivi = format == 4 || format == 5;
  TORCH_CHECK(format >= 0 && format <= 5, "the stack's caches are bfloat16 (0), int8 (1), fp8 (2, 3), int4 (4) or int2 (5), got ",
              format);
  TORCH_CHECK(!quantized || (has_quant_decode() && (head_dim_ == 64 || head_dim_ == 128) && group <= 8),
              "quantized caches in the stack need an x86 CPU, head dim 64 or 128 and at most 8 query heads per "
              "KV head");
  TORCH_CHECK(!quantized || (static_cast<int64_t>(k_scales.size()) == layers &&
                             static_cast<int64_t>(v_scales.size()) == layers),
              "quantized caches need one K and one V scale tensor per layer: ", layers);
  int64_t scratch_rows = 0;
  bool kivi_early = false;  // some row's block is read from the pool by a later row (kPlanEarly)
  if (kivi) {
    TORCH_CHECK(static_cast<int64_t>(k_grids.size()) == layers && static_cast<int64_t>(v_zeros.size()) == layers &&
                    static_cast<int64_t>(residual_ks.size()) == layers && static_cast<int64_t>(residual_vs.size()) == layers,
                "int4/int2 caches need one key grid, value zero point and residual slot tensor per layer: ", layers);
    TORCH_CHECK(kivi_plan.has_value() && scratch_slots.has_value() && own_rows.has_value(),
                "int4/int2 caches need the step's plan, scratch slots and own rows");
    TORCH_CHECK(own_rows->scalar_type() == torch::kLong && own_rows->dim() == 1 && own_rows->size(0) == tokens &&
                    own_rows->is_contiguous(),
                "own rows must be contiguous int64 [", tokens, "]");
    for (int64_t l = 0; l < layers; ++l)
      check_kivi_layer(format, num_kv_heads_, head_dim_, k_caches[l], k_scales[l], k_grids[l], v_caches[l], v_scales[l],
                       v_zeros[l], residual_ks[l], residual_vs[l], torch::kBFloat16);
    TORCH_CHECK(k_caches[0].size(1) <= 64 && partition % k_caches[0].size(1) == 0,
                "the partition must be a multiple of the block size");
    scratch_rows = check_kivi_plan(*kivi_plan, *scratch_slots, tokens, k_caches[0].size(0), k_caches[0].size(1),
                                   residual_ks[0].size(0));
    const int64_t* plan_rows = kivi_plan->data_ptr<int64_t>();
    for (int64_t r = 0; r < scratch_rows; ++r) kivi_early = kivi_early || plan_rows[r * kPlanFields + kPlanEarly] != 0;
    const int64_t* own = own_rows->data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(own[t] >= 0 && own[t] < scratch_rows, "own row ", own[t], " is outside the step's ", scratch_rows, " rows");
  }
  std::vector<int64_t> group_blocks(groups, std::numeric_limits<int64_t>::max());
  for (int64_t l = 0; l < layers; ++l) {
    const auto& k = k_caches[l];
    const auto& v = v_caches[l];
    if (kivi) {
      // checked above
    } else if (quantized) {
      TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.element_size() == 1 && v.element_size() == 1 &&
                      k.dim() == 4 && k.size(2) == num_kv_heads_ && k.size(3) == head_dim_ && v.sizes() == k.sizes() &&
                      k.size(1) <= 64 && partition % k.size(1) == 0,
                  "layer ", l, ": quantized caches must be contiguous one-byte codes [blocks, block_size <= 64, ",
                  num_kv_heads_, ", ", head_dim_, "] with the partition a multiple of the block size");
      for (const auto* sc : {&k_scales[l], &v_scales[l]})
        TORCH_CHECK(sc->is_contiguous() && sc->scalar_type() == torch::kHalf && sc->dim() == 3 &&
                        sc->size(0) == k.size(0) && sc->size(1) == k.size(1) && sc->size(2) == num_kv_heads_,
                    "layer ", l, ": scales must be contiguous float16 [blocks, block_size, ", num_kv_heads_, "]");
    } else {
      TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.scalar_type() == torch::kBFloat16 &&
                      v.scalar_type() == torch::kBFloat16 && k.dim() == 4 && k.size(2) == num_kv_heads_ &&
                      k.size(3) == head_dim_ && v.sizes() == k.sizes() && k.size(1) <= kMaxBlock &&
                      partition % k.size(1) == 0,
                  "layer ", l, ": caches must be contiguous bfloat16 [blocks, block_size, ", num_kv_heads_, ", ",
                  head_dim_, "] with the partition a multiple of the block size");
    }
    const int64_t slots_total = k.size(0) * k.size(1);
    const Group& G = attention_groups[group_of(l)];
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(G.slots[t] >= 0 && G.slots[t] < slots_total, "slot ", G.slots[t], " is outside the cache's ",
                  slots_total);
    group_blocks[group_of(l)] = std::min(group_blocks[group_of(l)], k.size(0));
  }
  // every group's tables against the smallest cache among its layers, once
  check_block_tables(block_tables, context_lens, from, k_caches[0].size(1), group_blocks[0]);
  for (int64_t g = 1; g < groups; ++g)
    check_block_tables(group_tables[g - 1], group_lens[g - 1], attention_groups[g].starts, k_caches[0].size(1),
                       group_blocks[g]);
  const int64_t block_size = k_caches[0].size(1);

  auto out = torch::empty({rows, hidden}, x.options());
  std::vector<T> h(rows * hidden), residual(rows * hidden), attn(rows * q_size, T(0.0f)), q(tokens * q_size);
  std::memcpy(h.data(), x.data_ptr<T>(), rows * hidden * sizeof(T));
  std::vector<float> acc(rows * std::max(w[0].out_features, w[2].out_features));
  std::vector<T> qkv(rows * w[0].out_features);
  const T* cos_p = cos.data_ptr<T>();
  const T* sin_p = sin.data_ptr<T>();
  const T* cos_local_p = any_local ? cos_local->data_ptr<T>() : nullptr;
  const T* sin_local_p = any_local ? sin_local->data_ptr<T>() : nullptr;
  const Isa isa = best_isa();
  const int threads = std::max(1, at::get_num_threads());
  std::vector<std::unique_ptr<DenseJob>> dense_jobs;  // one per attention group
#ifdef KVBANK_X86
  std::unique_ptr<QuantJob<T>> quant_job;
  std::vector<QuantLayer> quant_layers;
  std::vector<KiviWrite<T>> kivi_writes;
#endif
  // int4/int2: one layer's scratch rows at a time, reused by every layer
  std::vector<T> scratch_k(kivi ? scratch_rows * block_size * kv_size : 0),
      scratch_v(kivi ? scratch_rows * block_size * kv_size : 0);
  if (!quantized) {
    for (const Group& G : attention_groups) {
      dense_jobs.emplace_back(new DenseJob(q.data(), k_caches[0].data_ptr<T>(), v_caches[0].data_ptr<T>(), G.table,
                                           G.lens, attn.data(), tokens, num_kv_heads_, group, head_dim_, block_size,
                                           G.width, scale, partition));
      dense_jobs.back()->set_starts(G.starts);
    }
  } else {
#ifdef KVBANK_X86
    quant_job.reset(new QuantJob<T>(q.data(), block_tables.data_ptr<int64_t>(), lens, attn.data(), tokens,
                                    num_kv_heads_, group, head_dim_, block_size, block_tables.size(1), scale,
                                    partition));
    quant_job->partials.starts = from;
    for (int64_t l = 0; l < layers; ++l) {
      if (kivi) {
        kivi_writes.push_back(kivi_pointers<T>(format, k_caches[l], k_scales[l], k_grids[l], v_caches[l], v_scales[l],
                                               v_zeros[l], residual_ks[l], residual_vs[l], scratch_k.data(),
                                               scratch_v.data(), *kivi_plan, *scratch_slots));
        const KiviWrite<T>& W = kivi_writes.back();
        quant_layers.push_back(QuantLayer{format, W.k_codes, nullptr, W.k_ranges, W.k_grid, W.v_codes, W.v_scale, W.v_zero,
                                          num_kv_heads_, head_dim_, block_size, W.code_bytes, head_dim_ / W.group,
                                          scratch_k.data(), scratch_v.data(), own_rows->data_ptr<int64_t>()});
        continue;
      }
      quant_layers.push_back(QuantLayer{format, reinterpret_cast<const uint8_t*>(k_caches[l].data_ptr()),
                                        reinterpret_cast<const uint16_t*>(k_scales[l].data_ptr()), nullptr, nullptr,
                                        reinterpret_cast<const uint8_t*>(v_caches[l].data_ptr()),
                                        reinterpret_cast<const uint16_t*>(v_scales[l].data_ptr()), nullptr,
                                        num_kv_heads_, head_dim_, block_size, head_dim_, 1, nullptr, nullptr, nullptr});
    }
#endif
  }

  // A few rows: every thread quantizes all of them for itself (no barrier); more: each its share,
  // then a barrier. The values are the same either way.
  const bool split_rows = rows > SPLIT_ROWS;
  QuantRows shared_hidden, shared_attn, shared_inter;
  if (split_rows) {
    shared_hidden.resize(rows, hidden);
    shared_attn.resize(rows, q_size);
    shared_inter.resize(rows, inter);
  }
  const bool wide = elementwise16();
  // The attention's work items, taken by the threads on demand: one queue per layer, so no thread
  // resets a queue another may still be reading.
  std::unique_ptr<ItemQueue[]> item_queues(new ItemQueue[num_layers()]);
  // Each layer's four matmuls' groups (q/k/v, output, gate/up, down), taken on demand.
  std::unique_ptr<GroupChunks[]> matmuls(new GroupChunks[4 * num_layers()]);
  std::optional<SpinBarrier> spin_barrier;  // for the team OpenMP gives (it may be smaller than asked)
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
    spin_barrier.emplace(nt);
    auto barrier = [&] { spin_barrier->wait(); };
    const auto [row_begin, row_end] = share(rows, tid, nt);
    QuantRows local_hidden, local_attn, local_inter;
    if (!split_rows) {
      local_hidden.resize(rows, hidden);
      local_attn.resize(rows, q_size);
      local_inter.resize(rows, inter);
    }
    std::vector<float> values(std::max({hidden, inter, q_size}));
    // GeGLU's operands and result, rounded to T as the unfused projections and activation leave them
    std::vector<T> gate_up_row(gemma_ ? 2 * inter : 0), gated(gemma_ ? inter : 0);
    // `fill(r)` leaves row r's float values in `values`; returns the quantized rows to multiply.
    auto quantize = [&](QuantRows& shared, QuantRows& local, auto&& fill) -> const QuantRows& {
      if (!split_rows) {
        for (int64_t r = 0; r < rows; ++r) {
          fill(r);
          local.quantize_row(r, values.data());
        }
        return local;
      }
      for (int64_t r = row_begin; r < row_end; ++r) {
        fill(r);
        shared.quantize_row(r, values.data());
      }
      barrier();
      return shared;
    };
    // RMSNorm of h (+ residual, rounded as an add of two bfloat16 tensors) of row r.
    auto norm_row = [&](int64_t r, const T* add, const T* weight) {
      int64_t d = 0;
#ifdef KVBANK_X86
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (wide) d = sum_bf16_avx512(h.data() + r * hidden, add ? add + r * hidden : nullptr, values.data(), hidden);
      }
#endif
      for (; d < hidden; ++d) {
        values[d] = add ? round_as<T>(widen(h[r * hidden + d]) + widen(add[r * hidden + d])) : widen(h[r * hidden + d]);
      }
      float squares = 0.0f;
      for (d = 0; d < hidden; ++d) squares += values[d] * values[d];  // in order: one chain, as every path sums
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + static_cast<float>(eps_));
      d = 0;
#ifdef KVBANK_X86
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (wide) d = scale_bf16_avx512(values.data(), inv, weight, hidden);
      }
#endif
      for (; d < hidden; ++d) values[d] = values[d] * inv * widen(weight[d]);
    };
    // Gemma's norms leave T rows, as its unfused layer's do: the normed values rounded to T (before
    // they are quantized, or in place in h).
    auto round_values = [&](int64_t n) {
      for (int64_t d = 0; d < n; ++d) values[d] = round_as<T>(values[d]);
    };
    auto norm_in_place = [&](int64_t r, const T* weight) {
      norm_row(r, nullptr, weight);
      store_values(values.data(), h.data() + r * hidden, hidden, wide);
    };
    // RMSNorm of one head's `head_dim_` values in place (Gemma's q and k norms), as add_rms_norm_rows.
    auto norm_head = [&](T* head, const T* weight) {
      float squares = 0.0f;
      for (int64_t d = 0; d < head_dim_; ++d) squares += widen(head[d]) * widen(head[d]);
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(head_dim_) + static_cast<float>(eps_));
      for (int64_t d = 0; d < head_dim_; ++d) head[d] = narrow_to(widen(head[d]) * inv * widen(weight[d]), static_cast<T*>(nullptr));
    };
    for (int64_t l = 0; l < layers; ++l) {
      const PackedWeight &wqkv = w[4 * l], &wo = w[4 * l + 1], &wgu = w[4 * l + 2], &wdown = w[4 * l + 3];
      // Llama: input, post-attention (before the MLP). Gemma: input, post-attention, pre-feedforward,
      // post-feedforward, q, k.
      const int64_t per_layer = gemma_ ? 6 : 2;
      const T* norm1 = norms_[per_layer * l].data_ptr<T>();
      const T* norm2 = norms_[per_layer * l + (gemma_ ? 2 : 1)].data_ptr<T>();
      const T* norm_after_attn = gemma_ ? norms_[per_layer * l + 1].data_ptr<T>() : nullptr;
      const T* norm_after_mlp = gemma_ ? norms_[per_layer * l + 3].data_ptr<T>() : nullptr;
      const T* norm_q = gemma_ ? norms_[per_layer * l + 4].data_ptr<T>() : nullptr;
      const T* norm_k = gemma_ ? norms_[per_layer * l + 5].data_ptr<T>() : nullptr;
      const bool local = !local_layers.empty() && local_layers[l] == 1;
      const T* layer_cos = local ? cos_local_p : cos_p;
      const T* layer_sin = local ? sin_local_p : sin_p;
      const int64_t g = group_of(l);
      const int64_t* layer_slots = attention_groups[g].slots;
      DenseJob* dense_job = quantized ? nullptr : dense_jobs[g].get();
      T* kc = quantized ? nullptr : k_caches[l].data_ptr<T>();
      T* vc = quantized ? nullptr : v_caches[l].data_ptr<T>();
      const int64_t width = wqkv.out_features;
      // residual += h (h alone in the first layer), normed, q/k/v. The row's owner stores the
      // residual once every thread has read it.
      const T* previous = l ? residual.data() : nullptr;
#ifdef KVBANK_X86
      if (kivi) {
        // the blocks' earlier tokens into the scratch rows, before the barrier that ends the q/k/v matmul
        const auto [r0, r1] = share(scratch_rows, tid, nt);
        for (int64_t r = r0; r < r1; ++r) kivi_writes[l].preload(r);
      }
#endif
      const QuantRows& a1 = quantize(shared_hidden, local_hidden, [&](int64_t r) {
        norm_row(r, previous, norm1);
        if (gemma_) round_values(hidden);
      });
      matmuls[4 * l + 0].drain(wqkv.groups, nt, [&](int64_t g0, int64_t g1) {
        qmatmul_span(wqkv, isa, g0, g1, a1, acc.data(), width);
      });
      barrier();
      for (int64_t r = row_begin; r < row_end; ++r) {
        if (l) {
          add_values(h.data() + r * hidden, residual.data() + r * hidden, hidden, wide);
        } else {
          std::memcpy(residual.data() + r * hidden, h.data() + r * hidden, hidden * sizeof(T));
        }
        T* row = qkv.data() + r * width;
        store_values(acc.data() + r * width, row, width, wide);
        if (gemma_) {
          for (int64_t hh = 0; hh < num_heads_; ++hh) norm_head(row + hh * head_dim_, norm_q);
          for (int64_t hh = 0; hh < num_kv_heads_; ++hh) norm_head(row + q_size + hh * head_dim_, norm_k);
        }
        rope_rows(row, layer_cos + r * head_dim_, layer_sin + r * head_dim_, 1, num_heads_ + num_kv_heads_, head_dim_,
                  width);
        if (r < tokens) {
          if (kivi) {
#ifdef KVBANK_X86
            kivi_writes[l].place(r, row + q_size, row + q_size + kv_size);
#endif
          } else if (!quantized) {
            std::memcpy(kc + layer_slots[r] * kv_size, row + q_size, kv_size * sizeof(T));
            std::memcpy(vc + layer_slots[r] * kv_size, row + q_size + kv_size, kv_size * sizeof(T));
          } else {
#ifdef KVBANK_X86
            // quantized at the slot as TokenLayer.write does (quant_write_tokens)
            const QuantLayer& L = quant_layers[l];
            auto* k_codes = const_cast<uint8_t*>(L.k_codes);
            auto* v_codes = const_cast<uint8_t*>(L.v_codes);
            auto* k_sc = const_cast<uint16_t*>(L.k_scale);
            auto* v_sc = const_cast<uint16_t*>(L.v_scale);
            for (int64_t hh = 0; hh < num_kv_heads_; ++hh) {
              const int64_t at = slots[r] * num_kv_heads_ + hh;
              quantize_head(format, row + q_size + hh * head_dim_, head_dim_, k_codes + at * head_dim_, k_sc + at);
              quantize_head(format, row + q_size + kv_size + hh * head_dim_, head_dim_, v_codes + at * head_dim_,
                            v_sc + at);
            }
#endif
          }
          std::memcpy(q.data() + r * q_size, row, q_size * sizeof(T));
        }
      }
      barrier();
#ifdef KVBANK_X86
      if (kivi_early) {
        // blocks that later rows of a prefill chunk attend from the pool, quantized before attention
        const auto [r0, r1] = share(scratch_rows, tid, nt);
        for (int64_t r = r0; r < r1; ++r)
          if (kivi_writes[l].early(r)) kivi_writes[l].finish(r);
        barrier();
      }
#endif
      if (!quantized) {
        item_queues[l].drain(dense_job->partials(), nt,
                             [&](const int64_t* items, int count) { dense_job->run(items, count, kc, vc); });
      } else {
#ifdef KVBANK_X86
        item_queues[l].drain(quant_job->partials, nt, [&](const int64_t* items, int count) {
          quant_job->run(items, count, quant_layers[l]);
        });
        if (kivi) {
          // The other rows: filled blocks quantized, open ones back to their residual slots. Rows
          // attend their own block in the scratch rows, so this waits for no barrier; the next
          // layer's preload reuses the scratch rows only after the barriers below.
          const auto [r0, r1] = share(scratch_rows, tid, nt);
          for (int64_t r = r0; r < r1; ++r)
            if (!kivi_writes[l].early(r)) kivi_writes[l].finish(r);
        }
#endif
      }
      barrier();
      {
        int64_t pairs = 0;
#ifdef KVBANK_X86
        if (quantized) pairs = quant_job->pairs();
#endif
        if (!quantized) pairs = dense_job->pairs();
        const auto [p0, p1] = share(pairs, tid, nt);
        for (int64_t p = p0; p < p1; ++p) {
          if (!quantized) {
            dense_job->merge(p);
          } else {
#ifdef KVBANK_X86
            quant_job->merge(p);
#endif
          }
        }
      }
      barrier();
      // The output projection, added to the residual; normed; gate/up.
      const QuantRows& a2 = quantize(shared_attn, local_attn, [&](int64_t r) {
        for (int64_t d = 0; d < q_size; ++d) values[d] = widen(attn[r * q_size + d]);
      });
      matmuls[4 * l + 1].drain(wo.groups, nt, [&](int64_t g0, int64_t g1) {
        qmatmul_span(wo, isa, g0, g1, a2, acc.data(), hidden);
      });
      barrier();
      for (int64_t r = row_begin; r < row_end; ++r) {
        store_values(acc.data() + r * hidden, h.data() + r * hidden, hidden, wide);
        if (gemma_) norm_in_place(r, norm_after_attn);
      }
      barrier();
      const QuantRows& a3 = quantize(shared_hidden, local_hidden, [&](int64_t r) {
        norm_row(r, residual.data(), norm2);
        if (gemma_) round_values(hidden);
      });
      matmuls[4 * l + 2].drain(wgu.groups, nt, [&](int64_t g0, int64_t g1) {
        qmatmul_span(wgu, isa, g0, g1, a3, acc.data(), wgu.out_features);
      });
      barrier();
      for (int64_t r = row_begin; r < row_end; ++r)
        add_values(h.data() + r * hidden, residual.data() + r * hidden, hidden, wide);
      const QuantRows& a4 = quantize(shared_inter, local_inter, [&](int64_t r) {
        const float* gate = acc.data() + r * wgu.out_features;
        if (!gemma_) return silu_mul_row<T>(gate, gate + inter, values.data(), inter);
        store_values(gate, gate_up_row.data(), 2 * inter, wide);
        geglu_row(gate_up_row.data(), gate_up_row.data() + inter, gated.data(), inter);
        for (int64_t d = 0; d < inter; ++d) values[d] = widen(gated[d]);
      });
      if (!split_rows) {
        barrier();
      }
      matmuls[4 * l + 3].drain(wdown.groups, nt, [&](int64_t g0, int64_t g1) {
        qmatmul_span(wdown, isa, g0, g1, a4, acc.data(), hidden);
      });
      barrier();
      for (int64_t r = row_begin; r < row_end; ++r) {
        store_values(acc.data() + r * hidden, h.data() + r * hidden, hidden, wide);
        if (gemma_) norm_in_place(r, norm_after_mlp);
      }
      barrier();
    }
  }
  // The stack's output: the last layer's output added to the residual stream.
  T* o = out.data_ptr<T>();
  for (int64_t i = 0; i < rows * hidden; ++i) o[i] = narrow_to(widen(h[i]) + widen(residual[i]), static_cast<T*>(nullptr));
  return out;
}
