// The integer matmuls' avx512_vnni kernels (one 512-bit vpdpbusd multiplies four inputs into a
// group's 16 rows) and the amx tiles (matmul.h has the record layouts).
#include "matmul.h"

#include <algorithm>

#ifdef KVBANK_X86
namespace kvbank {

// The same arithmetic 16 lanes at a time (cvtps rounds to nearest even, as nearbyint does).
KVBANK_AVX512_VNNI void QuantRows::quantize_row_avx512(int64_t r, const float* x) {
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


namespace {

// 4 activation bytes broadcast to every lane, straight from memory (a load, no shuffle).
KVBANK_AVX512_VNNI inline __m512i quad(const int8_t* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

// 16 lanes' scales (or minimums) at `offset` of a record: fp16 (Q4, Q8) or float32 (Q4F, Q8H).
template <bool F32>
KVBANK_AVX512_VNNI inline __m512 record_values16(const uint8_t* rec, int64_t offset) {
  if (F32) return _mm512_loadu_ps(rec + offset);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + offset)));
}

template <int R, bool F32>
KVBANK_AVX512_VNNI void q4_group_avx512(const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
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
KVBANK_AVX512_VNNI void q4_pair_avx512(const uint8_t* w0, const uint8_t* w1, const QuantRows& a, int64_t r0, float* out0,
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
KVBANK_AVX512_VNNI void q8_group_avx512(const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
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
KVBANK_AVX512_VNNI void q8_pair_avx512(const uint8_t* w0, const uint8_t* w1, const QuantRows& a, int64_t r0, float* out0,
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
KVBANK_AVX512_VNNI void q5_group_avx512(const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
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

}  // namespace

template <int R>
void vnni_tile(Rec kind, const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
  switch (kind) {
    case Rec::Q4: return q4_group_avx512<R, false>(w, a, r0, out);
    case Rec::Q4F: return q4_group_avx512<R, true>(w, a, r0, out);
    case Rec::Q8: return q8_group_avx512<R, false>(w, a, r0, out);
    case Rec::Q8H: return q8_group_avx512<R, true>(w, a, r0, out);
    case Rec::Q5: return q5_group_avx512<R, false>(w, a, r0, out);
    case Rec::Q5F: return q5_group_avx512<R, true>(w, a, r0, out);
  }
}

void vnni_group(Rec kind, int64_t tile, const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
  switch (tile) {
    case 4: return vnni_tile<4>(kind, w, a, r0, out);
    case 3: return vnni_tile<3>(kind, w, a, r0, out);
    case 2: return vnni_tile<2>(kind, w, a, r0, out);
    default: return vnni_tile<1>(kind, w, a, r0, out);
  }
}

// Two groups at once on VNNI (Q5, Q5F and Q8H records have no pair kernel; they go one group at a time).
template <int R>
void pair_tile(Rec kind, const uint8_t* w0, const uint8_t* w1, const QuantRows& a, int64_t r0, float* out0, float* out1) {
  switch (kind) {
    case Rec::Q4: return q4_pair_avx512<R, false>(w0, w1, a, r0, out0, out1);
    case Rec::Q4F: return q4_pair_avx512<R, true>(w0, w1, a, r0, out0, out1);
    default: return q8_pair_avx512<R>(w0, w1, a, r0, out0, out1);
  }
}

void vnni_pair(Rec kind, int64_t tile, const uint8_t* w0, const uint8_t* w1, const QuantRows& a, int64_t r0,
               float* out0, float* out1) {
  switch (tile) {
    case 4: return pair_tile<4>(kind, w0, w1, a, r0, out0, out1);
    case 3: return pair_tile<3>(kind, w0, w1, a, r0, out0, out1);
    case 2: return pair_tile<2>(kind, w0, w1, a, r0, out0, out1);
    default: return pair_tile<1>(kind, w0, w1, a, r0, out0, out1);
  }
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
#ifdef KVBANK_HAS_AMX
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

}  // namespace kvbank
#endif
