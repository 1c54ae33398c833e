// Products on the GGUF's Q6_K blocks, tiled for the kernels (``q6k_tiles.h``: the layout and the
// one definition of the numbers), with int8 activations: the gguf weight format's 6-bit matrices
// (a Q4_K_M file's output head and about half its ffn_down matrices).
//
// Paths, chosen at run time (``isa.cpp``), all forming the same integer sums and float steps:
// - avx512 (on AMX hosts too: no AMX form yet): VNNI dot products, 16 outputs per register
//   (``q6k_avx512.h``);
// - avx2: _mm256_maddubs_epi16 pairs summed in int16, _mm256_madd_epi16 by the scales, 8 outputs
//   per register (below);
// - scalar: plain loops (below), the reference the tests hold the others to.
// Threads split the output groups, never a dot product.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "q6k_avx512.h"
#include "q6k_tiles.h"
#include "superblock_rows.h"

namespace {

using specserve::half_to_float;
using specserve::Isa;
using namespace specserve::q6k;

constexpr int64_t kChunkGroups = 32;  // output groups per chunk of work (parallel_chunks)

// q of output o at input i (0..255) of a tile, 0..63.
inline int32_t tile_q(const Tile& t, int o, int i) {
  const int b = i / kBlock, j = i % kBlock, h = j >= 16, v = (j % 16) / 4, byte = 4 * o + j % 4;
  const uint8_t nibbles = t.block(b)[64 * v + byte];
  const int32_t q = h ? nibbles >> 4 : nibbles & 0x0F;
  return q | (((t.top(b, h)[byte] >> (2 * v)) & 3) << 4);
}

// sc of output o's sub-block sb (0..15).
inline int32_t tile_sc(const Tile& t, int o, int sb) { return t.sc[32 * (sb / 2) + 2 * o + sb % 2]; }

void group_scalar(const uint8_t* tiles, const Rows& x, int64_t rows, const Out& out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* xr = x.q + r * x.k;
    for (int o = 0; o < out.count; ++o) {
      float acc = 0.f;
      for (int64_t s = 0; s < x.supers; ++s) {
        const Tile t(tiles + s * kTileBytes);
        int32_t s1 = 0, s2 = 0;
        for (int sb = 0; sb < kSubs; ++sb) {
          int32_t dot = 0;
          for (int i = sb * kSub; i < (sb + 1) * kSub; ++i) dot += tile_q(t, o, i) * xr[s * kSuper + i];
          s1 += tile_sc(t, o, sb) * dot;
          s2 += tile_sc(t, o, sb) * x.bsum[(r * x.supers + s) * kSubs + sb];
        }
        const float scale = half_to_float(t.d[o]) * x.scale[r * x.supers + s];
        acc = std::fma(static_cast<float>(s1 - kOffset * s2), scale, acc);
      }
      out.out[r * out.stride + o] = acc;
    }
  }
}

#if SPECSERVE_AVX2
inline __m256i broadcast4_avx2(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256i top_bits_at_4(__m256i top, int v) {  // bits 2 v, 2 v + 1 -> 4, 5 (others unmasked)
  switch (v) {
    case 0: return _mm256_slli_epi16(top, 4);
    case 1: return _mm256_slli_epi16(top, 2);
    case 2: return top;
    default: return _mm256_srli_epi16(top, 2);
  }
}

// Half H (outputs 8 H .. 8 H + 7: bytes 32 H .. 32 H + 31) of block b's 8 vectors of q.
inline void load_half(const Tile& t, int64_t b, int H, __m256i w[8]) {
  const __m256i low = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  for (int v = 0; v < 4; ++v) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.block(b) + 64 * v + 32 * H));
    for (int h = 0; h < 2; ++h) {
      const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.top(b, h) + 32 * H));
      const __m256i q = _mm256_and_si256(h ? _mm256_srli_epi16(bytes, 4) : bytes, low);
      w[4 * h + v] = _mm256_or_si256(q, _mm256_and_si256(top_bits_at_4(top, v), bits45));
    }
  }
}

