// The AVX-512 VNNI forms of the Q4_K product (see ``q4k_linear.cpp`` for the numbers they form);
// compiled with their own target attribute and chosen at run time (``isa.cpp``).
#pragma once

#include "common.h"
#include "q4k_blocks.h"

namespace specserve::q4k {

#if SPECSERVE_AVX512
// What the AVX-512 forms share. pick: the 16-bit scale lanes of _mm512_permutexvar_epi16 (the low
// 256 bits from one block, the high from another). step: one super-block's float step for one
// (row, output): fold the two halves of the integer lanes into the AVX2 code's eight, add its four
// min lanes, and multiply-add by [d x 8 | dmin x 4 | 0 x 4] times the row's activation scale.
// finish: the result from the sixteen float lanes, summed as the AVX2 code sums its registers.
struct Avx512Q4K {
  __m512i pick[4];

  SPECSERVE_AVX512_FN Avx512Q4K()
      : pick{_mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1),
             _mm512_inserti64x4(_mm512_set1_epi16(1), _mm256_set1_epi16(3), 1),
             _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1),
             _mm512_inserti64x4(_mm512_set1_epi16(5), _mm256_set1_epi16(7), 1)} {}

  static SPECSERVE_AVX512_FN __m512 scales(uint16_t d, uint16_t dmin) {
    return _mm512_maskz_mov_ps(0x0FFF, _mm512_mask_blend_ps(0x0F00, _mm512_set1_ps(half_to_float(d)),
                                                             _mm512_set1_ps(half_to_float(dmin))));
  }

  static SPECSERVE_AVX512_FN __m512 step(__m512 acc, __m512i isum, __m128i mn16, const int16_t* bsum, __m512 dd,
                                         float xs) {
    const __m256i folded = _mm256_add_epi32(_mm512_castsi512_si256(isum), _mm512_extracti64x4_epi64(isum, 1));
    const __m128i min_lanes = _mm_madd_epi16(mn16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(bsum)));
    const __m512i lanes = _mm512_inserti32x4(_mm512_zextsi256_si512(folded), min_lanes, 2);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_mul_ps(dd, _mm512_set1_ps(xs)), acc);
  }

  static SPECSERVE_AVX512_FN float finish(__m512 acc) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc);
    return specserve::lanes_sum8(lanes) - mins_sum4(lanes + 8);
  }
};

// The AVX-512 VNNI form of dot_group_avx2: a 64-byte load holds two 64-input chunks, its low nibbles
// blocks 4t and 4t + 2, its high nibbles 4t + 1 and 4t + 3 (activations interleaved to match), and
// each row takes one _mm512_maddubs_epi16 and one _mm512_dpwssd_epi32 (times the block scales) per
// 32 bytes of activations. Folding the two 256-bit halves gives exactly the AVX2 code's eight
// integer lanes (lane L: inputs 4L..4L+3 of every block, scaled), so the float steps that follow are
// the same and so is every result, bit for bit.
template <int G>
SPECSERVE_AVX512_FN void dot_group_avx512(const Q4K& w, const Rows& x, int64_t k, float* out, int64_t out_stride) {
  const int64_t supers = k / kSuper;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const Avx512Q4K shared;
  const __m512i* pick = shared.pick;
  // One float register per row: lanes 0..7 the AVX2 code's eight accumulators, 8..11 its four
  // min accumulators, 12..15 zero; each lane takes the same fused multiply-adds as there.
  __m512 acc[G];
  for (int r = 0; r < G; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* q = w.qs + s * kSuperBytes;
    // 16 super-blocks (2 KB) ahead: measured 1.2x faster than 4 ahead here at 1 row
    _mm_prefetch(reinterpret_cast<const char*>(q + 16 * kSuperBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(q + 16 * kSuperBytes + 64), _MM_HINT_T0);
    const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + s * kBlocks));
    const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(sc8));
    const __m128i mn16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.mn + s * kBlocks)));
    __m512i isum[G];
    for (int r = 0; r < G; ++r) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int t = 0; t < 2; ++t) {
      const __m512i bytes = _mm512_loadu_si512(q + 64 * t);
      const __m512i lo = _mm512_and_si512(bytes, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
      const __m512i sc_lo = _mm512_permutexvar_epi16(pick[2 * t], sc16);
      const __m512i sc_hi = _mm512_permutexvar_epi16(pick[2 * t + 1], sc16);
#pragma GCC unroll 8
      for (int r = 0; r < G; ++r) {
        const int8_t* xr = x.q + r * k + s * kSuper + 128 * t;
        isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(lo, _mm512_loadu_si512(xr)), sc_lo);
        isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(hi, _mm512_loadu_si512(xr + 64)), sc_hi);
      }
    }
    // [d x 8 | dmin x 4 | 0 x 4]: times a row's activation scale, the AVX2 code's two steps
    const __m512 dd = Avx512Q4K::scales(w.d[s], w.dmin[s]);
