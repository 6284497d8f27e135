// Flag native_decode_attention: decode attention (one query token per sequence) over vLLM-CPU's
// paged bf16 KV cache, the fast path of a decode-only step. vLLM-CPU runs decode rows through its
// general tiled kernel, which reads the cache well below DRAM speed on these CPUs; benchmarks/
// attention.py sets the two side by side (docs/performance.md).
//
// One task per (sequence, KV head) reads that head's K and V once, block by block, with the next
// region prefetched while it works (Stream below): scores for the GQA group's query heads (fp32
// dot products over d, in register tiles of 8 x W tokens of K's d-major rows), a softmax in fp32
// (max subtracted, exp to about 2 ulp), then the probability-weighted V rows (tiles of 8 x W
// dimensions), normalized and rounded to bf16 once. A task never splits the context, so the
// result does not depend on the thread count. The numerics are the textbook fp32 attention, not
// vLLM-CPU's kernel's bits: outputs differ from it by bf16 rounding (tests/test_layer_ops.py
// bounds it).
//
// AVX2 + FMA only, so that every ISA path of the native backend runs the same code and bits.
// Every cache interior vLLM-CPU packs is read: "vec" and "vec16" (K region d-major: token t of
// dimension d at d * bs + t; V region token-major), and "amx" (vLLM-CPU's choice on CPUs with AMX:
// K in 16-token groups of dimension pairs, V in 16-dimension groups of token pairs; paging.py). An
// AMX-interior load of 8 lanes holds two dimensions (K) or two tokens (V) interleaved, and each is
// split out exactly (a bf16 is the high half of its fp32), so every sum adds the same products in
// the same order as from a vec cache: the same bits.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

#include "avx2.h"
#include "ops.h"

