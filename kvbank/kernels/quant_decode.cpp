// The quantized attention and cache writes, as torch operators (job types: quant_decode.h).
#include "quant_decode.h"

#include <ATen/Parallel.h>

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
  int level = 0;
#ifdef KVBANK_X86
  kvbank::Isa wanted = kvbank::active_isa();
  TORCH_CHECK(isa == "auto" || kvbank::isa_from_name(isa, &wanted),
              "isa must be auto, scalar, avx2, avx512 or avx512_bf16, got ", isa);
  TORCH_CHECK(static_cast<int>(wanted) <= static_cast<int>(kvbank::active_isa()), "this CPU (capped at ",
              kvbank::isa_name(kvbank::active_isa()), ") does not run the ", isa, " version of the quantized kernel");
  level = quant_isa_at(wanted);
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

#ifdef KVBANK_X86
namespace {

// A KIVI block's codes of one token and head, unpacked (planar: byte i holds codes i, i + n, ...).
inline void unpack_planar(int bits, const uint8_t* p, int64_t dim, uint8_t* out) {
  const int per = 8 / bits;
  const int64_t n = dim / per;
  const int mask = (1 << bits) - 1;
  for (int s = 0; s < per; ++s)
    for (int64_t i = 0; i < n; ++i) out[i + s * n] = static_cast<uint8_t>((p[i] >> (bits * s)) & mask);
}

// low + code * scale with one rounding (torch.addcmul, as KiviKeys.dequantize), 8 channels at a time.
KVBANK_AVX2_F16C void dequantize_row8(const uint8_t* codes, const float* scale, const float* low, int64_t dim,
                                      float* out) {
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + d))));
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(c, _mm256_loadu_ps(scale + d), _mm256_loadu_ps(low + d)));
  }
}

// One block's keys [block_size, heads, dim] of one layer, as float32: a dense cache's as stored,
// a KIVI block's low + code * scale, rounded once.
template <typename T>
void key_block(int64_t format, const torch::Tensor& codes, const torch::Tensor& ranges, const torch::Tensor& grid,
               int64_t block, float* out) {
  const int64_t bs = codes.size(1), heads = codes.size(2);
  if (format == kBf16) {
    const int64_t n = bs * heads * codes.size(3);
    const T* x = codes.data_ptr<T>() + block * n;
    for (int64_t i = 0; i < n; ++i) out[i] = load(x, i);
    return;
  }
  const int bits = format == kInt4 ? 4 : 2;
  const bool scalar = scalar_writes();
  const int64_t dim = ranges.size(2), code_bytes = codes.size(3);
  const uint8_t* c = codes.data_ptr<uint8_t>() + block * bs * heads * code_bytes;
  const uint8_t* r = ranges.data_ptr<uint8_t>() + block * heads * dim;
  const uint16_t* g = reinterpret_cast<const uint16_t*>(grid.data_ptr()) + block * heads * 3;
  float scale[128], low[128];
  uint8_t q[128];
  for (int64_t h = 0; h < heads; ++h) {
    float scales[16], mins[16];
    kivi_key_grids(half_value(g[h * 3]), half_value(g[h * 3 + 1]), half_value(g[h * 3 + 2]), scales, mins);
    for (int64_t d = 0; d < dim; ++d) {
      scale[d] = scales[r[h * dim + d] & 15];
      low[d] = mins[r[h * dim + d] >> 4];
    }
    for (int64_t t = 0; t < bs; ++t) {
      unpack_planar(bits, c + (t * heads + h) * code_bytes, dim, q);
      float* row = out + (t * heads + h) * dim;
      if (!scalar) {
        dequantize_row8(q, scale, low, dim, row);
        continue;
      }
      for (int64_t d = 0; d < dim; ++d) row[d] = std::fma(static_cast<float>(q[d]), scale[d], low[d]);
    }
  }
}

