// Native A8W8 kernels for x86-64 CPUs with AVX512-VNNI: bit-compatible with the torch
// reference backend (vllm_pypto/kernels/reference.py).
//
// vpdpbusd multiplies unsigned by signed bytes, so activations are quantized to s8 as the
// spec says and stored as u8 = q + 128. The offset is removed exactly in int32:
//   sum_k (q+128) w = sum_k q w + 128 * colsum(w)   ->   acc = dot - comp[n], comp = 128*colsum.
//
// Weight layout (prepacked once at load): output channels in tiles of 64, K in groups of 4:
//   packed[t][g][c][j] = w[64 t + c][4 g + j]     (256 contiguous bytes per (tile, group))
// so one tile streams as one sequential run and each 64-byte line feeds one vpdpbusd over
// 16 channels. N is padded to 64 and K to 4 with zero weights (which add nothing).
//
// The kernel functions carry target attributes, so this file builds and loads on any x86-64
// CPU; Python only selects them where the CPU reports avx512_vnni.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <atomic>
#include <cstring>
#include <vector>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

namespace {

constexpr int64_t NT = 64;  // output channels per tile
constexpr int64_t MR = 4;   // token rows per register block

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// 16 bf16 values (masked) widened to fp32 exactly.
VNNI_TARGET inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Per-row quantization into u8 (q + 128), K padded with 128 (q = 0). Returns the fp32 scale
// amax/127, or NaN for a row holding NaN/inf (whose q are all 0), as the reference does.
VNNI_TARGET void quantize_row(const at::BFloat16* x, int64_t K, int64_t Kp, uint8_t* out, float* scale) {
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x);
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 bad = 0;
  int64_t k = 0;
  for (; k < K; k += 16) {
    __mmask16 m = K - k >= 16 ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 v = _mm512_abs_ps(load_bf16(xb + k, m));
    bad |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);                // NaN
    bad |= _mm512_mask_cmp_ps_mask(m, v, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);  // inf
    vmax = _mm512_max_ps(vmax, v);
  }
  float amax = std::max(_mm512_reduce_max_ps(vmax), 1e-4f);
  if (bad) {
    std::memset(out, 128, Kp);
    *scale = NAN;
    return;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / amax);  // a true division, as the spec says
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (k = 0; k < K; k += 16) {
    __mmask16 m = K - k >= 16 ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 v = _mm512_mul_ps(load_bf16(xb + k, m), inv);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // half to even
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128));
    _mm_mask_storeu_epi8(out + k, m, _mm512_cvtepi32_epi8(q));
  }
  if (Kp > K) std::memset(out + K, 128, Kp - K);
  *scale = amax / 127.0f;
}

// fp32 -> bf16, round to nearest even, NaN kept NaN (as torch's conversion).
VNNI_TARGET inline __m256i to_bf16(__m512 v) {
  __m512i b = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(b, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// One 64-channel tile for up to MR rows: 4 x R int32 accumulators, weights read once per block.
template <int R>
VNNI_TARGET void tile_kernel(const uint8_t* act, int64_t Kp, const int8_t* wt, const int32_t* comp,
                             const float* wscale, const float* ascale, at::BFloat16* y, int64_t ldy,
                             int64_t n0, int64_t N) {
  __m512i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_si512();
  const int64_t G = Kp / 4;
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* w = wt + g * 256;
    _mm_prefetch(reinterpret_cast<const char*>(w + 256 * 8), _MM_HINT_T0);
    __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
    __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
    for (int r = 0; r < R; ++r) {
      int32_t a4;
      std::memcpy(&a4, act + r * Kp + g * 4, 4);
      __m512i a = _mm512_set1_epi32(a4);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], a, w1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], a, w2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], a, w3);
    }
  }
  for (int c = 0; c < 4; ++c) {
    int64_t n = n0 + 16 * c;
    if (n >= N) break;
    __mmask16 m = N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n)) - 1);
    __m512i cp = _mm512_maskz_loadu_epi32(m, comp + n);
    __m512 ws = _mm512_maskz_loadu_ps(m, wscale + n);
    for (int r = 0; r < R; ++r) {
      __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], cp));  // exact int32 -> fp32 rounding
      v = _mm512_mul_ps(_mm512_mul_ps(v, ws), _mm512_set1_ps(ascale[r]));  // (acc*ws)*as
      _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(y + r * ldy + n), m, to_bf16(v));
    }
  }
}

}  // namespace

