// 256-bit bf16 helpers shared by the AVX2 and AVX-VNNI paths (isa_avx2.cpp) and by the
// ISA-independent ops that run on every path (attn_prologue.cpp, decode_attention.cpp). Targeted
// at AVX2 alone, without FMA: a caller built for AVX2 + FMA inlines them, and one built without
// FMA (attn_prologue.cpp, whose a*b - c*d must round twice) can too.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define AVX2_ONLY_TARGET __attribute__((target("avx2")))

namespace a8w8::avx2 {

// 8 (or the first n < 8) bf16 values widened to fp32 exactly; lanes past n are 0.
AVX2_ONLY_TARGET inline __m256 load8_bf16(const uint16_t* p, int64_t n = 8) {
  alignas(16) uint16_t t[8] = {};
  if (n < 8) std::memcpy(t, p, n * 2), p = t;
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16 as the AVX-512 path: round to nearest even, NaN kept NaN.
AVX2_ONLY_TARGET inline __m128i to_bf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_srli_epi32(_mm256_blendv_epi8(r, _mm256_or_si256(b, _mm256_set1_epi32(0x400000)), nan), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

AVX2_ONLY_TARGET inline void store8_bf16(uint16_t* p, __m128i v, int64_t n = 8) {
  if (n >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
  alignas(16) uint16_t t[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(t), v);
  std::memcpy(p, t, n * 2);
}

}  // namespace a8w8::avx2
