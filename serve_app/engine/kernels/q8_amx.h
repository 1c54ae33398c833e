// The AMX-INT8 form of the Q8 product for several activation rows (the numbers: ``q8_tiles.h``).
//
// A block's 512 offset weights are an 8 x 64-byte B tile (VNNI order): Q8's load from the tile as
// they are, Q5's are put together first (``load_block``); the rows' 32 activations are an A tile (up to 16 rows) and _tile_dpbsud gives
// every (row, output) block sum plus the offset's share, exactly in int32. Four blocks' sums at
// a time go to four C tiles and are then taken through the AVX-512 code's float steps. Rows beyond
// 16 run in chunks of 16 over the same B tiles (activations zero-padded to whole chunks).
#pragma once

#include <type_traits>
#include <vector>

#include "amx.h"
#include "common.h"
#include "q8_avx512.h"
#include "q8_tiles.h"

namespace specserve::q8 {

using specserve::amx_config;
using specserve::kAmxChunk;

#if SPECSERVE_AVX512

struct AmxScratch {
  alignas(64) int32_t sums[4][kAmxChunk * kOutputs];
  alignas(64) uint8_t unpacked[4][8 * 64];  // Q5's B tiles
  std::vector<float> acc;  // [rows][2][16]: the even and odd accumulators
  explicit AmxScratch(int64_t rows) : acc(rows * 2 * kOutputs) {}
};

// Block b0 + I with tiles A = TA, B = TB, C = TC (literal tile numbers, as the instructions need).
#define SPECSERVE_Q8_AMX_BLOCK(TA, TB, TC, I)                                        \
  do {                                                                               \
    if (b0 + (I) < x.blocks) {                                                       \
      _tile_loadd(TB, b_tiles[I], 64);                                               \
      _tile_loadd(TA, x.q + c0 * x.k + (b0 + (I)) * kBlock, x.k);                    \
      _tile_zero(TC);                                                                \
      _tile_dpbsud(TC, TA, TB);                                                      \
      _tile_stored(TC, scratch.sums[I], 64);                                         \
    }                                                                                \
  } while (0)

// Every row against one output group; the calling thread's tiles are configured (amx_config) and
// ``x`` holds ``padded_rows`` rows.
template <class V>
inline SPECSERVE_AMX_FN void group_amx(const uint8_t* tiles, const Rows& x, int64_t rows, int64_t padded_rows,
                                       const Out& out, AmxScratch& scratch) {
  float* acc = scratch.acc.data();
  for (int64_t i = 0; i < rows * 2; ++i) _mm512_storeu_ps(acc + i * kOutputs, _mm512_setzero_ps());
  for (int64_t b0 = 0; b0 < x.blocks; b0 += 4) {
    __m512 sw[4];
    const uint8_t* b_tiles[4] = {};
    for (int i = 0; i < 4 && b0 + i < x.blocks; ++i) {
      sw[i] = block_scales16<V>(tiles, b0 + i);
      const uint8_t* u = block_values<V>(tiles, b0 + i);
      if constexpr (std::is_same_v<V, Q8>) {
        b_tiles[i] = u;
      } else {
        __m512i w[8];
        load_block(V{}, u, w);
        for (int v = 0; v < 8; ++v) _mm512_store_si512(scratch.unpacked[i] + 64 * v, w[v]);
        b_tiles[i] = scratch.unpacked[i];
      }
    }
    for (int64_t c0 = 0; c0 < padded_rows; c0 += kAmxChunk) {
      SPECSERVE_Q8_AMX_BLOCK(0, 2, 4, 0);
      SPECSERVE_Q8_AMX_BLOCK(1, 3, 5, 1);
      SPECSERVE_Q8_AMX_BLOCK(0, 2, 6, 2);
      SPECSERVE_Q8_AMX_BLOCK(1, 3, 7, 3);
      const int64_t live = rows - c0 < kAmxChunk ? rows - c0 : kAmxChunk;
      for (int64_t r = 0; r < live; ++r) {
        const int64_t row = c0 + r;
        for (int i = 0; i < 4 && b0 + i < x.blocks; ++i) {
          const int64_t b = b0 + i;
          float* a = acc + (row * 2 + b % 2) * kOutputs;
          const __m512i biased = _mm512_load_si512(scratch.sums[i] + r * kOutputs);
          _mm512_storeu_ps(a, block_step<V>(_mm512_loadu_ps(a), biased, x.xsum[row * x.blocks + b], sw[i],
                                         x.scale[row * x.blocks + b]));
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    store_outputs(out, r, _mm512_loadu_ps(acc + 2 * r * kOutputs), _mm512_loadu_ps(acc + (2 * r + 1) * kOutputs));
}
#undef SPECSERVE_Q8_AMX_BLOCK
#endif

}  // namespace specserve::q8
