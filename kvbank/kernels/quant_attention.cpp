// The quantized decode attention's scalar reference and 8-lane (AVX2) kernels, the job that
// runs a step's work items in the version the registry picks (quant_attention.h), and its
// torch operator.
#include "quant_attention.h"

#include "quant_kernels.h"

#include <ATen/Parallel.h>

namespace kvbank {

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
          const float c = w1::exp_neg(max_out[g] - s);
          for (int d = 0; d < D; ++d) acc[d] *= c;
          sum_out[g] *= c;
          max_out[g] = s;
        }
        const float p = w1::exp_neg(s - max_out[g]);
        sum_out[g] += p;
        for (int d = 0; d < D; ++d) acc[d] += p * value[d];
      }
    }
  }
}

#ifdef KVBANK_X86
// Attention of G query heads of one KV head over tokens [begin, ends[r]) of a quantized sequence,
// for R <= quant_tile_rows(G, D) query rows q[r] that read the same blocks (`table`): consecutive
// rows of a prefill. Each block is decoded once into float32 rows (L1-resident), then every row's
// query heads run over them with the query and accumulator in registers. A row's arithmetic is
// that of the row alone (R = 1, quant_range): the same operations on the same values in the same
// order, its own tokens counted, so tiling never changes a bit. With R > 1 no row reads a block
// from the step's scratch rows (own_row < 0).
template <typename T, int G, int D>
KVBANK_AVX2 void quant_rows(const QuantLayer& L, const T* const* q, const int64_t* table, int64_t begin,
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
        _mm256_store_ps(qs[r][g] + v * 8, _mm256_mul_ps(w8::load_f32(q[r] + g * D + v * 8), _mm256_set1_ps(scale)));
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
        for (int v = 0; v < V; ++v) x[v] = w8::load_f32(sk + t * L.heads * D + v * 8);
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
          bias = w8::hsum(b);
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
        for (int v = 0; v < V; ++v) x[v] = w8::load_f32(sv + t * L.heads * D + v * 8);
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
        const float best = std::max(m[r][g], w8::hmax(top8));
        __m256 a[V];
        for (int v = 0; v < V; ++v) a[v] = _mm256_load_ps(acc[r][g] + v * 8);
        if (best > m[r][g]) {
          const float c = w1::exp_neg(m[r][g] - best);
          const __m256 correction = _mm256_set1_ps(c);
          for (int v = 0; v < V; ++v) a[v] = _mm256_mul_ps(a[v], correction);
          l[r][g] *= c;
          m[r][g] = best;
        }
        const __m256 top = _mm256_set1_ps(best);
        __m256 total = _mm256_setzero_ps();
        for (int t = 0; t < n_r; t += 8) {
          const __m256 p =
              _mm256_and_ps(w8::exp_neg(_mm256_sub_ps(_mm256_load_ps(scores[r][g] + t), top)), first_lanes(n_r - t));
          _mm256_store_ps(scores[r][g] + t, p);
          total = _mm256_add_ps(total, p);
        }
        l[r][g] += w8::hsum(total);
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
KVBANK_AVX2 void quant_range(const QuantLayer& L, const T* q, const int64_t* table, int64_t begin, int64_t end,
                                  int64_t head, int64_t own_block, int64_t own_row, float scale, float* acc_out,
                                  float* max_out, float* sum_out) {
  quant_rows<T, G, D>(L, &q, table, begin, &end, 1, head, own_block, own_row, scale, &acc_out, &max_out, &sum_out);
}
#endif

namespace {

template <typename T, int D, int G>
QuantRange<T, D> quant_range_of(Isa isa) {
#ifdef KVBANK_X86
  if (isa == Isa::Avx512Bf16 || isa == Isa::Avx512) return quant_range512_for<T, D>(G, isa == Isa::Avx512Bf16);
  if (isa == Isa::Avx2) return quant_range<T, G, D>;
#endif
  return quant_range_scalar<T, G, D>;
}

}  // namespace

template <typename T, int D>
QuantTile<T, D> quant_tile_for(int64_t group, Isa isa) {
  if (isa != Isa::Avx2 || quant_tile_rows(static_cast<int>(group), D) < 2) return nullptr;
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
QuantRange<T, D> quant_range_for(int64_t group, Isa isa) {
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

template <typename T>
void QuantJob<T>::item(int64_t item, const QuantLayer& L) {
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

template <typename T>
void QuantJob<T>::run(const int64_t* items, int count, const QuantLayer& L) {
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

template <typename T>
int QuantJob<T>::tile_at(const int64_t* items, int limit, const QuantLayer& L) {
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

#define KVBANK_QUANT_DISPATCH(T, D)                                    \
  template QuantRange<T, D> quant_range_for<T, D>(int64_t, Isa); \
  template QuantTile<T, D> quant_tile_for<T, D>(int64_t, Isa);
KVBANK_QUANT_SHAPES(KVBANK_QUANT_DISPATCH)
#undef KVBANK_QUANT_DISPATCH
template struct QuantJob<float>;
template struct QuantJob<c10::BFloat16>;

namespace {

template <typename T>
void quant_decode(const QuantLayer& L, const torch::Tensor& q, const torch::Tensor& tables, const torch::Tensor& lens,
                  double scale, int64_t partition, torch::Tensor& out, Isa isa, const int64_t* starts = nullptr) {
  QuantJob<T> job(q.data_ptr<T>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<T>(), q.size(0),
                  q.size(1), q.size(2), q.size(3), L.block_size, tables.size(1), scale, partition, isa);
  job.partials.starts = starts;  // rows read from starts[i] on (Partials::starts), or from 0
  run_items(job.partials, [&](const int64_t* items, int count) { job.run(items, count, L); });
  at::parallel_for(0, job.pairs(), 1, [&](int64_t from, int64_t to) {
    for (int64_t pair = from; pair < to; ++pair) job.merge(pair);
  });
}

}  // namespace
}  // namespace kvbank

using namespace kvbank;

bool has_quant_decode() {
#ifdef KVBANK_X86
  return kvbank::family_available(kvbank::Family::QuantAttention);
#else
  return false;
#endif
}

std::vector<std::string> quant_decode_isas() {
  std::vector<std::string> names;
#ifdef KVBANK_X86
  if (!has_quant_decode()) return names;
  kvbank::Isa best = kvbank::Isa::Avx2;
  kvbank::family_variant(kvbank::Family::QuantAttention, &best);
  for (kvbank::Isa v : kvbank::family_info(kvbank::Family::QuantAttention).variants)
    if (static_cast<int>(v) <= static_cast<int>(best)) names.emplace_back(kvbank::isa_name(v));
#endif
  return names;
}

torch::Tensor quant_decode_attention(torch::Tensor q, int64_t format, torch::Tensor k_codes, torch::Tensor k_scale,
                                     std::optional<torch::Tensor> k_grid, torch::Tensor v_codes, torch::Tensor v_scale,
                                     std::optional<torch::Tensor> v_zero, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t partition,
                                     std::optional<torch::Tensor> scratch_k, std::optional<torch::Tensor> scratch_v,
                                     std::optional<torch::Tensor> own_rows, std::string isa,
                                     std::optional<torch::Tensor> starts) {
  TORCH_CHECK(has_quant_decode(), "quantized decode attention needs an x86 CPU");
  Isa level = Isa::Scalar;
#ifdef KVBANK_X86
  Isa wanted = kvbank::active_isa();
  TORCH_CHECK(isa == "auto" || kvbank::isa_from_name(isa, &wanted),
              "isa must be ", kvbank::family_isa_choices(kvbank::Family::QuantAttention, false), ", got ", isa);
  TORCH_CHECK(static_cast<int>(wanted) <= static_cast<int>(kvbank::active_isa()), "this CPU (capped at ",
              kvbank::isa_name(kvbank::active_isa()), ") does not run the ", isa, " version of the quantized kernel");
  level = quant_variant_at(wanted);
#endif
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
  TORCH_CHECK(dense || ((kivi || k_scale.scalar_type() == torch::kHalf) && v_scale.scalar_type() == torch::kHalf),
              "scales must be float16");
  int64_t value_groups = 1;
  if (dense) {
    // no scales
  } else if (kivi) {
    // k_scale holds the key range bytes
    TORCH_CHECK(k_grid.has_value() && v_zero.has_value(), "int4/int2 need key grids and value zero points");
    TORCH_CHECK(k_scale.scalar_type() == torch::kByte && k_scale.dim() == 3 && k_scale.size(0) == k_codes.size(0) &&
                    k_scale.size(1) == heads && k_scale.size(2) == dim,
                "key ranges must be uint8 [blocks, heads, dim]");
    TORCH_CHECK(k_grid->scalar_type() == torch::kHalf && k_grid->dim() == 3 && k_grid->size(0) == k_codes.size(0) &&
                    k_grid->size(1) == heads && k_grid->size(2) == 3 && k_grid->is_contiguous(),
                "key grids must be contiguous float16 [blocks, heads, 3]");
    TORCH_CHECK(v_scale.dim() == 4 && v_scale.size(0) == k_codes.size(0) && v_scale.size(1) == block_size &&
                    v_scale.size(2) == heads,
                "value scales must be [blocks, block_size, heads, groups]");
    TORCH_CHECK(v_zero->scalar_type() == torch::kChar && v_zero->sizes() == v_scale.sizes() && v_zero->is_contiguous(),
                "value zero points must be contiguous int8 like the value scales");
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
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1, "block tables must be [rows, width], lengths [rows]");
  torch::Tensor first;
  const int64_t* from = row_starts(starts, q.size(0), first);
  check_block_tables(block_tables, context_lens, from, block_size, k_codes.size(0));
  if (scratch) {
    const int64_t* rows = own.data_ptr<int64_t>();
    for (int64_t r = 0; r < q.size(0); ++r)
      TORCH_CHECK(rows[r] >= 0 && rows[r] < sk.size(0), "own row ", rows[r], " is outside the ", sk.size(0),
                  " scratch blocks");
  }
  auto out = torch::empty_like(q);
#ifdef KVBANK_X86
  QuantLayer L{format,
               reinterpret_cast<const uint8_t*>(k_codes.data_ptr()),
               kivi ? nullptr : reinterpret_cast<const uint16_t*>(k_scale.data_ptr()),
               kivi ? reinterpret_cast<const uint8_t*>(k_scale.data_ptr()) : nullptr,
               kivi ? reinterpret_cast<const uint16_t*>(k_grid->data_ptr()) : nullptr,
               reinterpret_cast<const uint8_t*>(v_codes.data_ptr()),
               reinterpret_cast<const uint16_t*>(v_scale.data_ptr()),
               kivi ? reinterpret_cast<const int8_t*>(v_zero->data_ptr()) : nullptr,
               heads,
               dim,
               block_size,
               code_bytes,
               value_groups,
               scratch ? sk.data_ptr() : nullptr,
               scratch ? sv.data_ptr() : nullptr,
               scratch ? own.data_ptr<int64_t>() : nullptr};
  if (q.scalar_type() == torch::kBFloat16) {
    quant_decode<c10::BFloat16>(L, q, block_tables, context_lens, scale, partition, out, level, from);
  } else {
    quant_decode<float>(L, q, block_tables, context_lens, scale, partition, out, level, from);
  }
#endif
  return out;
}
