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
// The tile of output group g (16 features) and block pair j: kTileBytes contiguous bytes, groups
// outer, pairs inner, scales first (every path reads a tile in ascending order).
//   [0, 64)        sw of blocks 2 j and 2 j + 1: [2][16] fp16
//   [64, 576)      block 2 j: 8 vectors of 64 bytes; byte 4 o + e of vector v holds u of input
//                  32 b + 4 v + e of output o (16 outputs x 4 inputs: one VNNI dot product, one
//                  row of an AMX B tile; the block is its 8 x 64-byte B tile)
//   [576, 1088)    block 2 j + 1 (zero where the input blocks are odd in number: never read)
#pragma once

#include <cstdint>

namespace specserve::q8 {

constexpr int64_t kBlock = 32;
constexpr int64_t kOutputs = 16;
constexpr int64_t kBlockBytes = kOutputs * kBlock;                         // 512
constexpr int64_t kScaleBytes = 2 * 2 * kOutputs;                          // 64
constexpr int64_t kTileBytes = kScaleBytes + 2 * kBlockBytes;             // 1088 = 17 lines

// Block b (of the matrix) of a group whose tiles start at ``tiles``: its 16 scales and its values.
inline const uint16_t* block_scales(const uint8_t* tiles, int64_t b) {
  return reinterpret_cast<const uint16_t*>(tiles + (b / 2) * kTileBytes) + kOutputs * (b % 2);
}
inline const uint8_t* block_values(const uint8_t* tiles, int64_t b) {
  return tiles + (b / 2) * kTileBytes + kScaleBytes + (b % 2) * kBlockBytes;
}

struct Rows {  // quantized activation rows
  const int8_t* q;      // [M, K]
  const float* scale;   // [M, K / 32]
  const int32_t* xsum;  // [M, K / 32] times 128: what the offset adds to each block's sum
  int64_t k;
  int64_t blocks;       // K / 32
};

struct Out {  // one group's outputs: ``count`` features (16, fewer in the last group)
  float* out;
  int64_t stride;
  int count;
};

}  // namespace specserve::q8