// x * cos + (x's halves swapped) * sin per row of `dim`, rounded to T: apply_rope's three float32
// roundings (two products, one sum), never fused, so the bits are PyTorch's (the model's own
// rotation, rope_rows in layers.h, rounds each product to the model dtype instead).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_key_rows(const float* x, int64_t rows, int64_t dim,
                                                                  const float* cos, const float* sin, T* out) {
  const int64_t half = dim / 2;
  for (int64_t r = 0; r < rows; ++r, x += dim, out += dim)
    for (int64_t d = 0; d < dim; ++d) {
      const float a = x[d] * cos[d];
      const float b = x[d < half ? d + half : d - half] * sin[d];
      out[d] = static_cast<T>(a + b);
    }
}

template <typename T>
void rotate_layer_blocks(int64_t format, const torch::Tensor& codes, const torch::Tensor& ranges,
                         const torch::Tensor& grid, const int64_t* src, const int64_t* dst, int64_t n, const float* cos,
                         const float* sin) {
  const int64_t bs = codes.size(1), heads = codes.size(2);
  const int64_t dim = format == kBf16 ? codes.size(3) : ranges.size(2);
  const int64_t elems = bs * heads * dim;
  std::vector<float> keys(elems);
  std::vector<T> rotated(n * elems);  // every source is read before any destination is written
  for (int64_t i = 0; i < n; ++i) {
    key_block<T>(format, codes, ranges, grid, src[i], keys.data());
    rotate_key_rows<T>(keys.data(), bs * heads, dim, cos, sin, rotated.data() + i * elems);
  }
  if (format == kBf16) {
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(codes.data_ptr<T>() + dst[i] * elems, rotated.data() + i * elems, elems * sizeof(T));
    return;
  }
  const int bits = format == kInt4 ? 4 : 2;
  const int64_t code_bytes = codes.size(3);
  auto kivi_keys = scalar_writes() ? kivi_keys_scalar<T> : kivi_keys8<T>;
  uint8_t* c = codes.data_ptr<uint8_t>();
  uint8_t* r = ranges.data_ptr<uint8_t>();
  uint16_t* g = reinterpret_cast<uint16_t*>(grid.data_ptr());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h)
      kivi_keys(bits, rotated.data() + i * elems + h * dim, bs, heads * dim, dim,
                c + (dst[i] * bs * heads + h) * code_bytes, heads * code_bytes, r + (dst[i] * heads + h) * dim,
                g + (dst[i] * heads + h) * 3);
}

}  // namespace
#endif

namespace {

// Every layer's key tensors (a dense cache, or KIVI codes, ranges and grids) and the block ids,
// checked against each other; returns the head dim.
int64_t check_key_layers(const std::vector<torch::Tensor>& codes, int64_t format, const std::vector<torch::Tensor>& ranges,
                         const std::vector<torch::Tensor>& grids, bool bf16_keys,
                         std::initializer_list<const torch::Tensor*> ids) {
  TORCH_CHECK(kvbank::family_available(kvbank::Family::QuantWrite), "native key blocks need an x86 CPU");
  TORCH_CHECK(format == kBf16 || format == kInt4 || format == kInt2,
              "key blocks are dense caches (0), int4 (4) or int2 (5), got format ", format);
  const bool kivi = format != kBf16;
  TORCH_CHECK(!codes.empty(), "no layers given");
  TORCH_CHECK(!kivi || (ranges.size() == codes.size() && grids.size() == codes.size()),
              "KIVI keys need a range and a grid tensor per layer");
  for (const torch::Tensor* t : ids)
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->dim() == 1 && t->is_contiguous() &&
                    t->size(0) == (*ids.begin())->size(0),
                "block ids must be contiguous int64 [n] alike, got ", t->sizes());
  const int64_t dim = kivi ? ranges[0].size(-1) : codes[0].size(-1);
  for (size_t l = 0; l < codes.size(); ++l) {
    const torch::Tensor& k = codes[l];
    TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && k.sizes().slice(0, 3) == codes[0].sizes().slice(0, 3),
                "layer ", l, ": keys must be contiguous [blocks, block_size, heads, x] as layer 0's, got ", k.sizes());
    if (kivi) {
      const int64_t heads = k.size(2);
      TORCH_CHECK(dim % 8 == 0 && dim <= 128, "head dim must be a multiple of 8 up to 128, got ", dim);
      TORCH_CHECK(k.scalar_type() == torch::kByte && k.size(1) <= 64 && k.size(3) == dim * (format == kInt4 ? 4 : 2) / 8,
                  "layer ", l, ": key codes must be uint8 [blocks, block_size <= 64, heads, dim * bits / 8], got ",
                  k.sizes());
      TORCH_CHECK(ranges[l].scalar_type() == torch::kByte && ranges[l].dim() == 3 && ranges[l].size(0) == k.size(0) &&
                      ranges[l].size(1) == heads && ranges[l].size(2) == dim && ranges[l].is_contiguous(),
                  "layer ", l, ": key ranges must be contiguous uint8 [", k.size(0), ", ", heads, ", ", dim, "], got ",
                  ranges[l].sizes());
      TORCH_CHECK(grids[l].scalar_type() == torch::kHalf && grids[l].dim() == 3 && grids[l].size(0) == k.size(0) &&
                      grids[l].size(1) == heads && grids[l].size(2) == 3 && grids[l].is_contiguous(),
                  "layer ", l, ": key grids must be contiguous float16 [", k.size(0), ", ", heads, ", 3], got ",
                  grids[l].sizes());
    } else {
      TORCH_CHECK(k.scalar_type() == (bf16_keys ? torch::kBFloat16 : torch::kFloat), "layer ", l,
                  ": dense keys must be ", bf16_keys ? "bfloat16" : "float32", " [.., ", dim, "]");
    }
  }
  const int64_t blocks = codes[0].size(0);
  for (const torch::Tensor* t : ids)
    for (int64_t i = 0; i < t->size(0); ++i) {
      const int64_t id = t->data_ptr<int64_t>()[i];
      TORCH_CHECK(id >= 0 && id < blocks, "block ", id, " is outside the pool's ", blocks, " blocks");
    }
  return dim;
}

}  // namespace

