// The bfloat16 (and float32, float16) paged decode attention: the scalar reference and the
// avx512_bf16 kernel, the job that picks among them and the quantized kernel's format 0
// (dense_attention.h), and its torch operator.
#include "dense_attention.h"

#include "quant_attention.h"

#include <ATen/Parallel.h>

namespace kvbank {

// One step of a range's walk over its blocks (start += block_size - start % block_size): where
// its first token's row of the head lies in the cache (rows `token_stride` apart, the head at
// `offset` in each) and how many of the block's tokens it covers.
inline std::pair<int64_t, int64_t> block_step(const int64_t* table, int64_t start, int64_t end, int64_t block_size,
                                              int64_t token_stride, int64_t offset) {
  const int64_t first = start % block_size;
  return {(table[start / block_size] * block_size + first) * token_stride + offset,
          std::min(end - start, block_size - first)};
}

#ifdef KVBANK_X86
// bfloat16 q and cache, G query heads per KV head, head dim D (a multiple of 32): q.k by
// bfloat16 pair dot products into float32, 16 tokens' sums by one transpose tree, softmax and the
// value sum in float32 registers.
template <int G, int D>
KVBANK_AVX512_BF16 void attend_range_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                     const int64_t* table, int64_t begin, int64_t end, int64_t block_size,
                                     int64_t heads, int64_t head, float scale, float* acc_out, float* max_out,
                                     float* sum_out) {
  constexpr int C = D / 32;
  constexpr int V = D / 16;
  __m512bh qv[G][C];
  __m512 acc[G][V];
  float m[G], l[G];
  alignas(64) float scores[G][kMaxBlock];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + c * 32);
    for (int v = 0; v < V; ++v) acc[g][v] = _mm512_setzero_ps();
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  const int64_t token_stride = heads * D;
  for (int64_t start = begin; start < end; start += block_size - start % block_size) {
    const auto [base, count] = block_step(table, start, end, block_size, token_stride, head * D);
    prefetch_ahead(k_cache, v_cache, table, block_size, begin, start, end, token_stride * 2, head * D * 2, D * 2);
    // Each head's scores 16 tokens at a time: 16 vectors of pair dot products, summed across lanes
    // together by one transpose tree (a token's sum never meets another token's lanes).
    for (int g = 0; g < G; ++g) {
      for (int t0 = 0; t0 < count; t0 += 16) {
        __m512 part[16];
        for (int t = 0; t < 16; ++t) {
          __m512 s = _mm512_setzero_ps();
          if (t0 + t < count) {
            const uint16_t* kp = k_cache + base + (t0 + t) * token_stride;
            for (int c = 0; c < C; ++c) s = _mm512_dpbf16_ps(s, qv[g][c], (__m512bh)_mm512_loadu_si512(kp + c * 32));
          }
          part[t] = s;
        }
        _mm512_store_ps(scores[g] + t0, _mm512_mul_ps(transpose_sums16(part), _mm512_set1_ps(scale)));
      }
    }
    for (int g = 0; g < G; ++g) {
      float best = m[g];
      for (int j = 0; j < count; j += 16) {
        const __mmask16 lanes = count - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - j)) - 1);
        best = std::max(best, _mm512_mask_reduce_max_ps(lanes, _mm512_maskz_loadu_ps(lanes, scores[g] + j)));
      }
      if (best > m[g]) {
        const __m512 correction = w16::exp_neg(_mm512_set1_ps(m[g] - best));
        for (int v = 0; v < V; ++v) acc[g][v] = _mm512_mul_ps(acc[g][v], correction);
        l[g] *= _mm512_cvtss_f32(correction);
        m[g] = best;
      }
      const __m512 top = _mm512_set1_ps(best);
      __m512 total = _mm512_setzero_ps();
      for (int j = 0; j < count; j += 16) {
        const __mmask16 lanes = count - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - j)) - 1);
        const __m512 p = _mm512_maskz_mov_ps(lanes, w16::exp_neg(_mm512_sub_ps(_mm512_loadu_ps(scores[g] + j), top)));
        _mm512_storeu_ps(scores[g] + j, p);
        total = _mm512_add_ps(total, p);
      }
      l[g] += w16::hsum(total);
    }
    for (int t = 0; t < count; ++t) {
      const uint16_t* vp = v_cache + base + t * token_stride;
      __m512 vv[V];
      for (int v = 0; v < V; ++v) vv[v] = w16::load_bf16(vp + v * 16);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g][t]);
        for (int v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(p, vv[v], acc[g][v]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc_out + g * D + v * 16, acc[g][v]);
    max_out[g] = m[g];
    sum_out[g] = l[g];
  }
}
#endif

