// Key blocks of every layer read, rotated or stored as a whole (a stream's position shift, a
// recall), dense or KIVI, bit for bit the Python codecs; and rows copied between blocks.
#include "cache_write.h"

#include "quant_kernels.h"

#include <ATen/Parallel.h>

using namespace kvbank;

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
KVBANK_AVX2 void dequantize_row8(const uint8_t* codes, const float* scale, const float* low, int64_t dim,
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
  auto kivi_keys = kivi_keys_variant<T>();
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
  auto kivi_keys = kivi_keys_variant<float>();
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
