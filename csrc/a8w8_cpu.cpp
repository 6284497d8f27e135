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
// Paths: VNNI (registers, weights streamed once per 4 rows) for M < amx_min_rows (1-3); AMX-INT8
// (tdpbusd on 16x64 tiles, 16x64 output blocks) for M >= amx_min_rows where the CPU and the
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
#include <chrono>
#include <cstring>
#include <vector>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

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
template <bool U8 = true>
VNNI_TARGET void quantize_row(const at::BFloat16* x, int64_t K, int64_t Kp, uint8_t* out, float* scale,
                              const float* given = nullptr) {
  const int zero = U8 ? 128 : 0;
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
    std::memset(out, zero, Kp);
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
    __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(zero));
    _mm_mask_storeu_epi8(out + k, m, _mm512_cvtepi32_epi8(q));
  }
  if (Kp > K) std::memset(out + K, zero, Kp - K);
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
#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

std::atomic<int64_t> amx_min_rows{4};  // below this the VNNI path streams weights as fast (measured)

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
bool amx_on() { return amx_enabled.load() && amx_permitted(); }

// Every tile as 16 rows of 64 bytes: int8 A and B tiles, int32 16x16 C tiles. Tile state is
// per thread, so each thread loads it before its first tile instruction.
AMX_TARGET void load_tile_config() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
}

// One 64-channel weight tile for rows [r0, r0 + 16): one A tile against the whole tile, 4 C
// tiles and 3 B tiles in rotation, so the weights stream in order, once per 16 rows. Measured
// faster than 2x2 blocks of 32 rows x 32 channels at every M from 24 to 2048 (2026-11-30:
// e.g. M=256, 5120x5120 from DRAM 5.7 vs 7.4 ms; M=16 gate_up 34816x5120 8.7 ms).
// act has rows padded to a multiple of 16 (u8 128 = q 0) so tiles never read past it.
template <bool I32>
AMX_TARGET void amx_block(const uint8_t* act, int64_t Kp, const int8_t* wt, const int32_t* comp, const float* wscale,
                          const float* ascale, char* y, int64_t ldy_bytes, int64_t r0, int64_t M, int64_t n0,
                          int64_t N) {
  alignas(64) int32_t c[16][64];
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t kb = 0; kb < Kp / KA; ++kb) {
    const int8_t* b = wt + kb * 16 * 256;
    _tile_loadd(4, act + r0 * Kp + kb * KA, Kp);
    _tile_loadd(5, b, 256);
    _tile_dpbusd(0, 4, 5);
    _tile_loadd(6, b + 64, 256);
    _tile_dpbusd(1, 4, 6);
    _tile_loadd(7, b + 128, 256);
    _tile_dpbusd(2, 4, 7);
    _tile_loadd(5, b + 192, 256);
    _tile_dpbusd(3, 4, 5);
  }
  _tile_stored(0, &c[0][0], 256); _tile_stored(1, &c[0][16], 256);
  _tile_stored(2, &c[0][32], 256); _tile_stored(3, &c[0][48], 256);
  for (int s = 0; s < 4; ++s) {
    const int64_t n = n0 + 16 * s;
    if (n >= N) break;
    __mmask16 m = N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n)) - 1);
    __m512i cp = _mm512_maskz_loadu_epi32(m, comp + n);
    __m512 ws = I32 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, wscale + n);
    for (int64_t r = 0; r < 16 && r0 + r < M; ++r)
      store16<I32>(_mm512_load_si512(&c[r][16 * s]), cp, ws, I32 ? 0.f : ascale[r0 + r], y + (r0 + r) * ldy_bytes, n,
                   m);
  }
}

