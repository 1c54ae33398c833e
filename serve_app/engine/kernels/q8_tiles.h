// The Q8 product's data as every path reads it: int8 weights with an fp16 scale per 32 inputs, in
// tiles of 16 output features x 64 inputs, and the one definition of the numbers all paths form.
//
// Weights: w = sw * q, q in [-127, 127], one fp16 scale sw per block of 32 inputs (llama.cpp's
// Q8_0; the GGUF's Q8_0 / Q5_0 / Q4_0 blocks hold exactly). Activations: per row and block
// xq = round(x / sx) in [-127, 127], sx = max|x| / 127, and each block's integer sum xsum.
//
// The numbers, for activation row r, output o and blocks b in order:
//
//     P    = sum_{i in b} q[i] * xq[i]                     exact int32
//     acc[b % 2] = fma(float(P), sw * sx, acc[b % 2])      (two accumulators: even and odd blocks)
//     out  = acc[0] + acc[1]
//
// The weights are stored offset, u = q + 128 in 1..255, so that VNNI and AMX multiply them as
// unsigned bytes by the signed activations: sum u * xq = P + 128 * xsum, exact.
//
// The tile of output group g (16 features) and block pair j: Q8::kTileBytes contiguous bytes,
// groups outer, pairs inner, scales first (every path reads a tile in ascending order).
//   [0, 64)        sw of blocks 2 j and 2 j + 1: [2][16] fp16
//   [64, 576)      block 2 j: 8 vectors of 64 bytes; byte 4 o + e of vector v holds u of input
//                  32 b + 4 v + e of output o (16 outputs x 4 inputs: one VNNI dot product, one
//                  row of an AMX B tile; the block is its 8 x 64-byte B tile)
//   [576, 1088)    block 2 j + 1 (zero where the input blocks are odd in number: never read)
//
// Q5 holds values in [-16, 15] (the GGUF's Q5_0 and Q4_0 blocks) in 5 bits, u = q + 16 in 0..31,
// with the very same numbers (P is the same integer, the float steps the same): Q5::kTileBytes per
// tile, the scales first as above, then per block 320 bytes:
//   [0, 256)       4 vectors of 64 bytes: the low 4 bits of u, vector v's low nibbles the VNNI
//                  vector v above, its high nibbles vector v + 4
//   [256, 320)     the fifth bit: 8 masks of 64 bits, mask v bit i = bit 4 of byte i of vector v
#pragma once

#include <cstdint>

#include "common.h"

namespace specserve::q8 {

constexpr int64_t kBlock = 32;
constexpr int64_t kOutputs = 16;
constexpr int64_t kScaleBytes = 2 * 2 * kOutputs;  // 64

struct Q8 {  // int8 values, offset by 128
  static constexpr int64_t kBlockBytes = kOutputs * kBlock;                    // 512
  static constexpr int64_t kTileBytes = kScaleBytes + 2 * kBlockBytes;         // 1088 = 17 lines
  static constexpr int32_t kOffset = 128;
};

struct Q5 {  // 5-bit values, offset by 16
  static constexpr int64_t kNibbleBytes = kOutputs * kBlock / 2;               // 256
  static constexpr int64_t kBlockBytes = kNibbleBytes + kOutputs * kBlock / 8;  // 320
  static constexpr int64_t kTileBytes = kScaleBytes + 2 * kBlockBytes;         // 704 = 11 lines
  static constexpr int32_t kOffset = 16;
};

// Block b (of the matrix) of a group whose tiles start at ``tiles``: its 16 scales and its values.
template <class V>
inline const uint16_t* block_scales(const uint8_t* tiles, int64_t b) {
  return reinterpret_cast<const uint16_t*>(tiles + (b / 2) * V::kTileBytes) + kOutputs * (b % 2);
}
template <class V>
inline const uint8_t* block_values(const uint8_t* tiles, int64_t b) {
  return tiles + (b / 2) * V::kTileBytes + kScaleBytes + (b % 2) * V::kBlockBytes;
}

// u of output o at input i (0..31) of a block.
inline int32_t block_u(const Q8&, const uint8_t* block, int o, int i) { return block[64 * (i / 4) + 4 * o + i % 4]; }
inline int32_t block_u(const Q5&, const uint8_t* block, int o, int i) {
  const int v = i / 4, byte = 4 * o + i % 4;
  const uint8_t nibbles = block[64 * (v % 4) + byte];
  const int32_t low = v < 4 ? nibbles & 0x0F : nibbles >> 4;
  const uint8_t* masks = block + Q5::kNibbleBytes + 8 * v;
  return low | (((masks[byte / 8] >> (byte % 8)) & 1) << 4);
}

struct Rows {  // quantized activation rows
  const int8_t* q;      // [M, K]
  const float* scale;   // [M, K / 32]
  const int32_t* xsum;  // [M, K / 32]: each block's sum of q (the offset adds offset * xsum)
  int64_t k;
  int64_t blocks;       // K / 32
};

using Out = specserve::GroupOut;

}  // namespace specserve::q8
