// The torch ops (registered in register.cpp) on whichever ISA path isa.cpp chose: prepacking,
// the A8W8 GEMMs with per-token quantization in front and the fp32 epilogue behind, and the
// model class's fused layer ops (reference: vllm_pypto/kernels/layer_ref.py).

#include "ops.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cstring>

namespace a8w8 {

// Weight tile t of an int8 [N,K] weight into its packed place, 64 K at a time for all its
// channels (so the 16 lines written stay in L1), and comp = 128 colsum. Everything by value, as
// flip_rows below says why.
void pack_tile(const int8_t* __restrict w, int8_t* __restrict dst, int64_t t, int64_t N, int64_t K, int64_t Kp,
               int32_t* __restrict comp) {
  const int64_t c1 = std::min<int64_t>(NT, N - t * NT);
  for (int64_t k0 = 0; k0 < K; k0 += KA) {
    const int64_t kn = std::min<int64_t>(KA, K - k0);
    int8_t* d = dst + (t * (Kp / 4) + k0 / 4) * 256;
    for (int64_t c = 0; c < c1; ++c) {
      const int8_t* row = w + (t * NT + c) * K + k0;
      if (kn == KA) {
        for (int64_t j = 0; j < KA / 4; ++j) std::memcpy(d + j * 256 + c * 4, row + 4 * j, 4);
      } else {
        for (int64_t k = 0; k < kn; ++k) d[k / 4 * 256 + c * 4 + k % 4] = row[k];
      }
    }
  }
  for (int64_t c = 0; c < c1; ++c) {
    const int8_t* row = w + (t * NT + c) * K;
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += row[k];
    comp[t * NT + c] = 128 * sum;
  }
}

// int8 [N,K] -> (packed int8 [Np/64, Kp/4, 256], comp int32 [Np])
std::vector<torch::Tensor> prepack(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kInt8 && w.dim() == 2, "prepack: expected an int8 [N,K] weight");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Np = round_up(N, NT), Kp = round_up(K, KA);
  auto packed = torch::zeros({Np / NT, Kp / 4, 256}, torch::kInt8);
  auto comp = torch::zeros({Np}, torch::kInt32);
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* cp = comp.data_ptr<int32_t>();
  at::parallel_for(0, Np / NT, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) pack_tile(src, dst, t, N, K, Kp, cp);
  });
  return {packed, comp};
}

namespace {

// Quantized activation rows (Kp bytes each, row_stride(Kp) apart, in the path's encoding) with their fp32 scales.
struct Act {
  const Kernels& k;
  std::vector<uint8_t> a;
  std::vector<float> scale;
  int64_t M, Kp;
  Act(const Kernels& k_, int64_t M_, int64_t Kp_) : k(k_), M(M_), Kp(Kp_) {
    a.assign(k.rows_held(M) * lda(), k.u8 ? 128 : 0);  // extra rows: q = 0
    scale.resize(M);
  }
  int64_t lda() const { return row_stride(Kp); }  // as Gemm::lda()
};

// bf16 rows (optionally with a given amax per row) into `act`.
void quantize_rows(const torch::Tensor& x2, const float* given_amax, Act& act) {
  const int64_t K = x2.size(1);
  const auto* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  at::parallel_for(0, act.M, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      act.k.quantize_row(xp + r * K, K, act.Kp, act.a.data() + r * act.lda(), act.scale.data() + r,
                         given_amax ? given_amax + r : nullptr, act.k.u8);
  });
}

// Rows of K bytes, each XOR flip, into rows lda apart. Its own function with everything by value:
// a byte store may alias any pointer or size read through a reference (a lambda's captures, the
// vector behind act.a), and GCC then reloads them every byte and keeps the loop scalar (about a
// byte a cycle: 7 ms of a 130-token 0.6B prefill on a Xeon).
void flip_rows(const uint8_t* __restrict src, uint8_t* __restrict dst, int64_t rows, int64_t K, int64_t lda,
               uint8_t flip) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) dst[r * lda + k] = src[r * K + k] ^ flip;
}