template <typename T, int D>
void attend_range(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t begin, int64_t end,
                  int64_t block_size, int64_t heads, int64_t head, int64_t group, int64_t dim_rt, float scale,
                  float* acc, float* max_out, float* sum_out) {
  const int64_t dim = D > 0 ? D : dim_rt;
  float qf[kMaxGroup][kMaxDim];
  float scores[kMaxGroup][kMaxBlock];
  float kf[kMaxDim];
  float m[kMaxGroup], l[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < dim; ++d) qf[g][d] = load(q, g * dim + d) * scale;
    for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] = 0.0f;
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  const int64_t token_stride = heads * dim;
  for (int64_t start = begin; start < end; start += block_size - start % block_size) {
    const auto [base, count] = block_step(table, start, end, block_size, token_stride, head * dim);
    for (int64_t t = 0; t < count; ++t) {
      const T* kp = k_cache + base + t * token_stride;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) kf[d] = load(kp, d);
      for (int64_t g = 0; g < group; ++g) {
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; ++d) s += qf[g][d] * kf[d];
        scores[g][t] = s;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float best = m[g];
      for (int64_t t = 0; t < count; ++t) best = std::max(best, scores[g][t]);
      if (best > m[g]) {
        const float correction = w1::exp_neg(m[g] - best);
        l[g] *= correction;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] *= correction;
        m[g] = best;
      }
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t t = 0; t < count; ++t) {
        const float p = w1::exp_neg(scores[g][t] - best);
        scores[g][t] = p;
        total += p;
      }
      l[g] += total;
    }
    for (int64_t t = 0; t < count; ++t) {
      const T* vp = v_cache + base + t * token_stride;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) kf[d] = load(vp, d);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g][t];
        float* a = acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += p * kf[d];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    max_out[g] = m[g];
    sum_out[g] = l[g];
  }
}

using FastRange = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*, int64_t, int64_t,
                           int64_t, int64_t, int64_t, float, float*, float*, float*);

template <int D>
FastRange fast_range(int64_t group) {
#ifdef KVBANK_X86
  if constexpr (D == 64 || D == 128 || D == 256) {
    kvbank::Isa variant;
    if (!kvbank::family_variant(kvbank::Family::DenseAttention, &variant) || variant != kvbank::Isa::Avx512Bf16)
      return nullptr;
    switch (group) {
      case 1: return attend_range_bf16<1, D>;
      case 2: return attend_range_bf16<2, D>;
      case 3: return attend_range_bf16<3, D>;
      case 4: return attend_range_bf16<4, D>;
      case 5: return attend_range_bf16<5, D>;
      case 6: return attend_range_bf16<6, D>;
      case 7: return attend_range_bf16<7, D>;
      case 8: return attend_range_bf16<8, D>;
      default: return nullptr;
    }
  }
#endif
  return nullptr;
}

// One decode attention over raw pointers, as Partials work items: the tensor entry point and the
// fused decoder stack (stack.cpp) run the same items and merges, so both give the same bits.
template <typename T, int D>
struct DecodeJob {
  const T *q_p, *k_p, *v_p;
  const int64_t* t_p;
  T* o_p;
  int64_t heads, group, dim, block_size, width;
  float s;
  FastRange fast;
  Partials partials;

  DecodeJob(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lens, T* out, int64_t n_,
            int64_t heads_, int64_t group_, int64_t dim_, int64_t block_size_, int64_t width_, double scale,
            int64_t partition_)
      : q_p(q), k_p(k), v_p(v), t_p(tables), o_p(out), heads(heads_), group(group_), dim(dim_),
        block_size(block_size_), width(width_), s(static_cast<float>(scale)),
        partials(n_, heads_, group_, dim_, lens, partition_) {
    fast = std::is_same_v<T, c10::BFloat16> ? fast_range<D>(group) : nullptr;
  }

  int64_t items() const { return partials.items(); }
  int64_t pairs() const { return partials.pairs(); }

  void item(int64_t item) { this->item(item, k_p, v_p); }

