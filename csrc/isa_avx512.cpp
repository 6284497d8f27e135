// The AVX512-VNNI path: vpdpbusd (u8 x s8 -> s32) over 16 channels a register, 64-channel
// weight tiles streamed once per block of up to 6 rows, and 16-lane row ops.


#include <algorithm>
#include <cmath>
#include <cstring>

#include "avx512.h"

namespace a8w8::avx512 {

namespace {
// token rows per register block: 24 accumulators + 4 weights + 1 activation of the 32 zmm; against
// 4 rows, M = 16 ran 1.11-1.21x faster on a Zen 4 EPYC (three weight passes from L2, not four).
constexpr int64_t MR = 6;
}

int64_t rows_held(int64_t M) { return M; }

AVX512_TARGET void quantize_row(const uint16_t* xb, int64_t K, int64_t Kp, uint8_t* out, float* scale, const float* given,
                  bool u8) {
  const int zero = u8 ? 128 : 0;
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail_mask(K - k);
    __m512 v = _mm512_abs_ps(load_bf16(xb + k, m));
    bad |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);                       // NaN
    bad |= _mm512_mask_cmp_ps_mask(m, v, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);  // inf
    vmax = _mm512_max_ps(vmax, v);
  }
  const float amax = given ? *given : std::max(_mm512_reduce_max_ps(vmax), 1e-4f);
  if (bad || !std::isfinite(amax)) {
    std::memset(out, zero, Kp);
    *scale = NAN;
    return;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / amax);  // a true division, as the spec says
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail_mask(K - k);
    __m512 v = _mm512_mul_ps(load_bf16(xb + k, m), inv);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // half to even
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(zero));
    _mm_mask_storeu_epi8(out + k, m, _mm512_cvtepi32_epi8(q));
  }
  if (Kp > K) std::memset(out + K, zero, Kp - K);
  *scale = amax / 127.0f;
}

