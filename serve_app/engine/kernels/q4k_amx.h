// The AMX-INT8 form of the Q4_K product for several activation rows (the numbers: ``q4k_tiles.h``).
//
// Per block of 32 inputs and 16 outputs the tile's 4-bit values are unpacked into an 8 x 64-byte B
// tile (VNNI order: row kk holds inputs 4 kk .. 4 kk + 3 of each output), the rows' 32 activations
// are an A tile (up to 16 rows), and _tile_dpbsud gives every (row, output) block sum exactly in
// int32. Each sum times the block's scale (_mm512_mullo_epi32) adds to S1; the mins and the float
// steps are the AVX-512 code's. Two sets of tiles alternate between even and odd blocks so one
// block's products overlap the next's, four C tiles the stores. Rows beyond 16 run in chunks of 16
// over the same B tiles (the activations zero-padded to whole chunks by the caller).
#pragma once

#include <vector>

#include "amx.h"
#include "common.h"
#include "q4k_avx512.h"
#include "q4k_tiles.h"

namespace specserve::q4k {

using specserve::amx_config;
using specserve::kAmxChunk;

#if SPECSERVE_AVX512

// The per-thread scratch of the AMX path: a super-block's unpacked B tiles and stored C tiles, and
// S1 per row.
struct AmxScratch {
  alignas(64) uint8_t unpacked[kBlocks][8 * 64];
  alignas(64) int32_t sums[kBlocks][kAmxChunk * kOutputs];
  std::vector<int32_t> s1;
  explicit AmxScratch(int64_t rows) : s1(rows * kOutputs) {}
};

// The products of block BLK for one chunk of 16 rows, with tiles A = TA, B = TB, C = TC (literal
// tile numbers, as the tile instructions need).
#define SPECSERVE_Q4K_AMX_BLOCK(TA, TB, TC, BLK)                                  \
  do {                                                                            \
    _tile_loadd(TB, scratch.unpacked[BLK], 64);                                   \
    _tile_loadd(TA, x.q + c0 * x.k + s * kSuper + (BLK) * kBlock, x.k);           \
    _tile_zero(TC);                                                               \
    _tile_dpbsud(TC, TA, TB);                                                     \
    _tile_stored(TC, scratch.sums[BLK], 64);                                      \
  } while (0)

// Every row against one output group. The calling thread's tiles are configured (amx_config) and
// ``x`` holds ``padded_rows`` rows (rows rounded up to whole chunks where rows > 16). Per super-block
// three phases, so that no tile load waits for the stores just before it, nor a vector load for a
// tile store: unpack the 8 blocks; the 8 tile products per chunk; the sums times the scales.
inline SPECSERVE_AMX_FN void group_amx(const uint8_t* tiles, const Rows& x, int64_t rows, int64_t padded_rows,
                                       const Out& out, AmxScratch& scratch, float* acc, float* mins) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t r = 0; r < rows; ++r) {
    _mm512_storeu_ps(acc + r * kOutputs, _mm512_setzero_ps());
    _mm512_storeu_ps(mins + r * kOutputs, _mm512_setzero_ps());
  }
  for (int64_t s = 0; s < x.supers; ++s) {
    const uint8_t* t = tiles + s * kTileBytes;
    const Tile w(t);
    for (int64_t b = 0; b < kBlocks; ++b) {
      for (int v = 0; v < 4; ++v) {
        const __m512i bytes = _mm512_loadu_si512(w.qs + (4 * b + v) * 64);
        _mm512_store_si512(scratch.unpacked[b] + v * 64, _mm512_and_si512(bytes, low));
        _mm512_store_si512(scratch.unpacked[b] + (4 + v) * 64, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low));
      }
    }
    for (int64_t c0 = 0; c0 < padded_rows; c0 += kAmxChunk) {
      SPECSERVE_Q4K_AMX_BLOCK(0, 2, 4, 0);
      SPECSERVE_Q4K_AMX_BLOCK(1, 3, 5, 1);
      SPECSERVE_Q4K_AMX_BLOCK(0, 2, 6, 2);
      SPECSERVE_Q4K_AMX_BLOCK(1, 3, 7, 3);
      SPECSERVE_Q4K_AMX_BLOCK(0, 2, 4, 4);
      SPECSERVE_Q4K_AMX_BLOCK(1, 3, 5, 5);
      SPECSERVE_Q4K_AMX_BLOCK(0, 2, 6, 6);
      SPECSERVE_Q4K_AMX_BLOCK(1, 3, 7, 7);
      const int64_t live = rows - c0 < kAmxChunk ? rows - c0 : kAmxChunk;
      __m512i sc[kBlocks];
      for (int64_t b = 0; b < kBlocks; ++b)
        sc[b] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + kOutputs * b)));
      for (int64_t r = 0; r < live; ++r) {
        __m512i s1 = _mm512_setzero_si512();
        for (int64_t b = 0; b < kBlocks; ++b)
          s1 = _mm512_add_epi32(s1, _mm512_mullo_epi32(_mm512_load_si512(scratch.sums[b] + r * kOutputs), sc[b]));
        _mm512_storeu_si512(scratch.s1.data() + (c0 + r) * kOutputs, s1);
      }
    }
    const FloatStep step(w);
    for (int64_t r = 0; r < rows; ++r) {
      __m512 a = _mm512_loadu_ps(acc + r * kOutputs), m = _mm512_loadu_ps(mins + r * kOutputs);
      const __m512i s1 = _mm512_loadu_si512(scratch.s1.data() + r * kOutputs);
      step.apply(s1, x.bsum + r * (x.k / kBlock) + s * kBlocks, x.scale[r * x.supers + s], a, m);
      _mm512_storeu_ps(acc + r * kOutputs, a);
      _mm512_storeu_ps(mins + r * kOutputs, m);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    store_outputs(out, r, _mm512_loadu_ps(acc + r * kOutputs), _mm512_loadu_ps(mins + r * kOutputs));
}
#undef SPECSERVE_Q4K_AMX_BLOCK
#endif

}  // namespace specserve::q4k
