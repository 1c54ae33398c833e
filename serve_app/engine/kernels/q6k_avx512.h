// The AVX-512 VNNI form of the Q6_K product (the numbers: ``q6k_tiles.h``): 16 outputs per register.
// A block's 6-bit values are put together once per pass from their nibbles and their top bits
// (a shift and one vpternlogd: nibble | (shifted & 0x30)); one
// _mm512_dpbusd_epi32 per 16 outputs x 4 inputs against the row's 4 activations broadcast; each
// sub-block's sum times its 16 scales by _mm512_mullo_epi32; the offset's share (32 sc bsum) by
// _mm512_dpwssd_epi32 on the scale pairs; then the float step for 16 outputs at once, lane o exactly
// as the scalar code runs output o.
#pragma once

#include <cstring>

#include "common.h"
#include "q6k_tiles.h"

namespace specserve::q6k {

#if SPECSERVE_AVX512
inline SPECSERVE_AVX512_FN __m512i broadcast4(const void* p) {  // 4 bytes (activations, or 2 int16) into every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Block b's 8 vectors of q: w[v] holds inputs 32 b + 4 v + e (sub-block 2 b), w[4 + v] inputs
// 32 b + 16 + 4 v + e (sub-block 2 b + 1), byte 4 o + e.
inline SPECSERVE_AVX512_FN __m512i top_bits_at_4(__m512i top, int v) {  // bits 2 v, 2 v + 1 -> 4, 5
  switch (v) {
    case 0: return _mm512_slli_epi16(top, 4);
    case 1: return _mm512_slli_epi16(top, 2);
    case 2: return top;
    default: return _mm512_srli_epi16(top, 2);
  }
}

inline SPECSERVE_AVX512_FN void load_block(const Tile& t, int64_t b, __m512i w[8]) {
  const __m512i low = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  const uint8_t* nibbles = t.block(b);
  const __m512i top[2] = {_mm512_loadu_si512(t.top(b, 0)), _mm512_loadu_si512(t.top(b, 1))};
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) {
    const __m512i bytes = _mm512_loadu_si512(nibbles + 64 * v);
    const __m512i q[2] = {_mm512_and_si512(bytes, low), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low)};
    for (int h = 0; h < 2; ++h)  // q | (top & 0x30): 0xF8 is A | (B & C)
      w[4 * h + v] = _mm512_ternarylogic_epi32(q[h], top_bits_at_4(top[h], v), bits45, 0xF8);
  }
}

// Rows r0 .. r0 + G - 1 against one output group (its tiles from ``tiles``, super-blocks in order);
// the values put together once for all rows.
template <int G>
SPECSERVE_AVX512_FN void group_rows_avx512(const uint8_t* tiles, const Rows& x, int64_t r0, const Out& out) {
  __m512 acc[G];
  for (int r = 0; r < G; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < x.supers; ++s) {
    const Tile t(tiles + s * kTileBytes);
    __m512i s1[G], s2[G];
    for (int r = 0; r < G; ++r) s1[r] = s2[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int64_t b = 0; b < kBlocks; ++b) {
      // lane o: sc[2 b] in its low 16 bits, sc[2 b + 1] in its high ones
      const __m512i pairs = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.sc + 32 * b)));
      const __m512i even = _mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16), odd = _mm512_srai_epi32(pairs, 16);
      __m512i w[8];
      load_block(t, b, w);
#pragma GCC unroll 4
      for (int r = 0; r < G; ++r) {
        const int64_t row = r0 + r;
        const int8_t* xb = x.q + row * x.k + s * kSuper + b * kBlock;
        __m512i p0 = _mm512_setzero_si512(), p1 = _mm512_setzero_si512();
        for (int v = 0; v < 4; ++v) {
          p0 = _mm512_dpbusd_epi32(p0, w[v], broadcast4(xb + 4 * v));
          p1 = _mm512_dpbusd_epi32(p1, w[4 + v], broadcast4(xb + 16 + 4 * v));
        }
        s1[r] = _mm512_add_epi32(s1[r], _mm512_add_epi32(_mm512_mullo_epi32(p0, even), _mm512_mullo_epi32(p1, odd)));
        s2[r] = _mm512_dpwssd_epi32(s2[r], pairs, broadcast4(x.bsum + (row * x.supers + s) * kSubs + 2 * b));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.d)));
#pragma GCC unroll 4
    for (int r = 0; r < G; ++r) {
      const int64_t row = r0 + r;
      const __m512i sum = _mm512_sub_epi32(s1[r], _mm512_slli_epi32(s2[r], 5));  // S1 - 32 S2
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x.scale[row * x.supers + s]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << out.count) - 1);
  for (int r = 0; r < G; ++r) _mm512_mask_storeu_ps(out.out + (r0 + r) * out.stride, mask, acc[r]);
}

// Every row against one output group, four rows per pass (the group's tiles stay in L1 / L2 for the
// passes after the first).
inline SPECSERVE_AVX512_FN void group_avx512(const uint8_t* tiles, const Rows& x, int64_t rows, const Out& out) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) group_rows_avx512<4>(tiles, x, r, out);
  switch (rows - r) {
    case 3: group_rows_avx512<3>(tiles, x, r, out); break;
    case 2: group_rows_avx512<2>(tiles, x, r, out); break;
    case 1: group_rows_avx512<1>(tiles, x, r, out); break;
    default: break;
  }
}
#endif

}  // namespace specserve::q6k