void rotate_key_blocks(std::vector<torch::Tensor> codes, int64_t format, std::vector<torch::Tensor> ranges,
                       std::vector<torch::Tensor> grids, torch::Tensor src, torch::Tensor dst, torch::Tensor cos,
                       torch::Tensor sin, bool bf16_keys) {
  src = src.contiguous();
  dst = dst.contiguous();
  const int64_t dim = check_key_layers(codes, format, ranges, grids, bf16_keys, {&src, &dst});
  const bool kivi = format != kBf16;
  const int64_t n = src.size(0);
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.numel() == dim &&
                  sin.numel() == dim,
              "cos and sin must be float32 [", dim, "]");
  cos = cos.contiguous();
  sin = sin.contiguous();
#ifdef KVBANK_X86
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  const float* c = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const torch::Tensor none;
  at::parallel_for(0, static_cast<int64_t>(codes.size()), 1, [&](int64_t from, int64_t to) {
    for (int64_t l = from; l < to; ++l) {
      const torch::Tensor& r = kivi ? ranges[l] : none;
      const torch::Tensor& g = kivi ? grids[l] : none;
      if (bf16_keys) {
        rotate_layer_blocks<c10::BFloat16>(format, codes[l], r, g, s, d, n, c, sn);
      } else {
        rotate_layer_blocks<float>(format, codes[l], r, g, s, d, n, c, sn);
      }
    }
  });
#endif
}

torch::Tensor read_key_blocks(std::vector<torch::Tensor> codes, int64_t format, std::vector<torch::Tensor> ranges,
                              std::vector<torch::Tensor> grids, torch::Tensor ids, bool bf16_keys) {
  ids = ids.contiguous();
  const int64_t dim = check_key_layers(codes, format, ranges, grids, bf16_keys, {&ids});
  const int64_t layers = static_cast<int64_t>(codes.size()), n = ids.size(0);
  const int64_t bs = codes[0].size(1), heads = codes[0].size(2), elems = bs * heads * dim;
  auto out = torch::empty({layers, n, bs, heads, dim}, torch::kFloat);
#ifdef KVBANK_X86
  const bool kivi = format != kBf16;
  const torch::Tensor none;
  const int64_t* id = ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, layers * n, 1, [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) {
      const int64_t l = i / n;
      const torch::Tensor& r = kivi ? ranges[l] : none;
      const torch::Tensor& g = kivi ? grids[l] : none;
      if (bf16_keys) {
        key_block<c10::BFloat16>(format, codes[l], r, g, id[i % n], o + i * elems);
      } else {
        key_block<float>(format, codes[l], r, g, id[i % n], o + i * elems);
      }
    }
  });