template <bool I32>
AMX_TARGET void amx_tiles(const uint8_t* act, int64_t Kp, int64_t M, const int8_t* wp, const int32_t* comp,
                          const float* ws, const float* ascale, char* y, int64_t ldy_bytes, int64_t N, int64_t tb,
                          int64_t te) {
  load_tile_config();
  const int64_t tile_bytes = (Kp / 4) * 256;
  // Rows in chunks of about 8 MiB of activations: every chunk streams the whole weight from DRAM
  // once more, while a chunk re-read per tile comes from L3. Chunks sized for L2 (1 MiB) cost
  // more in weight passes than they saved (2026-11-30, 14B down 5120x17408 from DRAM: M=64
  // 10.4 ms -> 8.0-8.1 ms with 4-6 MiB, M=256 29.2 -> 16.6 ms with 8 MiB; 12 MiB gained no more).
  const int64_t Mc = std::max<int64_t>(16, (int64_t{8} << 20) / Kp / 16 * 16);
  for (int64_t m0 = 0; m0 < M; m0 += Mc)
    for (int64_t t = tb; t < te; ++t)
      for (int64_t r0 = m0; r0 < std::min(M, m0 + Mc); r0 += 16)
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

// u8 activations (q + 128, rows of Kp; Mp >= M rows, padded to 16 for AMX) with their fp32
// scales: the input every GEMM path reads.
struct Act {
  std::vector<uint8_t> a;
  std::vector<float> scale;
  int64_t M, Kp;
  bool amx;
  Act(int64_t M_, int64_t Kp_) : M(M_), Kp(Kp_) {
    amx = M >= amx_min_rows.load() && amx_on();
    a.assign((amx ? round_up(M, 16) : M) * Kp, 128);  // AMX reads whole 16-row tiles
    scale.resize(M);
  }
};

// Quantize bf16 rows (optionally with a given amax per row) into `act`.
void quantize_rows(const torch::Tensor& x2, const float* given_amax, Act& act) {
  const int64_t K = x2.size(1);
  const at::BFloat16* xp = x2.data_ptr<at::BFloat16>();
  at::parallel_for(0, act.M, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      quantize_row(xp + r * K, K, act.Kp, act.a.data() + r * act.Kp, act.scale.data() + r,
                   given_amax ? given_amax + r : nullptr);
  });
}

// Already-quantized int8 rows (q, scale) into `act`: u8 = q + 128 is q with its top bit flipped.
void load_rows(const torch::Tensor& q2, const torch::Tensor& scale, Act& act) {
  const int64_t K = q2.size(1);
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q2.data_ptr<int8_t>());
  for (int64_t r = 0; r < act.M; ++r)
    for (int64_t k = 0; k < K; ++k) act.a[r * act.Kp + k] = qp[r * K + k] ^ 0x80;
  std::memcpy(act.scale.data(), scale.data_ptr<float>(), act.M * sizeof(float));
}

