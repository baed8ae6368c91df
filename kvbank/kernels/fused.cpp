// Activations (SiLU, GeGLU) and the fused layer ops of the per-layer path: residual add, RMSNorm,
// the quantized projections and rotary embedding in one call each (qlayer_attn_in, qlayer_mlp),
// the LM head (qhead) and Q8 embedding rows (q8_rows).
#include "fused.h"

#include <algorithm>
#include <cmath>

namespace kvbank {

template <typename T>
void store_rows(const float* src, T* dst, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = narrow_to(src[i], static_cast<T*>(nullptr));
}

// --- fused decode steps ---------------------------------------------------------------------------

// silu(g) * u rounds to T after each op, as the unfused layer's ops do, and takes e^-g from the
// attention kernels' polynomial (exp_neg, clamped to [-87, 89]: beyond 88.7 it is inf and silu -0)
// with fused multiply-adds (w1_fused), so the scalar, 8-lane and 16-lane variants give the same bits.
inline float silu_exp(float x) { return w1_fused::exp_neg(std::min(x, 89.0f)); }

template <typename T>
inline float silu_mul_one(float gate, float up) {
  const float g = round_as<T>(gate), u = round_as<T>(up);
  return round_as<T>(round_as<T>(g / (1.0f + silu_exp(-g))) * u);
}

#ifdef KVBANK_X86
KVBANK_AVX512 inline __m512 round_bf16_v(__m512 x) {
  // Round to nearest even at bfloat16 (finite values), as narrow_to does.
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The whole 16s of silu_mul_row for bfloat16; returns how many it did.
KVBANK_AVX512 int64_t silu_mul_bf16_avx512(const float* gate, const float* up, float* out, int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 g = round_bf16_v(_mm512_loadu_ps(gate + k)), u = round_bf16_v(_mm512_loadu_ps(up + k));
    // scalef saturates to inf past the top of the range, as silu_exp's clamp to 89 does
    const __m512 e = w16::exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = round_bf16_v(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    _mm512_storeu_ps(out + k, round_bf16_v(_mm512_mul_ps(silu, u)));
  }
  return k;
}

KVBANK_AVX2 inline __m256 round_bf16_8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// bfloat16 bits of 16 floats as narrow_to gives them: round to nearest even, NaN to 0x7FC0.
KVBANK_AVX512 inline __m256i narrow16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// The whole 16s of the stack's elementwise loops for bfloat16 (the scalar loops do the rest, the
// same operations one value at a time); each returns how many it did.
// dst[i] = src[i] rounded to bfloat16
KVBANK_AVX512 int64_t store_bf16_avx512(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), narrow16(_mm512_loadu_ps(src + k)));
  return k;
}

// residual[i] = residual[i] + x[i], rounded to bfloat16
KVBANK_AVX512 int64_t add_bf16_avx512(const c10::BFloat16* x, c10::BFloat16* residual, int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(residual + k),
                        narrow16(_mm512_add_ps(w16::load_bf16(x + k), w16::load_bf16(residual + k))));
  return k;
}

// out[i] = x[i] + add[i] rounded to bfloat16, as float (no add: x[i])
KVBANK_AVX512 int64_t sum_bf16_avx512(const c10::BFloat16* x, const c10::BFloat16* add, float* out, int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 v = add ? w16::from_bf16(narrow16(_mm512_add_ps(w16::load_bf16(x + k), w16::load_bf16(add + k))))
                         : w16::load_bf16(x + k);
    _mm512_storeu_ps(out + k, v);
  }
  return k;
}

// values[i] = values[i] * inv * weight[i]
KVBANK_AVX512 int64_t scale_bf16_avx512(float* values, float inv, const c10::BFloat16* weight, int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16)
    _mm512_storeu_ps(values + k, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(values + k), _mm512_set1_ps(inv)),
                                               w16::load_bf16(weight + k)));
  return k;
}

// The whole 8s of silu_mul_row for bfloat16; returns how many it did.
KVBANK_AVX2 int64_t silu_mul_bf16_avx2(const float* gate, const float* up, float* out, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256 g = round_bf16_8(_mm256_loadu_ps(gate + k)), u = round_bf16_8(_mm256_loadu_ps(up + k));
    const __m256 e = w8::exp_neg(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(89.0f)));
    const __m256 silu = round_bf16_8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    _mm256_storeu_ps(out + k, round_bf16_8(_mm256_mul_ps(silu, u)));
  }
  return k;
}
#endif

