// Decode attention straight from a quantized paged KV cache: the codes are read in place through
// the block table and turned into float32 in registers, never written back out dequantized.
//
// Formats (kvbank/cache/quant.py):
// - bfloat16, dense: the model's own cache [blocks, block_size, heads, dim], no scales (used for
//   decodes on CPUs without the AVX-512 BF16 kernel of paged_decode.cpp).
// - int8, fp8 e4m3 / e5m2: codes [blocks, block_size, heads, dim] with one float16 scale per
//   token and KV head; the key scale multiplies the token's score.
// - int4 / int2 (KIVI): keys per channel over one block (scale and minimum [blocks, heads, dim]),
//   folded into the query once per block: q.k = (q * scale) . codes + q . minimum. Values per
//   token in groups of channels (scale and minimum [blocks, block_size, heads, groups]).
//   A row's own block (the one holding its newest tokens) is read in full precision from the
//   step's scratch blocks, as the reference path does.
//
// Vectors are 8 float32 lanes (AVX2, FMA, F16C), so the kernel runs on AVX-512 CPUs and on AVX2
// ones alike. A block's codes are decoded once into float32 rows that every query head of the KV
// head then reads; scores of 8 tokens are summed across lanes together, not one by one. Work
// items and their merge are the dense kernel's (Partials), so a row's result depends on its own
// sequence alone.
#include "native.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

enum QuantFormat : int64_t { kBf16 = 0, kInt8 = 1, kFp8E4M3 = 2, kFp8E5M2 = 3, kInt4 = 4, kInt2 = 5 };

// One layer's quantized K and V, and the step's full-precision scratch blocks (KIVI).
struct QuantLayer {
  int64_t format;
  const uint8_t* k_codes;
  const uint16_t* k_scale;
  const uint16_t* k_min;
  const uint8_t* v_codes;
  const uint16_t* v_scale;
  const uint16_t* v_min;
  int64_t heads, dim, block_size, code_bytes, value_groups;
  const void* scratch_k;  // [rows, block_size, heads, dim] in the query's dtype, or null
  const void* scratch_v;
  const int64_t* own_rows;  // per batch row: its scratch row, or -1
};

#ifdef KVBANK_X86
// AVX2 with FMA and F16C: every x86 CPU kvbank's fast paths target has them, AVX-512 ones too.
#define KVBANK_AVX2_F16C __attribute__((target("avx2,fma,f16c")))

