// The Python module of kvbank's native kernels: the registry's state and the operators of the
// other units, declared in native.h (QuantStack in stack.h). Every unit compiles alone, with one
// job; what units share is declared in headers (matmul.h, fused.h, partials.h, dense_attention.h,
// quant_attention.h, cache_write.h, layers.h, simd.h), each including what it uses.
#include <torch/extension.h>

#include "native.h"
#include "quant_attention.h"
#include "stack.h"

#include <alloca.h>


// Fills `bytes` of stack below the call on every thread of the kernels' pool with 0xFF bytes (NaN as
// float32 and bfloat16), so that a kernel called next reads NaN from any scratch it did not write.
void poison_stacks(int64_t bytes) {
  TORCH_CHECK(bytes > 0 && bytes <= (1 << 20), "poison_stacks takes 1 to 1048576 bytes, got ", bytes);
  auto fill = [bytes] {
    uint8_t* buffer = static_cast<uint8_t*>(alloca(bytes));
    volatile uint8_t* out = buffer;
    for (int64_t i = 0; i < bytes; ++i) out[i] = 0xFF;
  };
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) fill();
  });
  fill();
}

// The KV formats the attention, cache-write and key kernels take, by the name of the codec that
// stores each: the one place Python learns their ids.
py::dict kv_formats() {
  py::dict formats;
  formats["dense"] = static_cast<int64_t>(kvbank::kBf16);
  formats["int8"] = static_cast<int64_t>(kvbank::kInt8);
  formats["fp8_e4m3"] = static_cast<int64_t>(kvbank::kFp8E4M3);
  formats["fp8_e5m2"] = static_cast<int64_t>(kvbank::kFp8E5M2);
  formats["int4"] = static_cast<int64_t>(kvbank::kInt4);
  formats["int2"] = static_cast<int64_t>(kvbank::kInt2);
  return formats;
}

// The registry's state: the CPU's level, the cap, the active level and each family's variant.
py::dict isa_report() {
  py::dict report, families;
  report["cpu"] = kvbank::isa_name(kvbank::cpu_isa());
  report["cap"] = kvbank::isa_name(static_cast<kvbank::Isa>(kvbank::isa_cap_storage().load()));
  report["active"] = kvbank::isa_name(kvbank::active_isa());
  for (int f = 0; f < kvbank::kFamilies; ++f) {
    kvbank::Isa variant;
    const auto family = static_cast<kvbank::Family>(f);
    families[kvbank::family_info(family).name] =
        kvbank::family_variant(family, &variant) ? py::cast(kvbank::isa_name(variant)) : py::none();
  }
  report["families"] = families;
  return report;
}