// Already-quantized s8 rows (q, scale) into `act`: u8 = q + 128 is q with its top bit flipped.
void load_rows(const torch::Tensor& q2, const torch::Tensor& scale, Act& act) {
  const int64_t K = q2.size(1), lda = act.lda();
  const auto* qp = reinterpret_cast<const uint8_t*>(q2.data_ptr<int8_t>());
  uint8_t* ap = act.a.data();
  const uint8_t flip = act.k.u8 ? 0x80 : 0;
  at::parallel_for(0, act.M, 16, [&](int64_t b, int64_t e) { flip_rows(qp + b * K, ap + b * lda, e - b, K, lda, flip); });
  std::memcpy(act.scale.data(), scale.data_ptr<float>(), act.M * sizeof(float));
}

// Every weight tile over `act`, split over threads by tile; y is bf16 [M,N] through the epilogue,
// or int32 [M,N] raw sums.
void run_gemm(const Act& act, const torch::Tensor& packed, const torch::Tensor& comp, const float* ws,
              torch::Tensor& y) {
  TORCH_CHECK(packed.size(1) * 4 == act.Kp, "activation rows do not fit the packed weight");
  const Gemm g{act.a.data(),  act.scale.data(), act.M, act.Kp, y.size(1), packed.data_ptr<int8_t>(),
               comp.data_ptr<int32_t>(), ws, static_cast<char*>(y.data_ptr()), y.size(1) * y.element_size(),
               y.scalar_type() == torch::kInt32};
  at::parallel_for(0, packed.size(0), 1, [&](int64_t tb, int64_t te) { act.k.gemm(g, tb, te); });
}

torch::Tensor flat_rows(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, const char* op) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16, op, ": x must be bf16");
  const int64_t K = x.size(-1);
  TORCH_CHECK(round_up(K, KA) == packed.size(1) * 4 && packed.size(0) * NT >= N, op,
              ": x does not fit the packed weight");
  return x.reshape({-1, K}).contiguous();
}

Act act_from_q(const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& packed, const char* op) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(), op, ": q must be int8 [M,K]");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == q.size(0), op,
              ": scale must be fp32 [M]");
  TORCH_CHECK(round_up(q.size(1), KA) == packed.size(1) * 4, op, ": q does not fit the packed weight");
  Act act(active(), q.size(0), packed.size(1) * 4);
  load_rows(q, scale, act);
  return act;
}

at::Tensor rows2d(const torch::Tensor& x, const char* op) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16, op, ": expected bf16");
  return x.reshape({-1, x.size(-1)}).contiguous();
}

// vLLM's merged gate_up output (gate first) as bf16 rows of even width 2I.
at::Tensor gate_up_rows(const torch::Tensor& gu, const char* op) {
  auto x2 = rows2d(gu, op);
  TORCH_CHECK(x2.size(1) % 2 == 0, op, ": gate_up width ", x2.size(1), " is odd (expected gate and up halves)");
  return x2;
}

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bits_out(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// One row of bf16(SiLU(gate) * up) -> per-token int8. Still the costliest elementwise op: the row
// is split over threads (serial when the caller already runs rows in parallel, where
// at::parallel_for does not nest).
template <class Span>
void silu_quant_row(const Kernels& k, int64_t I, Span span, uint16_t* y, int8_t* q, float* scale) {
  at::parallel_for(0, I, 512, [&](int64_t b, int64_t e) { span(b, e, y); });
  k.quantize_row(y, I, I, reinterpret_cast<uint8_t*>(q), scale, nullptr, false);
}

}  // namespace

// bf16 [..., K] x prepacked weight -> bf16 [..., N]; N = weight_scale.numel() (fp32).
torch::Tensor a8w8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor comp, torch::Tensor weight_scale) {
  TORCH_CHECK(weight_scale.dtype() == torch::kFloat32 && weight_scale.is_contiguous(), "bad weight_scale");
  const int64_t N = weight_scale.numel();
  auto x2 = flat_rows(x, packed, N, "a8w8_linear");
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto y = torch::empty({x2.size(0), N}, x.options());
  if (x2.size(0) > 0) {
    Act act(active(), x2.size(0), packed.size(1) * 4);
    quantize_rows(x2, nullptr, act);
    run_gemm(act, packed, comp, weight_scale.data_ptr<float>(), y);
  }
  return y.reshape(out_shape);
}