// Rows r0 .. r0 + G - 1 against outputs 8 H .. 8 H + 7 of a group. u8 q <= 63 times s8 activations:
// a maddubs pair sum is at most 2 * 63 * 127 = 16002 in magnitude, so two of them add in int16
// without saturating; one _mm256_madd_epi16 against the sub-block's scale, repeated in both 16-bit
// halves of an output's lane, then adds the pairs and multiplies by the scale at once (a madd by
// ones per maddubs and a mullo per sub-block took 8 more vector operations per block and row).
template <int G>
void half_rows_avx2(const uint8_t* tiles, const Rows& x, int64_t r0, int H, const Out& out) {
  __m256 acc[G];
  for (int r = 0; r < G; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < x.supers; ++s) {
    const Tile t(tiles + s * kTileBytes);
    __m256i s1[G], s2[G];
    for (int r = 0; r < G; ++r) s1[r] = s2[r] = _mm256_setzero_si256();
    for (int64_t b = 0; b < kBlocks; ++b) {
      // lane o: (sc[2 b], sc[2 b + 1]) as int16; even / odd: one of them in both halves
      const __m256i pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.sc + 32 * b + 16 * H)));
      const __m256i even = _mm256_blend_epi16(pairs, _mm256_slli_epi32(pairs, 16), 0xAA);
      const __m256i odd = _mm256_blend_epi16(_mm256_srli_epi32(pairs, 16), pairs, 0xAA);
      __m256i w[8];
      load_half(t, b, H, w);
      for (int r = 0; r < G; ++r) {
        const int64_t row = r0 + r;
        const int8_t* xb = x.q + row * x.k + s * kSuper + b * kBlock;
        const auto pair_sum = [&](int i, int offset) {  // w[i], w[i + 1] against their activations, int16
          return _mm256_add_epi16(_mm256_maddubs_epi16(w[i], broadcast4_avx2(xb + offset)),
                                  _mm256_maddubs_epi16(w[i + 1], broadcast4_avx2(xb + offset + 4)));
        };
        const __m256i e = _mm256_add_epi32(_mm256_madd_epi16(pair_sum(0, 0), even), _mm256_madd_epi16(pair_sum(2, 8), even));
        const __m256i o = _mm256_add_epi32(_mm256_madd_epi16(pair_sum(4, 16), odd), _mm256_madd_epi16(pair_sum(6, 24), odd));
        s1[r] = _mm256_add_epi32(s1[r], _mm256_add_epi32(e, o));
        const int16_t* bsum = x.bsum + (row * x.supers + s) * kSubs + 2 * b;
        s2[r] = _mm256_add_epi32(s2[r], _mm256_madd_epi16(pairs, broadcast4_avx2(bsum)));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.d + 8 * H)));
    for (int r = 0; r < G; ++r) {
      const int64_t row = r0 + r;
      const __m256i sum = _mm256_sub_epi32(s1[r], _mm256_slli_epi32(s2[r], 5));
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.scale[row * x.supers + s]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r]);
    }
  }
  for (int r = 0; r < G; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    for (int o = 8 * H; o < std::min(out.count, 8 * H + 8); ++o) out.out[(r0 + r) * out.stride + o] = lanes[o - 8 * H];
  }
}

void group_avx2(const uint8_t* tiles, const Rows& x, int64_t rows, const Out& out) {
  for (int H = 0; H < 2 && 8 * H < out.count; ++H) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) half_rows_avx2<4>(tiles, x, r, H, out);
    switch (rows - r) {
      case 3: half_rows_avx2<3>(tiles, x, r, H, out); break;
      case 2: half_rows_avx2<2>(tiles, x, r, H, out); break;
      case 1: half_rows_avx2<1>(tiles, x, r, H, out); break;
      default: break;
    }
  }
}
#endif

}  // namespace

// x [M, K] (float32 or bf16); tiles uint8 [ceil(N / 16), K / 256, 3392] (``q6k_tiles.h``); n the
// output features (the last group's missing ones are zero padding) -> [M, N] float32.
torch::Tensor q6k_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "q6k_linear: x must be 2-d [M, K]");
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == torch::kUInt8 && tiles.size(2) == kTileBytes,
              "q6k_linear: tiles must be uint8 [groups, K / 256, ", kTileBytes, "]");
  const int64_t rows = x.size(0), k = x.size(1), groups = tiles.size(0);
  TORCH_CHECK(k % kSuper == 0, "q6k_linear: K must be a multiple of 256, got ", k);
  TORCH_CHECK(tiles.size(1) == k / kSuper, "q6k_linear: the tiles hold ", tiles.size(1) * kSuper,
              " inputs, x has ", k);
  TORCH_CHECK(n > (groups - 1) * kOutputs && n <= groups * kOutputs, "q6k_linear: ", groups,
              " groups of 16 cannot hold ", n, " outputs");
  const Isa isa = specserve::isa();
  auto xf = x.to(torch::kFloat32).contiguous();
  auto tc = tiles.contiguous();
  const int64_t supers = k / kSuper;
  std::vector<int8_t> xq(rows * k);
  std::vector<float> xs(rows * supers);
  std::vector<int16_t> bsums(rows * (k / kSub));
  specserve::quantize_superblock_rows<kSub>(xf.data_ptr<float>(), rows, rows, k, xq.data(), xs.data(), bsums.data());
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
