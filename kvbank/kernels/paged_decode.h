// Decode attention straight from the paged KV cache: one query token per sequence, grouped-query
// heads, the context read block by block through the block table (no gathered copy), in float32
// with an online softmax. Long contexts are split into partitions merged by log-sum-exp, so that
// a few sequences still keep every core busy.
#pragma once

#include "native.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

namespace {

constexpr int kMaxGroup = 16;
constexpr int kMaxDim = 256;
constexpr int kMaxBlock = 64;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float load(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }

// e^x for x <= 0 (e^-inf = 0) in plain arithmetic, so loops over it vectorize.
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;  // x / ln 2
  const float n = std::floor(t);
  const float f = (t - n) * 0.69314718055994531f;  // in [0, ln 2)
  float p = 1.0f / 5040;
  p = p * f + 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef KVBANK_X86

// Tokens ahead of the one being read whose K and V rows a kernel asks memory for. Each row's
// blocks lie anywhere in memory, so the hardware prefetchers cannot follow them; a long context
// streams from DRAM (every decode step reads all of it), and a block asked for only one block
// ahead, into L1, arrives late: L1 has few outstanding misses, and prefetches beyond them stall
// the loop. Asking for the block ~48 tokens ahead into L2 keeps enough of them in flight
// (measured on Zen 4 at 1,024 tokens, 64 sequences: 1.6x the attention's speed out of cache, the
// same within it).
constexpr int64_t kPrefetchTokens = 48;

// One line into L2. An asm statement, not _mm_prefetch: GCC takes a function whose only effect
// is __builtin_prefetch for one without effects, and drops calls to it once inlined.
inline void prefetch_l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

// Asks for the L2 lines of the KV head at `offset` bytes into each token row (`row_bytes` long,
// rows `token_bytes` apart) of the block `kPrefetchTokens` tokens past the block of `start` (and,
// at a range's first block, of every block up to it), for their tokens before `end`.
inline void prefetch_ahead(const void* k, const void* v, const int64_t* table, int64_t block_size, int64_t begin,
                           int64_t start, int64_t end, int64_t token_bytes, int64_t offset, int64_t row_bytes) {
  const int64_t ahead = std::max<int64_t>(1, kPrefetchTokens / block_size);
  for (int64_t j = start == begin ? 1 : ahead; j <= ahead; ++j) {
    const int64_t first = (start / block_size + j) * block_size;
    if (first >= end) return;
    const int64_t count = std::min(end - first, block_size);
    const int64_t at = table[first / block_size] * block_size * token_bytes + offset;
    for (int64_t t = 0; t < count; ++t) {
      for (int64_t c = 0; c < row_bytes; c += 64) {
        prefetch_l2(static_cast<const char*>(k) + at + t * token_bytes + c);
        prefetch_l2(static_cast<const char*>(v) + at + t * token_bytes + c);
      }
    }
  }
}

// Lane t of the result: the sum of the lanes of the vector of token t, for 16 tokens (the dense
// and quantized attention kernels' scores). The tree
// leaves token 4i + k in lane 4k + i, so the inputs go in that (self-inverse) order.
__attribute__((target("avx512f"))) inline __m512 transpose_sums16(const __m512* part) {
  __m512 t[8], u[4], s[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = part[4 * ((2 * i) % 4) + (2 * i) / 4], b = part[4 * ((2 * i + 1) % 4) + (2 * i + 1) / 4];
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int j = 0; j < 4; ++j)
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0xDD));
  for (int m = 0; m < 2; ++m)
    s[m] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * m], u[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * m], u[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// bfloat16 q and cache, G query heads per KV head, head dim D (a multiple of 32): q.k by
// bfloat16 pair dot products into float32, 16 tokens' sums by one transpose tree, softmax and the
// value sum in float32 registers.
template <int G, int D>
KVBANK_AVX512 void attend_range_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
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
    const int64_t block = table[start / block_size];
    const int64_t first = start % block_size;
    const int count = static_cast<int>(std::min(end - start, block_size - first));
    const int64_t base = (block * block_size + first) * token_stride + head * D;
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
        const __m512 correction = exp_neg_v(_mm512_set1_ps(m[g] - best));
        for (int v = 0; v < V; ++v) acc[g][v] = _mm512_mul_ps(acc[g][v], correction);
        l[g] *= _mm512_cvtss_f32(correction);
        m[g] = best;
      }
      const __m512 top = _mm512_set1_ps(best);
      __m512 total = _mm512_setzero_ps();
      for (int j = 0; j < count; j += 16) {
        const __mmask16 lanes = count - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - j)) - 1);
        const __m512 p = _mm512_maskz_mov_ps(lanes, exp_neg_v(_mm512_sub_ps(_mm512_loadu_ps(scores[g] + j), top)));
        _mm512_storeu_ps(scores[g] + j, p);
        total = _mm512_add_ps(total, p);
      }
      l[g] += _mm512_reduce_add_ps(total);
    }
    for (int t = 0; t < count; ++t) {
      const uint16_t* vp = v_cache + base + t * token_stride;
      __m512 vv[V];
      for (int v = 0; v < V; ++v) vv[v] = bf16_to_f32(vp + v * 16);
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
    const int64_t block = table[start / block_size];
    const int64_t first = start % block_size;
    const int64_t count = std::min(end - start, block_size - first);
    const int64_t base = (block * block_size + first) * token_stride + head * dim;
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
        const float correction = exp_neg(m[g] - best);
        l[g] *= correction;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] *= correction;
        m[g] = best;
      }
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t t = 0; t < count; ++t) {
        const float p = exp_neg(scores[g][t] - best);
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

// Partial results of decode attention split into work items (row, KV head, partition of the
// context) and merged per (row, KV head) by log-sum-exp. The dense and quantized kernels and the
// fused decoder stack (qmatmul.cpp) all use it, so a row's result never depends on the batch.
struct Partials {
  int64_t n, heads, group, dim, partition, parts;
  const int64_t* lens;
  // Where each row's keys begin (a sliding window: the row reads positions starts[i] .. lens[i]
  // - 1), or null for position 0. Partitions stay at absolute positions, so a row's items and
  // their arithmetic depend on its own window alone.
  const int64_t* starts = nullptr;
  std::unique_ptr<float[]> acc, maxes, sums;

  Partials(int64_t n_, int64_t heads_, int64_t group_, int64_t dim_, const int64_t* lens_, int64_t partition_)
      : n(n_), heads(heads_), group(group_), dim(dim_), partition(partition_), lens(lens_) {
    int64_t longest = 0;
    for (int64_t i = 0; i < n; ++i) longest = std::max(longest, lens[i]);
    parts = std::max<int64_t>(1, (longest + partition - 1) / partition);
    // Partial results: [n, heads, parts, group, dim] and [n, heads, parts, group] (max, sum).
    // Left uninitialized: every item writes its max and sum, and the merge reads only the partial
    // sums of non-empty items. A prefill's rows bring many items, so zeroing would cost a pass.
    const int64_t rows = n * heads * parts * group;
    acc.reset(new float[rows * dim]);
    maxes.reset(new float[rows]);
    sums.reset(new float[rows]);
  }

  int64_t items() const { return n * heads * parts; }
  int64_t pairs() const { return n * heads; }

  // The item at position k of the schedule. Items of one KV head and partition are adjacent, row
  // after row: a prefill's rows are consecutive rows of one sequence, so a thread running a run of
  // them reads the same partition of the cache (64 KiB for 256 bfloat16 tokens of a 64-wide head)
  // from its own cache level instead of from memory, once per row. Only the order changes: each
  // item's arithmetic, and so every row's result, is the same in any schedule.
  int64_t scheduled(int64_t k) const { return (k % n) * heads * parts + k / n; }

  // The row, KV head and token range of `item`; false (and an empty result) when the range is empty.
  bool span(int64_t item, int64_t& i, int64_t& h, int64_t& begin, int64_t& end) {
    i = item / (heads * parts);
    h = item / parts % heads;
    const int64_t part = item % parts;
    begin = part * partition;
    end = std::min(lens[i], begin + partition);
    if (starts != nullptr) begin = std::max(begin, starts[i]);
    if (begin < end) return true;
    for (int64_t g = 0; g < group; ++g) {
      maxes[item * group + g] = -std::numeric_limits<float>::infinity();
      sums[item * group + g] = 0.0f;
    }
    return false;
  }

  template <typename T>
  void merge(int64_t pair, T* out) {
    for (int64_t g = 0; g < group; ++g) {
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t part = 0; part < parts; ++part) best = std::max(best, maxes[(pair * parts + part) * group + g]);
      float total = 0.0f;
      float merged[kMaxDim] = {};
      for (int64_t part = 0; part < parts; ++part) {
        const int64_t row = (pair * parts + part) * group + g;
        if (sums[row] == 0.0f) continue;
        const float w = exp_neg(maxes[row] - best);
        total += w * sums[row];
        const float* a = acc.get() + row * dim;
        for (int64_t d = 0; d < dim; ++d) merged[d] += w * a[d];
      }
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
      T* o = out + (pair * group + g) * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(merged[d] * inv);
    }
  }
};