#endif
  return out;
}

void store_key_blocks(torch::Tensor x, std::vector<torch::Tensor> codes, int64_t format,
                      std::vector<torch::Tensor> ranges, std::vector<torch::Tensor> grids, torch::Tensor ids) {
  ids = ids.contiguous();
  TORCH_CHECK(format == kInt4 || format == kInt2, "stored key blocks are int4 (4) or int2 (5), got format ", format);
  const int64_t dim = check_key_layers(codes, format, ranges, grids, false, {&ids});
  const int64_t layers = static_cast<int64_t>(codes.size()), n = ids.size(0);
  const int64_t bs = codes[0].size(1), heads = codes[0].size(2), elems = bs * heads * dim;
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 5 && x.size(0) == layers && x.size(1) == n &&
                  x.size(2) == bs && x.size(3) == heads && x.size(4) == dim,
              "keys must be float32 [", layers, ", ", n, ", ", bs, ", ", heads, ", ", dim, "], got ", x.sizes());
  x = x.contiguous();
  // A block written twice would depend on the order: refused.
  std::vector<int64_t> seen(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + n);
  std::sort(seen.begin(), seen.end());
  TORCH_CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end(), "a block id appears twice");
#ifdef KVBANK_X86
  const int bits = format == kInt4 ? 4 : 2;
  const int64_t code_bytes = codes[0].size(3);
  auto kivi_keys = scalar_writes() ? kivi_keys_scalar<float> : kivi_keys8<float>;
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, layers * n, 1, [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) {
      const int64_t l = i / n, b = id[i % n];
      uint8_t* c = codes[l].data_ptr<uint8_t>();
      uint8_t* r = ranges[l].data_ptr<uint8_t>();
      uint16_t* g = reinterpret_cast<uint16_t*>(grids[l].data_ptr());
      for (int64_t h = 0; h < heads; ++h)
        kivi_keys(bits, xp + i * elems + h * dim, bs, heads * dim, dim, c + (b * bs * heads + h) * code_bytes,
                  heads * code_bytes, r + (b * heads + h) * dim, g + (b * heads + h) * 3);
    }
  });
#endif
}

void copy_rows(std::vector<torch::Tensor> tensors, torch::Tensor src, torch::Tensor dst) {
  TORCH_CHECK(src.scalar_type() == torch::kLong && dst.scalar_type() == torch::kLong && src.dim() == 1 &&
                  dst.sizes() == src.sizes(),
              "src and dst must be int64 [n] alike, got ", src.sizes(), " and ", dst.sizes());
  src = src.contiguous();
  dst = dst.contiguous();
  const int64_t n = src.size(0);
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  for (size_t l = 0; l < tensors.size(); ++l) {
    const torch::Tensor& t = tensors[l];
    TORCH_CHECK(t.dim() >= 1 && t.is_contiguous() && t.device().is_cpu(), "tensor ", l, " must be contiguous on the CPU");
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(s[i] >= 0 && s[i] < t.size(0) && d[i] >= 0 && d[i] < t.size(0), "tensor ", l, ": row ",
                  s[i] < 0 || s[i] >= t.size(0) ? s[i] : d[i], " is outside its ", t.size(0), " rows");
  }
  std::vector<uint8_t> moved;
  for (const torch::Tensor& t : tensors) {
    const int64_t row = t.size(0) ? t.numel() / t.size(0) * t.element_size() : 0;
    uint8_t* base = reinterpret_cast<uint8_t*>(t.data_ptr());
    moved.resize(n * row);  // every source row is read before any destination row is written
    for (int64_t i = 0; i < n; ++i) std::memcpy(moved.data() + i * row, base + s[i] * row, row);
    for (int64_t i = 0; i < n; ++i) std::memcpy(base + d[i] * row, moved.data() + i * row, row);
  }
}
