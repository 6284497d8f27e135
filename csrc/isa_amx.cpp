// The AMX-INT8 path: tdpbusd on 16x64 tiles for M >= amx_min_m(); below that, and for every
// row op, the AVX512-VNNI path (every AMX CPU has it), which streams the weights as fast there.

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "avx512.h"

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

namespace a8w8 {

namespace {
std::atomic<int64_t> min_rows{4};  // below this the VNNI path streams weights as fast (measured)
}

int64_t amx_min_m() { return min_rows.load(); }
void set_amx_min_m(int64_t m) { min_rows.store(std::max<int64_t>(1, m)); }

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

namespace amx {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile as 16 rows of 64 bytes: int8 A and B tiles, int32 16x16 C tiles. Tile state is
// per thread, so each thread loads it before its first tile instruction.
AMX_TARGET void load_tile_config() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
}

// The epilogue of int32 sums c (ldc a row) for rows [r0, r0 + rows) and channels [n0, n0 + ldc),
// rows past M and channels past N left out.
template <bool I32>
AMX_TARGET void store_sums(const Gemm& g, const int32_t* c, int64_t ldc, int64_t r0, int64_t rows, int64_t n0) {
  for (int64_t s = 0; s < ldc / 16; ++s) {
    const int64_t n = n0 + 16 * s;
    if (n >= g.N) break;
    const __mmask16 m = avx512::tail_mask(g.N - n);
    const __m512i cp = _mm512_maskz_loadu_epi32(m, g.comp + n);
    const __m512 ws = I32 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, g.ws + n);
    for (int64_t r = 0; r < rows && r0 + r < g.M; ++r)
      avx512::store16<I32>(_mm512_load_si512(c + r * ldc + 16 * s), cp, ws, I32 ? 0.f : g.ascale[r0 + r],
                           g.y + (r0 + r) * g.ldy, n, m);
  }
}

// Where the 16 x 64 A tile of 16-row block i at K step kb lies: in g.a's rows (lda apart), or, with several
// blocks, in a copy packed tile by tile (see tiles()).
struct ATiles {
  const uint8_t* base;
  int64_t ld, step, block, first;  // row, K step and block strides; the block at base
  const uint8_t* at(int64_t i, int64_t kb) const { return base + (i - first) * block + kb * step; }
};