namespace {

// acc += u8 a x s8 w, through asm on named accumulators. With the intrinsic on an array of
// accumulators GCC copied every accumulator each step (or spilled them); this form with the
// prefetch below ran 1.23-1.54x faster on a Zen 4 EPYC (docs/performance.md, gemm_ab.py).
#define A8W8_DPBUSD(acc, a, w) asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(w))

// One 64-channel tile for R <= MR rows: 4 x R int32 accumulators, weights read once per block;
// R > 1 prefetches `pf`, its share of the next tile (a8w8.h).
template <int R, bool I32>
AVX512_TARGET void tile_kernel(const Gemm& g, const int8_t* wt, int64_t r0, int64_t n0, TilePrefetch pf) {
  static_assert(R >= 1 && R <= MR);
  const __m512i z = _mm512_setzero_si512();
  __m512i c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z;
  __m512i c20 = z, c21 = z, c22 = z, c23 = z, c30 = z, c31 = z, c32 = z, c33 = z;
  __m512i c40 = z, c41 = z, c42 = z, c43 = z, c50 = z, c51 = z, c52 = z, c53 = z;
  const int64_t Kp = g.Kp, lda = g.lda();
  const uint8_t* act = g.a + r0 * lda;
  for (int64_t gi = 0; gi < Kp / 4; ++gi) {
    const int8_t* w = wt + gi * 256;
    if constexpr (R == 1)
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(w + PF_BYTES + 64 * l), _MM_HINT_T0);
    else
      pf.step();
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
    const __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
    const uint8_t* ag = act + gi * 4;
#define A8W8_ROW(r)                                                                                     \
  {                                                                                                     \
    int32_t a4;                                                                                         \
    std::memcpy(&a4, ag + r * lda, 4);                                                                  \
    const __m512i a = _mm512_set1_epi32(a4);                                                            \
    A8W8_DPBUSD(c##r##0, a, w0);                                                                       \
    A8W8_DPBUSD(c##r##1, a, w1);                                                                       \
    A8W8_DPBUSD(c##r##2, a, w2);                                                                       \
    A8W8_DPBUSD(c##r##3, a, w3);                                                                       \
  }
    A8W8_ROW(0)
    if constexpr (R > 1) A8W8_ROW(1)
    if constexpr (R > 2) A8W8_ROW(2)
    if constexpr (R > 3) A8W8_ROW(3)
    if constexpr (R > 4) A8W8_ROW(4)
    if constexpr (R > 5) A8W8_ROW(5)
#undef A8W8_ROW
  }
  const __m512i acc[MR][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23},
                              {c30, c31, c32, c33}, {c40, c41, c42, c43}, {c50, c51, c52, c53}};
  for (int c = 0; c < 4; ++c) {
    const int64_t n = n0 + 16 * c;
    if (n >= g.N) break;
    const __mmask16 m = tail_mask(g.N - n);
    const __m512i cp = _mm512_maskz_loadu_epi32(m, g.comp + n);
    const __m512 ws = I32 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, g.ws + n);
    for (int r = 0; r < R; ++r)
      store16<I32>(acc[r][c], cp, ws, I32 ? 0.f : g.ascale[r0 + r], g.y + (r0 + r) * g.ldy, n, m);
  }
}

// Each row block prefetches its share of the next tile (M = 16 ran 1.02-1.14x faster on a Zen 4).
// A tile of one block (M <= 6) streams as fast as M = 1 without; prefetching it ahead as M = 1
// does ran 0.80-0.97x.
template <bool I32>
void tiles(const Gemm& g, int64_t tb, int64_t te) {
  const int64_t blocks = (g.M + MR - 1) / MR;
  for (int64_t t = tb; t < te; ++t) {
    const int8_t* wt = g.w + t * g.tile_bytes();
    for (int64_t r = 0, b = 0; r < g.M; r += MR, ++b) {
      const TilePrefetch pf = next_tile_share(g, wt, blocks > 1 && t + 1 < te, b, blocks);
      switch (std::min<int64_t>(MR, g.M - r)) {
        case 6: tile_kernel<6, I32>(g, wt, r, t * NT, pf); break;
        case 5: tile_kernel<5, I32>(g, wt, r, t * NT, pf); break;
        case 4: tile_kernel<4, I32>(g, wt, r, t * NT, pf); break;
        case 3: tile_kernel<3, I32>(g, wt, r, t * NT, pf); break;
        case 2: tile_kernel<2, I32>(g, wt, r, t * NT, pf); break;
        default: tile_kernel<1, I32>(g, wt, r, t * NT, pf); break;
      }
    }
  }
}

}  // namespace

void gemm(const Gemm& g, int64_t tb, int64_t te) { g.i32 ? tiles<true>(g, tb, te) : tiles<false>(g, tb, te); }

// residual add (bf16 out), fp64 mean square, y = bf16((h * rinv) * gamma) or, deferred,
// bf16(h * gamma) with rinv folded into the row's scale; then per-token int8. Row norms accumulate
// in fp64 (exact for bf16 squares in practice, so the sum order does not matter).
AVX512_TARGET void rmsnorm_quant_row(const uint16_t* x, const uint16_t* res, const uint16_t* gamma, int64_t H,
                                     double eps, bool deferred, uint16_t* h, uint16_t* y, int8_t* q, float* scale) {
  __m512d ss0 = _mm512_setzero_pd(), ss1 = _mm512_setzero_pd();
  for (int64_t k = 0; k < H; k += 16) {
    const __mmask16 m = tail_mask(H - k);
    __m512 v = load_bf16(x + k, m);
    if (res) {
      __m256i hb = to_bf16(_mm512_add_ps(v, load_bf16(res + k, m)));
      _mm256_mask_storeu_epi16(h + k, m, hb);
      v = load_bf16(h + k, m);
    } else if (h != x) {
      _mm256_mask_storeu_epi16(h + k, m, _mm256_maskz_loadu_epi16(m, x + k));
    }
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    ss0 = _mm512_fmadd_pd(lo, lo, ss0);
    ss1 = _mm512_fmadd_pd(hi, hi, ss1);
  }
  const double var = _mm512_reduce_add_pd(_mm512_add_pd(ss0, ss1)) / static_cast<double>(H);
  const float rinv = static_cast<float>(1.0 / std::sqrt(var + eps));
  const __m512 vr = _mm512_set1_ps(rinv);
  for (int64_t k = 0; k < H; k += 16) {
    const __mmask16 m = tail_mask(H - k);
    __m512 v = load_bf16(h + k, m), gm = load_bf16(gamma + k, m);
    v = deferred ? _mm512_mul_ps(v, gm) : _mm512_mul_ps(_mm512_mul_ps(v, vr), gm);
    _mm256_mask_storeu_epi16(y + k, m, to_bf16(v));
  }
  quantize_row(y, H, H, reinterpret_cast<uint8_t*>(q), scale, nullptr, false);
  if (deferred) *scale = *scale * rinv;
}

namespace {

// exp(x) for 8 fp64 lanes with |x| <= 700: Cody-Waite reduction x = n ln2 + r (ln2 split so
// that n * ln2_hi is exact), |r| <= ln2/2, Taylor to r^13 (truncation < 0.1 ulp), times 2^n.
// Within about 1 ulp of fp64, like the reference's own exp (the reference and this kernel can
// then differ only where the exact SiLU lies within ~1e-16 of an fp32 rounding boundary). The
// AVX2 path runs the same operations in the same order on 4 lanes.
AVX512_TARGET inline __m512d exp_pd(__m512d x) {
  const __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(1.4426950408889634)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), x);
  r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);
  static constexpr double inv_fact[14] = {1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040,
                                          1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800,
                                          1.0 / 479001600, 1.0 / 6227020800};
  __m512d p = _mm512_set1_pd(inv_fact[13]);
  for (int k = 12; k >= 0; --k) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(inv_fact[k]));
  const __m512i e = _mm512_slli_epi64(_mm512_add_epi64(_mm512_cvtpd_epi64(n), _mm512_set1_epi64(1023)), 52);
  return _mm512_mul_pd(p, _mm512_castsi512_pd(e));
}