// out[k] = silu(gate[k]) * up[k] from the projections rounded to T; the same bits from every
// variant of the activation family, and the same function in every fused path.
template <typename T>
void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t k = 0;
#ifdef KVBANK_X86
  Isa variant = Isa::Scalar;
  kvbank::family_variant(kvbank::Family::Activation, &variant);
  if (std::is_same_v<T, c10::BFloat16> && variant == Isa::Avx512) k = silu_mul_bf16_avx512(gate, up, out, n);
  if (std::is_same_v<T, c10::BFloat16> && variant == Isa::Avx2) k = silu_mul_bf16_avx2(gate, up, out, n);
#endif
  for (; k < n; ++k) out[k] = silu_mul_one<T>(gate[k], up[k]);
}

// GeGLU (Gemma): gelu(gate) * up with gelu's tanh approximation, as torch's approximate="tanh",
// 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + e^-2y) (the same
// function; 1 + tanh(y) itself would cancel to nothing for gates below about -4) through
// silu_exp's polynomial; gelu rounds to bfloat16, then the product, as the unfused ops do. Plain
// multiplies and adds in a fixed order in every variant (no fused multiply-add outside the
// polynomial), so the scalar, 8-lane and 16-lane variants give the same bits.
inline float gelu_tanh(float g) {
  const float y = 0.7978845608028654f * (g + 0.044715f * ((g * g) * g));
  return g / (1.0f + silu_exp(-2.0f * y));
}

inline c10::BFloat16 geglu_one(c10::BFloat16 gate, c10::BFloat16 up) {
  return c10::BFloat16(round_as<c10::BFloat16>(gelu_tanh(static_cast<float>(gate))) * static_cast<float>(up));
}

#ifdef KVBANK_X86
KVBANK_AVX512 int64_t geglu_bf16_avx512(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out,
                                          int64_t n) {
  int64_t k = 0;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; k + 16 <= n; k += 16) {
    const __m512 g = w16::load_bf16(gate + k);
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                   _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), cube)));
    // scalef saturates to inf past the top of the range, as silu_exp's clamp to 89 does
    const __m512 e = w16::exp_neg(_mm512_mul_ps(_mm512_set1_ps(-2.0f), y));
    const __m512 gelu = round_bf16_v(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), narrow16(_mm512_mul_ps(gelu, w16::load_bf16(up + k))));
  }
  return k;
}

KVBANK_AVX2 int64_t geglu_bf16_avx2(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out,
                                    int64_t n) {
  int64_t k = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  alignas(32) float product[8];
  for (; k + 8 <= n; k += 8) {
    const __m256 g = w8::load_bf16(gate + k);
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                   _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
    const __m256 e = w8::exp_neg(_mm256_min_ps(_mm256_mul_ps(_mm256_set1_ps(-2.0f), y), _mm256_set1_ps(89.0f)));
    const __m256 gelu = round_bf16_8(_mm256_div_ps(g, _mm256_add_ps(one, e)));
    _mm256_store_ps(product, _mm256_mul_ps(gelu, w8::load_bf16(up + k)));
    for (int i = 0; i < 8; ++i) out[k + i] = c10::BFloat16(product[i]);
  }
  return k;
}
#endif

// out[k] = gelu(gate[k]) * up[k] for bfloat16 rows; the same bits from every variant.
void geglu_row(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out, int64_t n) {
  int64_t k = 0;
#ifdef KVBANK_X86
  Isa variant = Isa::Scalar;
  kvbank::family_variant(kvbank::Family::Activation, &variant);
  if (variant == Isa::Avx512) k = geglu_bf16_avx512(gate, up, out, n);
  if (variant == Isa::Avx2) k = geglu_bf16_avx2(gate, up, out, n);
#endif
  for (; k < n; ++k) out[k] = geglu_one(gate[k], up[k]);
}

// The stack's elementwise loops: 16 lanes where the activation family runs its avx512 variant,
// else one value at a time; the same operations in the same order, so the same bits.
bool elementwise16() {
  Isa variant = Isa::Scalar;
  kvbank::family_variant(kvbank::Family::Activation, &variant);
  return variant == Isa::Avx512;
}

