// The torch ops of ops.cpp, attn_prologue.cpp, decode_attention.cpp, decoder_layer.cpp and sampling.cpp, for
// register.cpp.
#pragma once

#include <torch/extension.h>

#include "a8w8.h"

namespace a8w8 {

std::vector<torch::Tensor> prepack(torch::Tensor w);
torch::Tensor a8w8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor comp, torch::Tensor weight_scale);
torch::Tensor a8w8_gemm_s32(torch::Tensor x, torch::Tensor packed, torch::Tensor comp, torch::Tensor amax, int64_t N);
torch::Tensor a8w8_linear_q(torch::Tensor q, torch::Tensor scale, torch::Tensor packed, torch::Tensor comp,
                            torch::Tensor weight_scale);
std::vector<torch::Tensor> rmsnorm_quant(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor gamma,
                                         double eps, bool deferred);
torch::Tensor silu_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> silu_mul_quant(torch::Tensor gate_up);
std::vector<torch::Tensor> gate_up_silu_quant(torch::Tensor q, torch::Tensor scale, torch::Tensor packed,
                                              torch::Tensor comp, torch::Tensor weight_scale);
torch::Tensor qk_norm_rope_cache(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions,
                                 torch::Tensor q_gamma, torch::Tensor k_gamma, double eps, torch::Tensor cos_sin,
                                 std::optional<torch::Tensor> kv_cache, std::optional<torch::Tensor> slots,
                                 std::string interior);
std::vector<torch::Tensor> decoder_layer(torch::Tensor x, std::optional<torch::Tensor> residual,
                                         torch::Tensor positions, std::vector<torch::Tensor> w, int64_t layer,
                                         int64_t num_heads, int64_t num_kv_heads, double eps, double qk_eps,
                                         torch::Tensor cos_sin, double scale, int64_t sliding_window, double softcap,
                                         bool deferred, bool fused_gate_up_silu, bool native_decode);
bool decode_attention_fits(int64_t num_heads, int64_t num_kv_heads, int64_t hd, const std::string& interior);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor seq_lens,
                               torch::Tensor block_table, int64_t num_kv_heads, double scale, std::string interior);
void decoder_layer_step(std::vector<torch::Tensor> kv_caches, std::optional<torch::Tensor> slots,
                        std::vector<torch::Tensor> meta, std::optional<torch::Tensor> dynamic_causal, bool causal,
                        int64_t num_actual_tokens, std::string interior);
void decoder_layer_step_end();
std::vector<torch::Tensor> top_candidates(torch::Tensor logits, int64_t width);
torch::Tensor gumbel_argmax_at(torch::Tensor vals, torch::Tensor idx, torch::Tensor seeds);
int64_t read_probe(torch::Tensor buf);
double int8_peak_gops(int64_t iters);

}  // namespace a8w8
