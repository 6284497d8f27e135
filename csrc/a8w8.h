// What every ISA path of the native A8W8 kernels shares: the packed weight layout, the
// activation rows a GEMM reads, and the table of kernels each ISA file fills in. The numerics
// contract is vllm_pypto/kernels/reference.py (and layer_ref.py for the fused ops): every path
// gives the same int32 sums and rounds at the same points, so all of them are bit-identical.
//
// Weight layout (prepacked once at load, the same bytes for every path): output channels in
// tiles of 64, K in groups of 4:
//   packed[t][g][c][j] = w[64 t + c][4 g + j]     (256 contiguous bytes per (tile, group))
// so one tile streams as one sequential run; 32 bytes feed one 256-bit multiply-add over 8
// channels, 64 bytes one 512-bit one over 16, and 16 groups are an AMX B tile (rows of 64 bytes
// at stride 256). N is padded to 64 and K to 64 with zero weights (which add nothing).
//
// Activations: per-token s8 q as the spec says. The u8 x s8 instructions (vpdpbusd, tdpbusd) read
// them as u8 = q + 128, and the offset leaves int32 exactly: sum_k (q+128) w = sum_k q w +
// 128 colsum(w), so acc = dot - comp[n] with comp = 128 colsum. Plain AVX2 keeps s8 (see
// isa_avx2.cpp).
//
// Each ISA file compiles its functions with target attributes, so the library builds and loads on
// any x86-64 CPU; isa.cpp selects a path by what the CPU reports.
#pragma once

#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace a8w8 {

constexpr int64_t NT = 64;  // output channels per weight tile
constexpr int64_t KA = 64;  // K padding: one AMX tile row of int8

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// M = 1 streams its weights with all four lines of a group prefetched 32 groups (8 KB) ahead: on an
// AVX2-only EPYC (Zen 3) one line 2 KB ahead, or the hardware prefetchers alone, left the GEMV
// 10-20 points further below the read probe (an interleaved A/B of builds, docs/performance.md).
// The read probe prefetches as far ahead, so that it bounds what the GEMV's loads can read: on a
// Zen 5 EPYC the probe without it read 12-19% less than with it, and less than the GEMV itself.
constexpr int64_t PF_BYTES = 8192;

// Bytes from one activation row to the next: Kp, plus one cache line where Kp is an even number of
// lines. At K = 2048 or 6144 the 32 rows of an AMX row-block pair would fall into 2 of L1's 64 sets
// and evict each other at every K step; an odd number of lines puts them in 32 sets (1.7B's
// linears on AMX at M = 256 and 2048: 1.12-1.32x, gemm_ab.py, docs/performance.md).
inline int64_t row_stride(int64_t Kp) { return (Kp / 64) % 2 ? Kp : Kp + 64; }

// One GEMM over quantized rows: y[M, N] = (sum_k a w - comp) * ws[n] * ascale[r] in bf16, or the
// exact int32 sums (i32, for tensor-parallel shards that reduce them before the epilogue).
struct Gemm {
  const uint8_t* a;      // M rows of Kp bytes, lda() apart (u8 = q + 128 on u8 paths, else s8 q)
  const float* ascale;   // [M]
  int64_t M, Kp, N;
  const int8_t* w;       // packed tiles
  const int32_t* comp;   // [Np] 128 * colsum(w)
  const float* ws;       // [N] weight scales (unused when i32)
  char* y;               // bf16 or int32 rows of N
  int64_t ldy;           // bytes per y row
  bool i32;
  int64_t tile_bytes() const { return Kp / 4 * 256; }
  int64_t lda() const { return row_stride(Kp); }
};