#pragma GCC unroll 8
    for (int r = 0; r < G; ++r) {
      acc[r] = Avx512Q4K::step(acc[r], isum[r], mn16, x.bsum + (r * supers + s) * kBlocks, dd, x.scale[r * supers + s]);
    }
  }
  for (int r = 0; r < G; ++r) out[r * out_stride] = Avx512Q4K::finish(acc[r]);
}

// One activation row against O output rows at once: per output exactly dot_group_avx512<1>'s
// integer lanes and float steps (so the same bits), with O independent dependency chains in flight
// and the activations loaded once per super-block for all of them (1.1-1.15x at one row).
template <int O>
SPECSERVE_AVX512_FN void dot_outputs_avx512(const Q4K* ws, const Rows& x, int64_t k, float* out) {
  const int64_t supers = k / kSuper;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const Avx512Q4K shared;
  const __m512i* pick = shared.pick;
  __m512 acc[O];
  for (int o = 0; o < O; ++o) acc[o] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const int8_t* xr = x.q + s * kSuper;
    const __m512i x0 = _mm512_loadu_si512(xr), x1 = _mm512_loadu_si512(xr + 64);
    const __m512i x2 = _mm512_loadu_si512(xr + 128), x3 = _mm512_loadu_si512(xr + 192);
#pragma GCC unroll 4
    for (int o = 0; o < O; ++o) {
      const Q4K& w = ws[o];
      const uint8_t* q = w.qs + s * kSuperBytes;
      _mm_prefetch(reinterpret_cast<const char*>(q + 16 * kSuperBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + 16 * kSuperBytes + 64), _MM_HINT_T0);
      const __m512i sc16 = _mm512_castsi128_si512(
          _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + s * kBlocks))));
      const __m128i mn16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.mn + s * kBlocks)));
      const __m512i b0 = _mm512_loadu_si512(q), b1 = _mm512_loadu_si512(q + 64);
      // integer sums are exact in any order: two partial sums, then one add
      __m512i i0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(_mm512_and_si512(b0, low), x0),
                                       _mm512_permutexvar_epi16(pick[0], sc16));
      __m512i i1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(),
                                       _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(b0, 4), low), x1),
                                       _mm512_permutexvar_epi16(pick[1], sc16));
      i0 = _mm512_dpwssd_epi32(i0, _mm512_maddubs_epi16(_mm512_and_si512(b1, low), x2), _mm512_permutexvar_epi16(pick[2], sc16));
      i1 = _mm512_dpwssd_epi32(i1, _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(b1, 4), low), x3),
                               _mm512_permutexvar_epi16(pick[3], sc16));
      const __m512 dd = Avx512Q4K::scales(w.d[s], w.dmin[s]);
      acc[o] = Avx512Q4K::step(acc[o], _mm512_add_epi32(i0, i1), mn16, x.bsum + s * kBlocks, dd, x.scale[s]);
    }
  }
  for (int o = 0; o < O; ++o) out[o] = Avx512Q4K::finish(acc[o]);
}
#endif

}  // namespace specserve::q4k
