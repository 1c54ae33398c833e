// Products on the GGUF's Q4_K blocks, tiled for the kernels (``q4k_tiles.h``: the layout and the
// one definition of the numbers), with int8 activations: the gguf weight format.
//
// Paths, chosen at run time (``isa.cpp``), all forming the same integer sums and float steps:
// - amx: AMX-INT8 tiles for products of at least kAmxMinRows rows (``q4k_amx.h``), else avx512;
// - avx512: VNNI dot products, 16 outputs per register (``q4k_avx512.h``);
// - avx2: _mm256_maddubs_epi16 summed in int16, one _mm256_madd_epi16 by the block's scales
//   (``q4k_avx2.h``);
// - scalar: plain loops (below), the reference the tests hold the others to.
// Threads split the output groups, never a dot product.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "q4k_amx.h"
#include "q4k_avx2.h"
#include "q4k_avx512.h"
#include "q4k_tiles.h"
#include "superblock_rows.h"

namespace {

using specserve::half_to_float;
using specserve::Isa;
using namespace specserve::q4k;

// From this many rows the AMX path beats the VNNI one (a tile product's fixed cost per block).
constexpr int64_t kAmxMinRows = 4;
constexpr int64_t kChunkGroups = 32;  // output groups per chunk of work (parallel_chunks)

// q of output o at input i (0..255) of a tile.
inline int32_t tile_q(const Tile& w, int o, int i) {
  const int b = i / kBlock, j = i % kBlock, high = j >= 16, v = (j % 16) / 4, e = j % 4;
  const uint8_t byte = w.qs[(4 * b + v) * 64 + 4 * o + e];
  return high ? byte >> 4 : byte & 0x0F;
}

void group_scalar(const uint8_t* tiles, const Rows& x, int64_t rows, const Out& out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* xr = x.q + r * x.k;
    for (int o = 0; o < out.count; ++o) {
      float acc = 0.f, mins = 0.f;
      for (int64_t s = 0; s < x.supers; ++s) {
        const Tile w(tiles + s * kTileBytes);
        int32_t s1 = 0, s2 = 0;
        for (int b = 0; b < kBlocks; ++b) {
          int32_t block = 0;
          for (int i = b * kBlock; i < (b + 1) * kBlock; ++i) block += tile_q(w, o, i) * xr[s * kSuper + i];
          s1 += static_cast<int32_t>(w.sc[kOutputs * b + o]) * block;
          const int j = b / 2, half = b % 2;
          s2 += static_cast<int32_t>(w.mn[32 * j + 2 * o + half]) * x.bsum[(r * x.supers + s) * kBlocks + b];
        }
        const float xs = x.scale[r * x.supers + s];
        acc = std::fma(static_cast<float>(s1), half_to_float(w.d[o]) * xs, acc);
        mins = std::fma(static_cast<float>(s2), half_to_float(w.dmin[o]) * xs, mins);
      }
      out.out[r * out.stride + o] = acc - mins;
    }
  }
}

}  // namespace

// x [M, K] (float32 or bf16); tiles uint8 [ceil(N / 16), K / 256, 2368] (``q4k_tiles.h``); n the
// output features (the last group's missing ones are zero padding) -> [M, N] float32.
torch::Tensor q4k_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "q4k_linear: x must be 2-d [M, K]");
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == torch::kUInt8 && tiles.size(2) == kTileBytes,
              "q4k_linear: tiles must be uint8 [groups, K / 256, ", kTileBytes, "]");
  const int64_t rows = x.size(0), k = x.size(1), groups = tiles.size(0);
  TORCH_CHECK(k % kSuper == 0, "q4k_linear: K must be a multiple of 256, got ", k);
  TORCH_CHECK(tiles.size(1) == k / kSuper, "q4k_linear: the tiles hold ", tiles.size(1) * kSuper,
              " inputs, x has ", k);
  TORCH_CHECK(n > (groups - 1) * kOutputs && n <= groups * kOutputs, "q4k_linear: ", groups,
              " groups of 16 cannot hold ", n, " outputs");
  const Isa isa = specserve::isa();
  const bool amx = isa == Isa::kAmx && rows >= kAmxMinRows;
  // AMX reads whole chunks of 16 rows beyond the first 16: zero rows pad the activations
  const int64_t padded = amx && rows > kAmxChunk ? (rows + kAmxChunk - 1) / kAmxChunk * kAmxChunk : rows;
  auto xf = x.to(torch::kFloat32).contiguous();
  auto tc = tiles.contiguous();
  const int64_t supers = k / kSuper;
  std::vector<int8_t> xq(padded * k);
  std::vector<float> xs(padded * supers);
  std::vector<int16_t> bsums(padded * (k / kBlock));
  specserve::quantize_superblock_rows<kBlock>(xf.data_ptr<float>(), rows, padded, k, xq.data(), xs.data(),
                                              bsums.data());
  const Rows activations{xq.data(), xs.data(), bsums.data(), k, supers};
  auto out = torch::empty({rows, n}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const uint8_t* tp = tc.data_ptr<uint8_t>();
  const int64_t group_bytes = supers * kTileBytes;
  specserve::parallel_chunks(groups, kChunkGroups, [&](int64_t begin, int64_t end) {
    const auto group_out = [&](int64_t g) {
      return Out{o + g * kOutputs, n, static_cast<int>(std::min<int64_t>(kOutputs, n - g * kOutputs))};
    };
#if SPECSERVE_AVX512
    if (amx) {
      const specserve::TileScope scope(amx_config(rows));
      AmxScratch scratch(rows);
      std::vector<float> acc(rows * kOutputs), mins(rows * kOutputs);
      for (int64_t g = begin; g < end; ++g)
        group_amx(tp + g * group_bytes, activations, rows, padded, group_out(g), scratch, acc.data(), mins.data());
      return;
    }
    if (isa == Isa::kAvx512 || isa == Isa::kAmx) {
      for (int64_t g = begin; g < end; ++g) group_avx512(tp + g * group_bytes, activations, rows, group_out(g));
      return;
    }
#endif
#if SPECSERVE_AVX2
    if (isa == Isa::kAvx2) {
      for (int64_t g = begin; g < end; ++g) group_avx2(tp + g * group_bytes, activations, rows, group_out(g));
      return;
    }
#endif
    for (int64_t g = begin; g < end; ++g) group_scalar(tp + g * group_bytes, activations, rows, group_out(g));
  });
  return out;
}
