// Greedy sampling: the index of each row's largest logit, as torch.argmax picks it (the first of
// equal maxima; a row holding NaN gives its first NaN), in one pass over rows the LM head has
// just written. torch's argmax is a serial index-tracking reduction, over a millisecond for 32
// rows of a 49k vocabulary; a vector pass is a tenth of that.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "native.h"

namespace {

using kvbank::Isa;

// Continues a scan that found no NaN before `begin`, with the best value and index so far: the
// first NaN from `begin` on, or the first index of the maximum.
int64_t argmax_tail(const float* x, int64_t begin, int64_t n, float best, int64_t at) {
  for (int64_t i = begin; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > best) {
      best = x[i];
      at = i;
    }
  }
  return at;
}

int64_t argmax_scalar(const float* x, int64_t n) { return std::isnan(x[0]) ? 0 : argmax_tail(x, 1, n, x[0], 0); }

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

#ifdef KVBANK_X86
KVBANK_BEGIN_TARGET(KVBANK_FEATURES_AVX2)
namespace w8 {
using namespace kvbank::w8;
#include "argmax.inc"
}  // namespace w8
KVBANK_END_TARGET

KVBANK_BEGIN_TARGET(KVBANK_FEATURES_AVX512)
namespace w16 {
using namespace kvbank::w16;
#include "argmax.inc"
}  // namespace w16
KVBANK_END_TARGET
#endif

}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits, std::string isa_name) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.stride(1) == 1 &&
                  logits.size(1) >= 1 && logits.size(1) <= std::numeric_limits<int32_t>::max(),
              "logits must be float32 [rows, vocab] with contiguous rows and 1 <= vocab < 2^31, got ",
              logits.scalar_type(), " ", logits.sizes());
  Isa isa = Isa::Scalar;
  if (isa_name == "auto") {
    kvbank::family_variant(kvbank::Family::Sampling, &isa);
  } else {
    TORCH_CHECK(kvbank::isa_from_name(isa_name, &isa) && kvbank::family_has_variant(kvbank::Family::Sampling, isa),
                "isa must be ", kvbank::family_isa_choices(kvbank::Family::Sampling, true), ", not ", isa_name);
    TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(kvbank::active_isa()), "this CPU (capped at ",
                kvbank::isa_name(kvbank::active_isa()), ") cannot run the ", isa_name, " path");
  }
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * stride;
#ifdef KVBANK_X86
      if (isa == Isa::Avx512) {
        o[r] = w16::argmax(row, n);
        continue;
      }
      if (isa == Isa::Avx2) {
        o[r] = w8::argmax(row, n);
        continue;
      }
#endif
      o[r] = argmax_scalar(row, n);
    }
  });
  return out;
}