// Every (tile, row block) over `act`; Y is bf16 [M,N] with the epilogue applied, or int32
// [M,N] raw sums when I32.
template <bool I32>
void run_gemm(const Act& act, const torch::Tensor& packed, const torch::Tensor& comp, const float* ws,
              torch::Tensor& y) {
  const int64_t M = act.M, Kp = act.Kp, N = y.size(1);
  TORCH_CHECK(packed.size(1) * 4 == Kp, "activation rows do not fit the packed weight");
  const int64_t tiles = packed.size(0);
  const uint8_t* ap = act.a.data();
  const float* as0 = act.scale.data();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* cp = comp.data_ptr<int32_t>();
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t esize = y.element_size();
  const int64_t tile_bytes = (Kp / 4) * 256;
  at::parallel_for(0, tiles, 1, [&](int64_t tb, int64_t te) {
    if (act.amx) {
      amx_tiles<I32>(ap, Kp, M, wp, cp, ws, as0, yp, N * esize, N, tb, te);
      return;
    }
    for (int64_t t = tb; t < te; ++t) {
      const int8_t* wt = wp + t * tile_bytes;
      for (int64_t r = 0; r < M; r += MR) {
        const uint8_t* a = ap + r * Kp;
        void* yr = yp + r * N * esize;
        const float* as = as0 + r;
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
  if (x2.size(0) > 0) {
    Act act(x2.size(0), packed.size(1) * 4);
    quantize_rows(x2, nullptr, act);
    run_gemm<false>(act, packed, comp, weight_scale.data_ptr<float>(), y);
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
    Act act(x2.size(0), packed.size(1) * 4);
    quantize_rows(x2, amax.data_ptr<float>(), act);
    run_gemm<true>(act, packed, comp, nullptr, y);
  }
  return y;
}

// ---- Fused layer ops (the model class's hot path) ---------------------------------------------
// Reference: vllm_pypto/kernels/layer_ref.py. Row norms accumulate in fp64 (exact for bf16
// squares in practice, so the sum order does not matter); every rounding point is the reference's.

namespace {

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

// residual add (bf16 out), fp64 mean square, y = bf16((h * rinv) * gamma) or, deferred,
// bf16(h * gamma) with rinv folded into the row's scale; then per-token int8.
VNNI_TARGET void rmsnorm_quant_row(const uint16_t* x, const uint16_t* res, const uint16_t* gamma, int64_t H,
                                   double eps, bool deferred, uint16_t* h, uint16_t* y, int8_t* q, float* scale) {
  __m512d ss0 = _mm512_setzero_pd(), ss1 = _mm512_setzero_pd();
  for (int64_t k = 0; k < H; k += 16) {
    __mmask16 m = H - k >= 16 ? 0xFFFF : (__mmask16)((1u << (H - k)) - 1);
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
    __mmask16 m = H - k >= 16 ? 0xFFFF : (__mmask16)((1u << (H - k)) - 1);
    __m512 v = load_bf16(h + k, m), g = load_bf16(gamma + k, m);
    v = deferred ? _mm512_mul_ps(v, g) : _mm512_mul_ps(_mm512_mul_ps(v, vr), g);
    _mm256_mask_storeu_epi16(y + k, m, to_bf16(v));
  }
  quantize_row<false>(reinterpret_cast<const at::BFloat16*>(y), H, H, reinterpret_cast<uint8_t*>(q), scale);
  if (deferred) *scale = *scale * rinv;
}

// exp(x) for 8 fp64 lanes with |x| <= 700: Cody-Waite reduction x = n ln2 + r (ln2 split so
// that n * ln2_hi is exact), |r| <= ln2/2, Taylor to r^13 (truncation < 0.1 ulp), times 2^n.
// Within about 1 ulp of fp64, like the reference's own exp (the reference and this kernel can
// then differ only where the exact SiLU lies within ~1e-16 of an fp32 rounding boundary).
VNNI_TARGET inline __m512d exp_pd(__m512d x) {
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
VNNI_TARGET inline __m256 silu_pd(__m256 g8) {
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

// fp32 producers of 16 gate or up lanes (masked) for silu_mul_span.
struct Bf16Lanes {  // a bf16 row
  const uint16_t* p;
  VNNI_TARGET __m512 operator()(int64_t k, __mmask16 m) const { return load_bf16(p + k, m); }
};
struct DequantLanes {  // int32 sums through the fp32 epilogue, (acc * ws[n]) * as
  const int32_t* acc;
  const float* ws;
  float as;
  VNNI_TARGET __m512 operator()(int64_t k, __mmask16 m) const {
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, acc + k)), _mm512_maskz_loadu_ps(m, ws + k));
    return _mm512_mul_ps(v, _mm512_set1_ps(as));
  }
};

// y[b, e) = bf16(SiLU(gate) * up), 16 lanes at a time.
template <class G, class U>
VNNI_TARGET void silu_mul_span(int64_t b, int64_t e, G gate, U up, uint16_t* y) {
  for (int64_t k = b; k < e; k += 16) {
    const __mmask16 m = e - k >= 16 ? 0xFFFF : (__mmask16)((1u << (e - k)) - 1);
    const __m512 gv = gate(k, m);
    const __m512 s = _mm512_insertf32x8(_mm512_castps256_ps512(silu_pd(_mm512_castps512_ps256(gv))),
                                        silu_pd(_mm512_extractf32x8_ps(gv, 1)), 1);
    _mm256_mask_storeu_epi16(y + k, m, to_bf16(_mm512_mul_ps(s, up(k, m))));
  }
}

// One row of SiLU(gate) * up -> bf16 -> per-token int8.
template <class G, class U>
void silu_quant_row(int64_t I, G gate, U up, uint16_t* y, int8_t* q, float* scale) {
  // Still the costliest elementwise op: split the row over threads (serial when the caller
  // already runs rows in parallel, where at::parallel_for does not nest).
  at::parallel_for(0, I, 512, [&](int64_t b, int64_t e) { silu_mul_span(b, e, gate, up, y); });
  quantize_row<false>(reinterpret_cast<const at::BFloat16*>(y), I, I, reinterpret_cast<uint8_t*>(q), scale);
}

}  // namespace

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
  auto xp = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  auto rp = residual ? reinterpret_cast<const uint16_t*>(r2.data_ptr<at::BFloat16>()) : nullptr;
  auto hp = reinterpret_cast<uint16_t*>(h.data_ptr<at::BFloat16>());
  auto gp = reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    std::vector<uint16_t> y(H);
    for (int64_t r = b; r < e; ++r)
      rmsnorm_quant_row(xp + r * H, rp ? rp + r * H : nullptr, gp, H, eps, deferred, hp + r * H, y.data(),
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
  const at::BFloat16* xp = x2.data_ptr<at::BFloat16>();
  auto yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, M * I, 512, [&](int64_t b, int64_t e) {
    for (int64_t r = b / I; r * I < e; ++r) {  // spans cut at row ends
      const auto* row = reinterpret_cast<const uint16_t*>(xp + r * 2 * I);
      silu_mul_span(std::max(b, r * I) - r * I, std::min(e, (r + 1) * I) - r * I, Bf16Lanes{row}, Bf16Lanes{row + I},
                    yp + r * I);
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
  const at::BFloat16* xp = x2.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    std::vector<uint16_t> y(I);
    for (int64_t r = b; r < e; ++r) {
      const auto* row = reinterpret_cast<const uint16_t*>(xp + r * 2 * I);
      silu_quant_row(I, Bf16Lanes{row}, Bf16Lanes{row + I}, y.data(), q.data_ptr<int8_t>() + r * I,
                     scale.data_ptr<float>() + r);
    }
  });
  return {q, scale};
}

namespace {
Act act_from_q(const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& packed, const char* op) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(), op, ": q must be int8 [M,K]");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == q.size(0), op,
              ": scale must be fp32 [M]");
  TORCH_CHECK(round_up(q.size(1), KA) == packed.size(1) * 4, op, ": q does not fit the packed weight");
  Act act(q.size(0), packed.size(1) * 4);
  load_rows(q, scale, act);
  return act;
}
}  // namespace

