// The AVX2 form of the Q4_K product (the numbers: ``q4k_tiles.h``): a group's 16 outputs as two
// registers of 8, both halves of a tile read in one pass.
//
// Without VNNI the 4-input dot product is _mm256_maddubs_epi16 (u8 nibbles times s8 activations,
// pairs summed into int16). A block's eight maddubs results are summed in int16 (each pair sum is at
// most 2 * 15 * 127 = 3810 in magnitude, eight of them 30480 < 2^15: no saturation, exact), and one
// _mm256_madd_epi16 against the block's scales, each repeated in both 16-bit halves of its output's
// lane, adds the pairs and multiplies by the scale at once: sc * (p0 + p1) per output in int32. That
// is 17 vector operations per block, row and half, where a madd per maddubs and a mullo per block
// took 26: on a 2-core AVX2 host the 1-row product was bound by those instructions, not by memory.
//
// Rows are taken two at a time (their int16 sums, int32 sums and broadcast activations fill the 16
// ymm registers) inside each super-block, so that a tile is read from memory once and from L1 for
// the other pairs; the float steps' running sums of up to kRowChunk rows wait in a small buffer.
#pragma once

#include <cstring>

#include "common.h"
#include "q4k_tiles.h"

namespace specserve::q4k {

#if SPECSERVE_AVX2
inline __m256i broadcast4_avx2(const void* p) {  // 4 bytes (or 2 int16) into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Block b's scales of outputs 8 h .. 8 h + 7, each in both 16-bit halves of its lane.
inline __m256i scale_pairs_avx2(const Tile& w, int64_t b, int h) {
  const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + kOutputs * b + 8 * h)));
  return _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
}

// S1 of one super-block for rows xr[0 .. G - 1] (each its 256 activations) and the 16 outputs:
// s1[h * G + r] holds outputs 8 h .. 8 h + 7 of row r.
template <int G>
inline void block_sums_avx2(const Tile& w, const int8_t* const xr[G], __m256i s1[2 * G]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < 2 * G; ++i) s1[i] = _mm256_setzero_si256();
  for (int64_t b = 0; b < kBlocks; ++b) {
    __m256i p[2 * G];
    for (int i = 0; i < 2 * G; ++i) p[i] = _mm256_setzero_si256();
    for (int v = 0; v < 4; ++v) {
      __m256i xl[G], xh[G];
      for (int r = 0; r < G; ++r) {
        xl[r] = broadcast4_avx2(xr[r] + b * kBlock + 4 * v);
        xh[r] = broadcast4_avx2(xr[r] + b * kBlock + 16 + 4 * v);
      }
      for (int h = 0; h < 2; ++h) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + (4 * b + v) * 64 + 32 * h));
        const __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        for (int r = 0; r < G; ++r)
          p[h * G + r] = _mm256_add_epi16(
              p[h * G + r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[r]), _mm256_maddubs_epi16(hi, xh[r])));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i sc = scale_pairs_avx2(w, b, h);
      for (int r = 0; r < G; ++r) s1[h * G + r] = _mm256_add_epi32(s1[h * G + r], _mm256_madd_epi16(p[h * G + r], sc));
    }
  }
}

// The float step of one super-block for one row's 16 outputs (see q4k_tiles.h), on the running
// sums acc[16], mins[16] of that row.
inline void float_step_avx2(const Tile& w, const __m256i s1[2], const int16_t* bsum, float xs, float* acc,
                            float* mins) {
  const __m256 scale = _mm256_set1_ps(xs);
  for (int h = 0; h < 2; ++h) {
    __m256i s2 = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mn + 32 * j + 16 * h)));
      s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(mn, broadcast4_avx2(bsum + 2 * j)));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + 8 * h)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dmin + 8 * h)));
    const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[h]), _mm256_mul_ps(d, scale), _mm256_loadu_ps(acc + 8 * h));
    const __m256 m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2), _mm256_mul_ps(dmin, scale), _mm256_loadu_ps(mins + 8 * h));
    _mm256_storeu_ps(acc + 8 * h, a);
    _mm256_storeu_ps(mins + 8 * h, m);
  }
}

constexpr int64_t kRowChunk = 16;  // rows whose running sums wait in the buffer at once

// Rows r0 .. r0 + count - 1 (count <= kRowChunk) against one output group.
inline void row_chunk_avx2(const uint8_t* tiles, const Rows& x, int64_t r0, int64_t count, const Out& out) {
  alignas(32) float acc[kRowChunk][kOutputs] = {}, mins[kRowChunk][kOutputs] = {};
  for (int64_t s = 0; s < x.supers; ++s) {
    const Tile w(tiles + s * kTileBytes);
    const auto row_q = [&](int64_t r) { return x.q + (r0 + r) * x.k + s * kSuper; };
    const auto step = [&](int64_t r, const __m256i s1[2]) {
      const int64_t row = r0 + r;
      float_step_avx2(w, s1, x.bsum + row * (x.k / kBlock) + s * kBlocks, x.scale[row * x.supers + s], acc[r], mins[r]);
    };
    int64_t r = 0;
    for (; r + 2 <= count; r += 2) {
      const int8_t* xr[2] = {row_q(r), row_q(r + 1)};
      __m256i s1[4];
      block_sums_avx2<2>(w, xr, s1);
      const __m256i first[2] = {s1[0], s1[2]}, second[2] = {s1[1], s1[3]};
      step(r, first);
      step(r + 1, second);
    }
    if (r < count) {
      const int8_t* xr[1] = {row_q(r)};
      __m256i s1[2];
      block_sums_avx2<1>(w, xr, s1);
      step(r, s1);
    }
  }
  for (int64_t r = 0; r < count; ++r)
    for (int o = 0; o < out.count; ++o) out.out[(r0 + r) * out.stride + o] = acc[r][o] - mins[r][o];
}

// Every row against one output group.
inline void group_avx2(const uint8_t* tiles, const Rows& x, int64_t rows, const Out& out) {
  for (int64_t r = 0; r < rows; r += kRowChunk) row_chunk_avx2(tiles, x, r, std::min(kRowChunk, rows - r), out);
}
#endif

}  // namespace specserve::q4k
