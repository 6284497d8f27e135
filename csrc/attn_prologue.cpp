// Flag native_attn_prologue: what runs between the QKV GEMM and vLLM-CPU's attention kernel, as
// one op (reference: vllm_pypto/kernels/layer_ref.py qk_norm_rope_cache). Per-head RMSNorm of q and
// k (fp64 mean square, as the other norms), rotate-half RoPE from an fp32 cos|sin table, all in
// fp32 with one bf16 rounding, and K and V written into vLLM-CPU's paged cache at slot_mapping in
// the order its attention ISA reads them (kernels/ascend/paging.py INTERIORS).
//
// Plain C++ with no ISA attributes, so it is the same code on every ISA path; this translation unit
// is built without -mfma, so the compiler cannot contract the RoPE's a*b - c*d into an FMA, which
// would round once where the reference rounds twice.

#include <ATen/Parallel.h>

#include <cmath>

#include "ops.h"

namespace a8w8 {

namespace {

using bf16 = at::BFloat16;

// x bf16 [hd] -> fp32 x * rinv * gamma, rinv = 1/sqrt(mean(x^2) + eps) from an fp64 sum
void head_norm(const bf16* x, const bf16* gamma, int64_t hd, double eps, float* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < hd; ++i) {
    const double v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float rinv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(hd) + eps));
  for (int64_t i = 0; i < hd; ++i) out[i] = (static_cast<float>(x[i]) * rinv) * static_cast<float>(gamma[i]);
}

// rotate-half RoPE of fp32 x [hd] with cs = cos [hd/2] | sin [hd/2], rounded to bf16 once
void rope_round(const float* x, const float* cs, int64_t hd, bf16* out) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float c = cs[i], s = cs[half + i];
    const float a = x[i] * c, b = x[half + i] * s, e = x[half + i] * c, f = x[i] * s;
    out[i] = bf16(a - b);
    out[half + i] = bf16(e + f);
  }
}

// element offset of token slot t's dimension d inside a (block, head)'s K region and V region
struct Interior {
  bool amx;
  int64_t bs, hd;
  int64_t k(int64_t t, int64_t d) const {
    return amx ? (t / 16) * (16 * hd) + (d / 2) * 32 + (t % 16) * 2 + d % 2 : d * bs + t;
  }
  int64_t v(int64_t t, int64_t d) const {
    return amx ? (d / 16) * (16 * bs) + (t / 2) * 32 + (d % 16) * 2 + t % 2 : t * hd + d;
  }
};

}  // namespace

torch::Tensor qk_norm_rope_cache(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions,
                                 torch::Tensor q_gamma, torch::Tensor k_gamma, double eps, torch::Tensor cos_sin,
                                 std::optional<torch::Tensor> kv_cache, std::optional<torch::Tensor> slots,
                                 std::string interior) {
  const int64_t T = q.size(0), hd = q_gamma.numel();
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && v.dim() == 2 && k.size(0) == T && v.size(0) == T,
              "qk_norm_rope_cache: q, k, v must be [T, heads*head_dim]");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
                  v.scalar_type() == torch::kBFloat16,
              "qk_norm_rope_cache: q, k, v must be bf16");
  TORCH_CHECK(q.stride(1) == 1 && k.stride(1) == 1 && v.stride(1) == 1, "qk_norm_rope_cache: rows must be dense");
  TORCH_CHECK(hd % 2 == 0 && q.size(1) % hd == 0 && k.size(1) % hd == 0 && k.size(1) == v.size(1),
              "qk_norm_rope_cache: widths must be whole heads of ", hd);
  TORCH_CHECK(k_gamma.numel() == hd && q_gamma.scalar_type() == torch::kBFloat16 &&
                  k_gamma.scalar_type() == torch::kBFloat16,
              "qk_norm_rope_cache: q and k norm weights must be bf16 [head_dim]");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == hd && cos_sin.scalar_type() == torch::kFloat32 &&
                  cos_sin.is_contiguous(),
              "qk_norm_rope_cache: cos_sin must be fp32 [max_positions, head_dim]");
  TORCH_CHECK(positions.numel() == T, "qk_norm_rope_cache: one position per token");
  const int64_t nq = q.size(1) / hd, nkv = k.size(1) / hd;
  auto pos = positions.reshape({-1}).to(torch::kInt64).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos_sin.size(0), "qk_norm_rope_cache: position ", pp[t],
                " outside the cos/sin table of ", cos_sin.size(0), " positions");

  bf16* cache = nullptr;
  const int64_t* sp = nullptr;
  int64_t n_slots = 0, bs = 0;
  torch::Tensor slots64;
  if (kv_cache.has_value() && slots.has_value()) {
    const auto& kc = *kv_cache;
    TORCH_CHECK(kc.dim() == 4 && kc.size(1) == nkv && kc.size(3) == 2 * hd && kc.is_contiguous() &&
                    kc.scalar_type() == torch::kBFloat16,
                "qk_norm_rope_cache: expected vLLM-CPU's bf16 cache [blocks, ", nkv, ", block_size, ", 2 * hd,
                "], got ", kc.sizes());
    TORCH_CHECK(interior == "vec" || interior == "vec16" || interior == "amx",
                "qk_norm_rope_cache: unknown vLLM-CPU cache interior '", interior, "'");
    slots64 = slots->reshape({-1}).to(torch::kInt64).contiguous();
    n_slots = std::min<int64_t>(slots64.numel(), T);  // rows past the slots are padding
    sp = slots64.data_ptr<int64_t>();
    bs = kc.size(2);
    for (int64_t t = 0; t < n_slots; ++t)
      TORCH_CHECK(sp[t] < kc.size(0) * bs, "qk_norm_rope_cache: slot ", sp[t], " outside the cache");
    cache = kc.data_ptr<bf16>();
  }
  const Interior in{interior == "amx", bs, hd};

  auto out = torch::empty({T, nq * hd}, q.options());
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* kp = k.data_ptr<bf16>();
  const bf16* vp = v.data_ptr<bf16>();
  const bf16* qg = q_gamma.data_ptr<bf16>();
  const bf16* kg = k_gamma.data_ptr<bf16>();
  const float* table = cos_sin.data_ptr<float>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  // one task per (token, head): q heads first, then kv heads, which also write the cache
  at::parallel_for(0, T * (nq + nkv), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(hd);
    std::vector<bf16> kr(hd);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / (nq + nkv), h = i % (nq + nkv);
      const float* cs = table + pp[t] * hd;
      if (h < nq) {
        head_norm(qp + t * qs + h * hd, qg, hd, eps, xf.data());
        rope_round(xf.data(), cs, hd, op + t * nq * hd + h * hd);
        continue;
      }
      const int64_t kh = h - nq;
      if (cache == nullptr || t >= n_slots || sp[t] < 0) continue;  // no cache to write, or a padding row
      head_norm(kp + t * ks + kh * hd, kg, hd, eps, xf.data());
      rope_round(xf.data(), cs, hd, kr.data());
      const int64_t blk = sp[t] / bs, slot = sp[t] % bs;
      bf16* base = cache + (blk * nkv + kh) * (2 * bs * hd);
      const bf16* vrow = vp + t * vs + kh * hd;
      for (int64_t d = 0; d < hd; ++d) {
        base[in.k(slot, d)] = kr[d];
        base[bs * hd + in.v(slot, d)] = vrow[d];
      }
    }
  });
  return out;
}

}  // namespace a8w8
