// torch.ops.pypto_cpu.* (what vLLM's torch.compile traces as opaque calls; their fake
// implementations are in vllm_pypto/kernels/ops.py) and the Python module vllm_pypto._C.

#include "ops.h"

TORCH_LIBRARY(pypto_cpu, m) {
  m.def("prepack(Tensor w) -> Tensor[]");
  m.def("a8w8_linear(Tensor x, Tensor packed, Tensor comp, Tensor weight_scale) -> Tensor");
  m.def("a8w8_gemm_s32(Tensor x, Tensor packed, Tensor comp, Tensor amax, int N) -> Tensor");
  m.def("a8w8_linear_q(Tensor q, Tensor scale, Tensor packed, Tensor comp, Tensor weight_scale) -> Tensor");
  m.def("rmsnorm_quant(Tensor x, Tensor? residual, Tensor gamma, float eps, bool deferred) -> Tensor[]");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("silu_mul_quant(Tensor gate_up) -> Tensor[]");
  m.def("gate_up_silu_quant(Tensor q, Tensor scale, Tensor packed, Tensor comp, Tensor weight_scale) -> Tensor[]");
  m.def("qk_norm_rope_cache(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor q_gamma, Tensor k_gamma, "
        "float eps, Tensor cos_sin, Tensor(a!)? kv_cache, Tensor? slots, str interior) -> Tensor");
  m.def("decoder_layer(Tensor x, Tensor? residual, Tensor positions, Tensor[] weights, int layer, int num_heads, "
        "int num_kv_heads, float eps, float qk_eps, Tensor cos_sin, float scale, int sliding_window, float softcap, "
        "bool deferred, bool fused_gate_up_silu, bool native_decode) -> Tensor[]");
  m.def("decode_attention(Tensor q, Tensor kv_cache, Tensor seq_lens, Tensor block_table, int num_kv_heads, "
        "float scale, str interior) -> Tensor");
  m.def("top_candidates(Tensor logits, int width) -> Tensor[]");
  m.def("gumbel_argmax_at(Tensor vals, Tensor idx, Tensor seeds) -> Tensor");
}

TORCH_LIBRARY_IMPL(pypto_cpu, CPU, m) {
  m.impl("prepack", &a8w8::prepack);
  m.impl("a8w8_linear", &a8w8::a8w8_linear);
  m.impl("a8w8_gemm_s32", &a8w8::a8w8_gemm_s32);
  m.impl("a8w8_linear_q", &a8w8::a8w8_linear_q);
  m.impl("rmsnorm_quant", &a8w8::rmsnorm_quant);
  m.impl("silu_mul", &a8w8::silu_mul);
  m.impl("silu_mul_quant", &a8w8::silu_mul_quant);
  m.impl("gate_up_silu_quant", &a8w8::gate_up_silu_quant);
  m.impl("qk_norm_rope_cache", &a8w8::qk_norm_rope_cache);
  m.impl("decoder_layer", &a8w8::decoder_layer);
  m.impl("decode_attention", &a8w8::decode_attention);
  m.impl("top_candidates", &a8w8::top_candidates);
  m.impl("gumbel_argmax_at", &a8w8::gumbel_argmax_at);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &a8w8::isa, "the ISA path in use: amx, avx512, avx_vnni, avx2, or none");
  m.def("isa_paths", &a8w8::isa_paths, "the ISA paths this CPU runs, best first");
  m.def("set_isa", &a8w8::set_isa, "use this path (one of isa_paths(), or auto: the best)");
  m.def("amx_min_m", &a8w8::amx_min_m, "rows from which the AMX path uses tiles");
  m.def("set_amx_min_m", &a8w8::set_amx_min_m, "change that threshold (benchmarks)");
  m.def("int8_peak_gops", &a8w8::int8_peak_gops, "int8 multiply-add peak from registers, all threads, active path");
  m.def("decoder_layer_step", &a8w8::decoder_layer_step,
        "this step's KV caches (by layer), slot mapping and attention metadata for decoder_layer");
  m.def("decoder_layer_step_end", &a8w8::decoder_layer_step_end, "drop them after the forward");
  m.def("read_probe", &a8w8::read_probe, "read a buffer once with the active path's loads (bandwidth probe)");
}