// A GEMM with several blocks of rows reads each weight tile once per block: the first block from
// DRAM, the later ones from L2. So each block prefetches a share of the next tile into L2 while it
// computes, and the next tile's first block does not wait on DRAM (docs/performance.md,
// 2026-12-03 afternoon). step() runs once per K group of the block's loop.
struct TilePrefetch {
  const int8_t* p = nullptr;
  const int8_t* end = nullptr;
  int per_group = 0;
  void step() {
    if (p < end)
      for (int l = 0; l < per_group; ++l, p += 64) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  }
};

// Share `part` of `parts` of the tile after `wt` (none past the thread's last tile), spread over
// the block's K groups at up to 4 lines a group.
inline TilePrefetch next_tile_share(const Gemm& g, const int8_t* wt, bool has_next, int64_t part, int64_t parts) {
  if (!has_next) return {};
  const int64_t tile = g.tile_bytes(), groups = g.Kp / 4, share = (tile / parts + 63) / 64 * 64;
  const int8_t* p = wt + tile + part * share;
  const int8_t* end = std::min(p + share, wt + 2 * tile);
  if (p >= end) return {};
  return {p, end, static_cast<int>(std::min<int64_t>(4, (share / 64 + groups - 1) / groups))};
}

// A table of f(x) for every bf16 bit pattern x, filled once by Fill (one table per Fill).
template <void (*Fill)(float*)>
const float* bf16_table() {
  static const std::vector<float> t = [] {
    std::vector<float> v(1 << 16);
    Fill(v.data());
    return v;
  }();
  return t.data();
}

// The kernels of one ISA path. Row ops work on bf16 as raw uint16 bits.
struct Kernels {
  const char* name;
  bool u8;  // activations as q + 128, comp subtracted
  // rows the activation buffer must hold for M rows (AMX loads whole 16-row tiles)
  int64_t (*rows_held)(int64_t M);
  // one bf16 row -> K quantized bytes (then zero q up to Kp); scale = amax/127, or NaN for a row
  // with NaN/inf (all q 0). `given`: the row's amax over more than this slice (may be null).
  void (*quantize_row)(const uint16_t* x, int64_t K, int64_t Kp, uint8_t* out, float* scale, const float* given,
                       bool u8);
  // weight tiles [tile_begin, tile_end) for every row (called on several threads at once)
  void (*gemm)(const Gemm& g, int64_t tile_begin, int64_t tile_end);
  // residual add, fp64 mean square, bf16 norm, s8 per-token quantization (layer_ref.rmsnorm_quant)
  void (*rmsnorm_quant_row)(const uint16_t* x, const uint16_t* res, const uint16_t* gamma, int64_t H, double eps,
                            bool deferred, uint16_t* h, uint16_t* y, int8_t* q, float* scale);
  // y[b, e) = bf16(SiLU(gate) * up), from bf16 gate/up or from int32 sums through the epilogue
  void (*silu_mul_bf16)(int64_t b, int64_t e, const uint16_t* gate, const uint16_t* up, uint16_t* y);
  void (*silu_mul_acc)(int64_t b, int64_t e, const int32_t* acc_gate, const int32_t* acc_up, const float* ws_gate,
                       const float* ws_up, float as, uint16_t* y);
  // the bandwidth probe: read n bytes once with the path's widest loads
  int64_t (*read_slice)(const uint8_t* p, int64_t n);
  // the compute probe: int8 ops done by `iters` rounds of independent multiply-adds from registers
  int64_t (*peak_loop)(int64_t iters);
};

// Defined by isa_avx2.cpp, isa_avx512.cpp and isa_amx.cpp.
extern const Kernels avx2_kernels, avx_vnni_kernels, avx512_kernels, amx_kernels;

// isa.cpp: the path in use (the best this CPU runs unless set_isa chose a lower one).
const Kernels& active();
bool has_path();
std::string isa();
std::vector<std::string> isa_paths();
void set_isa(const std::string& name);

// isa_amx.cpp: where the AMX path starts (below it, AVX512-VNNI streams the weights as fast).
int64_t amx_min_m();
void set_amx_min_m(int64_t m);
bool amx_permitted();

}  // namespace a8w8