inline bool avx2_f16c_supported() {
  static const bool supported =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return supported;
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
constexpr float kFp8E4M3Unit = 256.0f;

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

// Attention of G query heads of one KV head over tokens [begin, end) of a quantized sequence.
// Each block is decoded once into float32 rows (L1-resident), then every query head runs over
// them with its query and accumulator in registers.
template <typename T, int G, int D>
KVBANK_AVX2_F16C void quant_range(const QuantLayer& L, const T* q, const int64_t* table, int64_t begin, int64_t end,
                                  int64_t head, int64_t own_block, int64_t own_row, float scale, float* acc_out,
                                  float* max_out, float* sum_out) {
  constexpr int V = D / 8;
  constexpr int kMaxBlockTokens = 64;
  const int64_t bs = L.block_size;
  const bool kivi = L.format == kInt4 || L.format == kInt2;
  const bool scaled = !kivi && L.format != kBf16;  // one scale per token and head
  const __m256 unit = _mm256_set1_ps(L.format == kFp8E4M3 ? kFp8E4M3Unit : 1.0f);  // exact: a power of two
  alignas(32) float qs[G][D];
  alignas(32) float acc[G][D];
  float m[G], l[G];
  alignas(32) float scores[G][kMaxBlockTokens];
  alignas(32) float rows[kMaxBlockTokens][D];
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < V; ++v) {
      _mm256_store_ps(qs[g] + v * 8, _mm256_mul_ps(load8(q + g * D + v * 8), _mm256_set1_ps(scale)));
      _mm256_store_ps(acc[g] + v * 8, _mm256_setzero_ps());
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  const int64_t group_size = kivi ? D / L.value_groups : D;
  const int64_t token_codes = L.heads * L.code_bytes;
  for (int64_t start = begin; start < end; start += bs - start % bs) {
    const int64_t j = start / bs;
    const int64_t block = table[j];
    const int64_t first = start % bs;
    const int count = static_cast<int>(std::min(end - start, bs - first));
    const bool own = own_row >= 0 && j == own_block;
    const T* sk = own ? static_cast<const T*>(L.scratch_k) + ((own_row * bs + first) * L.heads + head) * D : nullptr;
    const T* sv = own ? static_cast<const T*>(L.scratch_v) + ((own_row * bs + first) * L.heads + head) * D : nullptr;
    const uint8_t* kc = L.k_codes + (block * bs + first) * token_codes + head * L.code_bytes;
    const uint8_t* vc = L.v_codes + (block * bs + first) * token_codes + head * L.code_bytes;
    const int64_t next = start + count;
    if (next < end) {
      // The next block is elsewhere in memory: ask for its rows now, so they arrive while this one computes.
      const int64_t nb = table[next / bs];
      const int ahead = static_cast<int>(std::min(end - next, bs));
      for (int t = 0; t < ahead; ++t) {
        const int64_t at = (nb * bs + t) * token_codes + head * L.code_bytes;
        for (int64_t c = 0; c < L.code_bytes; c += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(L.k_codes + at + c), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(L.v_codes + at + c), _MM_HINT_T0);
        }
      }
    }
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
    const uint16_t* ks = folded ? L.k_scale + (block * L.heads + head) * D : nullptr;
    const uint16_t* km = folded ? L.k_min + (block * L.heads + head) * D : nullptr;
    for (int g = 0; g < G; ++g) {
      __m256 qv[V];
      float bias = 0.0f;
      if (folded) {
        __m256 b = _mm256_setzero_ps();
        for (int v = 0; v < V; ++v) {
          const __m256 x = _mm256_load_ps(qs[g] + v * 8);
          qv[v] = _mm256_mul_ps(x, halves(ks + v * 8));
          b = _mm256_fmadd_ps(x, halves(km + v * 8), b);
        }
        bias = hsum8(b);
      } else {
        for (int v = 0; v < V; ++v) qv[v] = _mm256_load_ps(qs[g] + v * 8);
      }
      // Scores, 8 tokens at a time, summed across lanes together.
      for (int t0 = 0; t0 < count; t0 += 8) {
        __m256 part[8];
        const int n = std::min(8, count - t0);
        for (int t = 0; t < 8; ++t) {
          if (t >= n) {
            part[t] = _mm256_setzero_ps();
            continue;
          }
          const float* r = rows[t0 + t];
          __m256 s0 = _mm256_mul_ps(qv[0], _mm256_load_ps(r));
          __m256 s1 = _mm256_mul_ps(qv[1], _mm256_load_ps(r + 8));
          for (int v = 2; v < V; v += 2) {
            s0 = _mm256_fmadd_ps(qv[v], _mm256_load_ps(r + v * 8), s0);
            s1 = _mm256_fmadd_ps(qv[v + 1], _mm256_load_ps(r + v * 8 + 8), s1);
          }
          part[t] = _mm256_add_ps(s0, s1);
        }
        __m256 s = row_sums(part);
        if (!own && scaled) s = _mm256_mul_ps(s, _mm256_load_ps(token_scale + t0));
        _mm256_store_ps(scores[g] + t0, _mm256_add_ps(s, _mm256_set1_ps(bias)));
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
          const int64_t meta = ((block * bs + first + t) * L.heads + head) * L.value_groups;
          for (int v = 0; v < V; ++v) {
            const int64_t c = meta + v * 8 / group_size;
            x[v] = _mm256_fmadd_ps(x[v], _mm256_set1_ps(_cvtsh_ss(L.v_scale[c])), _mm256_set1_ps(_cvtsh_ss(L.v_min[c])));
          }
        }
      }
      for (int v = 0; v < V; ++v) _mm256_store_ps(rows[t] + v * 8, x[v]);
    }
    // Online softmax over the block, then the value sum; lanes past `count` are masked out.
    for (int g = 0; g < G; ++g) {
      __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      for (int t = 0; t < count; t += 8) {
        const __m256 live = first_lanes(count - t);
        top8 = _mm256_max_ps(top8, _mm256_blendv_ps(top8, _mm256_load_ps(scores[g] + t), live));
      }
      const float best = std::max(m[g], hmax8(top8));
      __m256 a[V];
      for (int v = 0; v < V; ++v) a[v] = _mm256_load_ps(acc[g] + v * 8);
      if (best > m[g]) {
        const float c = exp_neg(m[g] - best);
        const __m256 correction = _mm256_set1_ps(c);
        for (int v = 0; v < V; ++v) a[v] = _mm256_mul_ps(a[v], correction);
        l[g] *= c;
        m[g] = best;
      }
      const __m256 top = _mm256_set1_ps(best);
      __m256 total = _mm256_setzero_ps();
      for (int t = 0; t < count; t += 8) {
        const __m256 p =
            _mm256_and_ps(exp_neg8(_mm256_sub_ps(_mm256_load_ps(scores[g] + t), top)), first_lanes(count - t));
        _mm256_store_ps(scores[g] + t, p);
        total = _mm256_add_ps(total, p);
      }
      l[g] += hsum8(total);
      for (int t = 0; t < count; ++t) {
        const __m256 p = _mm256_set1_ps(scores[g][t]);
        const float* r = rows[t];
        for (int v = 0; v < V; ++v) a[v] = _mm256_fmadd_ps(p, _mm256_load_ps(r + v * 8), a[v]);
      }
      for (int v = 0; v < V; ++v) _mm256_store_ps(acc[g] + v * 8, a[v]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc_out + g * D + v * 8, _mm256_load_ps(acc[g] + v * 8));
    max_out[g] = m[g];
    sum_out[g] = l[g];
  }
}

