// The AVX-512 VNNI form of the Q8 product (the numbers: ``q8_tiles.h``): 16 outputs per register,
// one _mm512_dpbusd_epi32 per 64 bytes of offset weights (16 outputs x 4 inputs) against the row's
// 4 activations broadcast; the offset's share (offset * xsum) taken off each block's sum, then the
// float steps for 16 outputs at once, lane o exactly as the scalar code runs output o. Q8 values
// load as they are; Q5 values are put together from their nibbles and their fifth bits.
#pragma once

#include <cstring>

#include "common.h"
#include "q8_tiles.h"

namespace specserve::q8 {

#if SPECSERVE_AVX512
inline SPECSERVE_AVX512_FN __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <class V>
inline SPECSERVE_AVX512_FN __m512 block_scales16(const uint8_t* tiles, int64_t b) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block_scales<V>(tiles, b))));
}

// A block's 8 vectors of offset values u.
inline SPECSERVE_AVX512_FN void load_block(const Q8&, const uint8_t* u, __m512i w[8]) {
  for (int v = 0; v < 8; ++v) w[v] = _mm512_loadu_si512(u + 64 * v);
}
inline SPECSERVE_AVX512_FN void load_block(const Q5&, const uint8_t* u, __m512i w[8]) {
  const __m512i low = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  for (int v = 0; v < 4; ++v) {
    const __m512i nibbles = _mm512_loadu_si512(u + 64 * v);
    uint64_t high[2];
    std::memcpy(high, u + Q5::kNibbleBytes + 8 * v, 8);
    std::memcpy(high + 1, u + Q5::kNibbleBytes + 8 * (v + 4), 8);
    w[v] = _mm512_or_si512(_mm512_and_si512(nibbles, low), _mm512_maskz_mov_epi8(high[0], bit4));
    w[v + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low),
                               _mm512_maskz_mov_epi8(high[1], bit4));
  }
}

// One block's float step for one row: acc += float(P) * (sw * sx), P = biased - offset * xsum.
template <class V>
inline SPECSERVE_AVX512_FN __m512 block_step(__m512 acc, __m512i biased, int32_t xsum, __m512 sw, float sx) {
  const __m512i sum = _mm512_sub_epi32(biased, _mm512_set1_epi32(V::kOffset * xsum));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sw, _mm512_set1_ps(sx)), acc);
}

inline SPECSERVE_AVX512_FN void store_outputs(const Out& out, int64_t row, __m512 even, __m512 odd) {
  const __mmask16 mask = static_cast<__mmask16>((1u << out.count) - 1);
  _mm512_mask_storeu_ps(out.out + row * out.stride, mask, _mm512_add_ps(even, odd));
}

// Block b of the group for rows r0 .. r0 + G - 1, into their accumulators ``acc`` (even or odd).
template <class V, int G>
SPECSERVE_AVX512_FN inline void block_rows(const uint8_t* tiles, const Rows& x, int64_t r0, int64_t b, __m512* acc) {
  const __m512 sw = block_scales16<V>(tiles, b);  // first: each tile is read in ascending order
  __m512i w[8];
  load_block(V{}, block_values<V>(tiles, b), w);
#pragma GCC unroll 4
  for (int r = 0; r < G; ++r) {
    const int64_t row = r0 + r;
    const int8_t* xb = x.q + row * x.k + b * kBlock;
    __m512i p0 = _mm512_setzero_si512(), p1 = _mm512_setzero_si512();
    for (int v = 0; v < 8; v += 2) {
      p0 = _mm512_dpbusd_epi32(p0, w[v], broadcast4(xb + 4 * v));
      p1 = _mm512_dpbusd_epi32(p1, w[v + 1], broadcast4(xb + 4 * v + 4));
    }
    acc[r] = block_step<V>(acc[r], _mm512_add_epi32(p0, p1), x.xsum[row * x.blocks + b], sw,
                           x.scale[row * x.blocks + b]);
  }
}

// Rows r0 .. r0 + G - 1 against one output group, blocks in order (a tile's two blocks: the even
// and the odd accumulators).
template <class V, int G>
SPECSERVE_AVX512_FN void group_rows_avx512(const uint8_t* tiles, const Rows& x, int64_t r0, const Out& out) {
  __m512 even[G], odd[G];
  for (int r = 0; r < G; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  // the first pass reads the group from memory (see tile_prefetch_rows)
  const int64_t from_rows = tile_prefetch_rows();
  const bool prefetch = r0 == 0 && from_rows > 0 && G >= from_rows;
  int64_t b = 0;
  for (; b + 2 <= x.blocks; b += 2) {
    if (prefetch)
      for (int line = 0; line < V::kTileBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(tiles + (b / 2 + 4) * V::kTileBytes + line), _MM_HINT_T0);
    block_rows<V, G>(tiles, x, r0, b, even);
    block_rows<V, G>(tiles, x, r0, b + 1, odd);
  }
  if (b < x.blocks) block_rows<V, G>(tiles, x, r0, b, even);
  for (int r = 0; r < G; ++r) store_outputs(out, r0 + r, even[r], odd[r]);
}

// Every row against one output group, four rows per pass.
template <class V>
inline SPECSERVE_AVX512_FN void group_avx512(const uint8_t* tiles, const Rows& x, int64_t rows, const Out& out) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) group_rows_avx512<V, 4>(tiles, x, r, out);
  switch (rows - r) {
    case 3: group_rows_avx512<V, 3>(tiles, x, r, out); break;
    case 2: group_rows_avx512<V, 2>(tiles, x, r, out); break;
    case 1: group_rows_avx512<V, 1>(tiles, x, r, out); break;
    default: break;
  }
}
#endif

}  // namespace specserve::q8
