// The Q4_K product's data as every path reads it: the weights in tiles of 16 output features x 256
// inputs, the quantized activation rows, and the one definition of the numbers all paths form.
//
// Weights: llama.cpp's Q4_K. Per super-block of 256 inputs an fp16 scale d and min dmin; per block
// of 32 an integer scale sc and min m in 0..63; per input a 4-bit q:  w = d * sc * q - dmin * m.
// Activations: per row and super-block xq = round(x / xs) in [-127, 127], xs = max|x| / 127, and
// each block's integer sum bsum (llama.cpp's Q8_K).
//
// The numbers, for activation row r, output o, and super-blocks s in order:
//
//     S1 = sum_b sc[b] * (sum_{i in b} q[i] * xq[i])     exact int32 (|S1| < 8 * 63 * 32 * 15 * 127)
//     S2 = sum_b m[b] * bsum[b]                          exact int32
//     acc  = fma(float(S1), d * xs, acc)
//     mins = fma(float(S2), dmin * xs, mins)
//     out  = acc - mins
//
// Integer sums are the same in any order, so a path may form S1 and S2 however its instructions
// like (VNNI dot products over 4 inputs, AMX tiles over 32, scalar loops); the float steps are the
// same for every (r, o) whatever the number of rows, threads or the path. So a row's result never
// depends on the other rows, nor on the CPU: the engine's exactness rests on that.
//
// The tile of output group g (16 features) and super-block s: kTileBytes contiguous bytes, groups
// outer, super-blocks inner (a thread's outputs are one sequential stream).
//   [0, 32)       d[o] fp16          [32, 64)     dmin[o] fp16
//   [64, 192)     m as pairs: [j][o][2] = m[2 j], m[2 j + 1] of o
//   [192, 320)    sc[b][o] u8
//   [320, 2368)   4-bit values. Block b (0..7) is 4 vectors of 64 bytes at 320 + (4 b + v) * 64;
//                 byte 4 o + e of vector v holds input 32 b + 4 v + e of output o in its low nibble
//                 and input 32 b + 16 + 4 v + e in its high nibble. So a vector's low nibbles are
//                 16 outputs x 4 consecutive inputs (what one VNNI dot product and one row of an AMX
//                 B tile take), and block b's AMX B tile (8 rows x 64 bytes) is its low nibbles
//                 (rows 0..3) then its high nibbles (rows 4..7).
// The scales come first so that a path reading them before the values reads every tile in
// ascending order (the hardware prefetcher follows ascending streams).
#pragma once

#include <cstdint>

#include "common.h"
#include "superblock_rows.h"

namespace specserve::q4k {

constexpr int64_t kSuper = 256;
constexpr int64_t kBlock = 32;
constexpr int64_t kBlocks = kSuper / kBlock;  // blocks per super-block
constexpr int64_t kOutputs = 16;              // output features per tile
constexpr int64_t kQsBytes = kOutputs * kSuper / 2;
constexpr int64_t kMetaBytes = 2 * 2 * kOutputs + 2 * kBlocks * kOutputs;  // 320 = 5 lines
constexpr int64_t kTileBytes = kMetaBytes + kQsBytes;                        // 2368 = 37 lines

struct Tile {  // one tile's parts
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* dmin;
  const uint8_t* sc;     // [8][16]
  const uint8_t* mn;     // [4][16][2]

  explicit Tile(const uint8_t* t)
      : qs(t + kMetaBytes),
        d(reinterpret_cast<const uint16_t*>(t)),
        dmin(reinterpret_cast<const uint16_t*>(t + 2 * kOutputs)),
        sc(t + 4 * kOutputs + kBlocks * kOutputs),
        mn(t + 4 * kOutputs) {}
};

using Rows = specserve::SuperBlockRows;  // bsum: per block of 32 (Q4_K) / sub-block of 16 (Q6_K)
using Out = specserve::GroupOut;

}  // namespace specserve::q4k
