// Which ISA path runs: by CPU feature, never by vendor. The best the CPU runs, unless set_isa
// (VLLM_PYPTO_CPU_ISA, tests, benchmarks) chose a lower one. All paths read the same packed
// weights, so switching needs no repack.

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <atomic>

#include "a8w8.h"

namespace a8w8 {

namespace {

// __builtin_cpu_supports takes string literals only
#define CPU(f) __builtin_cpu_supports(f)

// Best first; each with every extension its target attributes compile for.
struct Path {
  const Kernels* k;
  bool (*runs)();
};
const Path paths[] = {
    {&amx_kernels, [] { return CPU("avx512vnni") && CPU("avx512bw") && CPU("avx512vl") && CPU("avx512dq") &&
                             amx_permitted(); }},
    {&avx512_kernels,
     [] { return CPU("avx512vnni") && CPU("avx512bw") && CPU("avx512vl") && CPU("avx512dq") && CPU("avx512f"); }},
    {&avx_vnni_kernels, [] { return CPU("avxvnni") && CPU("avx2") && CPU("fma"); }},
    {&avx2_kernels, [] { return CPU("avx2") && CPU("fma"); }},
};

const Kernels* best() {
  for (const auto& p : paths)
    if (p.runs()) return p.k;
  return nullptr;
}

std::atomic<const Kernels*> current{nullptr};
std::atomic<bool> chosen{false};

const Kernels* get() {
  if (!chosen.load()) {
    current.store(best());
    chosen.store(true);
  }
  return current.load();
}

}  // namespace

bool has_path() { return get() != nullptr; }

const Kernels& active() {
  const Kernels* k = get();
  TORCH_CHECK(k, "vllm_pypto native kernels: this CPU has no AVX2+FMA (no ISA path runs here)");
  return *k;
}

std::string isa() { return has_path() ? active().name : "none"; }

std::vector<std::string> isa_paths() {
  std::vector<std::string> out;
  for (const auto& p : paths)
    if (p.runs()) out.emplace_back(p.k->name);
  return out;
}

void set_isa(const std::string& name) {
  if (name.empty() || name == "auto") {
    current.store(best());
    chosen.store(true);
    return;
  }
  for (const auto& p : paths) {
    if (name != p.k->name) continue;
    TORCH_CHECK(p.runs(), "ISA path '", name, "' cannot run on this CPU (it runs: ",
                c10::Join(", ", isa_paths()), ")");
    current.store(p.k);
    chosen.store(true);
    return;
  }
  TORCH_CHECK(false, "unknown ISA path '", name, "' (choose one of amx, avx512, avx_vnni, avx2, auto)");
}

}  // namespace a8w8
