// Flag native_attn_prologue: what runs between the QKV GEMM and vLLM-CPU's attention kernel, as
// one op (reference: vllm_pypto/kernels/layer_ref.py qk_norm_rope_cache). Per-head RMSNorm of q and
// k (fp64 mean square, as the other norms), rotate-half RoPE from an fp32 cos|sin table, all in
// fp32 with one bf16 rounding, and K and V written into vLLM-CPU's paged cache at slot_mapping in
// the order its attention ISA reads them (kernels/ascend/paging.py INTERIORS).
//
// AVX2 without FMA, the same code on every ISA path (all of them have AVX2): nothing here may
// contract the RoPE's a*b - c*d into an FMA, which would round once where the reference rounds twice.

#include <ATen/Parallel.h>

#include <cmath>

#include "avx2.h"
#include "ops.h"

namespace a8w8 {

using bf16 = at::BFloat16;

// AVX2 code in a8w8::avx2, where the ISA checks (test_native_cpu.py) expect 256-bit registers
namespace avx2 {
namespace {

// One head: x bf16 [hd] -> bf16 out [hd], RMS-normed (rinv = 1/sqrt(mean(x^2) + eps)), times
// gamma, and rotated with cs = cos [hd/2] | sin [hd/2]; hd a multiple of 16 (every head size
// vLLM-CPU's attention takes). The squares of bf16 values are exact in fp64 and so, in practice,
// is their sum in any order (the reference's torch reduction has its own): 4 x 4 partial sums.
// AVX2 without FMA, so a*c - b*s rounds after each product as in the reference.
AVX2_ONLY_TARGET void norm_rope(const bf16* x, const bf16* gamma, int64_t hd, double eps, const float* cs,
                                float* xf, bf16* out) {
  const auto* xb = reinterpret_cast<const uint16_t*>(x);
  const auto* gb = reinterpret_cast<const uint16_t*>(gamma);
  __m256d ss[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  for (int64_t i = 0; i < hd; i += 8) {
    const __m256 v = load8_bf16(xb + i);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    const int p = (i / 8) % 2 * 2;
    ss[p] = _mm256_add_pd(ss[p], _mm256_mul_pd(lo, lo));
    ss[p + 1] = _mm256_add_pd(ss[p + 1], _mm256_mul_pd(hi, hi));
  }
  alignas(32) double part[4];
  _mm256_store_pd(part, _mm256_add_pd(_mm256_add_pd(ss[0], ss[1]), _mm256_add_pd(ss[2], ss[3])));
  const double sum = (part[0] + part[1]) + (part[2] + part[3]);
  const __m256 rinv = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(hd) + eps)));
  for (int64_t i = 0; i < hd; i += 8)
    _mm256_storeu_ps(xf + i, _mm256_mul_ps(_mm256_mul_ps(load8_bf16(xb + i), rinv), load8_bf16(gb + i)));
  const int64_t half = hd / 2;
  auto* ob = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < half; i += 8) {
    const __m256 a = _mm256_loadu_ps(xf + i), b = _mm256_loadu_ps(xf + half + i);
    const __m256 c = _mm256_loadu_ps(cs + i), sn = _mm256_loadu_ps(cs + half + i);
    store8_bf16(ob + i, to_bf16(_mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, sn))));
    store8_bf16(ob + half + i, to_bf16(_mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, sn))));
  }
}

}  // namespace
}  // namespace avx2

namespace {

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
  TORCH_CHECK(__builtin_cpu_supports("avx2"), "qk_norm_rope_cache: this CPU has no AVX2, which the kernel is built for");
  TORCH_CHECK(hd % 16 == 0 && q.size(1) % hd == 0 && k.size(1) % hd == 0 && k.size(1) == v.size(1),
              "qk_norm_rope_cache: widths must be whole heads of ", hd, " (a multiple of 16)");
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
  // one task per (token, head): q heads first, then kv heads, which also write the cache. A task
  // takes well under a microsecond: a decode step's few heads run on the calling thread, not a
  // forked team.
  at::parallel_for(0, T * (nq + nkv), 64, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(hd);
    std::vector<bf16> kr(hd);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / (nq + nkv), h = i % (nq + nkv);
      const float* cs = table + pp[t] * hd;
      if (h < nq) {
        avx2::norm_rope(qp + t * qs + h * hd, qg, hd, eps, cs, xf.data(), op + t * nq * hd + h * hd);
        continue;
      }
      const int64_t kh = h - nq;
      if (cache == nullptr || t >= n_slots || sp[t] < 0) continue;  // no cache to write, or a padding row
      avx2::norm_rope(kp + t * ks + kh * hd, kg, hd, eps, cs, xf.data(), kr.data());
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
