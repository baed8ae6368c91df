// The integer matmuls' dispatch and scalar reference (matmul.h); the vector kernels are in
// matmul_avx2.cpp and matmul_vnni.cpp.
#include "matmul.h"

#include <algorithm>
#include <cmath>

namespace kvbank {

Isa best_isa() {
  Isa variant = Isa::Scalar;
  family_variant(Family::Matmul, &variant);
  return variant;
}

void QuantRows::quantize_row(int64_t r, const float* x) {
#ifdef KVBANK_X86
  if (vnni(best_isa())) {
    quantize_row_avx512(r, x);
  } else if (best_isa() == Isa::Avx2) {
    quantize_row_avx2(r, x);
  } else {
    quantize_row_scalar(r, x);
  }
#else
  quantize_row_scalar(r, x);
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* qb = q.data() + r * cols + b * QK;
    int32_t low = 0;
    for (int64_t k = 0; k < QK / 2; ++k) low += qb[k];
    sum_lo[r * blocks + b] = low;
  }
}

void QuantRows::quantize_row_scalar(int64_t r, const float* x) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.0f;
    for (int64_t k = 0; k < QK; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float scale = amax / 127.0f;
    const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    int8_t* qb = q.data() + r * cols + b * QK;
    int32_t total = 0;
    for (int64_t k = 0; k < QK; ++k) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[k] * inv));
      qb[k] = static_cast<int8_t>(v);
      total += v;
    }
    d[r * blocks + b] = scale;
    sum[r * blocks + b] = total;
    s[r * blocks + b] = scale * static_cast<float>(total);
  }
}

namespace {

// --- one group of 16 output rows for `tile` activation rows: out[i * 16 + lane] ------------------

// A record's scale or minimum of `lane` at `offset`: float32 (F32) or fp16.
template <bool F32>
inline float record_value(const uint8_t* rec, int64_t offset, int64_t lane) {
  if (F32) {
    float v;
    std::memcpy(&v, rec + offset + 4 * lane, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, rec + offset + 2 * lane, 2);
  return half_to_float(h);
}

// The stored integer of `lane`'s input k (0..31) in a record: a nibble (k < 16 the low one of chunk
// k / 4, else the high one of chunk (k - 16) / 4) with its fifth bit, or a byte of chunk k / 4.
template <Rec K>
inline int32_t stored_weight(const uint8_t* rec, int64_t lane, int64_t k) {
  using T = Record<K>;
  const int64_t at = lane * 4 + k % 4;
  if (!T::nibbles) return rec[k / 4 * 64 + at];
  const int64_t half = k / 16, chunk = k % 16 / 4;
  const uint8_t byte = rec[chunk * 64 + at];
  int32_t q = half ? byte >> 4 : byte & 15;
  if (T::fifth) q |= static_cast<int32_t>((load_u64(rec + 256 + 32 * half + 8 * chunk) >> at) & 1) << 4;
  return q;
}

// Per row, lane and block the first and last 16 inputs' exact integer dot products, less the record's
// offset times the activations' sums; scaled together (Q8H: apart, low half first), then the
// minimum's term from the activation block sums.
template <Rec K>
void group_scalar(const uint8_t* w, const QuantRows& a, int64_t r0, int64_t tile, float* out) {
  using T = Record<K>;
  for (int64_t i = 0; i < tile; ++i) {
    for (int64_t lane = 0; lane < GROUP_ROWS; ++lane) {
      float acc = 0.0f;
      for (int64_t b = 0; b < a.blocks; ++b) {
        const uint8_t* rec = w + b * T::bytes;
        const int8_t* qa = a.q.data() + (r0 + i) * a.cols + b * QK;
        int32_t dot[2] = {0, 0};
        for (int64_t k = 0; k < QK; ++k) dot[k / 16] += stored_weight<K>(rec, lane, k) * qa[k];
        const int64_t ab = (r0 + i) * a.blocks + b;
        dot[0] -= T::offset * a.sum_lo[ab];
        dot[1] -= T::offset * (a.sum[ab] - a.sum_lo[ab]);
        const float d_lo = record_value<T::f32>(rec, T::scale_at, lane) * a.d[ab];
        if (T::halves) {
          acc = std::fma(static_cast<float>(dot[0]), d_lo, acc);
          acc = std::fma(static_cast<float>(dot[1]), record_value<true>(rec, T::scale_hi_at, lane) * a.d[ab], acc);
        } else {
          acc = std::fma(static_cast<float>(dot[0] + dot[1]), d_lo, acc);
        }
        if (T::minimum) acc = std::fma(record_value<T::f32>(rec, T::min_at, lane), a.s[ab], acc);
      }
      out[i * GROUP_ROWS + lane] = acc;
    }
  }
}

void group_kernel(Rec kind, Isa isa, const uint8_t* w, const QuantRows& a, int64_t r0, int64_t tile, float* out) {
#ifdef KVBANK_X86
  if (vnni(isa)) return vnni_group(kind, tile, w, a, r0, out);
  if (isa == Isa::Avx2) return avx2_group(kind, tile, w, a, r0, out);
#endif
  with_kind(kind, [&](auto k) { group_scalar<decltype(k)::value>(w, a, r0, tile, out); });
}

// Groups [begin, end) of out[r, n] (float32, row stride `out_stride`) = the quantized rows of `a`
// times the packed weights.
void qmatmul_groups(Rec kind, Isa isa, const uint8_t* weights, int64_t begin, int64_t end, const QuantRows& a,
                    float* out, int64_t out_stride) {
  const int64_t group_bytes = a.blocks * record_bytes(kind);
  alignas(64) float tile_out[ROW_TILE * GROUP_ROWS];
  int64_t first = 0;  // the rows the kernels below start at
#ifdef KVBANK_HAS_AMX
  if (isa == Isa::Amx && amx_kind(kind) && a.rows >= AMX_ROWS) {
    first = a.rows / AMX_ROWS * AMX_ROWS;
    amx_dispatch(kind, weights, begin, end, a, first, out, out_stride);
    if (first == a.rows) return;
  }
#endif
#ifdef KVBANK_X86
  if (vnni(isa) && (kind == Rec::Q4 || kind == Rec::Q4F || kind == Rec::Q8)) {
    // on VNNI: groups two at a time (pair_avx512), the odd one below
    alignas(64) float pair_out[2][ROW_TILE * GROUP_ROWS];
    for (; begin + 1 < end; begin += 2) {
      const uint8_t* w = weights + begin * group_bytes;
      for (int64_t r0 = first; r0 < a.rows; r0 += ROW_TILE) {
        const int64_t tile = std::min(ROW_TILE, a.rows - r0);
        vnni_pair(kind, tile, w, w + group_bytes, a, r0, pair_out[0], pair_out[1]);
        for (int64_t i = 0; i < tile; ++i) {
          for (int h = 0; h < 2; ++h)
            std::memcpy(out + (r0 + i) * out_stride + (begin + h) * GROUP_ROWS, pair_out[h] + i * GROUP_ROWS,
                        GROUP_ROWS * sizeof(float));
        }
      }
    }
  }
#endif
  for (int64_t g = begin; g < end; ++g) {
    const uint8_t* w = weights + g * group_bytes;
    for (int64_t r0 = first; r0 < a.rows; r0 += ROW_TILE) {
      const int64_t tile = std::min(ROW_TILE, a.rows - r0);
      group_kernel(kind, isa, w, a, r0, tile, tile_out);
      for (int64_t i = 0; i < tile; ++i) {
        std::memcpy(out + (r0 + i) * out_stride + g * GROUP_ROWS, tile_out + i * GROUP_ROWS,
                    GROUP_ROWS * sizeof(float));
      }
    }
  }
}

}  // namespace

// The matmul variant called `name` (auto: the active one); refused above the active level.
Isa parse_isa(const std::string& name) {
  if (name == "auto") return best_isa();
  const std::vector<Isa>& variants = family_info(Family::Matmul).variants;
  Isa wanted = Isa::Scalar;
  if (!kvbank::isa_from_name(name, &wanted) || std::find(variants.begin(), variants.end(), wanted) == variants.end()) {
    std::string names = "auto";
    for (auto v = variants.rbegin(); v != variants.rend(); ++v) names += std::string(", ") + kvbank::isa_name(*v);
    TORCH_CHECK(false, "isa must be one of ", names, "; not ", name);
  }
  TORCH_CHECK(static_cast<int>(wanted) <= static_cast<int>(best_isa()), "this CPU (capped at ",
              kvbank::isa_name(kvbank::active_isa()), ") cannot run the ", name, " path");
  return wanted;
}

PackedWeight check_weight(const torch::Tensor& w, int64_t kind) {
  TORCH_CHECK(kind == 4 || kind == 5 || kind == 8 || kind == 41 || kind == 51 || kind == 81,
              "kind must be 4 (Q4 records), 5 (Q5), 8 (Q8), 41 (Q4 with float32 scales), 51 (Q5 with float32 "
              "scales) or 81 (Q8 with float32 half-block scales), not ",
              kind);
  const Rec rec = static_cast<Rec>(kind);
  const int64_t record = record_bytes(rec);
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(2) == record,
              "packed weights must be contiguous uint8 [groups, blocks, ", record, "], got ", w.sizes());
  return {w.data_ptr<uint8_t>(), w.size(0), w.size(1), w.size(0) * GROUP_ROWS, w.size(1) * QK, rec,
          {{w.data_ptr<uint8_t>(), w.size(0), rec}}};
}