void store_values(const float* src, c10::BFloat16* dst, int64_t n, bool wide) {
  for (int64_t k = KVBANK_WIDE16(wide, store_bf16_avx512(src, dst, n)); k < n; ++k) dst[k] = narrow_to(src[k], dst);
}

void add_values(const c10::BFloat16* x, c10::BFloat16* residual, int64_t n, bool wide) {
  for (int64_t k = KVBANK_WIDE16(wide, add_bf16_avx512(x, residual, n)); k < n; ++k)
    residual[k] = narrow_to(widen(x[k]) + widen(residual[k]), residual);
}

// residual (+)= x, rounded to T as an add of two T tensors is; returns the rows RMS-normed in float32.
template <typename T>
void add_norm_quantize(T* x, T* residual, const T* weight, int64_t rows, int64_t dim, double eps, QuantRows& out) {
  out.resize(rows, dim);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(dim);
    for (int64_t r = begin; r < end; ++r) {
      T* src = x + r * dim;
      if (residual != nullptr) {
        T* res = residual + r * dim;
        for (int64_t d = 0; d < dim; ++d) res[d] = narrow_to(widen(src[d]) + widen(res[d]), static_cast<T*>(nullptr));
        src = res;
      }
      float squares = 0.0f;
      for (int64_t d = 0; d < dim; ++d) squares += widen(src[d]) * widen(src[d]);
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(dim) + static_cast<float>(eps));
      for (int64_t d = 0; d < dim; ++d) normed[d] = widen(src[d]) * inv * widen(weight[d]);
      out.quantize_row(r, normed.data());
    }
  });
}

template <typename T>
torch::Tensor attn_in_impl(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor norm_w, double eps,
                           const PackedWeight& qkv, torch::Tensor cos, torch::Tensor sin, int64_t rope_heads, Isa isa) {
  const int64_t rows = x.size(0), dim = x.size(1);
  QuantRows a;
  add_norm_quantize(x.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr, norm_w.data_ptr<T>(), rows, dim, eps,
                    a);
  std::vector<float> acc(rows * qkv.out_features);
  qmatmul_rows(qkv, isa, a, acc.data(), qkv.out_features);
  auto out = torch::empty({rows, qkv.out_features}, x.options());
  store_rows(acc.data(), out.data_ptr<T>(), acc.size());
  rope_rows(out.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), rows, rope_heads, cos.size(1), qkv.out_features);
  return out;
}

template <typename T>
torch::Tensor mlp_impl(torch::Tensor attn, torch::Tensor residual, const PackedWeight& o, torch::Tensor norm_w,
                       double eps, const PackedWeight& gate_up, const PackedWeight& down, Isa isa) {
  const int64_t rows = attn.size(0), hidden = residual.size(1), inter = gate_up.out_features / 2;
  QuantRows a;
  quantize_rows(attn.data_ptr<T>(), attn.stride(0), rows, attn.size(1), a);
  std::vector<float> acc(rows * std::max(hidden, gate_up.out_features));
  qmatmul_rows(o, isa, a, acc.data(), hidden);
  std::vector<T> projected(rows * hidden);
  store_rows(acc.data(), projected.data(), rows * hidden);
  add_norm_quantize(projected.data(), residual.data_ptr<T>(), norm_w.data_ptr<T>(), rows, hidden, eps, a);
  qmatmul_rows(gate_up, isa, a, acc.data(), gate_up.out_features);
  // silu(gate) * up from the projections rounded to T, as the unfused layer computes them.
  a.resize(rows, inter);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(inter);
    for (int64_t r = begin; r < end; ++r) {
      const float* g = acc.data() + r * gate_up.out_features;
      silu_mul_row<T>(g, g + inter, h.data(), inter);
      a.quantize_row(r, h.data());
    }
  });
  qmatmul_rows(down, isa, a, acc.data(), hidden);
  auto out = torch::empty({rows, hidden}, residual.options());
  store_rows(acc.data(), out.data_ptr<T>(), rows * hidden);
  return out;
}

void check_rows(const torch::Tensor& x, int64_t cols, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == cols, what, " must be contiguous [rows, ", cols, "], got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat, what,
              " must be bfloat16 or float32, not ", x.scalar_type());
}

