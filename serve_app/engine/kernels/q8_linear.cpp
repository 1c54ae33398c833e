// Products on int8 weights with an fp16 scale per 32 inputs, tiled for the kernels (``q8_tiles.h``:
// the layout and the one definition of the numbers), with int8 activations: the Q8 weight format,
// and Q5 (values in [-16, 15] stored in 5 bits: the same numbers from 35% fewer bytes).
//
// Paths, chosen at run time (``isa.cpp``), all forming the same integer sums and float steps:
// - amx: AMX-INT8 tiles for products of at least kAmxMinRows rows (``q8_amx.h``), else avx512;
// - avx512: VNNI dot products, 16 outputs per register (``q8_avx512.h``);
// - avx2: _mm256_maddubs_epi16 on |w| and sign-adjusted activations, 8 outputs per register (below);
// - scalar: plain loops (below), the reference the tests hold the others to.
// Threads split the output groups, never a dot product.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "q8_amx.h"
#include "q8_avx512.h"
#include "q8_tiles.h"

namespace {

using specserve::half_to_float;
using specserve::Isa;
using namespace specserve::q8;

constexpr int64_t kAmxMinRows = 8;  // from here AMX beats VNNI (a tile product's fixed cost per block)
constexpr int64_t kChunkGroups = 8;  // output groups per chunk of work (parallel_chunks)

// Per row and block: q = round(x / s) in [-127, 127], s = max|x| / 127 (0 for an all-zero block),
// and sum(q). Rows from ``rows`` up to ``padded`` are zero.
void quantize_rows(const float* x, int64_t rows, int64_t padded, int64_t k, int8_t* q, float* scales,
                   int32_t* xsums) {
  const int64_t blocks = k / kBlock;
  std::memset(q + rows * k, 0, (padded - rows) * k);
  std::fill(scales + rows * blocks, scales + padded * blocks, 0.f);
  std::fill(xsums + rows * blocks, xsums + padded * blocks, 0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + m * k + b * kBlock;
        float amax = 0.f;
        for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float s = amax / 127.f;
        const float inv = s > 0.f ? 1.f / s : 0.f;
        int8_t* qb = q + m * k + b * kBlock;
        int32_t sum = 0;
        for (int64_t i = 0; i < kBlock; ++i) {
          qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
          sum += qb[i];
        }
        scales[m * blocks + b] = s;
        xsums[m * blocks + b] = sum;
      }
    }
  });
}

template <class V>
void group_scalar(const uint8_t* tiles, const Rows& x, int64_t rows, const Out& out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int o = 0; o < out.count; ++o) {
      float acc[2] = {0.f, 0.f};
      for (int64_t b = 0; b < x.blocks; ++b) {
        const uint8_t* u = block_values<V>(tiles, b);
        const int8_t* xb = x.q + r * x.k + b * kBlock;
        int32_t p = 0;
        for (int i = 0; i < kBlock; ++i) p += (block_u(V{}, u, o, i) - V::kOffset) * xb[i];
        const float scale = half_to_float(block_scales<V>(tiles, b)[o]) * x.scale[r * x.blocks + b];
        acc[b % 2] = std::fma(static_cast<float>(p), scale, acc[b % 2]);
      }
      out.out[r * out.stride + o] = acc[0] + acc[1];
    }
  }
}

#if SPECSERVE_AVX2
// Half h (outputs 8 h .. 8 h + 7) of a block's vector v, as 8 int32 sums of 4 products each: Q8's
// signed values by maddubs on |w| and the activations carrying w's sign (both in [-127, 127]: pair
// sums cannot saturate), the exact P; Q5's offset values u <= 31 times the activations (pairs below
// 2 * 31 * 127), P plus the offset's share, taken off per block.
inline __m256i half_sums(const Q8&, const uint8_t* u, int v, int h, __m256i x4) {
  const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64 * v + 32 * h)),
                                     _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x4, w));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}
inline __m256i half_sums(const Q5&, const uint8_t* u, int v, int h, __m256i x4) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64 * (v % 4) + 32 * h));
  nibbles = _mm256_and_si256(v < 4 ? nibbles : _mm256_srli_epi16(nibbles, 4), low);
  uint32_t bits;  // the fifth bits of these 32 bytes, one per byte
  std::memcpy(&bits, u + Q5::kNibbleBytes + 8 * v + 4 * h, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)),
                                             _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  const __m256i w = _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x4), _mm256_set1_epi16(1));
}

template <class V, int G>
void half_rows_avx2(const uint8_t* tiles, const Rows& x, int64_t r0, int h, const Out& out) {
  constexpr int32_t offset = std::is_same_v<V, Q8> ? 0 : V::kOffset;  // Q8's sums are exact already
  __m256 acc[G][2];
  for (int r = 0; r < G; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const __m256 sw =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block_scales<V>(tiles, b) + 8 * h)));
    const uint8_t* u = block_values<V>(tiles, b);
    for (int r = 0; r < G; ++r) {
      const int64_t row = r0 + r;
      const int8_t* xb = x.q + row * x.k + b * kBlock;
      __m256i p = _mm256_set1_epi32(-offset * x.xsum[row * x.blocks + b]);
      for (int v = 0; v < 8; ++v) {
        int32_t four;
        std::memcpy(&four, xb + 4 * v, 4);
        p = _mm256_add_epi32(p, half_sums(V{}, u, v, h, _mm256_set1_epi32(four)));
      }
      const __m256 scale = _mm256_mul_ps(sw, _mm256_set1_ps(x.scale[row * x.blocks + b]));
      acc[r][b % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r][b % 2]);
    }
  }
  for (int r = 0; r < G; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(acc[r][0], acc[r][1]));
    for (int o = 8 * h; o < std::min(out.count, 8 * h + 8); ++o) out.out[(r0 + r) * out.stride + o] = lanes[o - 8 * h];
  }
}

