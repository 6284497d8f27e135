// Flag native_decoder_layer: a whole Qwen3 decoder layer on vLLM-CPU as one op. The same ops the
// model class calls one by one with flag native_attn_prologue (rmsnorm_quant, a8w8_linear_q,
// qk_norm_rope_cache, vLLM-CPU's attention kernel, a8w8_linear, rmsnorm_quant, the gate_up GEMM with
// SiLU*up and quantization, a8w8_linear_q), called in the same order on the same tensors, so the
// output is the same bits; what goes is the Python and dispatch between them (about 150 us a
// layer on a 2-CPU host, docs/performance.md).
//
// What a layer needs of vLLM's forward context (its KV cache, the slot mapping, the attention
// metadata) is handed over once a step, before the compiled model runs (decoder_layer_step, from
// vllm_pypto/model/decoder_layer.py), so the compiled graph calls this op directly, with no Python
// in between.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include "ops.h"

namespace a8w8 {

namespace {

// vLLM-CPU's attention kernel, found in the dispatcher: vllm._C registers it when vLLM loads, and
// this extension does not link against vLLM.
const c10::OperatorHandle& vllm_cpu_attention() {
  static const c10::OperatorHandle op = [] {
    auto h = c10::Dispatcher::singleton().findSchema({"_C::cpu_attention_with_kv_cache", ""});
    TORCH_CHECK(h.has_value(), "decoder_layer: vLLM-CPU's _C::cpu_attention_with_kv_cache is not registered "
                "(import vllm._C first)");
    TORCH_CHECK(h->schema().arguments().size() == 18, "decoder_layer: _C::cpu_attention_with_kv_cache has the "
                "schema ", h->schema(), ", not the 18 arguments of vLLM 0.32 this op passes");
    return *h;
  }();
  return op;
}

// The order of the `weights` list (vllm_pypto/model/decoder_layer.py builds it).
enum W { IN_NORM, Q_NORM, K_NORM, POST_NORM, QKV, O = QKV + 3, GATE_UP = O + 3, DOWN = GATE_UP + 3, N_W = DOWN + 3 };

// f() under the name of the op it calls, so that the torch profiler (benchmarks/profile_step.py) sees
// the parts of the layer as it sees the separate ops; a flag test when no profiler runs.
template <class F>
auto as_op(const char* name, F&& f) {
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  return f();
}

torch::Tensor linear_q(const torch::Tensor& q, const torch::Tensor& scale, const std::vector<torch::Tensor>& w,
                       int i) {
  return as_op("pypto_cpu::a8w8_linear_q", [&] { return a8w8_linear_q(q, scale, w[i], w[i + 1], w[i + 2]); });
}

// This step's share of vLLM's forward context; the engine runs one forward at a time.
struct Step {
  std::vector<torch::Tensor> kv_caches;  // by layer index, an empty tensor where a layer has none; none: no step
  std::optional<torch::Tensor> slots;
  std::vector<torch::Tensor> meta;  // query_start_loc, seq_lens, block_table, scheduler_metadata; none: no attention
  std::optional<torch::Tensor> dynamic_causal;
  bool causal = true;
  int64_t num_actual_tokens = 0;
  std::string interior;
  bool decode_only = false;  // every sequence has one query token (query_start_loc is 0, 1, ..., n)
};
Step step;

}  // namespace

void decoder_layer_step(std::vector<torch::Tensor> kv_caches, std::optional<torch::Tensor> slots,
                        std::vector<torch::Tensor> meta, std::optional<torch::Tensor> dynamic_causal, bool causal,
                        int64_t num_actual_tokens, std::string interior) {
  TORCH_CHECK(meta.empty() || meta.size() == 4, "decoder_layer_step: meta is [query_start_loc, seq_lens, "
              "block_table, scheduler_metadata], or empty on a pass without attention");
  bool decode_only = false;
  if (!meta.empty() && meta[0].scalar_type() == torch::kInt32 && meta[0].is_contiguous() &&
      meta[1].numel() == num_actual_tokens && meta[0].numel() > num_actual_tokens) {
    const int32_t* qsl = meta[0].data_ptr<int32_t>();
    decode_only = true;
    for (int64_t i = 0; i <= num_actual_tokens; ++i) decode_only = decode_only && qsl[i] == i;
  }
  step = Step{std::move(kv_caches), std::move(slots), std::move(meta), std::move(dynamic_causal), causal,
              num_actual_tokens, std::move(interior), decode_only};
}

void decoder_layer_step_end() { step = Step{}; }

std::vector<torch::Tensor> decoder_layer(torch::Tensor x, std::optional<torch::Tensor> residual,
                                         torch::Tensor positions, std::vector<torch::Tensor> w, int64_t layer,
                                         int64_t num_heads, int64_t num_kv_heads, double eps, double qk_eps,
                                         torch::Tensor cos_sin, double scale, int64_t sliding_window, double softcap,
                                         bool deferred, bool fused_gate_up_silu, bool native_decode) {
  TORCH_CHECK(w.size() == N_W, "decoder_layer: expected ", int(N_W), " weight tensors, got ", w.size());
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(step.kv_caches.size()),
              "decoder_layer: no step context for layer ", layer, " (the model's forward sets it first)");
  const int64_t hd = w[Q_NORM].numel(), T = x.size(0);
  const torch::Tensor& kc = step.kv_caches[layer];
  const bool write = step.slots.has_value() && kc.numel() > 0;
  auto qsh = as_op("pypto_cpu::rmsnorm_quant", [&] { return rmsnorm_quant(x, residual, w[IN_NORM], eps, deferred); });
  // qsh: (q, scale, the new residual)
  auto qkv = linear_q(qsh[0], qsh[1], w, QKV);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * hd, "decoder_layer: the QKV width ", qkv.size(1),
              " is not ", num_heads, " + 2 x ", num_kv_heads, " heads of ", hd);
  auto q = qkv.narrow(1, 0, num_heads * hd), k = qkv.narrow(1, num_heads * hd, num_kv_heads * hd),
       v = qkv.narrow(1, (num_heads + num_kv_heads) * hd, num_kv_heads * hd);
  auto qr = as_op("pypto_cpu::qk_norm_rope_cache", [&] {
    return qk_norm_rope_cache(q, k, v, positions, w[Q_NORM], w[K_NORM], qk_eps, cos_sin,
                              write ? std::optional<torch::Tensor>(kc) : std::nullopt,
                              write ? step.slots : std::nullopt, step.interior);
  });
  torch::Tensor attn;
  const int64_t n = std::min(step.num_actual_tokens, T);
  if (step.meta.empty()) {
    attn = torch::zeros({T, num_heads * hd}, x.options());  // a warm-up or profiling pass: no attention
  } else if (native_decode && step.decode_only && step.causal && !step.dynamic_causal && sliding_window < 0 &&
             softcap == 0.0 && write && decode_attention_fits(num_heads, num_kv_heads, hd, step.interior)) {
    // flag native_decode_attention on a decode-only step (decode_attention.cpp)
    auto a = as_op("pypto_cpu::decode_attention", [&] {
      return decode_attention(qr.view({T, num_heads, hd}).narrow(0, 0, n), kc, step.meta[1], step.meta[2],
                              num_kv_heads, scale, step.interior);
    });
    if (n == T) {
      attn = a;
    } else {  // padding rows: zeros into the O GEMM, as below
      attn = torch::zeros({T, num_heads * hd}, x.options());
      attn.narrow(0, 0, n).copy_(a);
    }
  } else {
    TORCH_CHECK(write, "decoder_layer: attention metadata but no KV cache and slots for layer ", layer);
    attn = torch::empty({T, num_heads * hd}, x.options());
    auto kv = kc.view({kc.size(0), kc.size(1), 2 * kc.size(2), hd}).chunk(2, 2);
    const auto& m = step.meta;
    torch::jit::Stack st;
    st.reserve(18);
    for (const c10::IValue& a : std::initializer_list<c10::IValue>{
             qr.view({T, num_heads, hd}).narrow(0, 0, n), kv[0], kv[1], attn.view({T, num_heads, hd}).narrow(0, 0, n),
             m[0], m[1], scale, step.causal, c10::IValue(), sliding_window, m[2], softcap, m[3], c10::IValue(),
             step.dynamic_causal ? c10::IValue(*step.dynamic_causal) : c10::IValue(), 1.0, 1.0, std::string("auto")})
      st.push_back(a);
    vllm_cpu_attention().callBoxed(&st);
    if (n < T) attn.narrow(0, n, T - n).zero_();  // padding rows: defined values into the O GEMM
  }
  auto o = as_op("pypto_cpu::a8w8_linear", [&] { return a8w8_linear(attn, w[O], w[O + 1], w[O + 2]); });
  auto q2 = as_op("pypto_cpu::rmsnorm_quant", [&] { return rmsnorm_quant(o, qsh[2], w[POST_NORM], eps, deferred); });
  std::vector<torch::Tensor> act;
  if (fused_gate_up_silu) {
    act = as_op("pypto_cpu::gate_up_silu_quant",
                [&] { return gate_up_silu_quant(q2[0], q2[1], w[GATE_UP], w[GATE_UP + 1], w[GATE_UP + 2]); });
  } else {
    auto gu = linear_q(q2[0], q2[1], w, GATE_UP);
    act = as_op("pypto_cpu::silu_mul_quant", [&] { return silu_mul_quant(gu); });
  }
  return {linear_q(act[0], act[1], w, DOWN), q2[2]};
}

}  // namespace a8w8
