// The GEMM of one ISA path, built from one revision of csrc/ without torch (benchmarks/gemm_ab.py
// builds two and runs them in turn). Weights rotate through copies totalling ~1 GiB, so every
// call reads them from DRAM, and the tiles split over the threads in halves, as at::parallel_for
// splits them in ops.cpp. Prints one JSON line: median ms, GOPS, weight GB/s and a hash of the
// output of the first copy (equal across builds when both compute the same bits).
//
//   gemm_ab_driver ISA M K N THREADS SECONDS

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "a8w8.h"

using namespace a8w8;

// Bytes between activation rows: Gemm::lda() where the revision has it, else Kp.
template <class G>
auto row_stride_of(G g, int, int64_t Kp) -> decltype(g.lda()) { return g.Kp = Kp, g.lda(); }
template <class G>
int64_t row_stride_of(G, long, int64_t Kp) { return Kp; }

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s ISA M K N THREADS SECONDS\n", argv[0]);
    return 2;
  }
  const std::string isa = argv[1];
  const int64_t M = std::atoll(argv[2]), K = std::atoll(argv[3]), N = std::atoll(argv[4]);
  const int threads = std::atoi(argv[5]);
  const double seconds = std::atof(argv[6]);
  const Kernels* k = isa == "avx512" ? &avx512_kernels
                     : isa == "avx2" ? &avx2_kernels
                     : isa == "avx_vnni" ? &avx_vnni_kernels
                     : isa == "amx" && amx_permitted() ? &amx_kernels  // asks Linux for tile state once
                                                       : nullptr;
  if (!k) {
    std::fprintf(stderr, "ISA %s: choose avx512, avx2, avx_vnni or amx (on a CPU with AMX)\n", isa.c_str());
    return 2;
  }
  const int64_t Kp = round_up(K, KA), Np = round_up(N, NT), tiles = Np / NT, bytes = tiles * (Kp / 4) * 256;
  const int64_t copies = std::max<int64_t>(3, (int64_t{1} << 30) / bytes + 1);
  // 64-byte aligned, as torch allocates the packed weights. A malloc'd copy starts 16 bytes into
  // its page, so half its 32-byte loads straddle two lines: that slowed 2-5 rows by up to 1.4x
  // against the op, and ranked a change that the op ran slower as faster (docs/performance.md).
  struct Free {
    void operator()(int8_t* p) const { std::free(p); }
  };
  std::vector<std::unique_ptr<int8_t[], Free>> w;
  uint32_t seed = 12345;
  for (int64_t c = 0; c < copies; ++c) {
    w.emplace_back(static_cast<int8_t*>(std::aligned_alloc(64, bytes)));
    for (int64_t i = 0; i < bytes; ++i)
      w.back()[i] = static_cast<int8_t>(static_cast<int>((seed = seed * 1664525u + 1013904223u) >> 24) % 255 - 127);
  }
  // the same M x Kp values at the revision's row stride, so that both builds' outputs hash alike
  const int64_t lda = row_stride_of(Gemm{}, 0, Kp);
  std::vector<uint8_t> a(k->rows_held(M) * lda);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = 0; c < Kp; ++c) a[r * lda + c] = static_cast<uint8_t>((seed = seed * 1664525u + 1013904223u) >> 24);
  std::vector<float> as(M, 1e-3f), ws(N, 2e-3f);
  std::vector<int32_t> comp(Np, 0);
  std::vector<uint16_t> y(M * N);
  auto run = [&](const int8_t* wc) {
    const Gemm g{a.data(), as.data(), M, Kp, N, wc, comp.data(), ws.data(), reinterpret_cast<char*>(y.data()), N * 2, false};
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), per = (tiles + threads - 1) / threads;
      const int64_t b = std::min(tiles, t * per), e = std::min(tiles, b + per);
      if (b < e) k->gemm(g, b, e);
    }
  };
  std::vector<double> times;
  const auto t_end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (int64_t i = 0; i < 2 * copies || std::chrono::steady_clock::now() < t_end; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run(w[i % copies].get());
    if (i >= copies) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  const double t = times[times.size() / 2];
  run(w[0].get());  // the hash's output: the same copy for every build
  uint64_t h = 1469598103934665603ull;
  for (uint16_t v : y) h = (h ^ v) * 1099511628211ull;
  std::printf("{\"ms\": %.4f, \"GOPS\": %.2f, \"weight_GBs\": %.2f, \"calls\": %zu, \"hash\": \"%016llx\"}\n", t * 1e3,
              2.0 * M * N * K / t / 1e9, static_cast<double>(N) * K / t / 1e9, times.size(),
              static_cast<unsigned long long>(h));
  return 0;
}