template void silu_mul_row<float>(const float*, const float*, float*, int64_t);
template void silu_mul_row<c10::BFloat16>(const float*, const float*, float*, int64_t);

}  // namespace kvbank

using namespace kvbank;

std::string qmatmul_isa() { return kvbank::isa_name(best_isa()); }

torch::Tensor geglu(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() == 2 && gate_up.device().is_cpu(),
              "geglu takes a bfloat16 CPU matrix [rows, 2 * n]");
  TORCH_CHECK(gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1, "geglu: rows of gate then up, contiguous");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({rows, n}, gate_up.options());
  const auto* x = gate_up.data_ptr<at::BFloat16>();
  auto* y = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) geglu_row(x + r * stride, x + r * stride + n, y + r * n, n);
  });
  return out;
}

torch::Tensor qlinear(torch::Tensor x, torch::Tensor w, int64_t kind, bool float_out, std::string isa_name) {
  const PackedWeight pw = check_weight(w, kind);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == pw.in_features, "x must be [rows, ", pw.in_features,
              "] with contiguous rows, got ", x.sizes());
  const Isa isa = parse_isa(isa_name);
  QuantRows a;
  const int64_t rows = x.size(0);
  if (x.scalar_type() == torch::kBFloat16) {
    quantize_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), rows, pw.in_features, a);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "qlinear supports bfloat16 and float32 x, not ", x.scalar_type());
    quantize_rows(x.data_ptr<float>(), x.stride(0), rows, pw.in_features, a);
  }
  if (float_out || x.scalar_type() == torch::kFloat) {
    auto out = torch::empty({rows, pw.out_features}, x.options().dtype(torch::kFloat));
    qmatmul_rows(pw, isa, a, out.data_ptr<float>(), pw.out_features);
    return out;
  }
  std::vector<float> acc(rows * pw.out_features);
  qmatmul_rows(pw, isa, a, acc.data(), pw.out_features);
  auto out = torch::empty({rows, pw.out_features}, x.options());
  store_rows(acc.data(), out.data_ptr<c10::BFloat16>(), acc.size());
  return out;
}

torch::Tensor qlayer_attn_in(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor norm_w, double eps,
                             std::vector<torch::Tensor> qkv_w, std::vector<int64_t> kind, torch::Tensor cos,
                             torch::Tensor sin, int64_t rope_heads, std::string isa_name) {
  const PackedWeight qkv = check_weights(qkv_w, kind);
  check_rows(x, qkv.in_features, "x");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() && residual->scalar_type() == x.scalar_type(),
                "residual must be a contiguous tensor shaped and typed like x");
  }
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == x.size(1) && norm_w.scalar_type() == x.scalar_type() &&
                  norm_w.is_contiguous(),
              "the norm weight must be [", x.size(1), "] of x's dtype");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must be contiguous [rows, dim] of x's dtype");
  TORCH_CHECK(cos.size(1) % 2 == 0 && cos.size(1) <= 512 && rope_heads * cos.size(1) <= qkv.out_features,
              "rotary dim ", cos.size(1), " x ", rope_heads, " heads does not fit rows of ", qkv.out_features);
  const Isa isa = parse_isa(isa_name);
  if (x.scalar_type() == torch::kBFloat16)
    return attn_in_impl<c10::BFloat16>(x, residual, norm_w, eps, qkv, cos, sin, rope_heads, isa);
  return attn_in_impl<float>(x, residual, norm_w, eps, qkv, cos, sin, rope_heads, isa);
}