  // An item over other caches of the same shape (another layer's).
  void item(int64_t item, const T* k_p, const T* v_p) {
    int64_t i, h, begin, end;
    if (!partials.span(item, i, h, begin, end)) return;
    const int64_t row = item * group;
    float* acc = partials.acc.get() + row * dim;
    float* maxes = partials.maxes.get() + row;
    float* sums = partials.sums.get() + row;
    const T* q_i = q_p + (i * heads + h) * group * dim;
    if (fast != nullptr) {
      fast(reinterpret_cast<const uint16_t*>(q_i), reinterpret_cast<const uint16_t*>(k_p),
           reinterpret_cast<const uint16_t*>(v_p), t_p + i * width, begin, end, block_size, heads, h, s, acc, maxes,
           sums);
    } else {
      attend_range<T, D>(q_i, k_p, v_p, t_p + i * width, begin, end, block_size, heads, h, group, dim, s, acc, maxes,
                         sums);
    }
  }

  void merge(int64_t pair) { partials.merge(pair, o_p); }
};

template <typename T, int D>
void decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& tables, const torch::Tensor& lens, double scale, int64_t partition,
            torch::Tensor& out, const int64_t* starts) {
  DecodeJob<T, D> job(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables.data_ptr<int64_t>(),
                      lens.data_ptr<int64_t>(), out.data_ptr<T>(), q.size(0), q.size(1), q.size(2), q.size(3),
                      k_cache.size(1), tables.size(1), scale, partition);
  job.partials.starts = starts;
  run_items(job.partials, [&](const int64_t* items, int count) {
    for (int k = 0; k < count; ++k) job.item(items[k]);
  });
  at::parallel_for(0, job.pairs(), 1, [&](int64_t from, int64_t to) {
    for (int64_t pair = from; pair < to; ++pair) job.merge(pair);
  });
}

template <typename T>
void decode_dim(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& tables,
                const torch::Tensor& lens, double scale, int64_t partition, torch::Tensor& out,
                const int64_t* starts = nullptr) {
  switch (q.size(3)) {
    case 64: return decode<T, 64>(q, k, v, tables, lens, scale, partition, out, starts);
    case 128: return decode<T, 128>(q, k, v, tables, lens, scale, partition, out, starts);
    default: return decode<T, 0>(q, k, v, tables, lens, scale, partition, out, starts);
  }
}

DenseJob::DenseJob(const Bf16* q, const Bf16* k, const Bf16* v, const int64_t* tables, const int64_t* lens, Bf16* out,
                   int64_t n, int64_t heads, int64_t group, int64_t dim, int64_t block_size, int64_t width,
                   double scale, int64_t partition)
    : heads_(heads), dim_(dim), block_size_(block_size) {
  kvbank::Isa variant = kvbank::Isa::Scalar;
  kvbank::family_variant(kvbank::Family::DenseAttention, &variant);
  const bool lanes = variant == kvbank::Isa::Avx2 || variant == kvbank::Isa::Avx512;
  if (lanes && (dim == 64 || dim == 128 || dim == 256) && group <= 8) {
    quant_.reset(new QuantJob<Bf16>(q, tables, lens, out, n, heads, group, dim, block_size, width, scale, partition,
                                    variant));
  } else if (dim == 64) {
    d64_.reset(new DecodeJob<Bf16, 64>(q, k, v, tables, lens, out, n, heads, group, dim, block_size, width, scale,
                                       partition));
  } else if (dim == 128) {
    d128_.reset(new DecodeJob<Bf16, 128>(q, k, v, tables, lens, out, n, heads, group, dim, block_size, width, scale,
                                         partition));
  } else if (dim == 256) {
    d256_.reset(new DecodeJob<Bf16, 256>(q, k, v, tables, lens, out, n, heads, group, dim, block_size, width, scale,
                                         partition));
  } else {
    any_.reset(new DecodeJob<Bf16, 0>(q, k, v, tables, lens, out, n, heads, group, dim, block_size, width, scale,
                                      partition));
  }
}

DenseJob::~DenseJob() = default;

template <typename F>
decltype(auto) DenseJob::visit(F&& f) const {
  if (d64_) return f(*d64_);
  if (d128_) return f(*d128_);
  if (d256_) return f(*d256_);
  return f(*any_);
}

const Partials& DenseJob::partials() const {
  return quant_ ? quant_->partials : visit([](auto& job) -> const Partials& { return job.partials; });
}

