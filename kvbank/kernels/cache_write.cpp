// Cache writes at a step's slots (cache_write.h): the scalar reference and the 8-lane versions of
// the per-token and KIVI quantizers, the KIVI write phases, and their torch operators.
#include "cache_write.h"

#include "quant_kernels.h"

#include <ATen/Parallel.h>

namespace kvbank {


// One head of one token quantized per token (int8, fp8): a float16 scale of amax / top (never
// zero, rounded up when rounding to nearest went down, so no code clips), codes x / scale rounded
// to nearest even (int8) or converted to fp8 as PyTorch does (round to nearest even, subnormals).
template <typename T>
void quantize_head_scalar(int64_t format, const T* x, int64_t dim, uint8_t* codes, uint16_t* scale_out) {
  const float top = format == kInt8 ? 127.0f : format == kFp8E4M3 ? 448.0f : 57344.0f;
  float peak = 0.0f;
  for (int64_t c = 0; c < dim; ++c) peak = std::max(peak, std::fabs(load(x, c)));
  const float wanted = std::max(peak / top, kTinyScale);
  uint16_t h = c10::Half(wanted).x;
  if (half_value(h) < wanted) ++h;  // the next float16 up (wanted is positive)
  *scale_out = h;
  const float exact = half_value(h);
  for (int64_t c = 0; c < dim; ++c) {
    const float y = std::min(std::max(load(x, c) / exact, -top), top);
    if (format == kInt8) {
      codes[c] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
    } else if (format == kFp8E4M3) {
      codes[c] = c10::Float8_e4m3fn(y).x;
    } else {
      codes[c] = c10::Float8_e5m2(y).x;
    }
  }
}

// The KIVI key grid of a block's head from each channel's smallest (lo) and largest (hi) key: the
// grid (top scale, first minimum, minimum step), and per channel its range byte, grid minimum (low)
// and grid scale, the largest grid minimum at or below its smallest key and the smallest grid scale
// that spans its keys from there. hi is left holding each channel's width from its minimum.
inline void kivi_key_grid(float top_code, const float* lo, float* hi, int64_t dim, float* low, float* scale,
                          uint8_t* ranges, uint16_t* grid) {
  const float lo_min = *std::min_element(lo, lo + dim), lo_max = *std::max_element(lo, lo + dim);
  const uint16_t start16 = half_toward(lo_min, false);
  const float start = half_value(start16);
  const uint16_t step16 = half_toward((lo_max - start) / 15.0f, true);
  float scales[16], mins[16];
  kivi_key_grids(0.0f, start, half_value(step16), scales, mins);
  uint8_t min_index[128];
  float widest = 0.0f;
  for (int64_t c = 0; c < dim; ++c) {
    int i = 0;
    for (int j = 1; j < 16; ++j) i += mins[j] <= lo[c];  // the grid ascends
    min_index[c] = static_cast<uint8_t>(i);
    low[c] = mins[i];
    hi[c] -= low[c];  // the channel's width from its minimum
    widest = std::max(widest, hi[c]);
  }
  const uint16_t top16 = half_toward(std::max(widest / top_code, kTinyScale), true);
  kivi_key_grids(half_value(top16), start, half_value(step16), scales, mins);
  for (int64_t c = 0; c < dim; ++c) {
    int i = 0;
    for (int j = 1; j < 16; ++j) i += scales[j] * top_code >= hi[c];  // the grid descends
    scale[c] = scales[i];
    ranges[c] = static_cast<uint8_t>(i | (min_index[c] << 4));
  }
  grid[0] = top16;
  grid[1] = start16;
  grid[2] = step16;
}

// A KIVI block's keys of one head (KiviKeys.quantize): x is token 0's row, `stride` apart per
// token. The grid from each channel's smallest and largest key (kivi_key_grid); codes
// (x - minimum) / scale rounded to nearest even and clamped.
template <typename T>
void kivi_keys_scalar(int bits, const T* x, int64_t tokens, int64_t stride, int64_t dim, uint8_t* codes,
                      int64_t code_stride, uint8_t* ranges, uint16_t* grid) {
  uint8_t q[128];
  float lo[128], hi[128], low[128], scale[128];
  const float top_code = static_cast<float>((1 << bits) - 1);
  for (int64_t c = 0; c < dim; ++c) {
    lo[c] = std::numeric_limits<float>::infinity();
    hi[c] = -lo[c];
    for (int64_t t = 0; t < tokens; ++t) {
      lo[c] = std::min(lo[c], load(x, t * stride + c));
      hi[c] = std::max(hi[c], load(x, t * stride + c));
    }
  }
  kivi_key_grid(top_code, lo, hi, dim, low, scale, ranges, grid);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < dim; ++c) {
      const float y = std::nearbyint((load(x, t * stride + c) - low[c]) / scale[c]);
      q[c] = static_cast<uint8_t>(std::min(std::max(y, 0.0f), top_code));
    }
    pack_planar(bits, q, dim, codes + t * code_stride);
  }
}