// SiLU in fp64 rounded to fp32 (the reference's order) for 8 lanes; lanes outside exp_pd's
// range, NaN and inf take std::exp, so their overflow, -0 and NaN results are the reference's.
AVX512_TARGET inline __m256 silu_pd(__m256 g8) {
  const __m512d g = _mm512_cvtps_pd(g8), x = _mm512_sub_pd(_mm512_setzero_pd(), g);
  __m512d e = exp_pd(x);
  const __mmask8 out = _mm512_cmp_pd_mask(_mm512_abs_pd(x), _mm512_set1_pd(700.0), _CMP_NLE_UQ);  // or NaN
  if (out) {
    alignas(64) double xs[8], es[8];
    _mm512_store_pd(xs, x);
    _mm512_store_pd(es, e);
    for (int j = 0; j < 8; ++j)
      if (out >> j & 1) es[j] = std::exp(xs[j]);
    e = _mm512_load_pd(es);
  }
  return _mm512_cvtpd_ps(_mm512_div_pd(g, _mm512_add_pd(_mm512_set1_pd(1.0), e)));
}

// fp32 producers of 16 gate or up lanes (masked) for silu_span.
struct DequantLanes {  // int32 sums through the fp32 epilogue, (acc * ws[n]) * as
  const int32_t* acc;
  const float* ws;
  float as;
  AVX512_TARGET __m512 operator()(int64_t k, __mmask16 m) const {
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, acc + k)), _mm512_maskz_loadu_ps(m, ws + k));
    return _mm512_mul_ps(v, _mm512_set1_ps(as));
  }
};

template <class G, class U>
AVX512_TARGET void silu_span(int64_t b, int64_t e, G gate, U up, uint16_t* y) {
  for (int64_t k = b; k < e; k += 16) {
    const __mmask16 m = tail_mask(e - k);
    const __m512 gv = gate(k, m);
    const __m512 s = _mm512_insertf32x8(_mm512_castps256_ps512(silu_pd(_mm512_castps512_ps256(gv))),
                                        silu_pd(_mm512_extractf32x8_ps(gv, 1)), 1);
    _mm256_mask_storeu_epi16(y + k, m, to_bf16(_mm512_mul_ps(s, up(k, m))));
  }
}

