// The decoder stack run for a whole step in one call: every layer's fused ops, cache writes and
// row-wise attention inside one parallel region (stack.h).
#include "stack.h"

#include "cache_write.h"
#include "dense_attention.h"
#include "fused.h"
#include "matmul.h"
#include "quant_attention.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

using namespace kvbank;

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
torch::Tensor QuantStack::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const StackStep& step) {
  TORCH_CHECK(step.slot_mapping.defined() && step.block_tables.defined() && step.context_lens.defined() &&
                  step.scale > 0.0 && step.partition > 0,
              "a stack step needs its slot mapping, block tables, context lengths, scale and partition");
  // The step's fields by the names the body uses; the tables and lengths it makes contiguous are copies.
  const std::vector<torch::Tensor>&k_caches = step.k_caches, &v_caches = step.v_caches, &k_scales = step.k_scales,
                                  &v_scales = step.v_scales, &k_grids = step.k_grids, &v_zeros = step.v_zeros,
                                  &residual_ks = step.residual_ks, &residual_vs = step.residual_vs,
                                  &group_slots = step.group_slots, &group_starts = step.group_starts;
  std::vector<torch::Tensor> group_tables = step.group_tables, group_lens = step.group_lens;
  const torch::Tensor& slot_mapping = step.slot_mapping;
  torch::Tensor block_tables = step.block_tables, context_lens = step.context_lens;
  const std::optional<torch::Tensor>&kivi_plan = step.kivi_plan, &scratch_slots = step.scratch_slots,
                                    &own_rows = step.own_rows, &starts = step.starts, &cos_local = step.cos_local,
                                    &sin_local = step.sin_local;
  const std::vector<int64_t>&local_layers = step.local_layers, &layer_groups = step.layer_groups;
  const double scale = step.scale;
  const int64_t partition = step.partition, format = step.format;
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
  // (cache_write.cpp), quantized as they are written and attended in place; 4 int4, 5 int2: KIVI
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
      int64_t d = KVBANK_WIDE16(
          wide, sum_bf16_avx512(h.data() + r * hidden, add ? add + r * hidden : nullptr, values.data(), hidden));
      for (; d < hidden; ++d) {
        values[d] = add ? round_as<T>(widen(h[r * hidden + d]) + widen(add[r * hidden + d])) : widen(h[r * hidden + d]);
      }
      float squares = 0.0f;
      for (d = 0; d < hidden; ++d) squares += values[d] * values[d];  // in order: one chain, as every path sums
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + static_cast<float>(eps_));
      for (d = KVBANK_WIDE16(wide, scale_bf16_avx512(values.data(), inv, weight, hidden)); d < hidden; ++d)
        values[d] = values[d] * inv * widen(weight[d]);
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
    // The output and down projections: hidden values into h, then (Gemma) its norm after them.
    auto project_to_hidden = [&](GroupChunks& chunks, const PackedWeight& weight, const QuantRows& a,
                                 const T* norm) {
      chunks.drain(weight.groups, nt, [&](int64_t g0, int64_t g1) {
        qmatmul_span(weight, isa, g0, g1, a, acc.data(), hidden);
      });
      barrier();
      for (int64_t r = row_begin; r < row_end; ++r) {
        store_values(acc.data() + r * hidden, h.data() + r * hidden, hidden, wide);
        if (gemma_) norm_in_place(r, norm);
      }
      barrier();
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
      project_to_hidden(matmuls[4 * l + 1], wo, a2, norm_after_attn);
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
      project_to_hidden(matmuls[4 * l + 3], wdown, a4, norm_after_mlp);
    }
  }
  // The stack's output: the last layer's output added to the residual stream.
  T* o = out.data_ptr<T>();
  for (int64_t i = 0; i < rows * hidden; ++i) o[i] = narrow_to(widen(h[i]) + widen(residual[i]), static_cast<T*>(nullptr));
  return out;
}