// One head of one token's values (KiviValues.quantize): per group of channels a float16 scale
// (the group's width / top, at least |minimum| / 127, rounded up) and an int8 zero point
// (minimum / scale, rounded); codes x / scale - zero, rounded and clamped.
template <typename T>
void kivi_values_scalar(int bits, const T* x, int64_t dim, int64_t group, uint8_t* codes, uint16_t* scale,
                        int8_t* zero) {
  uint8_t q[128];
  const float top = static_cast<float>((1 << bits) - 1);
  for (int64_t g = 0; g * group < dim; ++g) {
    float lo = load(x, g * group), hi = lo;
    for (int64_t c = 1; c < group; ++c) {
      lo = std::min(lo, load(x, g * group + c));
      hi = std::max(hi, load(x, g * group + c));
    }
    const float want = std::max(std::max((hi - lo) / top, std::fabs(lo) / 127.0f), kTinyScale);
    const uint16_t s16 = half_toward(want, true);
    const float sf = half_value(s16);
    const float z = std::min(std::max(std::nearbyint(lo / sf), -128.0f), 127.0f);
    scale[g] = s16;
    zero[g] = static_cast<int8_t>(z);
    for (int64_t c = 0; c < group; ++c) {
      const float y = std::nearbyint(load(x, g * group + c) / sf - z);
      q[g * group + c] = static_cast<uint8_t>(std::min(std::max(y, 0.0f), top));
    }
  }
  pack_planar(bits, q, dim, codes);
}


#ifdef KVBANK_X86
// --- The write side: per-token quantization at the step's slots (int8, fp8 e4m3 / e5m2). ---
// Bit for bit PerTokenInt8 / PerTokenFP8.quantize: the float16 scale of amax / top (never zero,
// rounded up when rounding to nearest went down, so no code clips), codes x / scale rounded to
// nearest even (int8) or converted to fp8 by round to nearest even with fp8's subnormals, as
// PyTorch's float -> float8 conversion does.