// int8 [N,K] -> (packed int8 [Np/64, Kp/4, 256], comp int32 [Np], N, K)
std::vector<torch::Tensor> prepack(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kInt8 && w.dim() == 2, "prepack: expected an int8 [N,K] weight");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Np = round_up(N, NT), Kp = round_up(K, 4);
  auto packed = torch::zeros({Np / NT, Kp / 4, 256}, torch::kInt8);
  auto comp = torch::zeros({Np}, torch::kInt32);
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* cp = comp.data_ptr<int32_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      int64_t t = n / NT, c = n % NT;
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        int8_t v = src[n * K + k];
        sum += v;
        dst[((t * (Kp / 4) + k / 4) * NT + c) * 4 + k % 4] = v;
      }
      cp[n] = 128 * sum;
    }
  });
  return {packed, comp};
}

// bf16 [..., K] x prepacked weight -> bf16 [..., N]; N = weight_scale.numel() (fp32).
torch::Tensor a8w8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor comp, torch::Tensor weight_scale) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16, "a8w8_linear: x must be bf16");
  TORCH_CHECK(weight_scale.dtype() == torch::kFloat32 && weight_scale.is_contiguous(), "bad weight_scale");
  const int64_t N = weight_scale.numel();
  const int64_t K = x.size(-1), Kp = packed.size(1) * 4, tiles = packed.size(0);
  TORCH_CHECK(round_up(K, 4) == Kp && tiles * NT >= N, "a8w8_linear: x does not fit the packed weight");
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y.reshape(out_shape);
  std::vector<uint8_t> act(M * Kp);
  std::vector<float> ascale(M);
  const at::BFloat16* xp = x2.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) quantize_row(xp + r * K, K, Kp, act.data() + r * Kp, ascale.data() + r);
  });
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* cp = comp.data_ptr<int32_t>();
  const float* ws = weight_scale.data_ptr<float>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t tile_bytes = (Kp / 4) * 256;
  at::parallel_for(0, tiles, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      const int8_t* wt = wp + t * tile_bytes;
      for (int64_t r = 0; r < M; r += MR) {
        const uint8_t* a = act.data() + r * Kp;
        at::BFloat16* yr = yp + r * N;
        switch (std::min<int64_t>(MR, M - r)) {
          case 4: tile_kernel<4>(a, Kp, wt, cp, ws, ascale.data() + r, yr, N, t * NT, N); break;
          case 3: tile_kernel<3>(a, Kp, wt, cp, ws, ascale.data() + r, yr, N, t * NT, N); break;
          case 2: tile_kernel<2>(a, Kp, wt, cp, ws, ascale.data() + r, yr, N, t * NT, N); break;
          default: tile_kernel<1>(a, Kp, wt, cp, ws, ascale.data() + r, yr, N, t * NT, N); break;
        }
      }
    }
  });
  return y.reshape(out_shape);
}

// Streaming-read probe for the bandwidth limit the benchmarks compare against: every thread
// reads its slice with 64-byte loads (no stores), the way the GEMV streams weights.
VNNI_TARGET static int64_t read_slice(const uint8_t* p, int64_t n) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i + 256 <= n; i += 256) {
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i));
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i + 64));
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i + 128));
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i + 192));
  }
  return _mm512_reduce_add_epi64(acc);
}

int64_t read_probe(torch::Tensor buf) {
  TORCH_CHECK(buf.is_contiguous(), "read_probe: contiguous buffer expected");
  const uint8_t* p = static_cast<const uint8_t*>(buf.data_ptr());
  const int64_t n = buf.numel() * buf.element_size();
  std::atomic<int64_t> sum{0};
  at::parallel_for(0, n / 4096, 256, [&](int64_t b, int64_t e) { sum += read_slice(p + b * 4096, (e - b) * 4096); });
  return sum.load();
}

bool cpu_has_vnni() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"); }

TORCH_LIBRARY(pypto_cpu, m) {
  m.def("prepack(Tensor w) -> Tensor[]");
  m.def("a8w8_linear(Tensor x, Tensor packed, Tensor comp, Tensor weight_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pypto_cpu, CPU, m) {
  m.impl("prepack", &prepack);
  m.impl("a8w8_linear", &a8w8_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_has_vnni", &cpu_has_vnni, "AVX512-VNNI (and BW) available on this CPU");
  m.def("read_probe", &read_probe, "read a buffer once with 64-byte loads (bandwidth probe)");
}