template <class V>
void group_avx2(const uint8_t* tiles, const Rows& x, int64_t rows, const Out& out) {
  for (int h = 0; h < 2 && 8 * h < out.count; ++h) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) half_rows_avx2<V, 4>(tiles, x, r, h, out);
    switch (rows - r) {
      case 3: half_rows_avx2<V, 3>(tiles, x, r, h, out); break;
      case 2: half_rows_avx2<V, 2>(tiles, x, r, h, out); break;
      case 1: half_rows_avx2<V, 1>(tiles, x, r, h, out); break;
      default: break;
    }
  }
}
#endif

// Every group of ``tiles`` (values stored as V) on the chosen path.
template <class V>
void product(Isa isa, bool amx, const uint8_t* tp, int64_t groups, int64_t group_bytes, const Rows& x,
             int64_t rows, int64_t padded, float* o, int64_t n) {
  specserve::parallel_chunks(groups, kChunkGroups, [&](int64_t begin, int64_t end) {
    const auto group_out = [&](int64_t g) {
      return Out{o + g * kOutputs, n, static_cast<int>(std::min<int64_t>(kOutputs, n - g * kOutputs))};
    };
#if SPECSERVE_AVX512
    if (amx) {
      const specserve::TileScope scope(amx_config(rows));
      AmxScratch scratch(rows);
      for (int64_t g = begin; g < end; ++g) group_amx<V>(tp + g * group_bytes, x, rows, padded, group_out(g), scratch);
      return;
    }
    if (isa == Isa::kAvx512 || isa == Isa::kAmx) {
      for (int64_t g = begin; g < end; ++g) group_avx512<V>(tp + g * group_bytes, x, rows, group_out(g));
      return;
    }
#endif
#if SPECSERVE_AVX2
    if (isa == Isa::kAvx2) {
      for (int64_t g = begin; g < end; ++g) group_avx2<V>(tp + g * group_bytes, x, rows, group_out(g));
      return;
    }
#endif
    for (int64_t g = begin; g < end; ++g) group_scalar<V>(tp + g * group_bytes, x, rows, group_out(g));
  });
}

}  // namespace

// x [M, K] (float32 or bf16); tiles uint8 [ceil(N / 16), ceil(K / 64), tile bytes] (``q8_tiles.h``),
// the values in ``bits`` (8: Q8, 5: Q5); n the output features -> [M, N] float32.
torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 5, "q8_linear: values of 8 or 5 bits, not ", bits);
  const int64_t tile_bytes = bits == 8 ? Q8::kTileBytes : Q5::kTileBytes;
  TORCH_CHECK(x.dim() == 2, "q8_linear: x must be 2-d [M, K]");
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == torch::kUInt8 && tiles.size(2) == tile_bytes,
              "q8_linear: tiles must be uint8 [groups, ceil(K / 64), ", tile_bytes, "]");
  const int64_t rows = x.size(0), k = x.size(1), groups = tiles.size(0);
  TORCH_CHECK(k % kBlock == 0, "q8_linear: K must be a multiple of 32, got ", k);
  TORCH_CHECK(tiles.size(1) == (k / kBlock + 1) / 2, "q8_linear: the tiles hold ", tiles.size(1) * 2 * kBlock,
              " inputs, x has ", k);
  TORCH_CHECK(n > (groups - 1) * kOutputs && n <= groups * kOutputs, "q8_linear: ", groups,
              " groups of 16 cannot hold ", n, " outputs");
  const Isa isa = specserve::isa();
  const bool amx = isa == Isa::kAmx && rows >= kAmxMinRows;
  const int64_t padded = amx && rows > kAmxChunk ? (rows + kAmxChunk - 1) / kAmxChunk * kAmxChunk : rows;
  auto xf = x.to(torch::kFloat32).contiguous();
  auto tc = tiles.contiguous();
  const int64_t blocks = k / kBlock;
  std::vector<int8_t> xq(padded * k);
  std::vector<float> xs(padded * blocks);
  std::vector<int32_t> xsums(padded * blocks);
  quantize_rows(xf.data_ptr<float>(), rows, padded, k, xq.data(), xs.data(), xsums.data());
  const Rows activations{xq.data(), xs.data(), xsums.data(), k, blocks};
  auto out = torch::empty({rows, n}, torch::kFloat32);
  const uint8_t* tp = tc.data_ptr<uint8_t>();
  const int64_t group_bytes = tiles.size(1) * tile_bytes;
  if (bits == 8)
    product<Q8>(isa, amx, tp, groups, group_bytes, activations, rows, padded, out.data_ptr<float>(), n);
  else
    product<Q5>(isa, amx, tp, groups, group_bytes, activations, rows, padded, out.data_ptr<float>(), n);
  return out;
}