// 8 int32 lanes (each a byte's value) stored as 8 bytes.
template <bool Signed>
KVBANK_AVX2 inline void store_bytes8(__m256i v, uint8_t* out) {
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
KVBANK_AVX2 inline __m256i f32_to_fp8(__m256 y) {
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
KVBANK_AVX2 void quantize_head8(int64_t format, const T* x, int64_t dim, uint8_t* codes, uint16_t* scale_out) {
  const float top = format == kInt8 ? 127.0f : format == kFp8E4M3 ? 448.0f : 57344.0f;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 peak = _mm256_setzero_ps();
  for (int64_t c = 0; c < dim; c += 8) peak = _mm256_max_ps(peak, _mm256_and_ps(w8::load_f32(x + c), magnitude));
  float wanted = w8::hmax(peak) / top;
  if (wanted < 0x1p-24f) wanted = 0x1p-24f;
  uint16_t h = _cvtss_sh(wanted, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if (_cvtsh_ss(h) < wanted) ++h;  // the next float16 up (wanted is positive)
  *scale_out = h;
  const __m256 exact = _mm256_set1_ps(_cvtsh_ss(h));
  const __m256 hi = _mm256_set1_ps(top), lo = _mm256_set1_ps(-top);
  for (int64_t c = 0; c < dim; c += 8) {
    const __m256 y = _mm256_div_ps(w8::load_f32(x + c), exact);
    if (format == kInt8) {
      const __m256 r = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      store_bytes8<true>(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi)), codes + c);
    } else {
      const __m256 clamped = _mm256_min_ps(_mm256_max_ps(y, lo), hi);
      store_bytes8<false>(format == kFp8E4M3 ? f32_to_fp8<true>(clamped) : f32_to_fp8<false>(clamped), codes + c);
    }
  }
}

// One head of one token into its codes and scale, in the quant_write family's variant.
template <typename T>
void quantize_head(int64_t format, const T* x, int64_t dim, uint8_t* codes, uint16_t* scale_out) {
  if (scalar_writes()) return quantize_head_scalar(format, x, dim, codes, scale_out);
  quantize_head8(format, x, dim, codes, scale_out);
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

// --- The KIVI write side (int4, int2): a block is quantized whole, when it fills. ---
// Every block that receives tokens in a step gets a scratch row [block_size, heads, dim] in the
// model's dtype. Per row the plan holds (block id, residual slot or -1, tokens the block held
// before the step, tokens it holds after): the held tokens come from the residual slot, the
// step's tokens go to their scratch slots, then a block that is now full is quantized into the
// pool and any other row's new tokens go back to its residual slot. KiviLayer.write
// (kvbank/cache/layers/kivi.py) runs these three phases through kivi_write, the fused stack
// (stack.cpp) inside its layer loop; the scratch rows are what attention reads a row's own
// block from, so the stack finishes a row after attention unless a later row reads its block
// from the pool (kPlanEarly). Quantization is bit for bit KiviKeys / KiviValues.quantize (kvbank/cache/quant.py):
// the same float32 operations in the same order, float16 roundings toward the side that keeps
// every value inside its range, codes rounded to nearest even and clamped, packed planar.

// 8 codes (x - low) / scale, rounded and clamped to [0, top], as bytes.
KVBANK_AVX2 inline void kivi_codes8(__m256 x, __m256 low, __m256 scale, __m256 top, uint8_t* out) {
  const __m256 y = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(x, low), scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  store_bytes8<false>(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, _mm256_setzero_ps()), top)), out);
}

// Keys of one head of a block, as kivi_keys_scalar: x is token 0's row of the head, `stride` apart
// per token (KiviKeys.quantize).
template <typename T>
KVBANK_AVX2 void kivi_keys8(int bits, const T* x, int64_t tokens, int64_t stride, int64_t dim, uint8_t* codes,
                                int64_t code_stride, uint8_t* ranges, uint16_t* grid) {
  alignas(32) uint8_t q[64][128];
  alignas(32) float lo[128], hi[128], low[128], scale[128];
  const float top_code = static_cast<float>((1 << bits) - 1);
  for (int64_t c = 0; c < dim; c += 8) {
    __m256 l = _mm256_set1_ps(std::numeric_limits<float>::infinity()), h = _mm256_sub_ps(_mm256_setzero_ps(), l);
    for (int64_t t = 0; t < tokens; ++t) {
      const __m256 v = w8::load_f32(x + t * stride + c);
      l = _mm256_min_ps(l, v);
      h = _mm256_max_ps(h, v);
    }
    _mm256_store_ps(lo + c, l);
    _mm256_store_ps(hi + c, h);
  }
  kivi_key_grid(top_code, lo, hi, dim, low, scale, ranges, grid);
  const __m256 top = _mm256_set1_ps(top_code);
  for (int64_t c = 0; c < dim; c += 8)
    for (int64_t t = 0; t < tokens; ++t)
      kivi_codes8(w8::load_f32(x + t * stride + c), _mm256_load_ps(low + c), _mm256_load_ps(scale + c), top, q[t] + c);
  for (int64_t t = 0; t < tokens; ++t) pack_planar(bits, q[t], dim, codes + t * code_stride);
}

