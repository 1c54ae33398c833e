// The run-time choice of vector code for every kernel (see common.h).
#include <torch/extension.h>

#include <cstring>
#include <string>

#include "common.h"

namespace specserve {
namespace {

const char* best_isa() {
#if SPECSERVE_AVX512
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return "avx512";
#endif
#if SPECSERVE_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

const char*& current() {
  static const char* isa = best_isa();
  return isa;
}

int rank(const char* name) {
  if (std::strcmp(name, "avx512") == 0) return 2;
  if (std::strcmp(name, "avx2") == 0) return 1;
  if (std::strcmp(name, "scalar") == 0) return 0;
  return -1;
}

}  // namespace

const char* active_isa() { return current(); }

bool isa_is(const char* name) { return std::strcmp(current(), name) == 0; }

void force_isa(const char* name) {
  const char* best = best_isa();
  if (std::strcmp(name, "auto") == 0) {
    current() = best;
    return;
  }
  const int wanted = rank(name);
  TORCH_CHECK(wanted >= 0, "kernels: unknown instruction set '", name, "' (auto, avx512, avx2, scalar)");
  TORCH_CHECK(wanted <= rank(best), "kernels: this CPU or build has no ", name, " path (best: ", best, ")");
  current() = wanted == 2 ? "avx512" : wanted == 1 ? "avx2" : "scalar";
}

}  // namespace specserve