// Already-quantized activations (q, scale) x prepacked weight -> bf16 [M, N].
torch::Tensor a8w8_linear_q(torch::Tensor q, torch::Tensor scale, torch::Tensor packed, torch::Tensor comp,
                            torch::Tensor weight_scale) {
  const int64_t N = weight_scale.numel();
  auto y = torch::empty({q.size(0), N}, q.options().dtype(torch::kBFloat16));
  if (q.size(0) == 0) return y;
  Act act = act_from_q(q, scale, packed, "a8w8_linear_q");
  run_gemm<false>(act, packed, comp, weight_scale.data_ptr<float>(), y);
  return y;
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
  run_gemm<true>(act, packed, comp, nullptr, acc);
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* ws = weight_scale.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    std::vector<uint16_t> y(I);
    for (int64_t r = b; r < e; ++r) {
      const int32_t* row = ap + r * N;
      const float as = act.scale[r];
      silu_quant_row(I, DequantLanes{row, ws, as}, DequantLanes{row + I, ws + I, as}, y.data(),
                     qo.data_ptr<int8_t>() + r * I, so.data_ptr<float>() + r);
    }
  });
  return {qo, so};
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
std::string isa() { return amx_on() ? "amx" : "vnni"; }
void set_amx(bool on) { amx_enabled.store(on); }
int64_t amx_min_m() { return amx_min_rows.load(); }
void set_amx_min_m(int64_t m) { amx_min_rows.store(std::max<int64_t>(1, m)); }