// Values of one head of one token: per group of `group` channels a float16 scale (the group's
// width / top, at least |minimum| / 127, rounded up) and an int8 zero point (minimum / scale,
// rounded); codes x / scale - zero, rounded and clamped (KiviValues.quantize).
template <typename T>
KVBANK_AVX2 void kivi_values8(int bits, const T* x, int64_t dim, int64_t group, uint8_t* codes, uint16_t* scale,
                                  int8_t* zero) {
  alignas(32) uint8_t q[128];
  const float top = static_cast<float>((1 << bits) - 1);
  for (int64_t g = 0; g * group < dim; ++g) {
    const T* xg = x + g * group;
    __m256 lo = w8::load_f32(xg), hi = lo;
    for (int64_t c = 8; c < group; c += 8) {
      const __m256 v = w8::load_f32(xg + c);
      lo = _mm256_min_ps(lo, v);
      hi = _mm256_max_ps(hi, v);
    }
    const float lof = w8::hmin(lo);
    const float want = std::max(std::max((w8::hmax(hi) - lof) / top, std::fabs(lof) / 127.0f), kTinyScale);
    const uint16_t s16 = half_toward(want, true);
    const float sf = half_value(s16);
    const float z = std::min(std::max(std::nearbyint(lof / sf), -128.0f), 127.0f);
    scale[g] = s16;
    zero[g] = static_cast<int8_t>(z);
    const __m256 sv = _mm256_set1_ps(sf), zv = _mm256_set1_ps(z), topv = _mm256_set1_ps(top);
    for (int64_t c = 0; c < group; c += 8) {
      const __m256 y = _mm256_round_ps(_mm256_sub_ps(_mm256_div_ps(w8::load_f32(xg + c), sv), zv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      store_bytes8<false>(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, _mm256_setzero_ps()), topv)),
                          q + g * group + c);
    }
  }
  pack_planar(bits, q, dim, codes);
}

template <typename T>
void KiviWrite<T>::finish(int64_t r) const {
  const int64_t* p = plan + r * kPlanFields;
  const T* sk = scratch_k + r * block_elems();
  const T* sv = scratch_v + r * block_elems();
  if (p[kPlanUpto] < block_size) {
    const int64_t from = p[kPlanHeld] * heads * dim, n = (p[kPlanUpto] - p[kPlanHeld]) * heads * dim;
    std::memcpy(res_k + p[kPlanSlot] * block_elems() + from, sk + from, n * sizeof(T));
    std::memcpy(res_v + p[kPlanSlot] * block_elems() + from, sv + from, n * sizeof(T));
    return;
  }
  const int64_t b = p[kPlanBlock], groups = dim / group;
  const bool scalar = scalar_writes();
  auto kivi_keys = scalar ? kivi_keys_scalar<T> : kivi_keys8<T>;
  auto kivi_values = scalar ? kivi_values_scalar<T> : kivi_values8<T>;
  for (int64_t h = 0; h < heads; ++h) {
    kivi_keys(bits, sk + h * dim, block_size, heads * dim, dim, k_codes + (b * block_size * heads + h) * code_bytes,
              heads * code_bytes, k_ranges + (b * heads + h) * dim, k_grid + (b * heads + h) * 3);
    for (int64_t t = 0; t < block_size; ++t) {
      const int64_t at = (b * block_size + t) * heads + h;
      kivi_values(bits, sv + (t * heads + h) * dim, dim, group, v_codes + at * code_bytes, v_scale + at * groups,
                  v_zero + at * groups);
    }
  }
}

