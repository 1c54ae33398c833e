// The Q4_K product's data as the kernels see it (``q4k_linear.cpp`` and its AVX-512 forms in
// ``q4k_avx512.h``): one output row's blocks, the quantized activation rows, the sizes.
#pragma once

#include <cstdint>

namespace specserve::q4k {

constexpr int64_t kSuper = 256;
constexpr int64_t kBlock = 32;
constexpr int64_t kBlocks = kSuper / kBlock;  // blocks per super-block
constexpr int64_t kSuperBytes = kSuper / 2;   // 4-bit values of one super-block

struct Q4K {  // one output row's weights
  const uint8_t* qs;     // [K / 2]
  const uint16_t* d;     // [K / 256] fp16 bits
  const uint16_t* dmin;  // [K / 256] fp16 bits
  const uint8_t* sc;     // [K / 32]
  const uint8_t* mn;     // [K / 32]
};

struct Rows {  // quantized activation rows
  const int8_t* q;       // [M, K]
  const float* scale;    // [M, K / 256]
  const int16_t* bsum;   // [M, K / 32]
};

// The four min lanes of a super-block, summed in the one order every path uses.
inline float mins_sum4(const float* l) { return (l[0] + l[2]) + (l[1] + l[3]); }

}  // namespace specserve::q4k