template <typename T, int D>
using QuantRange = void (*)(const QuantLayer&, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                            float, float*, float*, float*);

template <typename T, int D>
QuantRange<T, D> quant_range_for(int64_t group) {
  switch (group) {
    case 1: return quant_range<T, 1, D>;
    case 2: return quant_range<T, 2, D>;
    case 3: return quant_range<T, 3, D>;
    case 4: return quant_range<T, 4, D>;
    case 5: return quant_range<T, 5, D>;
    case 6: return quant_range<T, 6, D>;
    case 7: return quant_range<T, 7, D>;
    case 8: return quant_range<T, 8, D>;
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
  Partials partials;

  QuantJob(const T* q, const int64_t* tables, const int64_t* lens, T* out, int64_t n, int64_t heads_, int64_t group_,
           int64_t dim_, int64_t block_size_, int64_t width_, double scale, int64_t partition)
      : q_p(q), t_p(tables), lens_p(lens), o_p(out), heads(heads_), group(group_), dim(dim_), block_size(block_size_),
        width(width_), s(static_cast<float>(scale)), partials(n, heads_, group_, dim_, lens, partition) {
    if (dim == 64) range64 = quant_range_for<T, 64>(group);
    if (dim == 128) range128 = quant_range_for<T, 128>(group);
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
    } else {
      range128(L, q_i, t_p + i * width, begin, end, h, own_block, own_row, s, acc, maxes, sums);
    }
  }

  void merge(int64_t pair) { partials.merge(pair, o_p); }
};

