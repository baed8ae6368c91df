// What every decode attention kernel shares: work items (row, KV head, partition of the context)
// over a paged KV cache and their log-sum-exp merge (Partials), the queues that hand the items out
// and the prefetches that stream a sequence's blocks into L2.
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

namespace kvbank {

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
KVBANK_AVX512 inline __m512 transpose_sums16(const __m512* part) {
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
#endif

// Partial results of decode attention split into work items (row, KV head, partition of the
// context) and merged per (row, KV head) by log-sum-exp. The dense and quantized kernels and the
// fused decoder stack (stack.cpp) all use it, so a row's result never depends on the batch.
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
        const float w = w1::exp_neg(maxes[row] - best);
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

}  // namespace kvbank
