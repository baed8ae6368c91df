// Small per-layer ops fused for CPU decode steps, where each PyTorch op costs more in dispatch
// than in arithmetic: a residual add with RMSNorm, and rotary embedding in place. Both round
// exactly where the PyTorch ops they replace do, so bfloat16 results match theirs.
#pragma once

#include "native.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace kvbank {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as PyTorch does; NaN stays NaN.
inline float narrow_to(float x, float*) { return x; }
inline c10::BFloat16 narrow_to(float x, c10::BFloat16*) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  return out;
}
template <typename T>
inline float round_as(float x) {
  return widen(narrow_to(x, static_cast<T*>(nullptr)));
}

template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t dim, int64_t x_stride,
                       double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      T* src = xr;
      if (residual != nullptr) {
        T* res = residual + r * dim;
        for (int64_t d = 0; d < dim; ++d) res[d] = narrow_to(widen(xr[d]) + widen(res[d]), static_cast<T*>(nullptr));
        src = res;
      }
      float squares = 0.0f;
      for (int64_t d = 0; d < dim; ++d) {
        const float v = widen(src[d]);
        squares += v * v;
      }
      // As torch.nn.functional.rms_norm: float32 throughout, one rounding at the end.
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(dim) + static_cast<float>(eps));
      T* o = out + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        o[d] = narrow_to(widen(src[d]) * inv * widen(weight[d]), static_cast<T*>(nullptr));
      }
    }
  });
}

template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t dim, int64_t x_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    float rotated[512];
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * dim;
      const T* s = sin + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + r * x_stride + h * dim;
        for (int64_t d = 0; d < dim; ++d) rotated[d] = widen(v[d < half ? d + half : d - half]);
        for (int64_t d = 0; d < dim; ++d) {
          const float a = round_as<T>(widen(v[d]) * widen(c[d]));
          const float b = round_as<T>(rotated[d] * widen(s[d]));
          v[d] = narrow_to(a + b, static_cast<T*>(nullptr));
        }
      }
    }
  });
}

}  // namespace kvbank