template struct KiviWrite<float>;
template struct KiviWrite<c10::BFloat16>;
template void quantize_head<c10::BFloat16>(int64_t, const c10::BFloat16*, int64_t, uint8_t*, uint16_t*);
#endif


template <typename T>
KiviKeys<T> kivi_keys_variant() {
#ifdef KVBANK_X86
  if (!scalar_writes()) return kivi_keys8<T>;
#endif
  return kivi_keys_scalar<T>;
}
template KiviKeys<float> kivi_keys_variant<float>();
template KiviKeys<c10::BFloat16> kivi_keys_variant<c10::BFloat16>();


// The plan's rows and scratch slots against the residual slots they name; returns the row count.
int64_t check_kivi_plan(const torch::Tensor& plan, const torch::Tensor& scratch_slots, int64_t tokens, int64_t blocks,
                        int64_t block_size, int64_t residual_slots) {
  TORCH_CHECK(plan.scalar_type() == torch::kLong && plan.dim() == 2 && plan.size(1) == kPlanFields && plan.is_contiguous(),
              "the plan must be contiguous int64 [rows, ", kPlanFields, "], got ", plan.sizes());
  TORCH_CHECK(scratch_slots.scalar_type() == torch::kLong && scratch_slots.dim() == 1 &&
                  scratch_slots.size(0) == tokens && scratch_slots.is_contiguous(),
              "scratch slots must be contiguous int64 [", tokens, "], got ", scratch_slots.sizes());
  const int64_t rows = plan.size(0);
  const int64_t* p = plan.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r, p += kPlanFields) {
    TORCH_CHECK(p[kPlanBlock] >= 0 && p[kPlanBlock] < blocks, "plan row ", r, ": block ", p[kPlanBlock],
                " is outside the pool's ", blocks, " blocks");
    TORCH_CHECK(p[kPlanHeld] >= 0 && p[kPlanHeld] < p[kPlanUpto] && p[kPlanUpto] <= block_size, "plan row ", r,
                ": tokens held ", p[kPlanHeld], " -> ", p[kPlanUpto], " do not fit a block of ", block_size);
    TORCH_CHECK(p[kPlanEarly] == 0 || (p[kPlanEarly] == 1 && p[kPlanUpto] == block_size), "plan row ", r,
                ": only a block this step fills can be read early, got early ", p[kPlanEarly], " with ",
                p[kPlanUpto], " of ", block_size, " tokens");
    const bool needs_slot = p[kPlanHeld] > 0 || p[kPlanUpto] < block_size;
    TORCH_CHECK(!needs_slot || (p[kPlanSlot] >= 0 && p[kPlanSlot] < residual_slots), "plan row ", r,
                ": residual slot ", p[kPlanSlot], " is outside the ", residual_slots, " slots");
  }
  const int64_t* s = scratch_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < rows * block_size, "scratch slot ", s[t], " is outside the step's ",
                rows * block_size);
  return rows;
}