namespace a8w8 {

using bf16 = at::BFloat16;

// AVX2 code in a8w8::avx2, where the ISA checks (test_native_cpu.py) expect 256-bit registers
namespace avx2 {
namespace {

#define DA_TARGET __attribute__((target("avx2,fma")))

DA_TARGET inline __m256 bf16x8(const bf16* p) { return load8_bf16(reinterpret_cast<const uint16_t*>(p)); }

// exp(x) for x <= 0 (a score minus the row max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
// Cephes' degree-6 polynomial; below -87 it is 0, as expf underflows.
DA_TARGET inline __m256 exp_neg(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

struct Head {
  const bf16* cache;     // the layer's cache [blocks, nkv, 2 * bs * hd]
  const int32_t* table;  // this sequence's block-table row
  int64_t ctx, bs, hd, nkv, kvh;
  bool amx;  // the AMX interior
  // block j's K region (vec: [hd][bs], d-major), followed in memory by its V region (vec: [bs][hd])
  const bf16* k(int64_t j) const { return cache + (table[j] * nkv + kvh) * (2 * bs * hd); }
  const bf16* v(int64_t j) const { return k(j) + bs * hd; }
};

// The regions a task reads, in the order it reads them: K of every block, then V of every block,
// then the next task's first K. While it works on one region (`steps` inner steps) it prefetches
// the next, spread evenly over those steps, so no region starts on cold lines but a thread's first. Only the lines of a block's n tokens are
// fetched: the first n tokens of each K row, the first n V rows. Into L2: a K or V region is
// 32 KB at Qwen3 sizes, as much as L1, and a pass reads from all of it.
struct Lines {  // rows x `per_row` lines, `stride` bytes apart
  const char* p = nullptr;
  int64_t rows = 0, per_row = 0, stride = 0;
};

// AMX interior: K is the first n tokens' 16-token groups ([hd / 2][16][2] each), one run; V is
// hd / 16 rows of 16 dimensions, each of n tokens in pairs (64 bytes a pair).
inline Lines k_lines(const Head& h, int64_t j) {
  const int64_t n = std::min(h.bs, h.ctx - j * h.bs);
  const char* p = reinterpret_cast<const char*>(h.k(j));
  return h.amx ? Lines{p, 1, (n + 15) / 16 * h.hd / 2, 0} : Lines{p, h.hd, (n * 2 + 63) / 64, h.bs * 2};
}

inline Lines v_lines(const Head& h, int64_t j) {
  const int64_t n = std::min(h.bs, h.ctx - j * h.bs);
  const char* p = reinterpret_cast<const char*>(h.v(j));
  return h.amx ? Lines{p, h.hd / 16, (n + 1) / 2, h.bs * 32} : Lines{p, 1, (n * h.hd * 2 + 63) / 64, 0};
}

// The two fp32 vectors in 8 AMX-interior pairs of bf16: the even elements (the first dimension of
// a K pair, the first token of a V pair) and the odd ones.
DA_TARGET inline __m256 pair_lo(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
DA_TARGET inline __m256 pair_hi(__m256i x) {
  return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
DA_TARGET inline __m256i load_pairs(const bf16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

struct Stream {
  const Head& h;
  const Head* then;  // the thread's next task, or null
  int64_t blocks;
  Lines cur;
  int64_t row = 0, line = 0, per_step = 1;
  Lines region(int64_t i) const {
    if (i < blocks) return k_lines(h, i);
    if (i < 2 * blocks) return v_lines(h, i - blocks);
    return i == 2 * blocks && then ? k_lines(*then, 0) : Lines{};
  }
  void start(int64_t i, int64_t steps) {  // region i begins, `steps` inner steps long: prefetch region i + 1
    cur = region(i + 1);
    row = line = 0;
    per_step = (cur.rows * cur.per_row + steps - 1) / steps;
  }
  void step() {
    for (int64_t k = 0; k < per_step && row < cur.rows; ++k) {
      _mm_prefetch(cur.p + row * cur.stride + line * 64, _MM_HINT_T1);
      if (++line == cur.per_row) line = 0, ++row;
    }
  }
};

inline void prefetch_all(const Lines& r) {
  for (int64_t i = 0; i < r.rows; ++i)
    for (int64_t l = 0; l < r.per_row; ++l) _mm_prefetch(r.p + i * r.stride + l * 64, _MM_HINT_T1);
}

// One (sequence, KV head) for G query heads: q [G][hd] fp32 (scale applied), out [G][hd] bf16.
// W vectors of 8 lanes per head per pass, G * W <= 8 accumulators: for G = 1-2, W = 4, so a pass
// uses a whole 64-byte line of each K row (32 tokens) and of each V row (32 dimensions), with 8
// FMA chains in flight. Each output is the same sum in the same order (over d for a score, over
// t for an output dimension) whatever W is.
template <int G, int W, bool Amx>
DA_TARGET void head_attention(const Head& h, const Head* then, const float* q, float* s, float* acc, bf16* out,
                              int64_t out_stride) {
  const int64_t bs = h.bs, hd = h.hd, ctx = h.ctx, stride = ctx + 8 * W;  // s: [G][ctx rounded up]
  const int64_t blocks = (ctx + bs - 1) / bs;
  Stream st{h, then, blocks, {}};
  for (int64_t j = 0; j < blocks; ++j) {  // scores, 8 * W tokens a pass (the last may read past ctx)
    const bf16* K = h.k(j);
    const int64_t t0 = j * bs, n = std::min(bs, ctx - t0);
    st.start(j, (n + 8 * W - 1) / (8 * W) * hd);
    for (int64_t t = 0; t < n; t += 8 * W) {
      __m256 a[G][W];
      for (int g = 0; g < G; ++g)
        for (int w = 0; w < W; ++w) a[g][w] = _mm256_setzero_ps();
      if constexpr (Amx) {
        for (int64_t d = 0; d < hd; d += 2) {  // a dimension pair: d, then d + 1 into each accumulator
          st.step(), st.step();
          __m256 q0[G], q1[G];
          for (int g = 0; g < G; ++g)
            q0[g] = _mm256_broadcast_ss(q + g * hd + d), q1[g] = _mm256_broadcast_ss(q + g * hd + d + 1);
          for (int w = 0; w < W; ++w) {
            const int64_t tt = t + 8 * w;  // 8 tokens of one 16-token group
            const __m256i x = load_pairs(K + tt / 16 * (16 * hd) + d * 16 + tt % 16 * 2);
            const __m256 k0 = pair_lo(x), k1 = pair_hi(x);
            for (int g = 0; g < G; ++g) a[g][w] = _mm256_fmadd_ps(q1[g], k1, _mm256_fmadd_ps(q0[g], k0, a[g][w]));
          }
        }
      } else {
        for (int64_t d = 0; d < hd; ++d) {
          st.step();
          __m256 kv[W];
          for (int w = 0; w < W; ++w) kv[w] = bf16x8(K + d * bs + t + 8 * w);
          for (int g = 0; g < G; ++g) {
            const __m256 qd = _mm256_broadcast_ss(q + g * hd + d);
            for (int w = 0; w < W; ++w) a[g][w] = _mm256_fmadd_ps(qd, kv[w], a[g][w]);
          }
        }
      }
      for (int g = 0; g < G; ++g)
        for (int w = 0; w < W; ++w) _mm256_storeu_ps(s + g * stride + t0 + t + 8 * w, a[g][w]);
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {  // softmax over the ctx valid scores (lanes past ctx are garbage)
    float* sg = s + g * stride;
    float m = -INFINITY;
    for (int64_t t = 0; t < ctx; ++t) m = std::max(m, sg[t]);
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= ctx; t += 8) {
      const __m256 p = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vm));
      _mm256_storeu_ps(sg + t, p);
      sum8 = _mm256_add_ps(sum8, p);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum8);
    float sum = 0.f;
    for (float l : lanes) sum += l;
    if (t < ctx) {
      alignas(32) float tail[8] = {};
      for (int64_t i = t; i < ctx; ++i) tail[i - t] = sg[i] - m;
      for (int64_t i = ctx - t; i < 8; ++i) tail[i] = -INFINITY;
      _mm256_store_ps(tail, exp_neg(_mm256_load_ps(tail)));
      for (int64_t i = t; i < ctx; ++i) sum += (sg[i] = tail[i - t]);
    }
    inv[g] = 1.0f / sum;
  }
  std::fill(acc, acc + G * hd, 0.0f);
  for (int64_t j = 0; j < blocks; ++j) {  // probability-weighted V rows, 8 * W dimensions a pass
    const bf16* V = h.v(j);
    const int64_t t0 = j * bs, n = std::min(bs, ctx - t0);
    st.start(blocks + j, hd / (8 * W) * n);
    for (int64_t d = 0; d < hd; d += 8 * W) {
      __m256 a[G][W];
      for (int g = 0; g < G; ++g)
        for (int w = 0; w < W; ++w) a[g][w] = _mm256_loadu_ps(acc + g * hd + d + 8 * w);
      if constexpr (Amx) {
        for (int64_t t = 0; t < n; t += 2) {  // a token pair: t, then t + 1 (if in the block's n)
          const bool two = t + 1 < n;
          st.step();
          if (two) st.step();
          __m256 p0[G], p1[G];
          for (int g = 0; g < G; ++g)
            p0[g] = _mm256_broadcast_ss(s + g * stride + t0 + t),
            p1[g] = _mm256_broadcast_ss(s + g * stride + t0 + t + two);
          for (int w = 0; w < W; ++w) {
            const int64_t dd = d + 8 * w;  // 8 dimensions of one 16-dimension group
            const __m256i x = load_pairs(V + dd / 16 * (16 * bs) + t * 16 + dd % 16 * 2);
            const __m256 v0 = pair_lo(x);
            for (int g = 0; g < G; ++g) a[g][w] = _mm256_fmadd_ps(p0[g], v0, a[g][w]);
            if (two) {
              const __m256 v1 = pair_hi(x);
              for (int g = 0; g < G; ++g) a[g][w] = _mm256_fmadd_ps(p1[g], v1, a[g][w]);
            }
          }
        }
      } else {
        for (int64_t t = 0; t < n; ++t) {
          st.step();
          __m256 vv[W];
          for (int w = 0; w < W; ++w) vv[w] = bf16x8(V + t * hd + d + 8 * w);
          for (int g = 0; g < G; ++g) {
            const __m256 p = _mm256_broadcast_ss(s + g * stride + t0 + t);
            for (int w = 0; w < W; ++w) a[g][w] = _mm256_fmadd_ps(p, vv[w], a[g][w]);
          }
        }
      }
      for (int g = 0; g < G; ++g)
        for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + g * hd + d + 8 * w, a[g][w]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int64_t d = 0; d < hd; ++d) out[g * out_stride + d] = bf16(acc[g * hd + d] * inv[g]);
}

using HeadFn = void (*)(const Head&, const Head*, const float*, float*, float*, bf16*, int64_t);

// The widest tile for G that divides both the block size and head_dim (bs and hd are multiples of 16).
template <int G, bool Amx>
HeadFn tiled(int64_t bs, int64_t hd) {
  constexpr int W = G <= 2 ? 4 : G <= 4 ? 2 : 1;
  if constexpr (W > 2) {
    if (bs % (8 * W) == 0 && hd % (8 * W) == 0) return head_attention<G, W, Amx>;
  }
  if constexpr (W > 1) return head_attention<G, 2, Amx>;
  return head_attention<G, 1, Amx>;
}

template <bool Amx>
HeadFn head_fn(int64_t G, int64_t bs, int64_t hd) {
  switch (G) {
    case 1: return tiled<1, Amx>(bs, hd);
    case 2: return tiled<2, Amx>(bs, hd);
    case 3: return tiled<3, Amx>(bs, hd);
    case 4: return tiled<4, Amx>(bs, hd);
    case 5: return tiled<5, Amx>(bs, hd);
    case 6: return tiled<6, Amx>(bs, hd);
    case 7: return tiled<7, Amx>(bs, hd);
    case 8: return tiled<8, Amx>(bs, hd);
    default: return nullptr;
  }
}

}  // namespace
}  // namespace avx2

using avx2::Head;
using avx2::HeadFn;

bool decode_attention_fits(int64_t num_heads, int64_t num_kv_heads, int64_t hd, const std::string& interior) {
  return (interior == "vec" || interior == "vec16" || interior == "amx") && num_kv_heads > 0 &&
         num_heads % num_kv_heads == 0 && num_heads >= num_kv_heads && num_heads / num_kv_heads <= 8 && hd % 16 == 0;
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor seq_lens,
                               torch::Tensor block_table, int64_t num_kv_heads, double scale, std::string interior) {
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
              "decode_attention: this CPU has no AVX2 + FMA, which the kernel is built for");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kBFloat16 && q.stride(2) == 1,
              "decode_attention: q must be bf16 [sequences, heads, head_dim]");
  const int64_t B = q.size(0), nq = q.size(1), hd = q.size(2);
  TORCH_CHECK(decode_attention_fits(nq, num_kv_heads, hd, interior), "decode_attention: ", nq, " query heads over ",
              num_kv_heads, " KV heads of ", hd, " in the '", interior, "' cache interior are not supported "
              "(GQA groups of 1..8 heads, head_dim a multiple of 16, interiors vec, vec16 and amx)");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(1) == num_kv_heads && kv_cache.size(3) == 2 * hd &&
                  kv_cache.is_contiguous() && kv_cache.scalar_type() == torch::kBFloat16,
              "decode_attention: expected vLLM-CPU's bf16 cache [blocks, ", num_kv_heads, ", block_size, ", 2 * hd,
              "], got ", kv_cache.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.numel() == B && seq_lens.is_contiguous() &&
                  block_table.scalar_type() == torch::kInt32 && block_table.dim() == 2 &&
                  block_table.size(0) >= B && block_table.stride(1) == 1,
              "decode_attention: seq_lens int32 [", B, "] and block_table int32 [>= ", B, ", blocks] expected");
  const int64_t bs = kv_cache.size(2), blocks = kv_cache.size(0), G = nq / num_kv_heads;
  TORCH_CHECK(bs % 16 == 0, "decode_attention: block size ", bs, " is not a multiple of 16");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t row = block_table.stride(0);
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && (lens[b] + bs - 1) / bs <= block_table.size(1), "decode_attention: sequence ", b,
                " has ", lens[b], " tokens for ", block_table.size(1), " blocks of ", bs);
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(table[b * row + j] >= 0 && table[b * row + j] < blocks, "decode_attention: block ",
                  table[b * row + j], " outside the cache");
    longest = std::max<int64_t>(longest, lens[b]);
  }
  auto out = torch::empty({B, nq * hd}, q.options());
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* cache = kv_cache.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const bool amx = interior == "amx";
  const HeadFn fn = amx ? avx2::head_fn<true>(G, bs, hd) : avx2::head_fn<false>(G, bs, hd);
  const auto head = [&](int64_t i) {
    const int64_t b = i / num_kv_heads;
    return Head{cache, table + b * row, lens[b], bs, hd, num_kv_heads, i % num_kv_heads, amx};
  };
  at::parallel_for(0, B * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * hd), s(G * (longest + 32)), acc(G * hd);
    Head h = head(begin), then = h;
    avx2::prefetch_all(avx2::k_lines(h, 0));  // later tasks' first regions stream in during the task before
    for (int64_t i = begin; i < end; ++i, h = then) {
      if (i + 1 < end) then = head(i + 1);
      const int64_t b = i / num_kv_heads;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < hd; ++d)
          qf[g * hd + d] = static_cast<float>(qp[b * q.stride(0) + (h.kvh * G + g) * q.stride(1) + d]) * scale;
      fn(h, i + 1 < end ? &then : nullptr, qf.data(), s.data(), acc.data(), op + b * nq * hd + h.kvh * G * hd, hd);
    }
  });
  return out;
}

}  // namespace a8w8