PackedWeight check_weights(const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& kinds) {
  TORCH_CHECK(!ws.empty() && ws.size() == kinds.size(), "a projection takes one kind per records tensor, got ",
              ws.size(), " tensors and ", kinds.size(), " kinds");
  PackedWeight whole = check_weight(ws[0], kinds[0]);
  for (size_t i = 1; i < ws.size(); ++i) {
    const PackedWeight part = check_weight(ws[i], kinds[i]);
    TORCH_CHECK(part.in_features == whole.in_features, "records ", i, " take ", part.in_features, " inputs, not ",
                whole.in_features);
    whole.groups += part.groups;
    whole.out_features += part.out_features;
    whole.segments.push_back(part.segments[0]);
  }
  return whole;
}

// Groups [g0, g1) of a projection (counted over its segments), into out's columns.
void qmatmul_span(const PackedWeight& w, Isa isa, int64_t g0, int64_t g1, const QuantRows& a, float* out,
                  int64_t out_stride) {
  int64_t base = 0;
  for (const Segment& seg : w.segments) {
    const int64_t lo = std::max(g0, base), hi = std::min(g1, base + seg.groups);
    if (lo < hi) qmatmul_groups(seg.kind, isa, seg.data, lo - base, hi - base, a, out + base * GROUP_ROWS, out_stride);
    base += seg.groups;
  }
}

void qmatmul_rows(const PackedWeight& w, Isa isa, const QuantRows& a, float* out, int64_t out_stride) {
  at::parallel_for(0, w.groups, 1,
                   [&](int64_t begin, int64_t end) { qmatmul_span(w, isa, begin, end, a, out, out_stride); });
}

}  // namespace kvbank
