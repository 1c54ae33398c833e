// The run-time choice of vector code for every kernel (see common.h).
#include <torch/extension.h>

#include <cstring>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "common.h"

namespace specserve {
namespace {

constexpr const char* kNames[] = {"scalar", "avx2", "avx512", "amx"};
constexpr int kPaths = 4;

// AMX-INT8 usable by this process: the CPU has it (CPUID 7.0 EDX bits 24, 25) and Linux grants the
// tile data state (arch_prctl ARCH_REQ_XCOMP_PERM; a hypervisor or kernel without it refuses, and
// the first tile instruction would fault).
bool amx_usable() {
#if SPECSERVE_AVX512 && defined(__linux__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
  if (!tile || !int8) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
#else
  return false;
#endif
}

Isa best_isa() {
#if SPECSERVE_AVX512
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
    static const bool amx = amx_usable();
    return amx ? Isa::kAmx : Isa::kAvx512;
  }
#endif
  return SPECSERVE_AVX2 ? Isa::kAvx2 : Isa::kScalar;
}

Isa& current() {
  static Isa chosen = best_isa();
  return chosen;
}

int64_t vendor_prefetch_rows() {
#if SPECSERVE_AVX2
  __builtin_cpu_init();
  return __builtin_cpu_is("intel") ? 1 : 4;
#else
  return 0;
#endif
}

int64_t& prefetch_rows() {
  static int64_t rows = vendor_prefetch_rows();
  return rows;
}

}  // namespace

Isa isa() { return current(); }

const char* active_isa() { return kNames[static_cast<int>(current())]; }

int64_t tile_prefetch_rows() { return prefetch_rows(); }

void set_tile_prefetch(int64_t rows) { prefetch_rows() = rows < 0 ? vendor_prefetch_rows() : rows; }

void force_isa(const char* name) {
  const Isa best = best_isa();
  if (std::strcmp(name, "auto") == 0) {
    current() = best;
    return;
  }
  int wanted = -1;
  for (int i = 0; i < kPaths; ++i)
    if (std::strcmp(name, kNames[i]) == 0) wanted = i;
  TORCH_CHECK(wanted >= 0, "kernels: unknown instruction set '", name, "' (auto, amx, avx512, avx2, scalar)");
  TORCH_CHECK(wanted <= static_cast<int>(best), "kernels: this CPU or build has no ", name, " path (best: ",
              kNames[static_cast<int>(best)], ")");
  current() = static_cast<Isa>(wanted);
}

}  // namespace specserve
