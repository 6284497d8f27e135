// AVX-512 helpers shared by the AVX512-VNNI path (isa_avx512.cpp) and the AMX path, which
// reuses its row ops, its epilogue and its GEMM below AMX's row threshold (isa_amx.cpp).
#pragma once

#include <immintrin.h>

#include "a8w8.h"

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

namespace a8w8::avx512 {

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

// 16 bf16 values (masked) widened to fp32 exactly.
AVX512_TARGET inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16, round to nearest even, NaN kept NaN (as torch's conversion).
AVX512_TARGET inline __m256i to_bf16(__m512 v) {
  __m512i b = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(b, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// acc - comp for 16 channels starting at n (masked), to int32 out or through the fp32
// epilogue to bf16: v = (acc * ws[n]) * as, rounded to nearest even.
template <bool I32>
AVX512_TARGET inline void store16(__m512i acc, __m512i cp, __m512 ws, float as, char* yrow, int64_t n, __mmask16 m) {
  __m512i a = _mm512_sub_epi32(acc, cp);
  if constexpr (I32) {
    _mm512_mask_storeu_epi32(reinterpret_cast<int32_t*>(yrow) + n, m, a);
  } else {
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), ws), _mm512_set1_ps(as));
    _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(yrow) + n, m, to_bf16(v));
  }
}

// The AVX512-VNNI path's functions, which the AMX table lists too (declared with the target
// attribute of their definitions: in C++ a differing one would declare another version).
int64_t rows_held(int64_t M);
AVX512_TARGET void quantize_row(const uint16_t* x, int64_t K, int64_t Kp, uint8_t* out, float* scale, const float* given, bool u8);
void gemm(const Gemm& g, int64_t tb, int64_t te);
AVX512_TARGET void rmsnorm_quant_row(const uint16_t* x, const uint16_t* res, const uint16_t* gamma, int64_t H, double eps,
                       bool deferred, uint16_t* h, uint16_t* y, int8_t* q, float* scale);
AVX512_TARGET void silu_mul_bf16(int64_t b, int64_t e, const uint16_t* gate, const uint16_t* up, uint16_t* y);
AVX512_TARGET void silu_mul_acc(int64_t b, int64_t e, const int32_t* acc_gate, const int32_t* acc_up, const float* ws_gate,
                  const float* ws_up, float as, uint16_t* y);
AVX512_TARGET int64_t read_slice(const uint8_t* p, int64_t n);

}  // namespace a8w8::avx512
