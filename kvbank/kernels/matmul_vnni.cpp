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

// Chunk j of a nibble record's weights as bytes: `lo` the low nibbles (inputs 4j..4j+3), `hi` the high
// ones (16 + 4j..), each plus 16 where its fifth bit is set (Q5, Q5F).
template <Rec K>
KVBANK_AVX512_VNNI inline void nibbles16(const uint8_t* rec, int j, __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F), five = _mm512_set1_epi8(0x10);
  const __m512i v = _mm512_loadu_si512(rec + 64 * j);
  lo = _mm512_and_si512(v, low);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  if (Record<K>::fifth) {
    lo = _mm512_mask_add_epi8(lo, static_cast<__mmask64>(load_u64(rec + 256 + 8 * j)), lo, five);
    hi = _mm512_mask_add_epi8(hi, static_cast<__mmask64>(load_u64(rec + 288 + 8 * j)), hi, five);
  }
}

// A block's exact dot products of one row added to its 16 lanes' float32 sums, as every path adds
// them: less the record's offset times the activations' sum, scaled, then the minimum's term.
template <Rec K>
KVBANK_AVX512_VNNI inline __m512 add_block16(__m512 acc, __m512i dot, __m512 dw, __m512 mw, const QuantRows& a,
                                             int64_t ab) {
  if (Record<K>::offset) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(Record<K>::offset * a.sum[ab]));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[ab])), acc);
  if (Record<K>::minimum) acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[ab]), acc);
  return acc;
}

// A block's scales and minimums (zero where the kind has none).
template <Rec K>
KVBANK_AVX512_VNNI inline void block_scales16(const uint8_t* rec, __m512& dw, __m512& mw) {
  using T = Record<K>;
  dw = record_values16<T::f32>(rec, T::scale_at);
  mw = T::minimum ? record_values16<T::f32>(rec, T::min_at) : _mm512_setzero_ps();
}

// A block's weights are decoded once and meet every row of the tile: w[c] for the inputs
// 4c..4c+3 (nibble records: w[j] the low nibbles of chunk j, w[4 + j] its high ones). Per row the first
// and last 16 inputs' exact products run in two chains, so a vpdpbusd's latency is hidden behind
// the other chain and the other rows; they are scaled together (Q8H: apart, as group_scalar).
template <int R, Rec K>
KVBANK_AVX512_VNNI void group_avx512(const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
  using T = Record<K>;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = a.q.data() + (r0 + i) * a.cols;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* rec = w + b * T::bytes;
    prefetch_record(rec, T::bytes);
    __m512i wv[8];
    if constexpr (T::nibbles) {
      for (int j = 0; j < 4; ++j) nibbles16<K>(rec, j, wv[j], wv[4 + j]);
    } else {
      for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(rec + 64 * c);
    }
    __m512 dw, mw;
    block_scales16<K>(rec, dw, mw);
    const __m512 d_hi = T::halves ? record_values16<true>(rec, T::scale_hi_at) : dw;
    for (int i = 0; i < R; ++i) {
      const int8_t* qa = rows[i] + b * QK;
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        lo = _mm512_dpbusd_epi32(lo, wv[c], quad(qa + 4 * c));
        hi = _mm512_dpbusd_epi32(hi, wv[c + 4], quad(qa + 16 + 4 * c));
      }
      const int64_t ab = (r0 + i) * a.blocks + b;
      if (T::halves) {
        const __m512 d = _mm512_set1_ps(a.d[ab]);
        lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(T::offset * a.sum_lo[ab]));
        hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(T::offset * (a.sum[ab] - a.sum_lo[ab])));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(dw, d), acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(d_hi, d), acc[i]);
      } else {
        acc[i] = add_block16<K>(acc[i], _mm512_add_epi32(lo, hi), dw, mw, a, ab);
      }
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * GROUP_ROWS, acc[i]);
}

