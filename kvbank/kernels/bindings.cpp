// The Python module of kvbank's native kernels, built as one translation unit: the PyTorch
// headers dominate the build time, so they are parsed once.
#include "native.h"

#include "layers.cpp"
#include "paged_decode.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache: q [n, kv_heads, group, dim], caches [blocks, block_size, kv_heads, "
        "dim], block tables [n, width] and context lengths [n] (int64), scale, partition (tokens per work item)");
  m.def("add_rms_norm", &add_rms_norm, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        "RMSNorm of x, or of residual += x when a residual is given (updated in place); returns the normed rows");
  m.def("rope_", &rope_, "Rotary embedding in place on the first `heads` heads of x [rows, heads * dim]; cos/sin [rows, dim]");
  m.def("has_bf16_fast_path", &has_bf16_fast_path, "Whether this CPU runs the AVX-512 bfloat16 path");
}