// One KIVI layer's pool tensors and residual slots; names the shapes it expected.
void check_kivi_layer(int64_t format, int64_t heads, int64_t dim, const torch::Tensor& k_codes, const torch::Tensor& k_ranges,
                      const torch::Tensor& k_grid, const torch::Tensor& v_codes, const torch::Tensor& v_scale,
                      const torch::Tensor& v_zero, const torch::Tensor& residual_k, const torch::Tensor& residual_v,
                      torch::ScalarType dtype) {
  TORCH_CHECK(format == kInt4 || format == kInt2, "KIVI writes are int4 (4) or int2 (5), got format ", format);
  TORCH_CHECK(dim % 8 == 0 && dim <= 128, "head dim must be a multiple of 8 up to 128, got ", dim);
  const int64_t code_bytes = dim * (format == kInt4 ? 4 : 2) / 8;
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.scalar_type() == torch::kByte && k_codes.size(1) <= 64 &&
                  k_codes.size(2) == heads && k_codes.size(3) == code_bytes && v_codes.sizes() == k_codes.sizes() &&
                  v_codes.scalar_type() == torch::kByte,
              "codes must be uint8 [blocks, block_size <= 64, ", heads, ", ", code_bytes, "], got ", k_codes.sizes());
  const int64_t blocks = k_codes.size(0), block_size = k_codes.size(1);
  TORCH_CHECK(k_ranges.scalar_type() == torch::kByte && k_ranges.dim() == 3 && k_ranges.size(0) == blocks &&
                  k_ranges.size(1) == heads && k_ranges.size(2) == dim,
              "key ranges must be uint8 [", blocks, ", ", heads, ", ", dim, "], got ", k_ranges.sizes());
  TORCH_CHECK(k_grid.scalar_type() == torch::kHalf && k_grid.dim() == 3 && k_grid.size(0) == blocks &&
                  k_grid.size(1) == heads && k_grid.size(2) == 3,
              "key grids must be float16 [", blocks, ", ", heads, ", 3], got ", k_grid.sizes());
  TORCH_CHECK(v_scale.scalar_type() == torch::kHalf && v_scale.dim() == 4 && v_scale.size(0) == blocks &&
                  v_scale.size(1) == block_size && v_scale.size(2) == heads && v_scale.size(3) >= 1 &&
                  dim % v_scale.size(3) == 0 && (dim / v_scale.size(3)) % 8 == 0 && v_zero.sizes() == v_scale.sizes() &&
                  v_zero.scalar_type() == torch::kChar,
              "value scales (float16) and zero points (int8) must be [", blocks, ", ", block_size, ", ", heads,
              ", groups of a multiple of 8 channels], got ", v_scale.sizes(), " and ", v_zero.sizes());
  TORCH_CHECK(residual_k.scalar_type() == dtype && residual_k.dim() == 4 && residual_k.size(1) == block_size &&
                  residual_k.size(2) == heads && residual_k.size(3) == dim && residual_v.sizes() == residual_k.sizes() &&
                  residual_v.scalar_type() == dtype,
              "residual slots must be [slots, ", block_size, ", ", heads, ", ", dim, "] in the model's dtype, got ",
              residual_k.sizes());
  for (const auto* t : {&k_codes, &v_codes, &k_ranges, &k_grid, &v_scale, &v_zero, &residual_k, &residual_v})
    TORCH_CHECK(t->is_contiguous(), "KIVI caches and residual slots must be contiguous");
}

#ifdef KVBANK_X86
template <typename T>
KiviWrite<T> kivi_pointers(int64_t format, const torch::Tensor& k_codes, const torch::Tensor& k_ranges,
                           const torch::Tensor& k_grid, const torch::Tensor& v_codes, const torch::Tensor& v_scale,
                           const torch::Tensor& v_zero, const torch::Tensor& residual_k, const torch::Tensor& residual_v,
                           T* scratch_k, T* scratch_v, const torch::Tensor& plan, const torch::Tensor& scratch_slots) {
  const int64_t heads = k_codes.size(2), dim = k_ranges.size(2);
  return KiviWrite<T>{format == kInt4 ? 4 : 2,
                      heads,
                      dim,
                      k_codes.size(1),
                      k_codes.size(3),
                      dim / v_scale.size(3),
                      reinterpret_cast<uint8_t*>(k_codes.data_ptr()),
                      reinterpret_cast<uint8_t*>(v_codes.data_ptr()),
                      reinterpret_cast<uint8_t*>(k_ranges.data_ptr()),
                      reinterpret_cast<uint16_t*>(k_grid.data_ptr()),
                      reinterpret_cast<uint16_t*>(v_scale.data_ptr()),
                      reinterpret_cast<int8_t*>(v_zero.data_ptr()),
                      residual_k.data_ptr<T>(),
                      residual_v.data_ptr<T>(),
                      scratch_k,
                      scratch_v,
                      plan.data_ptr<int64_t>(),
                      scratch_slots.data_ptr<int64_t>()};
}
template KiviWrite<float> kivi_pointers<float>(int64_t, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                               const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                               const torch::Tensor&, const torch::Tensor&, float*, float*,
                                               const torch::Tensor&, const torch::Tensor&);
