// The AVX-512 VNNI form of the Q4_K product (the numbers: ``q4k_tiles.h``): 16 outputs per register.
// A 64-byte vector of a tile holds 16 outputs x 4 inputs in its low nibbles and 4 more inputs in its
// high ones; one _mm512_dpbusd_epi32 against the 4 activations broadcast adds each output's 4
// products; the block's sum times its 16 scales by _mm512_mullo_epi32; the float steps then run for 16 outputs at
// once, lane o exactly as the scalar code runs output o.
#pragma once

#include <cstring>

#include "common.h"
#include "q4k_tiles.h"

namespace specserve::q4k {

#if SPECSERVE_AVX512
inline SPECSERVE_AVX512_FN __m512i broadcast4(const int8_t* p) {  // 4 activations into every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline SPECSERVE_AVX512_FN __m512i broadcast_pair(const int16_t* p) {  // 2 int16 into every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// No software prefetch: each thread reads its tiles as one ascending stream, which the hardware
// prefetcher follows. Prefetching whole tiles 6 ahead (_mm_prefetch, T0) made the 1-row product
// 1.55x slower on an AMD EPYC and 0-12% slower at 1 to 16 rows on a Sapphire Rapids Xeon
// (BENCHMARKS.md, eighteenth session).

// The mins' integer sums S2 of 16 outputs for one activation row: four dpwssd on the (m, m) pairs.
inline SPECSERVE_AVX512_FN __m512i min_sums(const __m512i mn16[4], const int16_t* bsum) {
  __m512i s2 = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) s2 = _mm512_dpwssd_epi32(s2, mn16[j], broadcast_pair(bsum + 2 * j));
  return s2;
}

// The float step of one super-block for 16 outputs of one row (see q4k_tiles.h).
struct FloatStep {
  __m512 d, dmin;
  __m512i mn16[4];

  SPECSERVE_AVX512_FN explicit FloatStep(const Tile& w)
      : d(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d)))),
        dmin(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.dmin)))) {
    for (int j = 0; j < 4; ++j)
      mn16[j] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mn + 32 * j)));
  }

  SPECSERVE_AVX512_FN void apply(__m512i s1, const int16_t* bsum, float xs, __m512& acc, __m512& mins) const {
    const __m512 scale = _mm512_set1_ps(xs);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d, scale), acc);
    mins = _mm512_fmadd_ps(_mm512_cvtepi32_ps(min_sums(mn16, bsum)), _mm512_mul_ps(dmin, scale), mins);
  }
};

inline SPECSERVE_AVX512_FN void store_outputs(const Out& out, int64_t row, __m512 acc, __m512 mins) {
  const __mmask16 mask = static_cast<__mmask16>((1u << out.count) - 1);
  _mm512_mask_storeu_ps(out.out + row * out.stride, mask, _mm512_sub_ps(acc, mins));
}

// S1 of one super-block, one activation row (its 256 values at ``xs``) and 16 outputs. The high
// nibbles are masked in place (16 q, exact: the sum is shifted back by 4).
inline SPECSERVE_AVX512_FN __m512i row_sums(const Tile& w, const int8_t* xs) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512i s1 = _mm512_setzero_si512();
#pragma GCC unroll 2
  for (int64_t b = 0; b < kBlocks; ++b) {
    const int8_t* xb = xs + b * kBlock;
    __m512i pl = _mm512_setzero_si512(), ph = _mm512_setzero_si512();
    for (int v = 0; v < 4; ++v) {
      const __m512i bytes = _mm512_loadu_si512(w.qs + (4 * b + v) * 64);
      pl = _mm512_dpbusd_epi32(pl, _mm512_and_si512(bytes, low), broadcast4(xb + 4 * v));
      ph = _mm512_dpbusd_epi32(ph, _mm512_and_si512(bytes, high), broadcast4(xb + 16 + 4 * v));
    }
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + kOutputs * b)));
    s1 = _mm512_add_epi32(s1, _mm512_mullo_epi32(_mm512_add_epi32(pl, _mm512_srai_epi32(ph, 4)), sc));
  }
  return s1;
}

