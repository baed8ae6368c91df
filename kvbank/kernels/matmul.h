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
// give the same bits.
//
// matmul.cpp holds the dispatch and the scalar reference, matmul_avx2.cpp and matmul_vnni.cpp
// (avx512_vnni and amx) the vector kernels; each unit's kernels are reached through the entry
// points declared at the end of this file.
#pragma once

#include "layers.h"
#include "native.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace kvbank {

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

// A record kind's layout and arithmetic (the layouts above), one place every path's kernels read.
template <Rec K>
struct Record {
  static constexpr int64_t bytes = record_bytes(K);
  // 4-bit nibble pairs in four 64-byte chunks (else 8-bit weights in eight), Q5 and Q5F with their
  // fifth bits at 256 and 288
  static constexpr bool nibbles = K != Rec::Q8 && K != Rec::Q8H;
  static constexpr bool fifth = K == Rec::Q5 || K == Rec::Q5F;
  static constexpr int max_nibble = fifth ? 31 : 15;  // the largest decoded 4- or 5-bit weight
  // scales (and minimums) as float32, else fp16
  static constexpr bool f32 = K == Rec::Q4F || K == Rec::Q5F || K == Rec::Q8H;
  static constexpr int64_t scale_at = nibbles ? (fifth ? 320 : 256) : 512;
  // Q8H: the first 16 inputs scaled at scale_at, the last 16 apart at scale_hi_at
  static constexpr bool halves = K == Rec::Q8H;
  static constexpr int64_t scale_hi_at = 576;
  // w = d*q + m: the minimum's term comes from the activations' block sums
  static constexpr bool minimum = K == Rec::Q4 || K == Rec::Q4F || K == Rec::Q5F;
  static constexpr int64_t min_at = K == Rec::Q4 ? 288 : K == Rec::Q4F ? 320 : 384;
  // the stored integers lie this far above the weights' own (Q5: q - 16; Q8: w + 128), taken off a
  // block's dot product as this times the activations' sum
  static constexpr int32_t offset = K == Rec::Q5 ? 16 : nibbles ? 0 : 128;
};

// f(std::integral_constant<Rec, K>{}) for `kind`: a kernel template instantiated once per record kind.
template <typename F>
void with_kind(Rec kind, F&& f) {
  switch (kind) {
    case Rec::Q4: return f(std::integral_constant<Rec, Rec::Q4>{});
    case Rec::Q5: return f(std::integral_constant<Rec, Rec::Q5>{});
    case Rec::Q8: return f(std::integral_constant<Rec, Rec::Q8>{});
    case Rec::Q4F: return f(std::integral_constant<Rec, Rec::Q4F>{});
    case Rec::Q5F: return f(std::integral_constant<Rec, Rec::Q5F>{});
    case Rec::Q8H: return f(std::integral_constant<Rec, Rec::Q8H>{});
  }
}

constexpr int64_t ROW_TILE = 4;

// f(std::integral_constant<int, R>{}) for a tile of R = 1..ROW_TILE activation rows.
template <typename F>
void with_tile(int64_t tile, F&& f) {
  switch (tile) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

// f(R, K) as above for a tile and a record kind: a group kernel's instantiations.
template <typename F>
void with_tile_kind(int64_t tile, Rec kind, F&& f) {
  with_tile(tile, [&](auto r) { with_kind(kind, [&](auto k) { f(r, k); }); });
}

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

// The matmul family's variant at the active level (isa.h): scalar, avx2, avx512_vnni or amx.
Isa best_isa();

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
  void quantize_row(int64_t r, const float* x);
  void quantize_row_scalar(int64_t r, const float* x);
#ifdef KVBANK_X86
  // The same arithmetic 16 lanes at a time (matmul_vnni.cpp), 8 lanes at a time (matmul_avx2.cpp).
  KVBANK_AVX512_VNNI void quantize_row_avx512(int64_t r, const float* x);
  KVBANK_AVX2 void quantize_row_avx2(int64_t r, const float* x);
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

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
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

PackedWeight check_weight(const torch::Tensor& w, int64_t kind);
// The segments `ws` (kinds `kinds`) of one projection, side by side.
PackedWeight check_weights(const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& kinds);
// Groups [g0, g1) of a projection (counted over its segments), into out's columns.
void qmatmul_span(const PackedWeight& w, Isa isa, int64_t g0, int64_t g1, const QuantRows& a, float* out,
                  int64_t out_stride);
void qmatmul_rows(const PackedWeight& w, Isa isa, const QuantRows& a, float* out, int64_t out_stride);
// The matmul variant called `name` (auto: the active one); refused above the active level.
Isa parse_isa(const std::string& name);

// --- the vector units' entry points: one group of 16 output rows for `tile` (1..ROW_TILE)
// activation rows from r0, out[i * 16 + lane] ---
#ifdef KVBANK_X86
void vnni_group(Rec kind, int64_t tile, const uint8_t* w, const QuantRows& a, int64_t r0, float* out);
// Two groups at once (Q4, Q4F and Q8 records; the others have no pair kernel).
void vnni_pair(Rec kind, int64_t tile, const uint8_t* w0, const uint8_t* w1, const QuantRows& a, int64_t r0,
               float* out0, float* out1);
void avx2_group(Rec kind, int64_t tile, const uint8_t* w, const QuantRows& a, int64_t r0, float* out);
#endif
#ifdef KVBANK_HAS_AMX
// AMX tiles take whole 16-row tiles of these kinds (matmul_vnni.cpp).
constexpr int64_t AMX_ROWS = 16;
bool amx_kind(Rec kind);
// Groups [begin, end) for the first `rows` rows of `a` (a multiple of AMX_ROWS).
void amx_dispatch(Rec kind, const uint8_t* weights, int64_t begin, int64_t end, const QuantRows& a, int64_t rows,
                  float* out, int64_t out_stride);
#endif

}  // namespace kvbank