template <typename T>
void quant_decode(const QuantLayer& L, const torch::Tensor& q, const torch::Tensor& tables, const torch::Tensor& lens,
                  double scale, int64_t partition, torch::Tensor& out) {
  QuantJob<T> job(q.data_ptr<T>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<T>(), q.size(0),
                  q.size(1), q.size(2), q.size(3), L.block_size, tables.size(1), scale, partition);
  at::parallel_for(0, job.items(), 1, [&](int64_t from, int64_t to) {
    for (int64_t item = from; item < to; ++item) job.item(item, L);
  });
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
KVBANK_AVX2_F16C void quantize_head(int64_t format, const T* x, int64_t dim, uint8_t* codes, uint16_t* scale_out) {
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
#endif

const uint16_t* halves_ptr(const std::optional<torch::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<const uint16_t*>(t->data_ptr()) : nullptr;
}

}  // namespace

bool has_quant_decode() {
#ifdef KVBANK_X86
  return avx2_f16c_supported();
#else
  return false;
#endif
}

torch::Tensor quant_decode_attention(torch::Tensor q, int64_t format, torch::Tensor k_codes, torch::Tensor k_scale,
                                     std::optional<torch::Tensor> k_min, torch::Tensor v_codes, torch::Tensor v_scale,
                                     std::optional<torch::Tensor> v_min, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t partition,
                                     std::optional<torch::Tensor> scratch_k, std::optional<torch::Tensor> scratch_v,
                                     std::optional<torch::Tensor> own_rows) {
  TORCH_CHECK(has_quant_decode(), "quantized decode attention needs an x86 CPU with AVX2, FMA and F16C");
  TORCH_CHECK(format >= kBf16 && format <= kInt2, "unknown quantized KV format ", format);
  TORCH_CHECK(q.dim() == 4, "q must be [batch, kv_heads, group, dim], got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kFloat, "q must be bfloat16 or float32");
  const int64_t heads = q.size(1), group = q.size(2), dim = q.size(3);
  const bool kivi = format == kInt4 || format == kInt2;
  TORCH_CHECK(dim == 64 || dim == 128, "head dim must be 64 or 128, got ", dim);
  TORCH_CHECK(group >= 1 && group <= 8, "at most 8 query heads per KV head, got ", group);
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.sizes() == v_codes.sizes(), "codes must be [blocks, block_size, heads, bytes]");
  TORCH_CHECK(k_codes.size(2) == heads, "q has ", heads, " KV heads, the cache ", k_codes.size(2));
  const int64_t block_size = k_codes.size(1);
  TORCH_CHECK(block_size <= 64 && partition > 0 && partition % block_size == 0,
              "block size <= 64 and partition a multiple of it");
  const bool dense = format == kBf16;
  const int64_t code_bytes = kivi ? dim * (format == kInt4 ? 4 : 2) / 8 : dense ? 2 * dim : dim;
  TORCH_CHECK(k_codes.size(3) * k_codes.element_size() == code_bytes, "codes have ",
              k_codes.size(3) * k_codes.element_size(), " bytes per head, expected ", code_bytes);
  TORCH_CHECK(!dense || (k_codes.scalar_type() == torch::kBFloat16 && v_codes.scalar_type() == torch::kBFloat16),
              "a dense cache must be bfloat16");
  TORCH_CHECK(dense || (k_scale.scalar_type() == torch::kHalf && v_scale.scalar_type() == torch::kHalf),
              "scales must be float16");
  int64_t value_groups = 1;
  if (dense) {
    // no scales
  } else if (kivi) {
    TORCH_CHECK(k_min.has_value() && v_min.has_value(), "int4/int2 need key and value minimums");
    TORCH_CHECK(k_scale.dim() == 3 && k_scale.size(1) == heads && k_scale.size(2) == dim, "key scales must be [blocks, heads, dim]");
    TORCH_CHECK(k_min->sizes() == k_scale.sizes() && v_min->sizes() == v_scale.sizes(), "minimums must match scales");
    TORCH_CHECK(v_scale.dim() == 4 && v_scale.size(1) == block_size && v_scale.size(2) == heads,
                "value scales must be [blocks, block_size, heads, groups]");
    value_groups = v_scale.size(3);
    TORCH_CHECK(value_groups >= 1 && dim % value_groups == 0 && (dim / value_groups) % 16 == 0,
                "value groups must be whole multiples of 16 channels, got ", value_groups, " groups of dim ", dim);
  } else {
    TORCH_CHECK(k_scale.dim() == 3 && k_scale.size(1) == block_size && k_scale.size(2) == heads,
                "scales must be [blocks, block_size, heads]");
  }
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block tables and lengths must be int64");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "one table and length per row");
  const bool scratch = own_rows.has_value();
  if (scratch) {
    TORCH_CHECK(scratch_k.has_value() && scratch_v.has_value(), "own rows need scratch blocks");
    TORCH_CHECK(scratch_k->scalar_type() == q.scalar_type() && scratch_v->scalar_type() == q.scalar_type(),
                "scratch blocks must be in q's dtype");
    TORCH_CHECK(scratch_k->dim() == 4 && scratch_k->size(1) == block_size && scratch_k->size(2) == heads &&
                    scratch_k->size(3) == dim && scratch_k->sizes() == scratch_v->sizes(),
                "scratch blocks must be [rows, block_size, heads, dim]");
    TORCH_CHECK(own_rows->scalar_type() == torch::kLong && own_rows->size(0) == q.size(0), "one own row per row");
  }
  for (const auto* t : {&k_codes, &v_codes, &k_scale, &v_scale}) TORCH_CHECK(t->is_contiguous(), "caches must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  torch::Tensor sk, sv, own;
  if (scratch) {
    sk = scratch_k->contiguous();
    sv = scratch_v->contiguous();
    own = own_rows->contiguous();
  }
  auto out = torch::empty_like(q);
#ifdef KVBANK_X86
  QuantLayer L{format,
               reinterpret_cast<const uint8_t*>(k_codes.data_ptr()),
               reinterpret_cast<const uint16_t*>(k_scale.data_ptr()),
               halves_ptr(k_min),
               reinterpret_cast<const uint8_t*>(v_codes.data_ptr()),
               reinterpret_cast<const uint16_t*>(v_scale.data_ptr()),
               halves_ptr(v_min),
               heads,
               dim,
               block_size,
               code_bytes,
               value_groups,
               scratch ? sk.data_ptr() : nullptr,
               scratch ? sv.data_ptr() : nullptr,
               scratch ? own.data_ptr<int64_t>() : nullptr};
  if (q.scalar_type() == torch::kBFloat16) {
    quant_decode<c10::BFloat16>(L, q, block_tables, context_lens, scale, partition, out);
  } else {
    quant_decode<float>(L, q, block_tables, context_lens, scale, partition, out);
  }
#endif
  return out;
}

void quant_write_tokens(torch::Tensor x, int64_t format, torch::Tensor codes, torch::Tensor scale, torch::Tensor slots) {
  TORCH_CHECK(has_quant_decode(), "quantized KV writes need an x86 CPU with AVX2, FMA and F16C");
  TORCH_CHECK(format == kInt8 || format == kFp8E4M3 || format == kFp8E5M2,
              "per-token quantized writes are int8 (1), fp8_e4m3 (2) or fp8_e5m2 (3), got format ", format);
  TORCH_CHECK(x.dim() == 3, "x must be [tokens, heads, dim], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat, "x must be bfloat16 or float32");
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 8 == 0, "head dim must be a multiple of 8, got ", dim);
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == heads && codes.size(3) == dim && codes.element_size() == 1,
              "codes must be one byte each, [blocks, block_size, ", heads, ", ", dim, "], got ", codes.sizes());
  TORCH_CHECK(scale.scalar_type() == torch::kHalf && scale.dim() == 3 && scale.size(0) == codes.size(0) &&
                  scale.size(1) == codes.size(1) && scale.size(2) == heads,
              "scales must be float16 [blocks, block_size, heads], got ", scale.sizes());
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 && slots.size(0) == n,
              "slots must be int64 [", n, "], got ", slots.sizes());
  // Rows may be strided (k and v are views into the fused projection); each token's heads are dense.
  if (x.stride(2) != 1 || x.stride(1) != dim) x = x.contiguous();
  slots = slots.contiguous();
  const int64_t capacity = codes.size(0) * codes.size(1);
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slot_p[i] >= 0 && slot_p[i] < capacity, "slot ", slot_p[i], " is outside the cache's ", capacity, " slots");
#ifdef KVBANK_X86
  if (x.scalar_type() == torch::kBFloat16) {
    quant_write<c10::BFloat16>(format, x, codes, scale, slots);
  } else {
    quant_write<float>(format, x, codes, scale, slots);
  }
#endif
}
