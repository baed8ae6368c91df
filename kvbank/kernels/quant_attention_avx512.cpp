// The quantized decode attention's 16-lane kernels (AVX-512), and with bfloat16 tables for the
// codes (avx512_bf16); quant_attention.h has the formats, quant_attention.cpp the job that runs them.
#include "quant_attention.h"

#include "quant_kernels.h"

#ifdef KVBANK_X86
namespace kvbank {
namespace {


// --- The same attention with 16 float32 lanes (AVX-512F/BW/DQ/VL), where the CPU has them. ---
// Keys are decoded once per block into float32 rows in L1; each query head's scores for 16
// tokens are 16 vectors of partial sums reduced together by one transpose tree; values are
// decoded in registers and summed into accumulators that stay in registers, with the token's
// value scale folded into its softmax weight. One instantiation per format, so no format test
// runs per token.

// One head of one token as D / 16 float32 vectors of codes, channels in order.
template <int F, int D>
KVBANK_AVX512 inline void decode16(const uint8_t* p, __m512* out) {
  constexpr int V = D / 16;
  auto bytes16 = [&](int offset) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + offset)); };
  if constexpr (F == kBf16) {
    for (int v = 0; v < V; ++v) out[v] = w16::load_f32(reinterpret_cast<const c10::BFloat16*>(p) + v * 16);
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

KVBANK_AVX512 inline __mmask16 first16(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// State of one work item: G query heads' accumulators (registers once inlined), maxima and sums.
template <int G, int D>
struct Heads512 {
  __m512 acc[G][D / 16];
  float m[G], l[G];
};


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
  const float best = std::max(H.m[g], w16::hmax(top16));
  if (best > H.m[g]) {
    const float c = w1::exp_neg(H.m[g] - best);
    for (int v = 0; v < D / 16; ++v) H.acc[g][v] = _mm512_mul_ps(H.acc[g][v], _mm512_set1_ps(c));
    H.l[g] *= c;
    H.m[g] = best;
  }
  __m512 total = _mm512_setzero_ps();
  for (int t = 0; t < count; t += 16) {
    const __mmask16 live = first16(count - t);
    __m512 p = _mm512_maskz_mov_ps(live, w16::exp_neg(_mm512_sub_ps(_mm512_load_ps(scores + t), _mm512_set1_ps(best))));
    total = _mm512_add_ps(total, p);
    // lanes past `count` stay exactly zero: their value scales were never written (0 * NaN)
    if (v_scales != nullptr) p = _mm512_maskz_mul_ps(live, p, _mm512_load_ps(v_scales + t));
    _mm512_store_ps(scores + t, p);
  }
  H.l[g] += w16::hsum(total);
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
      for (int v = 0; v < V; ++v) x[v] = w16::load_f32(sv + t * L.heads * D + v * 16);
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
KVBANK_AVX512 void quant_range512_f(const QuantLayer& L, const T* q, const int64_t* table, int64_t begin, int64_t end,
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
      _mm512_store_ps(qs[g] + v * 16, _mm512_mul_ps(w16::load_f32(q + g * D + v * 16), _mm512_set1_ps(scale)));
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
        for (int v = 0; v < V; ++v) x[v] = w16::load_f32(sk + t * L.heads * D + v * 16);
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
        bias = w16::hsum(b);
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
KVBANK_AVX512_BF16 inline __attribute__((always_inline)) void codes_to_bf16(const __m512i* luts, const uint8_t* p, __m512i* out) {
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
KVBANK_AVX512_BF16 void quant_range512_lut(const QuantLayer& L, const c10::BFloat16* q, const int64_t* table,
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
KVBANK_AVX512_BF16 inline __attribute__((always_inline)) void nibbles_to_bf16(__m512i values, const uint8_t* p,
                                                                             __m512i* out) {
  for (int j = 0; j < D / 64; ++j) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j)));
    out[j] = _mm512_permutexvar_epi16(_mm512_and_si512(w, _mm512_set1_epi16(15)), values);
    out[j + D / 64] = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), values);
  }
}

// 16 floats rounded to bfloat16 (to nearest even) and back.
KVBANK_AVX512_BF16 inline __m512 bf16_round(__m512 x) {
  return w16::from_bf16((__m256i)_mm512_cvtneps_pbh(x));
}

template <int G, int D>
KVBANK_AVX512_BF16 void kivi4_range512_bf16(const QuantLayer& L, const c10::BFloat16* q, const int64_t* table,
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
      _mm512_store_ps(qs[g] + v * 16, _mm512_mul_ps(w16::load_f32(q + g * D + v * 16), _mm512_set1_ps(scale)));
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
          bias = w16::hsum(sum);
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
      const float best = std::max(H.m[g], w16::hmax(top));
      if (best > H.m[g]) {
        const float shrink = w1::exp_neg(H.m[g] - best);
        const __m512 c = _mm512_set1_ps(shrink);
        for (int v = 0; v < V; ++v) H.acc[g][v] = _mm512_mul_ps(H.acc[g][v], c);
        for (int v = 0; v < C; ++v) zero_share[g][v] = _mm512_mul_ps(zero_share[g][v], c);
        H.l[g] *= shrink;
        H.m[g] = best;
      }
      __m512 total = _mm512_setzero_ps();
      for (int t = 0; t < n; t += 16) {
        const __m512 p = _mm512_maskz_mov_ps(
            first16(n - t), w16::exp_neg(_mm512_sub_ps(_mm512_load_ps(scores[g] + t), _mm512_set1_ps(best))));
        total = _mm512_add_ps(total, p);
        _mm512_store_ps(scores[g] + t, p);
      }
      H.l[g] += w16::hsum(total);
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
      const float share = w16::hsum(zero_share[g][v / 2 / group_vectors]);
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

}  // namespace

template <typename T, int D>
QuantRange<T, D> quant_range512_for(int64_t group, bool tables) {
  switch (group) {
    case 1: return tables ? quant_range512<T, 1, D, true> : quant_range512<T, 1, D, false>;
    case 2: return tables ? quant_range512<T, 2, D, true> : quant_range512<T, 2, D, false>;
    case 3: return tables ? quant_range512<T, 3, D, true> : quant_range512<T, 3, D, false>;
    case 4: return tables ? quant_range512<T, 4, D, true> : quant_range512<T, 4, D, false>;
    case 5: return tables ? quant_range512<T, 5, D, true> : quant_range512<T, 5, D, false>;
    case 6: return tables ? quant_range512<T, 6, D, true> : quant_range512<T, 6, D, false>;
    case 7: return tables ? quant_range512<T, 7, D, true> : quant_range512<T, 7, D, false>;
    case 8: return tables ? quant_range512<T, 8, D, true> : quant_range512<T, 8, D, false>;
    default: return nullptr;
  }
}

#define KVBANK_QUANT_RANGE512(T, D) template QuantRange<T, D> quant_range512_for<T, D>(int64_t, bool);
KVBANK_QUANT_SHAPES(KVBANK_QUANT_RANGE512)
#undef KVBANK_QUANT_RANGE512

}  // namespace kvbank
#endif
