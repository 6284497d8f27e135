// The 256-bit paths, for x86-64 CPUs without AVX-512 (AMD EPYC Rome/Milan, Intel before Ice
// Lake): plain AVX2 (+FMA) and AVX-VNNI (256-bit vpdpbusd, e.g. Alder Lake, Zen 5). They share
// the 8-lane row ops below, which round exactly where the AVX-512 ones do; only the GEMM
// (gemm256.inc) differs between them. Lanes past a row's end go through small copies, never
// past the row.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "a8w8.h"
#include "avx2.h"

#define AVX2_TARGET __attribute__((target("avx2,fma")))

namespace a8w8::avx2 {

namespace {

AVX2_TARGET inline __m256 load8_f32(const float* p, int64_t n) {
  alignas(32) float t[8] = {};
  if (n < 8) std::memcpy(t, p, n * 4), p = t;
  return _mm256_loadu_ps(p);
}
AVX2_TARGET inline __m256i load8_i32(const int32_t* p, int64_t n) {
  alignas(32) int32_t t[8] = {};
  if (n < 8) std::memcpy(t, p, n * 4), p = t;
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// The epilogue for 8 channels from n (cnt of them): int32 out, or (acc * ws[n]) * as in bf16.
template <bool I32>
AVX2_TARGET inline void store8(__m256i acc, __m256 ws, float as, char* yrow, int64_t n, int64_t cnt) {
  if constexpr (I32) {
    int32_t* y = reinterpret_cast<int32_t*>(yrow) + n;
    if (cnt >= 8) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), acc);
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), acc);
    std::memcpy(y, t, cnt * 4);
  } else {
    const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), ws), _mm256_set1_ps(as));
    store8_bf16(reinterpret_cast<uint16_t*>(yrow) + n, to_bf16(v), cnt);
  }
}

AVX2_TARGET inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// q = clamp(rint(x * (127 / amax)), -127, 127) for 8 lanes, as int32.
AVX2_TARGET inline __m256i quant8(__m256 x, __m256 inv) {
  __m256 v = _mm256_round_ps(_mm256_mul_ps(x, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
  return _mm256_cvtps_epi32(v);
}

}  // namespace

// As the AVX-512 quantize_row (a8w8.h), 32 values a step.
AVX2_TARGET void quantize_row(const uint16_t* x, int64_t K, int64_t Kp, uint8_t* out, float* scale,
                              const float* given, bool u8) {
  const uint8_t zero = u8 ? 128 : 0;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = _mm256_and_ps(load8_bf16(x + k, K - k), absmask);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ));
    vmax = _mm256_max_ps(vmax, v);
  }
  const float amax = given ? *given : std::max(hmax(vmax), 1e-4f);
  if (_mm256_movemask_ps(bad) || !std::isfinite(amax)) {
    std::memset(out, zero, Kp);
    *scale = NAN;
    return;
  }
  const __m256 inv = _mm256_set1_ps(127.0f / amax);  // a true division, as the spec says
  const __m256i flip = _mm256_set1_epi8(u8 ? static_cast<char>(0x80) : 0);  // u8 = q + 128: q's top bit flipped
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);         // undo the packs' lane interleave
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m256i q0 = quant8(load8_bf16(x + k), inv), q1 = quant8(load8_bf16(x + k + 8), inv);
    const __m256i q2 = quant8(load8_bf16(x + k + 16), inv), q3 = quant8(load8_bf16(x + k + 24), inv);
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));  // |q| <= 127: exact
    b = _mm256_xor_si256(_mm256_permutevar8x32_epi32(b, order), flip);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), b);
  }
  for (; k < K; k += 8) {
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), quant8(load8_bf16(x + k, K - k), inv));
    for (int64_t j = 0; j < std::min<int64_t>(8, K - k); ++j) out[k + j] = static_cast<uint8_t>(t[j]) ^ (u8 ? 0x80 : 0);
  }
  if (Kp > K) std::memset(out + K, zero, Kp - K);
  *scale = amax / 127.0f;
}