template KiviWrite<c10::BFloat16> kivi_pointers<c10::BFloat16>(
    int64_t, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
    const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, c10::BFloat16*,
    c10::BFloat16*, const torch::Tensor&, const torch::Tensor&);
#endif

}  // namespace kvbank

using namespace kvbank;

void quant_write_tokens(torch::Tensor x, int64_t format, torch::Tensor codes, torch::Tensor scale, torch::Tensor slots) {
  TORCH_CHECK(kvbank::family_available(kvbank::Family::QuantWrite),
              "quantized KV writes need an x86 CPU");
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

std::vector<torch::Tensor> kivi_write(torch::Tensor k, torch::Tensor v, int64_t format, torch::Tensor k_codes,
                                      torch::Tensor k_ranges, torch::Tensor k_grid, torch::Tensor v_codes,
                                      torch::Tensor v_scale, torch::Tensor v_zero, torch::Tensor residual_k,
                                      torch::Tensor residual_v, torch::Tensor plan, torch::Tensor scratch_slots) {
  TORCH_CHECK(kvbank::family_available(kvbank::Family::QuantWrite), "KIVI writes need an x86 CPU");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must be [tokens, heads, dim], got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == torch::kBFloat16 || k.scalar_type() == torch::kFloat),
              "k and v must both be bfloat16 or float32");
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2);
  check_kivi_layer(format, heads, dim, k_codes, k_ranges, k_grid, v_codes, v_scale, v_zero, residual_k, residual_v,
                   k.scalar_type());
  // Rows may be strided (k and v are views into the fused projection); each token's heads are dense.
  if (k.stride(2) != 1 || k.stride(1) != dim) k = k.contiguous();
  if (v.stride(2) != 1 || v.stride(1) != dim) v = v.contiguous();
  const int64_t block_size = k_codes.size(1);
  const int64_t rows = check_kivi_plan(plan, scratch_slots, tokens, k_codes.size(0), block_size, residual_k.size(0));
  // zeros: the reference path attends whole scratch rows under a mask
  auto scratch_k = torch::zeros({rows, block_size, heads, dim}, k.options().memory_format(torch::MemoryFormat::Contiguous));
  auto scratch_v = torch::zeros_like(scratch_k);
#ifdef KVBANK_X86
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const KiviWrite<T> W = kivi_pointers<T>(format, k_codes, k_ranges, k_grid, v_codes, v_scale, v_zero, residual_k,
                                            residual_v, scratch_k.data_ptr<T>(), scratch_v.data_ptr<T>(), plan,
                                            scratch_slots);
    const T* k_p = k.data_ptr<T>();
    const T* v_p = v.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t from, int64_t to) {
      for (int64_t r = from; r < to; ++r) W.preload(r);
    });
    for (int64_t t = 0; t < tokens; ++t) W.place(t, k_p + t * k.stride(0), v_p + t * v.stride(0));
    at::parallel_for(0, rows, 1, [&](int64_t from, int64_t to) {
      for (int64_t r = from; r < to; ++r) W.finish(r);
    });
  };
  if (k.scalar_type() == torch::kBFloat16) {
    run(static_cast<c10::BFloat16*>(nullptr));
  } else {
    run(static_cast<float*>(nullptr));
  }
#endif
  return {scratch_k, scratch_v};
}
