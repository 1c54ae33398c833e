// What the kernels share: the instruction-set switch, fp16 scales, and a fixed-order lane sum.
#pragma once

#include <cstdint>

#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPECSERVE_AVX2 1
#else
#define SPECSERVE_AVX2 0
#endif

namespace specserve {

inline float half_to_float(uint16_t h) {
#if SPECSERVE_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// The sum of eight float lanes in the order the vector code uses: (0+4) (1+5) (2+6) (3+7), then
// ((a + c) + (b + d)). The scalar fallbacks call this on their own lanes, so both agree bit for bit.
inline float lanes_sum8(const float* l) {
  const float a = l[0] + l[4], b = l[1] + l[5], c = l[2] + l[6], d = l[3] + l[7];
  return (a + c) + (b + d);
}

#if SPECSERVE_AVX2
inline float lanes_sum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                // a b c d
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));        // a+c b+d
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55)); // (a+c)+(b+d)
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace specserve
