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
// 16 channels. N is padded to 64 and K to 64 with zero weights (which add nothing).
// The same bytes are AMX B tiles: 16 groups x 16 channels x 4 = rows of 64 bytes at stride 256.
//
// Paths: VNNI (registers, weights streamed once per 4 rows) for decode-sized M; AMX-INT8
// (tdpbusd on 16x64 tiles, 32x32 output blocks) for M >= amx_min_rows where the CPU and the
// kernel (arch_prctl XTILEDATA permission) allow it. Both give the same int32 sums.
//
// The kernel functions carry target attributes, so this file builds and loads on any x86-64
// CPU; Python only selects them where the CPU reports avx512_vnni.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <atomic>
#include <cstring>
#include <vector>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

namespace {

constexpr int64_t NT = 64;  // output channels per tile
constexpr int64_t MR = 4;   // token rows per register block
constexpr int64_t KA = 64;  // K padding: one AMX tile row of int8

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// 16 bf16 values (masked) widened to fp32 exactly.
VNNI_TARGET inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Per-row quantization into u8 (q + 128), K padded with 128 (q = 0). Returns the fp32 scale
// amax/127, or NaN for a row holding NaN/inf (whose q are all 0), as the reference does.
// `given` (may be null): the row's amax taken over more than this slice of K (tensor-parallel
// row shards: the max over all ranks, floored; +inf when any rank's slice is non-finite).
VNNI_TARGET void quantize_row(const at::BFloat16* x, int64_t K, int64_t Kp, uint8_t* out, float* scale,
                              const float* given = nullptr) {
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
  float amax = given ? *given : std::max(_mm512_reduce_max_ps(vmax), 1e-4f);
  if (bad || !std::isfinite(amax)) {
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

// acc - comp for 16 channels starting at n (masked), to int32 out or through the fp32
// epilogue to bf16: v = (acc * ws[n]) * as, rounded to nearest even.
template <bool I32>
VNNI_TARGET inline void store16(__m512i acc, __m512i cp, __m512 ws, float as, void* yrow, int64_t n, __mmask16 m) {
  __m512i a = _mm512_sub_epi32(acc, cp);
  if constexpr (I32) {
    _mm512_mask_storeu_epi32(static_cast<int32_t*>(yrow) + n, m, a);
  } else {
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), ws), _mm512_set1_ps(as));
    _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(static_cast<at::BFloat16*>(yrow) + n), m, to_bf16(v));
  }
}

// One 64-channel tile for up to MR rows: 4 x R int32 accumulators, weights read once per block.
// I32: store the exact int32 sums instead (tensor-parallel shards reduce them before the epilogue).
template <int R, bool I32 = false>
VNNI_TARGET void tile_kernel(const uint8_t* act, int64_t Kp, const int8_t* wt, const int32_t* comp,
                             const float* wscale, const float* ascale, void* yv, int64_t ldy,
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
    __m512 ws = I32 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, wscale + n);
    for (int r = 0; r < R; ++r)
      store16<I32>(acc[r][c], cp, ws, I32 ? 0.f : ascale[r], static_cast<char*>(yv) + r * ldy * (I32 ? 4 : 2), n, m);
  }
}

// ---- AMX-INT8 -------------------------------------------------------------------------------
#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")))

std::atomic<int64_t> amx_min_rows{16};  // below this the VNNI path streams weights as fast

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA),
// once per process; without it the first tile instruction kills the process.
bool amx_permitted() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-int8") || !__builtin_cpu_supports("amx-tile")) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}
std::atomic<bool> amx_enabled{true};

// One 64-channel weight tile for rows [r0, r0 + 32): per 32-channel half, 2 A tiles (rows) x
// 2 B tiles (channels) -> 4 int32 C tiles over all K, then the epilogue from a staging buffer.
// act has rows padded to a multiple of 32 (u8 128 = q 0) so tiles never read past it.
template <bool I32>
AMX_TARGET void amx_block(const uint8_t* act, int64_t Kp, const int8_t* wt, const int32_t* comp, const float* wscale,
                          const float* ascale, char* y, int64_t ldy_bytes, int64_t r0, int64_t M, int64_t n0,
                          int64_t N) {
  alignas(64) int32_t c[32][32];
  for (int h = 0; h < 2; ++h) {
    const int64_t nh = n0 + 32 * h;
    if (nh >= N) break;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < Kp / KA; ++kb) {
      const uint8_t* a = act + r0 * Kp + kb * KA;
      const int8_t* b = wt + kb * 16 * 256 + h * 128;
      _tile_loadd(4, a, Kp);
      _tile_loadd(5, a + 16 * Kp, Kp);
      _tile_loadd(6, b, 256);
      _tile_loadd(7, b + 64, 256);
      _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, &c[0][0], 128); _tile_stored(1, &c[0][16], 128);
    _tile_stored(2, &c[16][0], 128); _tile_stored(3, &c[16][16], 128);
    for (int s = 0; s < 2; ++s) {
      const int64_t n = nh + 16 * s;
      if (n >= N) break;
      __mmask16 m = N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n)) - 1);
      __m512i cp = _mm512_maskz_loadu_epi32(m, comp + n);
      __m512 ws = I32 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, wscale + n);
      for (int64_t r = 0; r < 32 && r0 + r < M; ++r)
        store16<I32>(_mm512_load_si512(&c[r][16 * s]), cp, ws, I32 ? 0.f : ascale[r0 + r], y + (r0 + r) * ldy_bytes,
                     n, m);
    }
  }
}