// As the AVX-512 rmsnorm_quant_row, with the fp64 squares in 4 x 4 partial sums.
AVX2_TARGET void rmsnorm_quant_row(const uint16_t* x, const uint16_t* res, const uint16_t* gamma, int64_t H,
                                   double eps, bool deferred, uint16_t* h, uint16_t* y, int8_t* q, float* scale) {
  __m256d ss[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  for (int64_t k = 0; k < H; k += 8) {
    const int64_t n = std::min<int64_t>(8, H - k);
    __m256 v = load8_bf16(x + k, n);
    if (res) {
      store8_bf16(h + k, to_bf16(_mm256_add_ps(v, load8_bf16(res + k, n))), n);
      v = load8_bf16(h + k, n);
    } else if (h != x) {
      std::memcpy(h + k, x + k, n * 2);
    }
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    const int s = (k / 8) % 2 * 2;
    ss[s] = _mm256_fmadd_pd(lo, lo, ss[s]);
    ss[s + 1] = _mm256_fmadd_pd(hi, hi, ss[s + 1]);
  }
  alignas(32) double part[4];
  _mm256_store_pd(part, _mm256_add_pd(_mm256_add_pd(ss[0], ss[1]), _mm256_add_pd(ss[2], ss[3])));
  const double var = ((part[0] + part[1]) + (part[2] + part[3])) / static_cast<double>(H);
  const float rinv = static_cast<float>(1.0 / std::sqrt(var + eps));
  const __m256 vr = _mm256_set1_ps(rinv);
  for (int64_t k = 0; k < H; k += 8) {
    const int64_t n = std::min<int64_t>(8, H - k);
    __m256 v = load8_bf16(h + k, n);
    const __m256 gm = load8_bf16(gamma + k, n);
    v = deferred ? _mm256_mul_ps(v, gm) : _mm256_mul_ps(_mm256_mul_ps(v, vr), gm);
    store8_bf16(y + k, to_bf16(v), n);
  }
  quantize_row(y, H, H, reinterpret_cast<uint8_t*>(q), scale, nullptr, false);
  if (deferred) *scale = *scale * rinv;
}

namespace {

// The AVX-512 path's exp_pd (isa_avx512.cpp says why it is exact enough), the same operations
// in the same order on 4 lanes; 2^n built through int32, as AVX2 has no fp64 -> int64 conversion.
AVX2_TARGET inline __m256d exp_pd(__m256d x) {
  const __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(6.93147180369123816490e-01), x);
  r = _mm256_fnmadd_pd(n, _mm256_set1_pd(1.90821492927058770002e-10), r);
  static constexpr double inv_fact[14] = {1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040,
                                          1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800,
                                          1.0 / 479001600, 1.0 / 6227020800};
  __m256d p = _mm256_set1_pd(inv_fact[13]);
  for (int k = 12; k >= 0; --k) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(inv_fact[k]));
  const __m256i ni = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n));  // |n| <= 1010 here: exact
  const __m256i e = _mm256_slli_epi64(_mm256_add_epi64(ni, _mm256_set1_epi64x(1023)), 52);
  return _mm256_mul_pd(p, _mm256_castsi256_pd(e));
}

// SiLU in fp64 rounded to fp32 for 4 lanes; lanes outside exp_pd's range take std::exp.
AVX2_TARGET inline __m128 silu4(__m128 g4) {
  const __m256d g = _mm256_cvtps_pd(g4), x = _mm256_sub_pd(_mm256_setzero_pd(), g);
  __m256d e = exp_pd(x);
  const __m256d ax = _mm256_and_pd(x, _mm256_castsi256_pd(_mm256_set1_epi64x(0x7FFFFFFFFFFFFFFF)));
  const int out = _mm256_movemask_pd(_mm256_cmp_pd(ax, _mm256_set1_pd(700.0), _CMP_NLE_UQ));  // or NaN
  if (out) {
    alignas(32) double xs[4], es[4];
    _mm256_store_pd(xs, x);
    _mm256_store_pd(es, e);
    for (int j = 0; j < 4; ++j)
      if (out >> j & 1) es[j] = std::exp(xs[j]);
    e = _mm256_load_pd(es);
  }
  return _mm256_cvtpd_ps(_mm256_div_pd(g, _mm256_add_pd(_mm256_set1_pd(1.0), e)));
}

struct DequantLanes {  // int32 sums through the fp32 epilogue, (acc * ws[n]) * as
  const int32_t* acc;
  const float* ws;
  float as;
  AVX2_TARGET __m256 operator()(int64_t k, int64_t n) const {
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(load8_i32(acc + k, n)), load8_f32(ws + k, n));
    return _mm256_mul_ps(v, _mm256_set1_ps(as));
  }
};