// Two groups (32 output rows) against R rows: each activation broadcast meets both groups'
// weights, and a weight chunk is decoded once for the R rows. Per row and group the integer dot
// products are exact and the float sums run in block order, as in the one-group kernels: same bits.
// Q4 and Q4F decode their nibbles, Q8 takes its bytes as they are.
template <int R, Rec K>
KVBANK_AVX512_VNNI void pair_avx512(const uint8_t* w0, const uint8_t* w1, const QuantRows& a, int64_t r0, float* out0,
                                    float* out1) {
  using T = Record<K>;
  __m512 acc0[R], acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  const int8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = a.q.data() + (r0 + i) * a.cols;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* rec0 = w0 + b * T::bytes;
    const uint8_t* rec1 = w1 + b * T::bytes;
    prefetch_record(rec0, T::bytes);
    prefetch_record(rec1, T::bytes);
    __m512i s0[R], s1[R];
    for (int i = 0; i < R; ++i) s0[i] = s1[i] = _mm512_setzero_si512();
    if constexpr (T::nibbles) {
      for (int j = 0; j < 4; ++j) {
        __m512i lo0, hi0, lo1, hi1;
        nibbles16<K>(rec0, j, lo0, hi0);
        nibbles16<K>(rec1, j, lo1, hi1);
        for (int i = 0; i < R; ++i) {
          const __m512i x_lo = quad(rows[i] + b * QK + 4 * j), x_hi = quad(rows[i] + b * QK + 16 + 4 * j);
          s0[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s0[i], lo0, x_lo), hi0, x_hi);
          s1[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s1[i], lo1, x_lo), hi1, x_hi);
        }
      }
    } else {
      for (int c = 0; c < 8; ++c) {
        const __m512i v0 = _mm512_loadu_si512(rec0 + 64 * c), v1 = _mm512_loadu_si512(rec1 + 64 * c);
        for (int i = 0; i < R; ++i) {
          const __m512i x = quad(rows[i] + b * QK + 4 * c);
          s0[i] = _mm512_dpbusd_epi32(s0[i], v0, x);
          s1[i] = _mm512_dpbusd_epi32(s1[i], v1, x);
        }
      }
    }
    __m512 dw0, mw0, dw1, mw1;
    block_scales16<K>(rec0, dw0, mw0);
    block_scales16<K>(rec1, dw1, mw1);
    for (int i = 0; i < R; ++i) {
      const int64_t ab = (r0 + i) * a.blocks + b;
      acc0[i] = add_block16<K>(acc0[i], s0[i], dw0, mw0, a, ab);
      acc1[i] = add_block16<K>(acc1[i], s1[i], dw1, mw1, a, ab);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(out0 + i * GROUP_ROWS, acc0[i]);
    _mm512_storeu_ps(out1 + i * GROUP_ROWS, acc1[i]);
  }
}

}  // namespace

void vnni_group(Rec kind, int64_t tile, const uint8_t* w, const QuantRows& a, int64_t r0, float* out) {
  with_tile_kind(tile, kind,
                 [&](auto r, auto k) { group_avx512<decltype(r)::value, decltype(k)::value>(w, a, r0, out); });
}

