// Activations for the super-block products (Q4_K, Q6_K): per row and super-block of 256 inputs
// xq = round(x / s) in [-127, 127], s = max|x| / 127 (llama.cpp's Q8_K), and the integer sum of each
// run of ``kSum`` inputs (Q4_K's blocks of 32 for its mins, Q6_K's sub-blocks of 16 for its offset).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace specserve {

constexpr int64_t kSuperBlock = 256;

struct SuperBlockRows {  // quantized activation rows
  const int8_t* q;       // [M, K]
  const float* scale;    // [M, K / 256]
  const int16_t* bsum;   // [M, K / run]: each run's integer sum (Q4_K: 32 inputs, Q6_K: 16)
  int64_t k;
  int64_t supers;        // K / 256
};

// Rows from ``rows`` up to ``padded`` are zero. q [padded, k], scales [padded, k / 256],
// sums [padded, k / kSum].
template <int64_t kSum>
void quantize_superblock_rows(const float* x, int64_t rows, int64_t padded, int64_t k, int8_t* q, float* scales,
                              int16_t* sums) {
  const int64_t supers = k / kSuperBlock, runs = kSuperBlock / kSum;
  std::memset(q + rows * k, 0, (padded - rows) * k);
  std::fill(scales + rows * supers, scales + padded * supers, 0.f);
  std::fill(sums + rows * (k / kSum), sums + padded * (k / kSum), int16_t{0});
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t s = 0; s < supers; ++s) {
        const float* xs = x + m * k + s * kSuperBlock;
        float amax = 0.f;
        for (int64_t i = 0; i < kSuperBlock; ++i) amax = std::max(amax, std::fabs(xs[i]));
        const float scale = amax / 127.f;
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        int8_t* qs = q + m * k + s * kSuperBlock;
        for (int64_t b = 0; b < runs; ++b) {
          int sum = 0;
          for (int64_t i = 0; i < kSum; ++i) {
            const float v = std::clamp(std::nearbyint(xs[b * kSum + i] * inv), -127.f, 127.f);
            qs[b * kSum + i] = static_cast<int8_t>(v);
            sum += static_cast<int>(v);
          }
          sums[(m * supers + s) * runs + b] = static_cast<int16_t>(sum);
        }
        scales[m * supers + s] = scale;
      }
    }
  });
}

}  // namespace specserve