// One 64-channel weight tile for rows [r0, r0 + 16): one A tile against the whole tile, 4 C
// tiles and 3 B tiles in rotation, so the weights stream in order, once per 16 rows (without the
// prefetch below, faster than 2x2 blocks at every M from 24 to 2048; with it, see block2).
// The activation rows are padded to a multiple of 16 (q 0) so tiles never read past them.
// Tile loads from L2 leave the tile unit waiting (a probe: 1.1-1.5 TOPS a core from L2, 2.5-4.1 from
// L1), so with several blocks (`ahead`) each K step pulls the next step's A and B lines into L1,
// and `pf` its share of the next weight tile into L2 (1.1-1.3x at M = 64 and 256 on a Xeon). A
// single block has `pf` stream its own tile ahead instead (stream_ahead).
template <bool I32>
AMX_TARGET void block(const Gemm& g, const ATiles& A, const int8_t* wt, int64_t r0, int64_t n0, bool ahead,
                      TilePrefetch pf) {
  alignas(64) int32_t c[16][64];
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const int64_t steps = g.Kp / KA;
  for (int64_t kb = 0; kb < steps; ++kb) {
    const int8_t* b = wt + kb * 16 * 256;
    if (ahead && kb + 1 < steps) {
      const char* an = reinterpret_cast<const char*>(A.at(r0 / 16, kb + 1));
      for (int r = 0; r < 16; ++r) _mm_prefetch(an + r * A.ld, _MM_HINT_T0);
      const char* bn = reinterpret_cast<const char*>(b + 16 * 256);
      for (int l = 0; l < 64; ++l) _mm_prefetch(bn + l * 64, _MM_HINT_T0);
    }
    for (int i = 0; i < 16; ++i) pf.step();  // a K step is 16 groups of 4
    _tile_loadd(4, A.at(r0 / 16, kb), A.ld);
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
  store_sums<I32>(g, &c[0][0], 64, r0, 16, n0);
}

// Rows [r0, r0 + 32) x the 32 channels of half h of the weight tile at channel n0: 2 A tiles x 2 B tiles, each
// loaded tile used twice, with the next K step's A and B lines pulled into L1 as in block().
template <bool I32>
AMX_TARGET void block2(const Gemm& g, const ATiles& A, const int8_t* wt, int64_t r0, int64_t n0, int64_t h,
                       TilePrefetch pf) {
  alignas(64) int32_t c[32][32];
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const int64_t steps = g.Kp / KA;
  for (int64_t kb = 0; kb < steps; ++kb) {
    const int8_t* b = wt + kb * 16 * 256 + h * 128;
    if (kb + 1 < steps) {
      const char* an0 = reinterpret_cast<const char*>(A.at(r0 / 16, kb + 1));
      const char* an1 = reinterpret_cast<const char*>(A.at(r0 / 16 + 1, kb + 1));
      for (int r = 0; r < 16; ++r) {
        _mm_prefetch(an0 + r * A.ld, _MM_HINT_T0);
        _mm_prefetch(an1 + r * A.ld, _MM_HINT_T0);
      }
      const char* bn = reinterpret_cast<const char*>(b + 16 * 256);
      for (int l = 0; l < 16; ++l) {
        _mm_prefetch(bn + l * 256, _MM_HINT_T0);
        _mm_prefetch(bn + l * 256 + 64, _MM_HINT_T0);
      }
    }
    for (int i = 0; i < 16; ++i) pf.step();  // a K step is 16 groups of 4
    _tile_loadd(4, A.at(r0 / 16, kb), A.ld);
    _tile_loadd(6, b, 256);
    _tile_dpbusd(0, 4, 6);
    _tile_loadd(7, b + 64, 256);
    _tile_dpbusd(1, 4, 7);
    _tile_loadd(5, A.at(r0 / 16 + 1, kb), A.ld);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, &c[0][0], 128); _tile_stored(1, &c[0][16], 128);
  _tile_stored(2, &c[16][0], 128); _tile_stored(3, &c[16][16], 128);
  store_sums<I32>(g, &c[0][0], 32, r0, 32, n0 + 32 * h);
}

// One block of rows (M <= 16) reads each weight tile once, straight from DRAM: it pulls the lines
// 32 KiB ahead of its tile loads into L2, across tile ends up to the thread's last tile. M = 4 and
// 16, Qwen3-1.7B and 14B linears: 1.02-1.10x (gemm_ab.py); 8 KiB into L1 ran 0.85x, 128 KiB 1.00x.
inline TilePrefetch stream_ahead(const Gemm& g, const int8_t* wt, int64_t te) {
  constexpr int64_t ahead_bytes = 32 << 10;
  const int8_t* end = std::min(wt + g.tile_bytes() + ahead_bytes, g.w + te * g.tile_bytes());
  return {wt + ahead_bytes, end, 4};  // 4 lines a K group: the 64 lines (4 KiB) a K step reads
}

// With several blocks, each weight tile re-reads every A tile from L2 or L3, and a tile of rows lda apart is 16
// lines on as many pages. Packed tile by tile (1 KiB each, a block's tiles in K order), a block's A is one
// stream for the prefetchers on few pages. Each thread packs the rows of its chunk for its own tiles, a copy
// of M x Kp bytes: 1.02-1.24x on Qwen3-1.7B and 14B linears at M = 20-2048 (14B down 1.00-1.04x), and pairs pay
// from M = 17 on (gemm_ab.py, docs/performance.md).
struct alignas(64) ATile {
  uint8_t v[16 * KA];
};

AMX_TARGET ATiles pack_rows(const Gemm& g, int64_t m0, int64_t m1, std::vector<ATile>& buf) {
  const int64_t steps = g.Kp / KA, blocks = (m1 - m0 + 15) / 16, lda = g.lda();
  if (static_cast<int64_t>(buf.size()) < blocks * steps) buf.resize(blocks * steps);
  for (int64_t i = 0; i < blocks; ++i)
    for (int64_t r = 0; r < 16; ++r) {  // rows past M are the buffer's padding rows (rows_held)
      const uint8_t* src = g.a + (m0 + 16 * i + r) * lda;
      for (int64_t kb = 0; kb < steps; ++kb)
        _mm512_store_si512(buf[i * steps + kb].v + r * KA, _mm512_loadu_si512(src + kb * KA));
    }
  return {buf[0].v, KA, 16 * KA, steps * 16 * KA, m0 / 16};
}

template <bool I32>
AMX_TARGET void tiles(const Gemm& g, int64_t tb, int64_t te) {
  load_tile_config();
  // Rows in chunks of about 8 MiB of activations: every chunk streams the whole weight from DRAM
  // once more, while a chunk re-read per tile comes from L3 (chunks sized for L2 cost more in
  // weight passes than they saved: docs/performance.md).
  const int64_t Mc = std::max<int64_t>(16, (int64_t{8} << 20) / g.lda() / 16 * 16);
  // The next tile goes to L2 while this one is read from there, so both must fit in half of an
  // AMX core's 2 MiB L2 (K <= 8192): with 1.1 MB tiles (K = 17408) it ran 0.97x at M = 64.
  const bool ahead = g.M > 16, next_tile = ahead && 2 * g.tile_bytes() <= (int64_t{1} << 20);
  // Blocks of rows whose tiles come from L2 go in pairs, 2 A x 2 B tiles: a fifth fewer tile bytes
  // loaded per tdpbusd than 1 A x 4 B (with A packed, from M = 17; tiles too large for the next one
  // in L2, as down's at K = 17408, keep 1 x 4: 0.89-0.91x in pairs).
  const bool paired = next_tile;
  thread_local std::vector<ATile> packed;  // up to a chunk's 8 MiB a thread, kept for the next call
  for (int64_t m0 = 0; m0 < g.M; m0 += Mc) {
    const int64_t m1 = std::min(g.M, m0 + Mc), blocks = (m1 - m0 + 15) / 16;
    const ATiles A = ahead ? pack_rows(g, m0, m1, packed) : ATiles{g.a, g.lda(), KA, 16 * g.lda(), 0};
    for (int64_t t = tb; t < te; ++t) {
      const int8_t* wt = g.w + t * g.tile_bytes();
      // each pair is two calls, one per half of the tile: blocks calls in all, each a share of the next tile
      const int64_t pairs = paired ? blocks / 2 : 0;
      int64_t b = 0;
      for (int64_t p = 0; p < pairs; ++p)
        for (int64_t h = 0; h < 2; ++h, ++b)
          block2<I32>(g, A, wt, m0 + 32 * p, t * NT, h, next_tile_share(g, wt, next_tile && t + 1 < te, b, blocks));
      for (int64_t r0 = m0 + 32 * pairs; r0 < m1; r0 += 16, ++b)
        block<I32>(g, A, wt, r0, t * NT, ahead,
                   ahead ? next_tile_share(g, wt, next_tile && t + 1 < te, b, blocks) : stream_ahead(g, wt, te));
    }
  }
  _tile_release();
}

bool takes(int64_t M) { return M >= min_rows.load(); }

int64_t rows_held(int64_t M) { return takes(M) ? round_up(M, 16) : M; }

void gemm(const Gemm& g, int64_t tb, int64_t te) {
  if (!takes(g.M)) return avx512::gemm(g, tb, te);
  g.i32 ? tiles<true>(g, tb, te) : tiles<false>(g, tb, te);
}

// 4 independent tdpbusd tiles, 16 x 16 x 64 multiply-adds each.
AMX_TARGET int64_t peak_loop(int64_t iters) {
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

}  // namespace
}  // namespace amx

const Kernels amx_kernels = {
    "amx", true, amx::rows_held, avx512::quantize_row, amx::gemm, avx512::rmsnorm_quant_row,
    avx512::silu_mul_bf16, avx512::silu_mul_acc, avx512::read_slice, amx::peak_loop,
};

}  // namespace a8w8