// Two groups at once (Q5, Q5F and Q8H records have no pair kernel; they go one group at a time).
void vnni_pair(Rec kind, int64_t tile, const uint8_t* w0, const uint8_t* w1, const QuantRows& a, int64_t r0,
               float* out0, float* out1) {
  with_tile(tile, [&](auto r) {
    constexpr int R = decltype(r)::value;
    switch (kind) {
      case Rec::Q4: return pair_avx512<R, Rec::Q4>(w0, w1, a, r0, out0, out1);
      case Rec::Q4F: return pair_avx512<R, Rec::Q4F>(w0, w1, a, r0, out0, out1);
      default: return pair_avx512<R, Rec::Q8>(w0, w1, a, r0, out0, out1);
    }
  });
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

// Every kind but Q8H, whose half-block scales a tile's whole-block products cannot take.
bool amx_kind(Rec kind) { return kind != Rec::Q8H; }

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
  for (int j = 0; j < 4; ++j) {
    __m512i lo, hi;
    nibbles16<K>(rec, j, lo, hi);
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
  __m512 dw, mw;
  block_scales16<K>(rec, dw, mw);
  for (int64_t i = 0; i < AMX_ROWS; ++i) {
    const int64_t ab = (r0 + i) * a.blocks + b;
    acc[i] = add_block16<K>(acc[i], _mm512_load_si512(products + GROUP_ROWS * i), dw, mw, a, ab);
  }
}

// One group's outputs for activation rows [r0, r0 + 16): out[i * out_stride + lane]. The products of
// the next stage's blocks are issued before the sums of this stage's, so tiles and vectors overlap;
// the `ahead_bytes` at `ahead` are prefetched along the way.
template <Rec K>
KVBANK_AMX void amx_group_rows(const uint8_t* rec0, const uint8_t* w, int64_t step, const QuantRows& a, int64_t r0,
                               float* out, int64_t out_stride, const uint8_t* ahead, int64_t ahead_bytes) {
  constexpr int64_t record = Record<K>::bytes;
  alignas(64) int32_t products[2][AMX_CHUNK][AMX_ROWS * GROUP_ROWS];
  __m512 acc[AMX_ROWS];
  for (int64_t i = 0; i < AMX_ROWS; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* x = a.q.data() + r0 * a.cols;
  const int64_t blocks = a.blocks;
  amx_products(x, a.cols, w, step, 0, std::min(AMX_CHUNK, blocks), products[0]);
  for (int64_t b0 = 0, stage = 0; b0 < blocks; b0 += AMX_CHUNK, stage ^= 1) {
    if (b0 + AMX_CHUNK < blocks)
      amx_products(x, a.cols, w, step, b0 + AMX_CHUNK, std::min(AMX_CHUNK, blocks - b0 - AMX_CHUNK),
                   products[stage ^ 1]);
    const int64_t n = std::min(AMX_CHUNK, blocks - b0);
    const int64_t lo = ahead_bytes * b0 / blocks, hi = ahead_bytes * (b0 + n) / blocks;
    for (int64_t line = lo & ~int64_t{63}; line < hi; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    for (int64_t k = 0; k < n; ++k) amx_scale<K>(products[stage][k], rec0 + (b0 + k) * record, a, r0, b0 + k, acc);
  }
  for (int64_t i = 0; i < AMX_ROWS; ++i) _mm512_storeu_ps(out + i * out_stride, acc[i]);
}

// Groups [begin, end) for the activation rows [0, rows) (a multiple of 16).
template <Rec K>
KVBANK_AMX void amx_groups(const uint8_t* weights, int64_t begin, int64_t end, const QuantRows& a, int64_t rows,
                           float* out, int64_t out_stride) {
  constexpr int64_t record = Record<K>::bytes;
  const int64_t group_bytes = a.blocks * record;
  thread_local std::vector<uint8_t> storage;
  uint8_t* widened = nullptr;
  if (Record<K>::nibbles) {
    storage.resize(a.blocks * AMX_B_BYTES + 64);
    widened = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  }
  amx_configure();
  for (int64_t g = begin; g < end; ++g) {
    const uint8_t* w = weights + g * group_bytes;
    const uint8_t* b_data = w;
    int64_t step = record;
    if (Record<K>::nibbles) {
      for (int64_t b = 0; b < a.blocks; ++b) amx_widen<K>(w + b * record, widened + b * AMX_B_BYTES);
      b_data = widened, step = AMX_B_BYTES;
    }
    // the weights stream from memory once: the next group's are asked for a share per row tile,
    // spread over its blocks, while this group's are multiplied
    const int64_t tiles = rows / AMX_ROWS, share = (group_bytes + tiles - 1) / tiles;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t from = std::min(group_bytes, t * share);
      const int64_t to = g + 1 < end ? std::min(group_bytes, from + share) : from;
      amx_group_rows<K>(w, b_data, step, a, t * AMX_ROWS, out + t * AMX_ROWS * out_stride + g * GROUP_ROWS, out_stride,
                        w + group_bytes + from, to - from);
    }
  }
  _tile_release();
}

void amx_dispatch(Rec kind, const uint8_t* weights, int64_t begin, int64_t end, const QuantRows& a, int64_t rows,
                  float* out, int64_t out_stride) {
  with_kind(kind, [&](auto k) {
    constexpr Rec K = decltype(k)::value;
    if constexpr (!Record<K>::halves) amx_groups<K>(weights, begin, end, a, rows, out, out_stride);
  });
}
#endif

}  // namespace kvbank
#endif
