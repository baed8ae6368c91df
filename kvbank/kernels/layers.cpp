// The fused residual add + RMSNorm and rotary embedding as torch operators (their loops: layers.h).
#include "layers.h"


using namespace kvbank;

torch::Tensor add_rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, dim] with contiguous rows, got ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [", x.size(1), "] of x's dtype");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() && residual->scalar_type() == x.scalar_type(),
                "residual must be a contiguous tensor shaped and typed like x");
  }
  auto out = torch::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), dim = x.size(1);
  switch (x.scalar_type()) {
    case torch::kBFloat16:
      add_rms_norm_rows(x.data_ptr<c10::BFloat16>(), residual ? residual->data_ptr<c10::BFloat16>() : nullptr,
                        weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, dim, x.stride(0), eps);
      break;
    case torch::kFloat:
      add_rms_norm_rows(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr, weight.data_ptr<float>(),
                        out.data_ptr<float>(), rows, dim, x.stride(0), eps);
      break;
    default: TORCH_CHECK(false, "add_rms_norm supports bfloat16 and float32, not ", x.scalar_type());
  }
  return out;
}

void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, heads * dim] with contiguous rows");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "cos and sin must be contiguous [rows, dim]");
  const int64_t dim = cos.size(1);
  TORCH_CHECK(dim % 2 == 0 && dim <= 512 && heads * dim <= x.size(1), "rotary dim ", dim, " x ", heads,
              " heads does not fit rows of ", x.size(1));
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "cos/sin must match x's dtype");
  switch (x.scalar_type()) {
    case torch::kBFloat16:
      rope_rows(x.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(), x.size(0),
                heads, dim, x.stride(0));
      break;
    case torch::kFloat:
      rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), heads, dim, x.stride(0));
      break;
    default: TORCH_CHECK(false, "rope_ supports bfloat16 and float32, not ", x.scalar_type());
  }
}