torch::Tensor qlayer_mlp(torch::Tensor attn, torch::Tensor residual, std::vector<torch::Tensor> o_w,
                         std::vector<int64_t> o_kind, torch::Tensor norm_w, double eps,
                         std::vector<torch::Tensor> gate_up_w, std::vector<int64_t> gate_up_kind,
                         std::vector<torch::Tensor> down_w, std::vector<int64_t> down_kind, std::string isa_name) {
  const PackedWeight o = check_weights(o_w, o_kind), gate_up = check_weights(gate_up_w, gate_up_kind),
                     down = check_weights(down_w, down_kind);
  check_rows(residual, o.out_features, "residual");
  TORCH_CHECK(attn.dim() == 2 && attn.stride(1) == 1 && attn.size(1) == o.in_features && attn.size(0) == residual.size(0) &&
                  attn.scalar_type() == residual.scalar_type(),
              "attn must be [", residual.size(0), ", ", o.in_features, "] with contiguous rows of the residual's dtype");
  TORCH_CHECK(gate_up.in_features == o.out_features && gate_up.out_features % 2 == 0 &&
                  down.in_features == gate_up.out_features / 2 && down.out_features == o.out_features,
              "o ", o.out_features, "x", o.in_features, ", gate_up ", gate_up.out_features, "x", gate_up.in_features,
              " and down ", down.out_features, "x", down.in_features, " do not chain");
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == o.out_features && norm_w.scalar_type() == residual.scalar_type() &&
                  norm_w.is_contiguous(),
              "the norm weight must be [", o.out_features, "] of the residual's dtype");
  const Isa isa = parse_isa(isa_name);
  if (residual.scalar_type() == torch::kBFloat16)
    return mlp_impl<c10::BFloat16>(attn, residual, o, norm_w, eps, gate_up, down, isa);
  return mlp_impl<float>(attn, residual, o, norm_w, eps, gate_up, down, isa);
}

// Rows `ids` of a Q8 record table (an embedding lookup), dequantized in float32 and rounded to
// `dtype` once: what the dense table, built the same way, would give.
torch::Tensor q8_rows(torch::Tensor records, torch::Tensor ids, torch::ScalarType dtype) {
  const PackedWeight table = check_weight(records, 8);
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, "ids must be int64 [n]");
  TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kFloat, "rows come as bfloat16 or float32, not ", dtype);
  auto index = ids.contiguous();
  const int64_t n = index.size(0), cols = table.in_features;
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < table.out_features, "token id ", id[i], " is outside the table's ", table.out_features, " rows");
  }
  auto out = torch::empty({n, cols}, torch::TensorOptions().dtype(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t group = id[i] / GROUP_ROWS, lane = id[i] % GROUP_ROWS;
    const uint8_t* base = table.data + group * table.blocks * Q8_RECORD;
    for (int64_t b = 0; b < table.blocks; ++b) {
      const uint8_t* rec = base + b * Q8_RECORD;
      uint16_t dh;
      std::memcpy(&dh, rec + 512 + 2 * lane, 2);
      const float d = half_to_float(dh);
      for (int64_t k = 0; k < QK; ++k) {
        const float v = static_cast<float>(static_cast<int32_t>(rec[(k / 4) * 64 + lane * 4 + k % 4]) - 128) * d;
        if (dtype == torch::kBFloat16) {
          out.data_ptr<c10::BFloat16>()[i * cols + b * QK + k] = narrow_to(v, static_cast<c10::BFloat16*>(nullptr));
        } else {
          out.data_ptr<float>()[i * cols + b * QK + k] = v;
        }
      }
    }
  }
  return out;
}

torch::Tensor qhead(torch::Tensor hidden, torch::Tensor norm_w, double eps, torch::Tensor head_w, int64_t kind,
                    std::string isa_name) {
  const PackedWeight head = check_weight(head_w, kind);
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == head.in_features, "hidden must be [rows, ", head.in_features, "]");
  auto x = hidden.contiguous();
  check_rows(x, head.in_features, "hidden");
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == x.size(1) && norm_w.scalar_type() == x.scalar_type() &&
                  norm_w.is_contiguous(),
              "the norm weight must be [", x.size(1), "] of hidden's dtype");
  const Isa isa = parse_isa(isa_name);
  QuantRows a;
  const int64_t rows = x.size(0);
  if (x.scalar_type() == torch::kBFloat16) {
    add_norm_quantize<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), nullptr, norm_w.data_ptr<c10::BFloat16>(), rows,
                                     x.size(1), eps, a);
  } else {
    add_norm_quantize<float>(x.data_ptr<float>(), nullptr, norm_w.data_ptr<float>(), rows, x.size(1), eps, a);
  }
  auto out = torch::empty({rows, head.out_features}, x.options().dtype(torch::kFloat));
  qmatmul_rows(head, isa, a, out.data_ptr<float>(), head.out_features);
  return out;
}
