// The run-time choice of vector code for every kernel (see common.h).
#include <torch/extension.h>

#include <cstring>

#include "common.h"

namespace specserve {
namespace {

constexpr const char* kNames[] = {"scalar", "avx2", "avx512"};

Isa best_isa() {
#if SPECSERVE_AVX512
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return Isa::kAvx512;
#endif
  return SPECSERVE_AVX2 ? Isa::kAvx2 : Isa::kScalar;
}

Isa& current() {
  static Isa chosen = best_isa();
  return chosen;
}

}  // namespace

Isa isa() { return current(); }

const char* active_isa() { return kNames[static_cast<int>(current())]; }

void force_isa(const char* name) {
  const Isa best = best_isa();
  if (std::strcmp(name, "auto") == 0) {
    current() = best;
    return;
  }
  int wanted = -1;
  for (int i = 0; i < 3; ++i)
    if (std::strcmp(name, kNames[i]) == 0) wanted = i;
  TORCH_CHECK(wanted >= 0, "kernels: unknown instruction set '", name, "' (auto, avx512, avx2, scalar)");
  TORCH_CHECK(wanted <= static_cast<int>(best), "kernels: this CPU or build has no ", name, " path (best: ",
              kNames[static_cast<int>(best)], ")");
  current() = static_cast<Isa>(wanted);
}

}  // namespace specserve