// Every ISA extension VNNI_TARGET compiles for (all CPUs with AVX512-VNNI have the others).
bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// Compute-peak probe, the other limit the benchmarks compare against: int8 multiply-adds from
// registers only (4 independent tdpbusd tiles, or 8 independent vpdpbusd accumulators), on
// every thread at once, for `iters` rounds each. Returns int8 ops (2 per multiply-add) per
// second, summed over threads.
namespace {
AMX_TARGET int64_t amx_peak_loop(int64_t iters) {
  load_tile_config();
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
  }
  alignas(64) int32_t c[16][16];
  _tile_stored(0, c, 64);  // keeps the loop
  _tile_release();
  return iters * 4 * 16 * 16 * 64 * 2 + c[0][0];
}
VNNI_TARGET int64_t vnni_peak_loop(int64_t iters) {
  __m512i acc[8], a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
  for (auto& v : acc) v = _mm512_setzero_si512();
  for (int64_t i = 0; i < iters * 16; ++i)
    for (auto& v : acc) v = _mm512_dpbusd_epi32(v, a, b);
  int64_t keep = 0;
  for (auto& v : acc) keep += _mm512_reduce_add_epi32(v) == -1;
  return iters * 16 * 8 * 64 * 2 + keep;
}
}  // namespace

double int8_peak_gops(int64_t iters) {
  const bool amx = amx_on();
  TORCH_CHECK(amx || cpu_has_vnni(), "int8_peak_gops: this CPU has neither AMX-INT8 nor AVX512-VNNI");
  const int n = at::get_num_threads();
  std::atomic<int64_t> ops{0};
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) ops += amx ? amx_peak_loop(iters) : vnni_peak_loop(iters);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return ops.load() / s / 1e9;
}

TORCH_LIBRARY(pypto_cpu, m) {
  m.def("prepack(Tensor w) -> Tensor[]");
  m.def("a8w8_linear(Tensor x, Tensor packed, Tensor comp, Tensor weight_scale) -> Tensor");
  m.def("a8w8_gemm_s32(Tensor x, Tensor packed, Tensor comp, Tensor amax, int N) -> Tensor");
  m.def("a8w8_linear_q(Tensor q, Tensor scale, Tensor packed, Tensor comp, Tensor weight_scale) -> Tensor");
  m.def("rmsnorm_quant(Tensor x, Tensor? residual, Tensor gamma, float eps, bool deferred) -> Tensor[]");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("silu_mul_quant(Tensor gate_up) -> Tensor[]");
  m.def("gate_up_silu_quant(Tensor q, Tensor scale, Tensor packed, Tensor comp, Tensor weight_scale) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(pypto_cpu, CPU, m) {
  m.impl("prepack", &prepack);
  m.impl("a8w8_linear", &a8w8_linear);
  m.impl("a8w8_gemm_s32", &a8w8_gemm_s32);
  m.impl("a8w8_linear_q", &a8w8_linear_q);
  m.impl("rmsnorm_quant", &rmsnorm_quant);
  m.impl("silu_mul", &silu_mul);
  m.impl("silu_mul_quant", &silu_mul_quant);
  m.impl("gate_up_silu_quant", &gate_up_silu_quant);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_has_vnni", &cpu_has_vnni, "AVX512-VNNI (and F/BW/VL/DQ) available on this CPU");
  m.def("isa", &isa, "which int8 path large M takes: amx or vnni");
  m.def("set_amx", &set_amx, "allow (default) or forbid the AMX path, for tests and benchmarks");
  m.def("amx_min_m", &amx_min_m, "rows from which the AMX path is taken");
  m.def("set_amx_min_m", &set_amx_min_m, "change that threshold (benchmarks)");
  m.def("int8_peak_gops", &int8_peak_gops, "int8 multiply-add peak from registers, all threads (AMX, else VNNI)");
  m.def("read_probe", &read_probe, "read a buffer once with 64-byte loads (bandwidth probe)");
}
