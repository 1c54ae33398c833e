// The Q6_K product's data as every path reads it: the weights in tiles of 16 output features x 256
// inputs, the quantized activation rows, and the one definition of the numbers all paths form.
//
// Weights: llama.cpp's Q6_K. Per super-block of 256 inputs an fp16 scale d; per sub-block of 16 a
// signed integer scale sc (int8); per input a 6-bit q in 0..63:  w = d * sc * (q - 32).
// Activations: per row and super-block xq = round(x / xs) in [-127, 127], xs = max|x| / 127, and
// each sub-block's integer sum bsum (16 inputs; what llama.cpp's Q8_K keeps, at 16).
//
// The numbers, for activation row r, output o, and super-blocks s in order:
//
//     S1 = sum_b sc[b] * (sum_{i in b} q[i] * xq[i])     exact int32 (|S1| < 16 * 128 * 16 * 63 * 127)
//     S2 = sum_b sc[b] * bsum[b]                         exact int32
//     acc = fma(float(S1 - 32 * S2), d * xs, acc)        (|S1 - 32 S2| < 2^29: exact in int32)
//     out = acc
//
// Integer sums are the same in any order, so a path may form S1 and S2 however its instructions like
// (VNNI dot products over 4 inputs, scalar loops); the float step is the same for every (r, o)
// whatever the number of rows, threads or the path. So a row's result never depends on the other
// rows, nor on the CPU: the engine's exactness rests on that.
//
// The tile of output group g (16 features) and super-block s: kTileBytes contiguous bytes, groups
// outer, super-blocks inner (a thread's outputs are one sequential stream).
//   [0, 32)       d[o] fp16
//   [32, 288)     sc as pairs: [j][o][2] = sc[2 j], sc[2 j + 1] of o (int8)
//   [288, 320)    zero (so that every block starts on a 64-byte line)
//   [320, 3392)   8 blocks of 32 inputs, 384 bytes each, block b at 320 + 384 b:
//     [0, 256)    4 vectors of 64 bytes: byte 4 o + e of vector v holds the low 4 bits of q of input
//                 32 b + 4 v + e of output o (sub-block 2 b) in its low nibble, those of input
//                 32 b + 16 + 4 v + e (sub-block 2 b + 1) in its high nibble: Q4_K's order;
//     [256, 384)  the top 2 bits of q: 2 vectors of 64 bytes, vector h (0: the low nibbles' inputs,
//                 1: the high nibbles') holding in bits 2 v, 2 v + 1 of byte i those of byte i of
//                 vector v's nibbles h. Shifting the vector left by 4 - 2 v puts them at bits 4, 5,
//                 where one vpternlogd merges them with the nibble (cheaper than bit masks).
// The scales come first so that a path reading them before the values reads every tile in
// ascending order (the hardware prefetcher follows ascending streams).
#pragma once

#include <cstdint>

#include "common.h"
#include "superblock_rows.h"

namespace specserve::q6k {

constexpr int64_t kSuper = 256;
constexpr int64_t kSub = 16;                  // inputs per scale
constexpr int64_t kSubs = kSuper / kSub;      // 16 sub-blocks per super-block
constexpr int64_t kBlock = 32;                // inputs per block of the layout (two sub-blocks)
constexpr int64_t kBlocks = kSuper / kBlock;  // 8
constexpr int64_t kOutputs = 16;              // output features per tile
constexpr int64_t kMetaBytes = 320;           // d, sc pairs, padding: 5 lines
constexpr int64_t kNibbleBytes = 256;         // a block's 4 vectors of nibbles
constexpr int64_t kBlockBytes = kNibbleBytes + 2 * 64;          // 384 = 6 lines
constexpr int64_t kTileBytes = kMetaBytes + kBlocks * kBlockBytes;  // 3392 = 53 lines
constexpr int32_t kOffset = 32;

struct Tile {  // one tile's parts
  const uint16_t* d;
  const int8_t* sc;  // [8][16][2]
  const uint8_t* blocks;

  explicit Tile(const uint8_t* t)
      : d(reinterpret_cast<const uint16_t*>(t)), sc(reinterpret_cast<const int8_t*>(t + 2 * kOutputs)),
        blocks(t + kMetaBytes) {}

  const uint8_t* block(int64_t b) const { return blocks + b * kBlockBytes; }
  // the top bits of block b's nibbles h: 64 bytes, four 2-bit fields each
  const uint8_t* top(int64_t b, int h) const { return block(b) + kNibbleBytes + 64 * h; }
};

using Rows = specserve::SuperBlockRows;  // bsum: per block of 32 (Q4_K) / sub-block of 16 (Q6_K)
using Out = specserve::GroupOut;

}  // namespace specserve::q6k