void DenseJob::set_starts(const int64_t* starts) {
  if (quant_) {
    quant_->partials.starts = starts;
  } else {
    visit([&](auto& job) { job.partials.starts = starts; });
  }
}

int64_t DenseJob::items() const { return quant_ ? quant_->items() : visit([](auto& job) { return job.items(); }); }
int64_t DenseJob::pairs() const { return quant_ ? quant_->pairs() : visit([](auto& job) { return job.pairs(); }); }

void DenseJob::item(int64_t i, const Bf16* k, const Bf16* v) {
  if (quant_) return quant_->item(i, layer(k, v));
  visit([&](auto& job) { job.item(i, k, v); });
}

void DenseJob::run(const int64_t* items, int count, const Bf16* k, const Bf16* v) {
  if (quant_) return quant_->run(items, count, layer(k, v));
  for (int j = 0; j < count; ++j) item(items[j], k, v);
}

void DenseJob::merge(int64_t pair) {
  if (quant_) return quant_->merge(pair);
  visit([&](auto& job) { job.merge(pair); });
}

QuantLayer DenseJob::layer(const Bf16* k, const Bf16* v) const {
  return QuantLayer{kBf16,    reinterpret_cast<const uint8_t*>(k), nullptr, nullptr, nullptr,
                    reinterpret_cast<const uint8_t*>(v), nullptr, nullptr, heads_, dim_, block_size_,
                    2 * dim_, 1,       nullptr,  nullptr, nullptr};
}

namespace {

void dense_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& tables,
                  const torch::Tensor& lens, double scale, int64_t partition, torch::Tensor& out,
                  const int64_t* starts) {
  DenseJob job(q.data_ptr<Bf16>(), k.data_ptr<Bf16>(), v.data_ptr<Bf16>(), tables.data_ptr<int64_t>(),
               lens.data_ptr<int64_t>(), out.data_ptr<Bf16>(), q.size(0), q.size(1), q.size(2), q.size(3), k.size(1),
               tables.size(1), scale, partition);
  job.set_starts(starts);
  const Bf16* k_p = k.data_ptr<Bf16>();
  const Bf16* v_p = v.data_ptr<Bf16>();
  run_items(job.partials(), [&](const int64_t* items, int count) { job.run(items, count, k_p, v_p); });
  at::parallel_for(0, job.pairs(), 1, [&](int64_t from, int64_t to) {
    for (int64_t pair = from; pair < to; ++pair) job.merge(pair);
  });
}

}  // namespace
}  // namespace kvbank

using namespace kvbank;


std::string dense_attention_isa() {
  kvbank::Isa variant = kvbank::Isa::Scalar;
  kvbank::family_variant(kvbank::Family::DenseAttention, &variant);
  return kvbank::isa_name(variant);
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t partition, std::optional<torch::Tensor> starts) {
  TORCH_CHECK(q.dim() == 4, "q must be [batch, kv_heads, group, dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and caches must share a dtype");
  TORCH_CHECK(q.size(1) == k_cache.size(2) && q.size(3) == k_cache.size(3), "q heads/dim do not match the cache");
  TORCH_CHECK(q.size(2) <= kMaxGroup && q.size(3) <= kMaxDim && k_cache.size(1) <= kMaxBlock,
              "group <= ", kMaxGroup, ", head dim <= ", kMaxDim, ", block size <= ", kMaxBlock);
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block tables and lengths must be int64");
  TORCH_CHECK(partition > 0 && partition % k_cache.size(1) == 0, "partition must be a multiple of the block size");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && context_lens.dim() == 1 &&
                  context_lens.size(0) == q.size(0),
              "one block table row and one context length per row of q");
  torch::Tensor first;
  const int64_t* s = row_starts(starts, q.size(0), first);
  check_block_tables(block_tables, context_lens, s, k_cache.size(1), k_cache.size(0));
  auto out = torch::empty_like(q);
  switch (q.scalar_type()) {
    case torch::kFloat: decode_dim<float>(q, k_cache, v_cache, block_tables, context_lens, scale, partition, out, s); break;
    case torch::kBFloat16: dense_decode(q, k_cache, v_cache, block_tables, context_lens, scale, partition, out, s); break;
    case torch::kHalf: decode_dim<c10::Half>(q, k_cache, v_cache, block_tables, context_lens, scale, partition, out, s); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}