template <class G, class U>
AVX2_TARGET void silu_span(int64_t b, int64_t e, G gate, U up, uint16_t* y) {
  for (int64_t k = b; k < e; k += 8) {
    const int64_t n = std::min<int64_t>(8, e - k);
    const __m256 gv = gate(k, n);
    const __m256 s = _mm256_set_m128(silu4(_mm256_extractf128_ps(gv, 1)), silu4(_mm256_castps256_ps128(gv)));
    store8_bf16(y + k, to_bf16(_mm256_mul_ps(s, up(k, n))), n);
  }
}

// fp32 SiLU of every bf16 bit pattern, by silu4.
AVX2_TARGET void fill_silu_table(float* t) {
  for (int i = 0; i < 1 << 16; i += 4) {
    const __m128i bits = _mm_slli_epi32(_mm_add_epi32(_mm_set1_epi32(i), _mm_setr_epi32(0, 1, 2, 3)), 16);
    _mm_storeu_ps(t + i, silu4(_mm_castsi128_ps(bits)));
  }
}

}  // namespace

// The unfused SiLU looks up a bf16 gate's fp64 SiLU, as the AVX-512 path does (isa_avx512.cpp).
AVX2_TARGET void silu_mul_bf16(int64_t b, int64_t e, const uint16_t* gate, const uint16_t* up, uint16_t* y) {
  const float* t = bf16_table<fill_silu_table>();
  for (int64_t k = b; k < e; k += 8) {
    const int64_t n = std::min<int64_t>(8, e - k);
    // load8_bf16 leaves lanes past n at +0, whose bits index SiLU(+0)
    const __m256i g = _mm256_srli_epi32(_mm256_castps_si256(load8_bf16(gate + k, n)), 16);
    const __m256 s = _mm256_i32gather_ps(t, g, 4);
    store8_bf16(y + k, to_bf16(_mm256_mul_ps(s, load8_bf16(up + k, n))), n);
  }
}

AVX2_TARGET void silu_mul_acc(int64_t b, int64_t e, const int32_t* acc_gate, const int32_t* acc_up,
                              const float* ws_gate, const float* ws_up, float as, uint16_t* y) {
  silu_span(b, e, DequantLanes{acc_gate, ws_gate, as}, DequantLanes{acc_up, ws_up, as}, y);
}

AVX2_TARGET int64_t read_slice(const uint8_t* p, int64_t n) {
  __m256i acc = _mm256_setzero_si256();
  for (int64_t i = 0; i + 256 <= n; i += 256) {
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + i + PF_BYTES + 64 * l), _MM_HINT_T0);
    for (int j = 0; j < 256; j += 32)
      acc = _mm256_xor_si256(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + j)));
  }
  alignas(32) int64_t t[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), acc);
  return t[0] + t[1] + t[2] + t[3];
}

int64_t rows_held(int64_t M) { return M; }

namespace plain {
#define GEMM_TARGET AVX2_TARGET
#define GEMM_VNNI 0
#include "gemm256.inc"
#undef GEMM_VNNI
#undef GEMM_TARGET
}  // namespace plain

namespace vnni {
#define GEMM_TARGET __attribute__((target("avx2,fma,avxvnni")))
#define GEMM_VNNI 1
#include "gemm256.inc"
#undef GEMM_VNNI
#undef GEMM_TARGET
}  // namespace vnni

}  // namespace a8w8::avx2

namespace a8w8 {
const Kernels avx2_kernels = {
    "avx2", false, avx2::rows_held, avx2::quantize_row, avx2::plain::gemm, avx2::rmsnorm_quant_row,
    avx2::silu_mul_bf16, avx2::silu_mul_acc, avx2::read_slice, avx2::plain::peak_loop,
};
const Kernels avx_vnni_kernels = {
    "avx_vnni", true, avx2::rows_held, avx2::quantize_row, avx2::vnni::gemm, avx2::rmsnorm_quant_row,
    avx2::silu_mul_bf16, avx2::silu_mul_acc, avx2::read_slice, avx2::vnni::peak_loop,
};
}  // namespace a8w8