void set_isa_cap(const std::string& name) {
  kvbank::Isa cap;
  TORCH_CHECK(kvbank::isa_from_name(name, &cap), "unknown instruction-set level ", name,
              "; the levels are scalar, avx2, avx512, avx512_vnni, avx512_bf16, amx");
  kvbank::set_isa_cap(cap);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL: they touch no Python object once their arguments are converted, and a
  // server's event loop (health checks, streamed tokens, new requests) keeps running during a long step
  // instead of waiting for a whole prefill of every layer.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("isa_report", &isa_report,
        "The instruction-set registry: the CPU's level, the cap, the active level, and the variant each kernel family "
        "runs (None: the family has no variant at that level)");
  m.def("set_isa_cap", &set_isa_cap, py::arg("level"),
        "Cap the level every kernel family runs at (process-wide; a cap above the CPU's level leaves the CPU's)");
  m.def("dense_attention_isa", &dense_attention_isa, "The variant of the bfloat16 dense attention that runs now");
  m.def("paged_decode_attention", &paged_decode_attention, nogil, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("partition"),
        py::arg("starts") = py::none(),
        "Decode attention over a paged KV cache: q [n, kv_heads, group, dim], caches [blocks, block_size, kv_heads, "
        "dim], block tables [n, width] and context lengths [n] (int64), scale, partition (tokens per work item); "
        "with starts [n] (int64), row i reads positions starts[i] .. context_lens[i] - 1 (a sliding window)");
  m.def("add_rms_norm", &add_rms_norm, nogil, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        "RMSNorm of x, or of residual += x when a residual is given (updated in place); returns the normed rows");
  m.def("rope_", &rope_, nogil, "Rotary embedding in place on the first `heads` heads of x [rows, heads * dim]; cos/sin [rows, dim]");
  m.def("geglu", &geglu, nogil, py::arg("gate_up"),
        "gelu(gate) * up (tanh approximation, each op rounded to bfloat16) of bfloat16 rows [gate | up]");
  m.def("qmatmul_isa", &qmatmul_isa, "The variant the integer GGUF matmuls run now: amx, avx512_vnni, avx2 or scalar");
  m.def("qlinear", &qlinear, nogil, py::arg("x"), py::arg("w"), py::arg("kind"), py::arg("float_out") = false,
        py::arg("isa") = "auto",
        "x [rows, in] times packed GGUF weights (kind 4: Q4 records, 5: Q5, 8: Q8, 41/51: Q4/Q5 with float32 scales, 81: Q8 with "
        "float32 scales per 16 inputs), x quantized to 8 bits per 32; "
        "float32 out when float_out, else x's dtype");
  m.def("qlayer_attn_in", &qlayer_attn_in, nogil, py::arg("x"), py::arg("residual"), py::arg("norm_w"), py::arg("eps"),
        py::arg("qkv_w"), py::arg("kind"), py::arg("cos"), py::arg("sin"), py::arg("rope_heads"),
        py::arg("isa") = "auto",
        "A decoder layer up to attention: residual += x (in place; none: x is the residual), RMSNorm, the q/k/v "
        "projection (a list of records tensors side by side, with their kinds) and rotary embedding of the first "
        "rope_heads heads");
  m.def("qlayer_mlp", &qlayer_mlp, nogil, py::arg("attn"), py::arg("residual"), py::arg("o_w"), py::arg("o_kind"),
        py::arg("norm_w"), py::arg("eps"), py::arg("gate_up_w"), py::arg("gate_up_kind"), py::arg("down_w"),
        py::arg("down_kind"), py::arg("isa") = "auto",
        "A decoder layer after attention: the output projection added to the residual (in place), RMSNorm, gate/up, "
        "silu(gate) * up and the down projection, returned");
  m.def("q8_rows", &q8_rows, nogil, py::arg("records"), py::arg("ids"), py::arg("dtype"),
        "Rows of a table of Q8 records (an embedding lookup), dequantized and cast to dtype");
  m.def("qhead", &qhead, nogil, py::arg("hidden"), py::arg("norm_w"), py::arg("eps"), py::arg("head_w"), py::arg("kind"),
        py::arg("isa") = "auto", "Float32 logits: the final RMSNorm of hidden and the packed LM head");
  py::class_<QuantStack>(m, "QuantStack")
      .def(py::init<std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<int64_t>>,
                    std::vector<torch::Tensor>, double, int64_t, int64_t, int64_t, bool>(),
           py::arg("weights"), py::arg("kinds"), py::arg("norms"), py::arg("eps"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("gemma") = false,
           "Per layer: packed q/k/v, o, gate/up and down weights (each a list of records tensors side by side) "
           "with their kinds, and the two norm weights; gemma: six norms per layer (input, post-attention, "
           "pre-feedforward, post-feedforward, q per head, k per head) and GeGLU")
      .def_property_readonly("num_layers", &QuantStack::num_layers)
      .def("forward", &QuantStack::forward, nogil, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("step"),
           "Every layer for a step whose tokens all attend by rows (x [rows, hidden] bfloat16, cos/sin [rows, "
           "head_dim]); returns the last layer's output plus the residual");
  // The step's fields, as StackStep (stack.h) documents them; lists are assigned whole.
  py::class_<StackStep>(m, "StackStep", "One step of QuantStack.forward beyond its rows: caches and attention")
      .def(py::init<>())
      .def_readwrite("format", &StackStep::format)
      .def_readwrite("k_caches", &StackStep::k_caches)
      .def_readwrite("v_caches", &StackStep::v_caches)
      .def_readwrite("k_scales", &StackStep::k_scales)
      .def_readwrite("v_scales", &StackStep::v_scales)
      .def_readwrite("k_grids", &StackStep::k_grids)
      .def_readwrite("v_zeros", &StackStep::v_zeros)
      .def_readwrite("residual_ks", &StackStep::residual_ks)
      .def_readwrite("residual_vs", &StackStep::residual_vs)
      .def_readwrite("slot_mapping", &StackStep::slot_mapping)
      .def_readwrite("block_tables", &StackStep::block_tables)
      .def_readwrite("context_lens", &StackStep::context_lens)
      .def_readwrite("starts", &StackStep::starts)
      .def_readwrite("kivi_plan", &StackStep::kivi_plan)
      .def_readwrite("scratch_slots", &StackStep::scratch_slots)
      .def_readwrite("own_rows", &StackStep::own_rows)
      .def_readwrite("scale", &StackStep::scale)
      .def_readwrite("partition", &StackStep::partition)
      .def_readwrite("cos_local", &StackStep::cos_local)
      .def_readwrite("sin_local", &StackStep::sin_local)
      .def_readwrite("local_layers", &StackStep::local_layers)
      .def_readwrite("layer_groups", &StackStep::layer_groups)
      .def_readwrite("group_slots", &StackStep::group_slots)
      .def_readwrite("group_tables", &StackStep::group_tables)
      .def_readwrite("group_lens", &StackStep::group_lens)
      .def_readwrite("group_starts", &StackStep::group_starts);
  m.def("quant_decode_attention", &quant_decode_attention, nogil, py::arg("q"), py::arg("format"), py::arg("k_codes"),
        py::arg("k_scale"), py::arg("k_grid"), py::arg("v_codes"), py::arg("v_scale"), py::arg("v_zero"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("partition"),
        py::arg("scratch_k") = py::none(), py::arg("scratch_v") = py::none(), py::arg("own_rows") = py::none(),
        py::arg("isa") = "auto", py::arg("starts") = py::none(),
        "Decode attention read in place from a quantized paged cache (format 0 bfloat16 dense, 1 int8, 2 fp8_e4m3, 3 fp8_e5m2, "
        "4 int4, 5 int2: k_scale holds the key range bytes); int4/int2 rows read their own block from the scratch blocks (own_rows: a scratch row per "
        "row, or -1); isa: auto (the active variant), avx512_bf16 (int8/fp8 keys through bfloat16 tables), avx512 or avx2; "
        "with starts [n] (int64), row i reads positions starts[i] .. context_lens[i] - 1");
  m.def("quant_write_tokens", &quant_write_tokens, nogil, py::arg("x"), py::arg("format"), py::arg("codes"), py::arg("scale"),
        py::arg("slots"),
        "Quantize tokens [n, heads, dim] per token and head (format 1 int8, 2 fp8_e4m3, 3 fp8_e5m2) into the cache's "
        "codes and float16 scales at their slots, bit for bit as the codecs do");
  m.def("kivi_write", &kivi_write, nogil, py::arg("k"), py::arg("v"), py::arg("format"), py::arg("k_codes"),
        py::arg("k_ranges"), py::arg("k_grid"), py::arg("v_codes"), py::arg("v_scale"), py::arg("v_zero"),
        py::arg("residual_k"), py::arg("residual_v"), py::arg("plan"), py::arg("scratch_slots"),
        "A step's K/V [tokens, heads, dim] into an int4 (4) / int2 (5) KIVI layer: plan rows [block, residual slot, "
        "held, after] get scratch rows (returned, K and V); full blocks are quantized as the codecs do, the others' "
        "new tokens kept in their residual slots");
  m.def("rotate_key_blocks", &rotate_key_blocks, nogil, py::arg("codes"), py::arg("format"), py::arg("ranges"),
        py::arg("grids"), py::arg("src"), py::arg("dst"), py::arg("cos"), py::arg("sin"), py::arg("bf16_keys"),
        "Keys of blocks dst = keys of blocks src rotated by (cos, sin) [dim], in every layer given: dense caches (format 0, "
        "the layers' key caches) or int4 (4) / int2 (5) KIVI keys (codes, ranges, grids per layer), dequantized, rotated "
        "and rounded to the model's dtype (bf16_keys) and quantized again as the codecs and apply_rope do, bit for bit");
  m.def("read_key_blocks", &read_key_blocks, nogil, py::arg("codes"), py::arg("format"), py::arg("ranges"),
        py::arg("grids"), py::arg("ids"), py::arg("bf16_keys"),
        "Keys of blocks ids in every layer given, float32 [layers, n, block_size, heads, dim]: dense caches (format 0) "
        "as stored, int4 (4) / int2 (5) KIVI keys dequantized as KiviKeys.dequantize does, bit for bit");
  m.def("store_key_blocks", &store_key_blocks, nogil, py::arg("x"), py::arg("codes"), py::arg("format"),
        py::arg("ranges"), py::arg("grids"), py::arg("ids"),
        "Keys x, float32 [layers, n, block_size, heads, dim], quantized into int4 (4) / int2 (5) KIVI blocks ids of "
        "every layer given, as KiviKeys.quantize does, bit for bit");
  m.def("copy_rows", &copy_rows, nogil, py::arg("tensors"), py::arg("src"), py::arg("dst"),
        "Rows src -> rows dst (first dimension) in every contiguous tensor given, every source read before any "
        "destination is written");
  m.def("argmax_rows", &argmax_rows, nogil, py::arg("logits"), py::arg("isa") = "auto",
        "Each row's index of its largest value, as torch.argmax picks it (first maximum; first NaN), float32 rows");
  m.def("poison_stacks", &poison_stacks, py::arg("bytes") = 262144,
        "Fill stack below the call on every kernel thread with 0xFF bytes (NaN): a test calls it before a kernel to "
        "make reads of unwritten scratch show");
  m.def("kv_formats", &kv_formats, "KV format ids by codec name (\"dense\": a cache in the model dtype): the format argument "
        "of the attention, cache-write and key kernels");
  m.def("quant_decode_isas", &quant_decode_isas, "The versions of the quantized attention this CPU runs, best last");
  m.def("has_quant_decode", &has_quant_decode, "Whether the quantized attention runs natively here (any x86 CPU: its scalar variant at the least)");
}