template <bool I32>
AMX_TARGET void amx_tiles(const uint8_t* act, int64_t Kp, int64_t M, const int8_t* wp, const int32_t* comp,
                          const float* ws, const float* ascale, char* y, int64_t ldy_bytes, int64_t N, int64_t tb,
                          int64_t te) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);  // per thread: tile state is thread-local
  const int64_t tile_bytes = (Kp / 4) * 256;
  for (int64_t t = tb; t < te; ++t)
    for (int64_t r0 = 0; r0 < M; r0 += 32)
      amx_block<I32>(act, Kp, wp + t * tile_bytes, comp, ws, ascale, y, ldy_bytes, r0, M, t * NT, N);
  _tile_release();
}

}  // namespace

// int8 [N,K] -> (packed int8 [Np/64, Kp/4, 256], comp int32 [Np], N, K)
std::vector<torch::Tensor> prepack(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kInt8 && w.dim() == 2, "prepack: expected an int8 [N,K] weight");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Np = round_up(N, NT), Kp = round_up(K, KA);
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

namespace {

// Quantize rows of x (optionally with given amax) and run every (tile, row block); Y is bf16
// [M,N] with the epilogue applied, or int32 [M,N] raw sums when I32.
template <bool I32>
void run_gemm(const torch::Tensor& x2, const torch::Tensor& packed, const torch::Tensor& comp,
              const float* ws, const float* given_amax, torch::Tensor& y) {
  const int64_t M = x2.size(0), K = x2.size(1), N = y.size(1);
  const int64_t Kp = packed.size(1) * 4, tiles = packed.size(0);
  const bool amx = M >= amx_min_rows.load() && amx_enabled.load() && amx_permitted();
  const int64_t Mp = amx ? round_up(M, 32) : M;  // AMX reads whole 32-row blocks
  std::vector<uint8_t> act(Mp * Kp, 128);
  std::vector<float> ascale(M);
  const at::BFloat16* xp = x2.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      quantize_row(xp + r * K, K, Kp, act.data() + r * Kp, ascale.data() + r, given_amax ? given_amax + r : nullptr);
  });
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* cp = comp.data_ptr<int32_t>();
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t esize = y.element_size();
  const int64_t tile_bytes = (Kp / 4) * 256;
  at::parallel_for(0, tiles, 1, [&](int64_t tb, int64_t te) {
    if (amx) {
      amx_tiles<I32>(act.data(), Kp, M, wp, cp, ws, ascale.data(), yp, N * esize, N, tb, te);
      return;
    }
    for (int64_t t = tb; t < te; ++t) {
      const int8_t* wt = wp + t * tile_bytes;
      for (int64_t r = 0; r < M; r += MR) {
        const uint8_t* a = act.data() + r * Kp;
        void* yr = yp + r * N * esize;
        const float* as = ascale.data() + r;
        switch (std::min<int64_t>(MR, M - r)) {
          case 4: tile_kernel<4, I32>(a, Kp, wt, cp, ws, as, yr, N, t * NT, N); break;
          case 3: tile_kernel<3, I32>(a, Kp, wt, cp, ws, as, yr, N, t * NT, N); break;
          case 2: tile_kernel<2, I32>(a, Kp, wt, cp, ws, as, yr, N, t * NT, N); break;
          default: tile_kernel<1, I32>(a, Kp, wt, cp, ws, as, yr, N, t * NT, N); break;
        }
      }
    }
  });
}

torch::Tensor flat_rows(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, const char* op) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16, op, ": x must be bf16");
  const int64_t K = x.size(-1);
  TORCH_CHECK(round_up(K, KA) == packed.size(1) * 4 && packed.size(0) * NT >= N, op,
              ": x does not fit the packed weight");
  return x.reshape({-1, K}).contiguous();
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
  if (x2.size(0) > 0) run_gemm<false>(x2, packed, comp, weight_scale.data_ptr<float>(), nullptr, y);
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
  if (x2.size(0) > 0) run_gemm<true>(x2, packed, comp, nullptr, amax.data_ptr<float>(), y);
  return y;
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

// "amx" where tdpbusd runs for M >= amx_min_rows, else "vnni" (also after set_amx(false)).
std::string isa() { return amx_enabled.load() && amx_permitted() ? "amx" : "vnni"; }
void set_amx(bool on) { amx_enabled.store(on); }
int64_t amx_min_m() { return amx_min_rows.load(); }
void set_amx_min_m(int64_t m) { amx_min_rows.store(std::max<int64_t>(1, m)); }

bool cpu_has_vnni() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"); }

TORCH_LIBRARY(pypto_cpu, m) {
  m.def("prepack(Tensor w) -> Tensor[]");
  m.def("a8w8_linear(Tensor x, Tensor packed, Tensor comp, Tensor weight_scale) -> Tensor");
  m.def("a8w8_gemm_s32(Tensor x, Tensor packed, Tensor comp, Tensor amax, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(pypto_cpu, CPU, m) {
  m.impl("prepack", &prepack);
  m.impl("a8w8_linear", &a8w8_linear);
  m.impl("a8w8_gemm_s32", &a8w8_gemm_s32);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_has_vnni", &cpu_has_vnni, "AVX512-VNNI (and BW) available on this CPU");
  m.def("isa", &isa, "which int8 path large M takes: amx or vnni");
  m.def("set_amx", &set_amx, "allow (default) or forbid the AMX path, for tests and benchmarks");
  m.def("amx_min_m", &amx_min_m, "rows from which the AMX path is taken");
  m.def("set_amx_min_m", &set_amx_min_m, "change that threshold (benchmarks)");
  m.def("read_probe", &read_probe, "read a buffer once with 64-byte loads (bandwidth probe)");
}