// Hands out [from, to) ranges of [0, count), `length` positions at a time, to whichever thread
// asks next (each thread of a region calls drain once; one object per pass over the positions).
class OnDemand {
 public:
  template <typename F>
  void drain(int64_t count, int64_t length, F&& run) {
    for (int64_t from = next_.fetch_add(length, std::memory_order_relaxed); from < count;
         from = next_.fetch_add(length, std::memory_order_relaxed))
      run(from, std::min(count, from + length));
  }

 private:
  std::atomic<int64_t> next_{0};
};

// Hands out positions of a Partials schedule in runs to whichever thread asks next. Rows of a
// prefill differ in length (the causal mask), so equal shares of the items are unequal work; runs
// taken on demand keep every thread busy to the end. Which thread runs an item never changes it.
class ItemQueue {
 public:
  // Calls run(items, count) for runs of items of `partials`, on the calling thread (one of
  // `threads` draining the queue), until none are left. A run is up to 8 consecutive positions,
  // fewer when there are few items, so that a decode step's handful still spreads over every
  // thread; consecutive positions are consecutive rows of one KV head and partition
  // (Partials::scheduled), which a kernel may attend together.
  template <typename F>
  void drain(const Partials& partials, int threads, F&& run) {
    const int64_t count = partials.items();
    const int64_t length = std::max<int64_t>(1, std::min<int64_t>(kRun, count / (4 * std::max(threads, 1))));
    int64_t items[kRun];
    ranges_.drain(count, length, [&](int64_t from, int64_t to) {
      for (int64_t k = from; k < to; ++k) items[k - from] = partials.scheduled(k);
      run(items, static_cast<int>(to - from));
    });
  }

  static constexpr int64_t kRun = 8;

 private:
  OnDemand ranges_;
};

// Every item of `partials` through run(items, count), in runs (ItemQueue::drain), on the
// kernels' threads.
template <typename F>
void run_items(const Partials& partials, F&& run) {
  ItemQueue queue;
  const int threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { queue.drain(partials, threads, run); });
}

// One decode attention over raw pointers, as Partials work items: the tensor entry point and the
// fused decoder stack (qmatmul.cpp) run the same items and merges, so both give the same bits.
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

}  // namespace