// bf16 [M, K] quantized with the given per-row amax (fp32 [M]) x prepacked weight -> int32 [M, N]
// exact sums (no epilogue), for tensor-parallel row shards that all-reduce them first.
torch::Tensor a8w8_gemm_s32(torch::Tensor x, torch::Tensor packed, torch::Tensor comp, torch::Tensor amax,
                            int64_t N) {
  auto x2 = flat_rows(x, packed, N, "a8w8_gemm_s32");
  TORCH_CHECK(amax.dtype() == torch::kFloat32 && amax.is_contiguous() && amax.numel() == x2.size(0),
              "a8w8_gemm_s32: amax must be fp32 [M]");
  auto y = torch::empty({x2.size(0), N}, x.options().dtype(torch::kInt32));
  if (x2.size(0) > 0) {
    Act act(active(), x2.size(0), packed.size(1) * 4);
    quantize_rows(x2, amax.data_ptr<float>(), act);
    run_gemm(act, packed, comp, nullptr, y);
  }
  return y;
}

// Already-quantized activations (q, scale) x prepacked weight -> bf16 [M, N].
torch::Tensor a8w8_linear_q(torch::Tensor q, torch::Tensor scale, torch::Tensor packed, torch::Tensor comp,
                            torch::Tensor weight_scale) {
  const int64_t N = weight_scale.numel();
  auto y = torch::empty({q.size(0), N}, q.options().dtype(torch::kBFloat16));
  if (q.size(0) == 0) return y;
  Act act = act_from_q(q, scale, packed, "a8w8_linear_q");
  run_gemm(act, packed, comp, weight_scale.data_ptr<float>(), y);
  return y;
}

// (x [+ residual]) -> (q int8 [M,H], scale fp32 [M], h bf16 [M,H]: the new residual)
std::vector<torch::Tensor> rmsnorm_quant(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor gamma,
                                         double eps, bool deferred) {
  auto x2 = rows2d(x, "rmsnorm_quant");
  const int64_t M = x2.size(0), H = x2.size(1);
  auto g = rows2d(gamma, "rmsnorm_quant gamma");
  TORCH_CHECK(g.numel() == H, "rmsnorm_quant: gamma has ", g.numel(), " values for rows of ", H);
  at::Tensor r2;
  if (residual) {
    r2 = rows2d(*residual, "rmsnorm_quant residual");
    TORCH_CHECK(r2.sizes() == x2.sizes(), "rmsnorm_quant: residual shape differs from x");
  }
  auto q = torch::empty({M, H}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({M}, x.options().dtype(torch::kFloat32));
  auto h = torch::empty_like(x2);  // never an alias of x: custom ops must not return views of inputs
  const Kernels& k = active();
  const uint16_t *xp = bits(x2), *rp = residual ? bits(r2) : nullptr, *gp = bits(g);
  uint16_t* hp = bits_out(h);
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    std::vector<uint16_t> y(H);
    for (int64_t r = b; r < e; ++r)
      k.rmsnorm_quant_row(xp + r * H, rp ? rp + r * H : nullptr, gp, H, eps, deferred, hp + r * H, y.data(),
                          q.data_ptr<int8_t>() + r * H, scale.data_ptr<float>() + r);
  });
  return {q, scale, h};
}

// gate_up bf16 [..., 2I] -> bf16(SiLU(gate) * up) [..., I] (the bf16 down-proj's input).
torch::Tensor silu_mul(torch::Tensor gu) {
  auto x2 = gate_up_rows(gu, "silu_mul");
  const int64_t M = x2.size(0), I = x2.size(1) / 2;
  auto out_shape = gu.sizes().vec();
  out_shape.back() = I;
  auto y = torch::empty({M, I}, gu.options());
  const Kernels& k = active();
  const uint16_t* xp = bits(x2);
  uint16_t* yp = bits_out(y);
  at::parallel_for(0, M * I, 512, [&](int64_t b, int64_t e) {
    for (int64_t r = b / I; r * I < e; ++r) {  // spans cut at row ends
      const uint16_t* row = xp + r * 2 * I;
      k.silu_mul_bf16(std::max(b, r * I) - r * I, std::min(e, (r + 1) * I) - r * I, row, row + I, yp + r * I);
    }
  });
  return y.reshape(out_shape);
}