// fp32 SiLU of every bf16 bit pattern, by silu_pd.
AVX512_TARGET void fill_silu_table(float* t) {
  for (int i = 0; i < 1 << 16; i += 16) {
    const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_add_epi32(_mm512_set1_epi32(i), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)), 16));
    _mm512_storeu_ps(t + i, _mm512_insertf32x8(_mm512_castps256_ps512(silu_pd(_mm512_castps512_ps256(g))),
                                               silu_pd(_mm512_extractf32x8_ps(g, 1)), 1));
  }
}

}  // namespace

// A bf16 gate takes one of 65,536 values, so the unfused SiLU looks its fp64 SiLU up (256 KB, of
// which a layer's gates use a few KB) instead of computing exp per lane: the same bits, and
// silu_mul_quant on 130 rows of 3,072 ran 3.2x faster on a Xeon (docs/performance.md, 2026-12-05 night).
AVX512_TARGET void silu_mul_bf16(int64_t b, int64_t e, const uint16_t* gate, const uint16_t* up, uint16_t* y) {
  const float* t = bf16_table<fill_silu_table>();
  for (int64_t k = b; k < e; k += 16) {
    const __mmask16 m = tail_mask(e - k);
    const __m512i g = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, gate + k));
    const __m512 s = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, g, t, 4);
    _mm256_mask_storeu_epi16(y + k, m, to_bf16(_mm512_mul_ps(s, load_bf16(up + k, m))));
  }
}

AVX512_TARGET void silu_mul_acc(int64_t b, int64_t e, const int32_t* acc_gate, const int32_t* acc_up, const float* ws_gate,
                  const float* ws_up, float as, uint16_t* y) {
  silu_span(b, e, DequantLanes{acc_gate, ws_gate, as}, DequantLanes{acc_up, ws_up, as}, y);
}

AVX512_TARGET int64_t read_slice(const uint8_t* p, int64_t n) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i + 256 <= n; i += 256) {
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + i + PF_BYTES + 64 * l), _MM_HINT_T0);
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i));
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i + 64));
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i + 128));
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i + 192));
  }
  return _mm512_reduce_add_epi64(acc);
}

namespace {
// 8 independent vpdpbusd accumulators, 16 x 4 multiply-adds each per instruction (named, through
// the GEMM's asm, so that the loop is nothing but the multiply-adds).
AVX512_TARGET int64_t peak_loop(int64_t iters) {
  const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
  __m512i v0 = a, v1 = a, v2 = a, v3 = a, v4 = a, v5 = a, v6 = a, v7 = a;
  for (int64_t i = 0; i < iters * 16; ++i) {
    A8W8_DPBUSD(v0, a, b);
    A8W8_DPBUSD(v1, a, b);
    A8W8_DPBUSD(v2, a, b);
    A8W8_DPBUSD(v3, a, b);
    A8W8_DPBUSD(v4, a, b);
    A8W8_DPBUSD(v5, a, b);
    A8W8_DPBUSD(v6, a, b);
    A8W8_DPBUSD(v7, a, b);
  }
  int64_t keep = 0;
  for (const __m512i v : {v0, v1, v2, v3, v4, v5, v6, v7}) keep += _mm512_reduce_add_epi32(v) == -1;
  return iters * 16 * 8 * 64 * 2 + keep;
}
}  // namespace

}  // namespace a8w8::avx512

namespace a8w8 {
const Kernels avx512_kernels = {
    "avx512", true, avx512::rows_held, avx512::quantize_row, avx512::gemm, avx512::rmsnorm_quant_row,
    avx512::silu_mul_bf16, avx512::silu_mul_acc, avx512::read_slice, avx512::peak_loop,
};
}  // namespace a8w8