// One activation row against one output group.
inline SPECSERVE_AVX512_FN void row_avx512(const uint8_t* tiles, const Rows& x, int64_t row, const Out& out) {
  __m512 acc = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
  const int8_t* xr = x.q + row * x.k;
  for (int64_t s = 0; s < x.supers; ++s) {
    const uint8_t* t = tiles + s * kTileBytes;
    const Tile w(t);
    const FloatStep step(w);  // first: the tile's lines are read in ascending order
    step.apply(row_sums(w, xr + s * kSuper), x.bsum + row * (x.k / kBlock) + s * kBlocks, x.scale[row * x.supers + s],
               acc, mins);
  }
  store_outputs(out, row, acc, mins);
}

// Rows r0 .. r0 + G - 1 (G >= 2) against one output group (its tiles from ``tiles``, super-blocks
// in order); the nibbles unpacked once for all rows.
template <int G>
SPECSERVE_AVX512_FN void group_rows_avx512(const uint8_t* tiles, const Rows& x, int64_t r0, const Out& out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[G], mins[G];
  for (int r = 0; r < G; ++r) acc[r] = mins[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < x.supers; ++s) {
    const uint8_t* t = tiles + s * kTileBytes;
    const Tile w(t);
    __m512i s1[G];
    for (int r = 0; r < G; ++r) s1[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int64_t b = 0; b < kBlocks; ++b) {
      __m512i lo[4], hi[4];
      for (int v = 0; v < 4; ++v) {
        const __m512i bytes = _mm512_loadu_si512(w.qs + (4 * b + v) * 64);
        lo[v] = _mm512_and_si512(bytes, low);
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
      }
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + kOutputs * b)));
#pragma GCC unroll 5
      for (int r = 0; r < G; ++r) {
        const int8_t* xb = x.q + (r0 + r) * x.k + s * kSuper + b * kBlock;
        __m512i block = _mm512_setzero_si512();
        for (int v = 0; v < 4; ++v) {
          block = _mm512_dpbusd_epi32(block, lo[v], broadcast4(xb + 4 * v));
          block = _mm512_dpbusd_epi32(block, hi[v], broadcast4(xb + 16 + 4 * v));
        }
        s1[r] = _mm512_add_epi32(s1[r], _mm512_mullo_epi32(block, sc));
      }
    }
    const FloatStep step(w);
#pragma GCC unroll 5
    for (int r = 0; r < G; ++r) {
      const int64_t row = r0 + r;
      step.apply(s1[r], x.bsum + row * (x.k / kBlock) + s * kBlocks, x.scale[row * x.supers + s], acc[r], mins[r]);
    }
  }
  for (int r = 0; r < G; ++r) store_outputs(out, r0 + r, acc[r], mins[r]);
}

// Every row against one output group, four rows per pass (the group's tiles stay in L1 / L2 for the
// passes after the first), and five in the last one rather than four and then one: a verify of 5
// tokens (depth 4) reads and unpacks the group's tiles once. Measured on an AMD EPYC (17920 x 1536,
// ms per product): 5 rows 1.004 as 4 + 1, 0.912 as one pass of 5; wider passes lose (8 rows in one
// pass 1.354 against 1.226 as 4 + 4: the accumulators no longer fit the registers).
inline SPECSERVE_AVX512_FN void group_avx512(const uint8_t* tiles, const Rows& x, int64_t rows, const Out& out) {
  int64_t r = 0;
  for (; rows - r > 5; r += 4) group_rows_avx512<4>(tiles, x, r, out);
  switch (rows - r) {
    case 5: group_rows_avx512<5>(tiles, x, r, out); break;
    case 4: group_rows_avx512<4>(tiles, x, r, out); break;
    case 3: group_rows_avx512<3>(tiles, x, r, out); break;
    case 2: group_rows_avx512<2>(tiles, x, r, out); break;
    case 1: row_avx512(tiles, x, r, out); break;
    default: break;
  }
}
#endif

}  // namespace specserve::q4k
