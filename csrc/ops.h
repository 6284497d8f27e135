// The torch ops of ops.cpp, for register.cpp.
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
int64_t read_probe(torch::Tensor buf);
double int8_peak_gops(int64_t iters);

}  // namespace a8w8