// gate_up bf16 [M, 2I] (gate first, as vLLM's merged gate_up_proj) -> (q int8 [M,I], scale fp32 [M])
std::vector<torch::Tensor> silu_mul_quant(torch::Tensor gu) {
  auto x2 = gate_up_rows(gu, "silu_mul_quant");
  const int64_t M = x2.size(0), I = x2.size(1) / 2;
  auto q = torch::empty({M, I}, gu.options().dtype(torch::kInt8));
  auto scale = torch::empty({M}, gu.options().dtype(torch::kFloat32));
  const Kernels& k = active();
  const uint16_t* xp = bits(x2);
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    std::vector<uint16_t> y(I);
    for (int64_t r = b; r < e; ++r) {
      const uint16_t* row = xp + r * 2 * I;
      auto span = [&](int64_t sb, int64_t se, uint16_t* yr) { k.silu_mul_bf16(sb, se, row, row + I, yr); };
      silu_quant_row(k, I, span, y.data(), q.data_ptr<int8_t>() + r * I, scale.data_ptr<float>() + r);
    }
  });
  return {q, scale};
}

// The merged gate_up GEMM with SiLU(gate) * up and the next quantization in its epilogue:
// gate and up stay fp32 (no bf16 rounding between the GEMM and SiLU) -> (q int8 [M,I], scale [M]).
std::vector<torch::Tensor> gate_up_silu_quant(torch::Tensor q, torch::Tensor scale, torch::Tensor packed,
                                              torch::Tensor comp, torch::Tensor weight_scale) {
  const int64_t N = weight_scale.numel(), I = N / 2, M = q.size(0);
  auto qo = torch::empty({M, I}, q.options());
  auto so = torch::empty({M}, scale.options());
  if (M == 0) return {qo, so};
  Act act = act_from_q(q, scale, packed, "gate_up_silu_quant");
  auto acc = torch::empty({M, N}, q.options().dtype(torch::kInt32));
  run_gemm(act, packed, comp, nullptr, acc);
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* ws = weight_scale.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    std::vector<uint16_t> y(I);
    for (int64_t r = b; r < e; ++r) {
      const int32_t* row = ap + r * N;
      const float as = act.scale[r];
      auto span = [&](int64_t sb, int64_t se, uint16_t* yr) {
        act.k.silu_mul_acc(sb, se, row, row + I, ws, ws + I, as, yr);
      };
      silu_quant_row(act.k, I, span, y.data(), qo.data_ptr<int8_t>() + r * I, so.data_ptr<float>() + r);
    }
  });
  return {qo, so};
}

// Streaming-read probe for the bandwidth limit the benchmarks compare against: every thread
// reads its slice once with the active path's widest loads (no stores), as the GEMV streams weights.
int64_t read_probe(torch::Tensor buf) {
  TORCH_CHECK(buf.is_contiguous(), "read_probe: contiguous buffer expected");
  const auto* p = static_cast<const uint8_t*>(buf.data_ptr());
  const int64_t n = buf.numel() * buf.element_size();
  const Kernels& k = active();
  std::atomic<int64_t> sum{0};
  at::parallel_for(0, n / 4096, 256, [&](int64_t b, int64_t e) { sum += k.read_slice(p + b * 4096, (e - b) * 4096); });
  return sum.load();
}

// Compute-peak probe, the other limit the benchmarks compare against: the active path's int8
// multiply-adds from registers only, on every thread at once, `iters` rounds each. Returns int8
// ops (2 per multiply-add) per second, summed over threads.
double int8_peak_gops(int64_t iters) {
  const Kernels& k = active();
  const int n = at::get_num_threads();
  std::atomic<int64_t> ops{0};
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) ops += k.peak_loop(iters);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return ops.load() / s / 1e9;
}

}  // namespace a8w8
